"""Reading trace files as a stream: the same events json.load sees, without the whole document."""

import gzip
import json

import pytest

from spyre_rt.trace import file as tracefile
from spyre_rt.trace.file import TraceFile

EVENTS = [
    {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "host"}},
    {"name": "mm", "cat": "job", "ph": "X", "ts": 1.5, "dur": 12345.25, "pid": 2, "tid": 1,
     "args": {"seq": 0, "module": "model.layers.3.mlp.up_proj", "nested": {"a": [1, {"b": 2}], "c": 3}}},
    {"name": "a name with },{ and \"quotes\" and \\ in it", "ph": "X", "ts": 20, "dur": 1, "pid": 2, "tid": 1},
    {"name": "queue depth", "ph": "C", "ts": 21, "pid": 2, "tid": 1, "args": {"jobs": 123456789}},
    {"name": "µs · ünïcode", "ph": "i", "ts": 22, "pid": "Spans", "tid": "PyTorch Profiler"},
]
DOC = {"schemaVersion": 1, "deviceProperties": [], "traceEvents": EVENTS, "traceName": "t",
       "metadata": {"spyre_rt": {"card": "spyre:0"}}}


def layouts():
    """The same document written the ways real writers write it."""
    yield "compact", json.dumps(DOC, separators=(",", ":"))
    yield "indented (torch.profiler)", json.dumps(DOC, indent=2)
    yield "spaced", json.dumps(DOC)
    yield "separators before commas", json.dumps(DOC, indent=1).replace("},\n", "}\n,\n")


@pytest.fixture(params=[1 << 20, 7], ids=["chunk 1 MiB", "chunk 7 chars"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(tracefile, "_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("layout", [name for name, _ in layouts()])
def test_streamed_events_are_what_json_load_reads(tmp_path, chunk, layout):
    text = dict(layouts())[layout]
    path = tmp_path / "t.json"
    path.write_text(text, encoding="utf-8")
    with TraceFile(path) as f:
        assert f.has_events and f.header == {"schemaVersion": 1, "deviceProperties": []}
        assert list(f.validated_events()) == EVENTS
        assert f.document() == {k: v for k, v in DOC.items() if k != "traceEvents"}


def test_gzip_is_read_by_its_magic_bytes_whatever_the_name(tmp_path, chunk):
    path = tmp_path / "t.json"  # no .gz suffix
    path.write_bytes(gzip.compress(json.dumps(DOC).encode()))
    with TraceFile(path) as f:
        assert list(f.events()) == EVENTS


def test_the_bare_array_form(tmp_path, chunk):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(EVENTS, indent=1))
    with TraceFile(path) as f:
        assert f.bare_array and list(f.events()) == EVENTS and f.document() == {}


def test_a_file_without_events_is_read_whole_into_the_header(tmp_path, chunk):
    path = tmp_path / "run.json"
    result = {"results": {"prebuilt": {"prefill_ms": 1.5}}, "model": "granite-tiny"}
    path.write_text(json.dumps(result, indent=1))
    with TraceFile(path) as f:
        assert not f.has_events and f.header == result and list(f.events()) == []


def test_events_stream_without_reading_the_whole_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tracefile, "_CHUNK", 4096)
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"traceEvents": EVENTS[1:2] * 20_000}))
    with TraceFile(path) as f:
        events = f.events()
        next(events)
        assert f._f.buffer.tell() < path.stat().st_size / 100  # noqa: SLF001 - how far the file was read


@pytest.mark.parametrize("text, message", [
    ('{"traceEvents": [{"ph": "X"', "not valid JSON"),
    ('{"traceEvents": [{"ph": "i", "pid": 1, "name": "a", "ts": 0} {"ph": "i"}]}', "expected ',' or ']'"),
    ('{"traceEvents": [], "x": 1} trailing', "extra data"),
    ('{"traceEvents": {}}', "'traceEvents' must be an array"),
    ("42", "not a JSON int"),
    ('{"traceEvents": [1]}', r"traceEvents\[0\]: an event must be a JSON object"),
])
def test_malformed_files_are_errors_naming_the_file(tmp_path, chunk, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        with TraceFile(path) as f:
            list(f.validated_events())
    assert str(path) in str(e.value)


def test_a_broken_gzip_file_is_an_error(tmp_path):
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(DOC).encode())[:-20])
    with pytest.raises(ValueError, match="gzip|not valid JSON"):
        with TraceFile(path) as f:
            list(f.events())
