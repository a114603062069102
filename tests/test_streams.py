"""Streams and events of the card: torch.spyre.Stream / Event shaped like torch.cuda's, the
device-generic forms (torch.Stream, torch.Event, torch.accelerator's stream calls), and
event timing on the card's own clock."""

import time
import warnings

import pytest
import torch

import spyre_rt
from spyre_rt import card as cards
from spyre_rt import streams
from spyre_rt.errors import SpyreError, SpyreGraphError


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- streams ----

def test_the_default_stream_and_new_streams():
    default = torch.spyre.default_stream()
    assert default.stream_id == 0 and default.device == torch.device("spyre", 0)
    assert torch.spyre.current_stream() == default
    s, t = torch.spyre.Stream(), torch.spyre.Stream()
    assert s != t and s != default and s.stream_id > 0
    assert s == torch.spyre.Stream(0, stream_id=s.stream_id) and hash(s) == hash(torch.spyre.Stream(0, stream_id=s.stream_id))
    assert isinstance(s, torch.Stream) and isinstance(s, torch._C.Stream) and issubclass(torch.spyre.Stream, torch.Stream)
    with pytest.raises(SpyreError, match="spyre:7 does not exist"):
        torch.spyre.Stream("spyre:7")


def test_torch_stream_and_torch_event_make_the_cards_classes():
    assert isinstance(torch.Stream("spyre"), torch.spyre.Stream)
    assert isinstance(torch.Stream(device="spyre:0", priority=-1), torch.spyre.Stream)
    assert isinstance(torch.Stream(), torch.spyre.Stream)  # the card is the accelerator
    assert isinstance(torch.Event(device="spyre", enable_timing=True), torch.spyre.Event)
    assert torch.Event("spyre", enable_timing=True).enable_timing
    assert not torch.Event("spyre").enable_timing  # torch.Event's default
    same = torch.Stream(stream_id=5, device_index=0, device_type=streams.DEVICE_TYPE)
    assert isinstance(same, torch.spyre.Stream) and same.stream_id == 5


def test_other_devices_keep_torchs_own_objects():
    cpu_stream, cpu_event = torch.Stream("cpu"), torch.Event("cpu")
    assert type(cpu_stream) is torch._C.Stream and type(cpu_event) is torch._C.Event
    assert isinstance(cpu_stream, torch.Stream) and isinstance(cpu_event, torch.Event)
    assert not isinstance(cpu_stream, torch.spyre.Stream)
    assert issubclass(torch._C.Event, torch.Event) and issubclass(torch.Event, torch._C.Event)
    assert torch.Stream.__name__ == "Stream" and torch.Event.__module__ == "torch"

    class MyEvent(torch.Event):  # a subclass is made as classes are
        pass

    assert type(MyEvent("cpu")) is MyEvent
    with pytest.raises(TypeError):
        torch.Event("spyre", no_such_argument=True)  # torch's own constructor reports it


def test_a_stream_context_makes_it_current_and_restores():
    s, t = torch.spyre.Stream(), torch.spyre.Stream()
    with torch.spyre.stream(s) as entered:
        assert entered is s and torch.spyre.current_stream() == s
        assert torch.accelerator.current_stream() == s
        with t:
            assert torch.spyre.current_stream() == t
        assert torch.spyre.current_stream() == s
    assert torch.spyre.current_stream() == torch.spyre.default_stream()
    with torch.spyre.stream(None):
        assert torch.spyre.current_stream() == torch.spyre.default_stream()
    with torch.Stream("spyre") as u:  # device-generic code
        assert torch.accelerator.current_stream() == u
    assert torch.accelerator.current_stream() == torch.spyre.default_stream()


def test_set_stream_through_torch_accelerator():
    s = torch.spyre.Stream()
    try:
        torch.accelerator.set_stream(s)
        assert torch.spyre.current_stream() == s
        # a torch.Stream of the card that torch made itself names the same queue
        torch.accelerator.set_stream(torch._C.Stream(stream_id=9, device_index=0, device_type=streams.DEVICE_TYPE))
        assert torch.spyre.current_stream().stream_id == 9
    finally:
        torch.spyre.set_stream(torch.spyre.default_stream())
    with pytest.raises(SpyreError, match="expected a stream of a spyre card"):
        torch.spyre.set_stream(torch._C.Stream("cpu"))


def test_the_current_stream_is_per_thread():
    import threading

    s = torch.spyre.Stream()
    seen = []
    with torch.spyre.stream(s):
        th = threading.Thread(target=lambda: seen.append(torch.spyre.current_stream()))
        th.start()
        th.join()
    assert seen == [torch.spyre.default_stream()]


def test_stream_synchronize_waits_for_the_card(quiet):
    c = cards.get(0)
    torch.ones(1 << 16).to("spyre")
    finish = c.device_finish_ns()
    s = torch.spyre.current_stream()
    s.synchronize()
    assert c.clock().host_ns >= finish and s.query()
    # one in-order queue: waiting on a stream or event of the same card launches nothing
    before = c.counters()["native_calls"]
    s.wait_stream(torch.spyre.Stream())
    s.wait_event(torch.spyre.Stream().record_event())
    assert c.counters()["native_calls"] == before


def test_is_capturing_follows_a_graph_capture():
    s = torch.spyre.current_stream()
    assert not s.is_capturing()
    g = torch.spyre.SpyreGraph()
    with torch.spyre.graph(g):
        assert s.is_capturing()
        with pytest.raises(SpyreGraphError, match="recording an event"):
            torch.spyre.Event().record()


# ---- events ----

def test_an_event_completes_when_the_card_reaches_it(quiet):
    c = cards.get(0)
    e = torch.spyre.Event()
    assert e.query() and e.device is None  # unrecorded: complete, as CUDA's
    e.synchronize()
    torch.ones(1 << 16).to("spyre")
    e.record()
    assert e.device == torch.device("spyre", 0)
    mark = c.device_finish_ns()
    torch.ones(1 << 18).to("spyre")  # later work the event does not wait for
    host = c.clock().host_ns
    waited = c.counters()["wait_ns"]
    e.synchronize()
    assert e.query() and c.clock().host_ns >= mark
    # the host waited until the event, never for the work launched after it
    assert c.counters()["wait_ns"] - waited <= max(0, mark - host) + 1


def test_device_generic_event_patterns(quiet):
    """As transformers' continuous batching and torch's own offloading use them."""
    device = torch.device("spyre", 0)
    h2d, compute = torch.Stream(device), torch.Stream(device)
    over = torch.Event(device, enable_timing=False)
    x = torch.randn(64, 64)
    with h2d:
        dx = x.to(device)
    h2d.record_event(over)
    compute.wait_event(over)
    with compute:
        y = dx * 2
    done = compute.record_event()
    done.synchronize()
    over.synchronize()
    assert done.query() and torch.equal(y.cpu(), x * 2)
    assert isinstance(done, torch.Event) and isinstance(done, torch.spyre.Event)
    torch.accelerator.synchronize()


def test_elapsed_time_needs_timing_recorded_and_completed_events():
    a, b = torch.spyre.Event(), torch.spyre.Event()
    a.record()
    b.record()
    with pytest.raises(SpyreError, match="enable_timing=True"):
        a.elapsed_time(b)
    a, b = torch.spyre.Event(enable_timing=True), torch.spyre.Event(enable_timing=True)
    with pytest.raises(SpyreError, match="must be recorded"):
        a.elapsed_time(b)
    a.record()
    b.record()
    b.synchronize()
    assert a.elapsed_time(b) == 0.0  # no work between them
    with pytest.raises(SpyreError, match="another torch.spyre.Event"):
        a.elapsed_time(torch._C.Event("cpu"))
    with pytest.raises(SpyreError, match="interprocess"):
        torch.spyre.Event(interprocess=True)


def _card_time_ms(c: cards.Card, first: int) -> tuple[float, int]:
    """What the card spent on the jobs in its trace from event `first` on: each job's run
    and its launch latency (the profile's job_launch_ns), in ms; and the number of jobs."""
    ev = c.trace_events(first)
    jobs = ev[ev["kind"] == cards.EV_JOB]
    run_ns = float((jobs["end_ns"] - jobs["start_ns"]).sum())
    return (run_ns + len(jobs) * c.profile["job_launch_ns"]) / 1e6, len(jobs)


def _timed(c: cards.Card, work) -> tuple[float, float, int]:
    """Events around work(): (elapsed ms, the card's time for the work from its trace,
    jobs)."""
    start, end = torch.Event("spyre", enable_timing=True), torch.Event("spyre", enable_timing=True)
    c.trace_enable(True, commands=False)
    try:
        first = c.trace_count()
        start.record()
        work()
        end.record()
        end.synchronize()
        return (start.elapsed_time(end), *_card_time_ms(c, first))
    finally:
        c.trace_enable(False)


def test_events_around_an_eager_matmul_time_the_cards_work(quiet):
    with spyre_rt.configured(sim_mode="timing") as cs:
        c = cs.cards[0]
        a, b = torch.randn(256, 512).to("spyre"), torch.randn(512, 128).to("spyre")
        t0 = c.clock()
        elapsed, card_ms, jobs = _timed(c, lambda: (_host_work(0.01), a @ b))
        span_ms = (c.clock().finish_ns - t0.finish_ns) / 1e6
    # the matmul runs on the CPU: the card copies a and b down and the product up
    assert jobs == 3
    assert elapsed == pytest.approx(card_ms, rel=1e-9)
    # the card sat idle while the host worked and multiplied: its timeline grew by more, the
    # event pair did not count it
    assert span_ms >= elapsed + 10


def _host_work(seconds: float) -> None:
    """Busy host work: `seconds` of the calling thread's CPU time (the host clock's)."""
    end = time.thread_time_ns() + int(seconds * 1e9)
    while time.thread_time_ns() < end:
        pass


def test_a_host_that_sleeps_does_not_keep_the_card_waiting(quiet):
    """Sleeping is not host work: the host clock is CPU time, so the card's timeline does
    not grow by a sleep (the wall twin of the host clock does)."""
    with spyre_rt.configured(sim_mode="timing") as cs:
        c = cs.cards[0]
        a = torch.randn(256, 512).to("spyre")
        torch.spyre.synchronize()
        t0 = c.clock()
        time.sleep(0.02)
        a.cpu()
        t1 = c.clock()
    assert t1.host_wall_ns - t0.host_wall_ns >= 20e6
    assert t1.finish_ns - t0.finish_ns < 20e6
    assert t1.host_ns - t0.host_ns < 20e6


def _compiled_step_time(sim_mode: str) -> tuple[float, float, int]:
    with spyre_rt.configured(sim_mode=sim_mode) as cs:
        c = cs.cards[0]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
        model = model.to("spyre")
        step = torch.compile(model, backend="spyre_rt")
        x = torch.randn(64, 256).to("spyre")
        with torch.no_grad():
            step(x)  # builds the plans (and uploads them: card work of its own)
            torch.spyre.synchronize()
            return _timed(c, lambda: step(x))


def test_events_around_a_compiled_step_time_the_card_deterministically(quiet):
    elapsed, card_ms, jobs = _compiled_step_time("timing")
    assert jobs >= 2 and elapsed == pytest.approx(card_ms, rel=1e-9)
    again = _compiled_step_time("timing")
    assert again[0] == pytest.approx(elapsed, rel=1e-9)  # the same work times the same
    functional = _compiled_step_time("functional")
    assert functional[0] == pytest.approx(elapsed, rel=1e-9)  # two modes, one timeline


def test_events_on_two_cards(small_profile_path, quiet):
    path = small_profile_path.replace("small.toml", "two.toml")
    from small_profiles import small_profile_text

    with open(path, "w") as f:
        f.write(small_profile_text(count=2))
    with spyre_rt.configured(path):
        e = torch.spyre.Event(enable_timing=True)
        torch.ones(1024).to("spyre:0")
        e.record(torch.spyre.Stream(0))
        with pytest.raises(SpyreError, match="cannot be recorded on spyre:1"):
            e.record(torch.spyre.Stream(1))
        other = torch.spyre.Event(enable_timing=True, device="spyre:1")
        other.record()
        assert other.device == torch.device("spyre", 1)
        other.synchronize()
        e.synchronize()
        with pytest.raises(SpyreError, match="two cards"):
            e.elapsed_time(other)
        # waiting on another card's event: the host waits for the event
        later = torch.spyre.Event()
        torch.ones(1 << 14).to("spyre:0")
        later.record(torch.spyre.Stream(0))
        torch.spyre.Stream(1).wait_event(later)
        assert later.query()
