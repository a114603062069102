"""Device profiles: every figure present, sourced and validated."""

import re
import tomllib

import pytest

from spyre_rt import device_profile
from spyre_rt.errors import SpyreProfileError
from spyre_rt.native import ffi, lib


def test_builtin_profile_has_every_figure_with_a_source():
    p = device_profile.load("spyre")
    assert set(p.figures) == set(device_profile.FIGURES)
    for fig in p.figures.values():
        assert fig.source.strip() and fig.kind in device_profile.KINDS
    assert p.num_cores == 32
    assert p.scratchpad_bytes == 2 << 20
    assert p.dram_bytes == 128 << 30
    assert p.stick_bytes == 128


def _text_without(key):
    lines = device_profile._source_text("spyre")[1].splitlines()
    return "\n".join(line for line in lines if not line.startswith(f"{key} ="))


def test_missing_figure_is_named():
    with pytest.raises(SpyreProfileError, match="missing figure.*pcie_latency_ns"):
        device_profile.parse(_text_without("pcie_latency_ns"))


def test_unknown_figure_is_named():
    text = device_profile._source_text("spyre")[1] + '\nwarp_size = { value = 32, unit = "x", kind = "public", source = "s" }\n'
    with pytest.raises(SpyreProfileError, match="unknown figure.*warp_size"):
        device_profile.parse(text)


def test_figure_without_source_is_rejected():
    text = device_profile._source_text("spyre")[1].replace(
        'ring_hop_ns = { value = 4, unit = "ns", kind = "assumption", source = "about 6 cycles per ring stop" }',
        'ring_hop_ns = { value = 4, unit = "ns", kind = "assumption", source = "" }',
    )
    with pytest.raises(SpyreProfileError, match="ring_hop_ns.*source"):
        device_profile.parse(text)


def test_bad_values_are_rejected():
    text = device_profile._source_text("spyre")[1].replace("num_cores = { value = 32,", "num_cores = { value = 2.5,")
    with pytest.raises(SpyreProfileError, match="num_cores"):
        device_profile.parse(text)
    with pytest.raises(SpyreProfileError, match="not valid TOML"):
        device_profile.parse("[device\n")


def test_unknown_profile_name_lists_known_ones():
    with pytest.raises(SpyreProfileError, match="known: .*spyre"):
        device_profile.load("no-such-card")


def test_a_name_is_looked_up_in_the_package_whatever_the_working_directory_holds(tmp_path, monkeypatch):
    """A directory (or file) called ``spyre`` in the working directory is not the device_profile."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spyre").mkdir()
    (tmp_path / "granite-3.3-8b").write_text("not a profile")
    p = device_profile.load("spyre")
    assert p.name and p.path != str(tmp_path / "spyre") and p.path.endswith("spyre.toml")
    from spyre_rt.profiler import run

    assert run.load_model("granite-3.3-8b").path.endswith("granite-3.3-8b.toml")


def test_a_path_is_a_path_when_it_looks_like_one(tmp_path, monkeypatch):
    text = device_profile._source_text("spyre")[1]
    (tmp_path / "mine.toml").write_text(text)
    (tmp_path / "plain").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert device_profile.load("mine.toml").path == "mine.toml"  # the suffix makes it a path
    assert device_profile.load(str(tmp_path / "plain")).path == str(tmp_path / "plain")  # a separator too
    assert device_profile.load(tmp_path / "plain").digest == device_profile.load("spyre").digest  # a path object
    with pytest.raises(SpyreProfileError, match="no device profile named 'plain'.*directory separator"):
        device_profile.load("plain")  # a bare name is a shipped profile's name
    with pytest.raises(SpyreProfileError, match="device profile file 'gone.toml' does not exist"):
        device_profile.load("gone.toml")
    with pytest.raises(SpyreProfileError, match="does not exist"):
        device_profile.load(f"{tmp_path}{'/'}")  # a directory is not a profile file


def test_several_cards(tmp_path):
    text = device_profile._source_text("spyre")[1].replace("count = 1", "count = 3")
    path = tmp_path / "three.toml"
    path.write_text(text)
    assert device_profile.load(str(path)).count == 3


def test_declared_figures_and_the_shipped_profile_agree():
    """Every figure the card declares (SPY_PROFILE_FIGURES) is in the TOML with its
    declared unit and a source, and the TOML has no figure the card does not declare."""
    figures = tomllib.loads(device_profile._source_text("spyre")[1])["figures"]
    assert set(figures) == set(device_profile.FIGURES)
    for key, entry in figures.items():
        assert entry["unit"] == device_profile.UNITS[key], key
        assert entry["source"].strip(), key


def test_loaded_profile_passes_the_native_range_check():
    native = ffi.new("spy_profile *")
    for field, value in device_profile.load("spyre").native_fields().items():
        setattr(native, field, value)
    assert lib.spy_profile_check(native) == lib.SPY_OK
    native.pt_utilization = 1.5
    assert lib.spy_profile_check(native) == lib.SPY_E_PROFILE
    assert "pt_utilization" in ffi.string(lib.spy_last_error()).decode()


def test_the_roofline_figures_name_their_evidence():
    """The figures that set the roofline are public only with a citation of the sources in
    the profile's header; the unpublished ones are assumptions with their reasoning, and
    nothing cites material that is not public."""
    text = device_profile._source_text("spyre")[1]
    assert "design notes" not in text and "[datasheet]" not in text
    p = device_profile.load("spyre")
    for name in ("pt_macs_per_ns", "pt_utilization", "dram_bandwidth_gbps"):
        f = p.figures[name]
        assert f.kind == "assumption" and "not published" in f.source, name
    for f in p.figures.values():
        if f.kind == "public":
            cited = re.findall(r"\[([\w-]+)\]", f.source)
            assert cited and all(f"#   [{c}]" in text for c in cited), f.name


def test_info_and_the_roofline_say_which_figures_are_assumptions():
    import io

    from rich.console import Console

    from spyre_rt import card as cards
    from spyre_rt.profiler import info, roofline

    p = device_profile.load("spyre")
    assert set(roofline.assumptions(p)) >= {"pt_macs_per_ns", "pt_utilization", "dram_bandwidth_gbps"}
    console = Console(file=io.StringIO(), width=200)
    console.print(info.profile_table(cards.card_set()))
    text = console.file.getvalue()
    assert "the roofline rests on assumptions: " in text and "dram_bandwidth_gbps" in text.split("rests on")[1]
