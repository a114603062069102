"""torch.accelerator answers for the card as it does for CUDA.

Each call runs in a process of its own (after a plain ``import torch``: the entry point
registers the card), so that a call that crashed the process, as ``empty_host_cache``
did, or hit torch's internal assert fails its own test; its script checks the answer
against the card's figures.
"""

import multiprocessing
import textwrap

import pytest
from small_profiles import small_profile_text

PRELUDE = """
import torch
from spyre_rt import card as cards

assert torch.accelerator.current_accelerator() == torch.device("spyre")
"""

# name -> a script that makes the call and checks its answer
CALLS = {
    "synchronize": """
        x = torch.ones(1 << 16).to("spyre")
        finish = cards.get(0).device_finish_ns()
        assert torch.accelerator.synchronize() is None
        assert cards.get(0).clock().host_ns >= finish  # the host waited for the card
        torch.accelerator.synchronize(0)
        torch.accelerator.synchronize("spyre:0")
    """,
    "empty_cache": """
        x = torch.empty(1 << 16, device="spyre")
        del x  # its block stays reserved, for reuse
        st = cards.get(0).mem_stats()
        assert st["reserved"] - st["allocated"] >= 1 << 18
        torch.accelerator.empty_cache()
        st = cards.get(0).mem_stats()
        assert st["reserved"] == st["allocated"]
    """,
    "empty_host_cache": """
        x = torch.ones(16).to("spyre")
        assert torch.accelerator.empty_host_cache() is None
        assert x.cpu().tolist() == [1.0] * 16
    """,
    "memory_allocated": """
        base = torch.accelerator.memory_allocated()
        x = torch.empty(1000, device="spyre")  # 4000 bytes: whole 128-byte sticks
        assert torch.accelerator.memory_allocated() - base == 4096
        assert torch.accelerator.memory_allocated() == torch.spyre.memory_allocated()
        assert torch.accelerator.memory_allocated(0) == torch.accelerator.memory_allocated("spyre:0")
        del x
        assert torch.accelerator.memory_allocated() == base
    """,
    "max_memory_allocated": """
        base = torch.accelerator.memory_allocated()
        x = torch.empty(1 << 20, device="spyre")
        del x
        assert torch.accelerator.max_memory_allocated() >= base + (4 << 20)
        assert torch.accelerator.max_memory_allocated() == torch.spyre.max_memory_allocated()
        assert torch.accelerator.memory_allocated() == base
    """,
    "memory_reserved": """
        x = torch.empty(1 << 16, device="spyre")
        del x
        assert torch.accelerator.memory_reserved() == cards.get(0).mem_stats()["reserved"]
        assert torch.accelerator.memory_reserved() == torch.spyre.memory_reserved()
        assert torch.accelerator.memory_reserved() >= (1 << 18) + torch.accelerator.memory_allocated()
    """,
    "max_memory_reserved": """
        x = torch.empty(1 << 20, device="spyre")
        del x
        peak = torch.accelerator.memory_reserved()
        torch.accelerator.empty_cache()
        assert torch.accelerator.memory_reserved() <= peak - (4 << 20)
        assert torch.accelerator.max_memory_reserved() == peak == torch.spyre.max_memory_reserved()
    """,
    "memory_stats": """
        x = torch.empty(1000, device="spyre")
        st, card = torch.accelerator.memory_stats(), cards.get(0).mem_stats()
        assert st["allocated_bytes.all.current"] == card["data_allocated"] == torch.spyre.memory_allocated()
        assert st["allocated_bytes.all.peak"] == card["data_peak"]
        assert st["reserved_bytes.all.current"] == card["reserved"]
        assert st["reserved_bytes.all.peak"] == card["peak_reserved"]
        assert st["num_ooms"] == card["num_ooms"] == 0
        assert list(st) == sorted(st)  # torch's own flattening
        assert {k: v for k, v in torch.spyre.memory_stats().items() if k in st} == dict(st)
    """,
    "reset_peak_memory_stats": """
        x = torch.empty(1 << 20, device="spyre")
        del x
        assert torch.accelerator.max_memory_allocated() > torch.accelerator.memory_allocated()
        assert torch.accelerator.reset_peak_memory_stats() is None
        assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated()
        assert torch.accelerator.max_memory_reserved() == torch.accelerator.memory_reserved()
    """,
    "reset_accumulated_memory_stats": """
        try:
            torch.empty(1 << 40, device="spyre")  # 4 TiB: more than the card holds
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("no out-of-memory error")
        assert torch.accelerator.memory_stats()["num_ooms"] == 1
        assert torch.accelerator.reset_accumulated_memory_stats() is None
        assert torch.accelerator.memory_stats()["num_ooms"] == 0
        assert cards.get(0).mem_stats()["total_allocs"] == 0
    """,
    "get_memory_info": """
        x = torch.empty(1000, device="spyre")
        free, total = torch.accelerator.get_memory_info()
        assert total == torch.spyre.get_device_properties().total_memory == 128 << 30
        assert free == total - torch.spyre.memory_reserved()
        assert torch.accelerator.get_memory_info(0) == (free, total)
    """,
    "torch.spyre.mem_get_info": """
        x = torch.empty(1000, device="spyre")
        free, total = torch.spyre.mem_get_info()
        assert (free, total) == torch.accelerator.get_memory_info()
        assert total == 128 << 30 and free == total - cards.get(0).mem_stats()["reserved"]
    """,
    "get_device_capability": """
        dtypes = torch.accelerator.get_device_capability()["supported_dtypes"]
        assert {torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool} <= dtypes
        assert torch.complex64 not in dtypes
    """,
    "streams_and_events": """
        s = torch.accelerator.current_stream()
        assert isinstance(s, torch.spyre.Stream) and s == torch.spyre.default_stream()
        t = torch.Stream()
        torch.accelerator.set_stream(t)
        assert torch.accelerator.current_stream() == t
        start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        start.record()
        y = torch.ones(1 << 16).to("spyre")
        end.record()
        torch.accelerator.synchronize()
        assert end.query() and start.elapsed_time(end) > 0
    """,
    "before_the_card_opens": """
        # torch's contract: the memory calls are no-ops before the allocator is initialised
        assert torch.accelerator.memory_allocated() == 0
        assert torch.accelerator.max_memory_reserved() == 0
        assert torch.accelerator.memory_stats() == {}
        torch.accelerator.empty_cache()
        torch.accelerator.empty_host_cache()
        torch.accelerator.reset_peak_memory_stats()
        torch.accelerator.reset_accumulated_memory_stats()
        torch.accelerator.synchronize()
        assert not cards.is_open()
        free, total = torch.accelerator.get_memory_info()  # opens it
        assert cards.is_open() and free == total == 128 << 30
    """,
}

TWO_CARDS = {
    "device_index": """
        assert torch.accelerator.device_count() == 2
        torch.spyre.set_device(1)
        assert torch.accelerator.current_device_index() == 1
        torch.accelerator.set_device_index(0)
        assert torch.spyre.current_device() == 0
        with torch.accelerator.device_index(1):
            assert torch.spyre.current_device() == 1
            x = torch.empty(1000, device="spyre")
            assert x.device == torch.device("spyre", 1)
            assert torch.accelerator.memory_allocated() == torch.spyre.memory_allocated(1) >= 4096
            assert torch.accelerator.current_stream().device_index == 1
        assert torch.accelerator.current_device_index() == 0
        assert torch.accelerator.memory_allocated(1) == torch.spyre.memory_allocated(1)
        torch.accelerator.set_device_index(-1)  # torch: a negative index does nothing
        assert torch.spyre.current_device() == 0
    """,
    "device_context_of_the_current_card": """
        # "spyre" without an index, given by a device context, means the current card for
        # the tensors made from data as for the factory functions
        torch.spyre.set_device(1)
        with torch.device("spyre"):
            made = (torch.tensor([1.0]), torch.as_tensor([1.0]), torch.asarray([1.0]), torch.zeros(2),
                    torch.tensor([1.0], device=None), torch.tensor(1.0, device="cpu"))
        assert [str(t.device) for t in made] == ["spyre:1"] * 5 + ["cpu"], made
        assert made[0].cpu().tolist() == [1.0]
        with torch.device("spyre:0"):
            assert torch.tensor([1.0]).device == torch.device("spyre", 0)
        with torch.device("spyre"), torch.device("meta"):  # the innermost context wins
            assert torch.tensor([1.0]).device.type == "meta"
        torch.set_default_device("spyre")
        try:
            assert torch.tensor([1.0]).device == torch.device("spyre", 1)
            assert torch.get_default_device() == torch.device("spyre", 1)
        finally:
            torch.set_default_device(None)
        assert torch.tensor([1.0]).device.type == "cpu"
    """,
    "new_tensors_on_the_tensors_own_card": """
        # Tensor.new_tensor and Tensor.new make their tensor in C++ from the dispatch key (no
        # index): they stay on the tensor's card, not the current one
        b = torch.arange(6.0).reshape(2, 3).to("spyre:1")
        made = {"new_tensor": b.new_tensor([1.0, 2.0]), "new_tensor of a tensor": b.new_tensor(b),
                "new(sizes)": b.new(2, 2), "new(data)": b.new([1.0]), "new()": b.new(),
                "new_tensor, device given": b.new_tensor([1.0], device="spyre:0")}
        devices = {k: str(v.device) for k, v in made.items()}
        assert devices == {**dict.fromkeys(made, "spyre:1"), "new_tensor, device given": "spyre:0"}, devices
        assert made["new_tensor"].cpu().tolist() == [1.0, 2.0] and made["new()"].shape == (0,)
        assert made["new_tensor of a tensor"].cpu().tolist() == b.cpu().tolist()
        assert b.new(b) is b or b.new(b).data_ptr() == b.data_ptr()  # new of one tensor aliases it
        assert torch.ones(2).new_tensor([3.0]).device.type == "cpu"
    """,
}


def _script(body: str, result: str) -> str:
    """The call's script, reporting ``ok`` or its traceback in the file `result`."""
    code = textwrap.indent(PRELUDE + textwrap.dedent(body), "    ")
    return (f"import traceback\ntry:\n{code}\n    open({result!r}, 'w').write('ok')\n"
            f"except BaseException:\n    open({result!r}, 'w').write(traceback.format_exc())\n    raise SystemExit(1)\n")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every script's exit code and report. Each runs in a process of its own, forked from a
    server that has only imported torch (and so registered the card: no card is open), which
    spares every call an import of torch."""
    tmp = tmp_path_factory.mktemp("accelerator")
    two = tmp / "two.toml"
    two.write_text(small_profile_text(dram_gib=1, count=2))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    scripts = dict(CALLS)
    scripts.update({n: f"cards.configure({str(two)!r})\n" + textwrap.dedent(b) for n, b in TWO_CARDS.items()})
    out = {}
    for name, body in scripts.items():
        result = tmp / f"{name}.txt"
        proc = ctx.Process(target=exec, args=(_script(body, str(result)), {}))
        proc.start()
        proc.join(timeout=600)
        out[name] = (proc.exitcode, result.read_text() if result.exists() else "(no report)")
    return out


@pytest.mark.parametrize("name", sorted(CALLS) + sorted(TWO_CARDS))
def test_call_exits_cleanly_with_the_cards_answer(outcomes, name):
    exitcode, report = outcomes[name]
    assert exitcode == 0 and report == "ok", f"{name}: exit {exitcode}\n{report}"


def test_other_accelerators_get_torchs_own_functions(monkeypatch):
    """The card answers only while it is the accelerator; otherwise torch's function runs
    (here torch's own answer for a Python backend: its guard cannot synchronize)."""
    import torch

    from spyre_rt import accelerator

    torch.ones(1, device="spyre")  # torch's own function is a no-op until the device is in use
    torch._C._accelerator_synchronizeDevice(0)  # the card answers
    monkeypatch.setattr(accelerator, "_card_is_accelerator", lambda: False)
    with pytest.raises(RuntimeError, match="doesn't support synchronizing all streams"):
        torch._C._accelerator_synchronizeDevice(0)
    for name in accelerator.ANSWERS:
        assert getattr(torch._C, name).__wrapped__ is not None, name


def test_a_non_blocking_copy_to_the_host_completes():
    """torch gives a non-blocking copy to the host a pinned result; the card's copies have
    completed when the call returns, so it is an ordinary copy."""
    import torch

    x = torch.randn(5, 7)
    out = x.to("spyre").to("cpu", non_blocking=True)
    assert out.device.type == "cpu" and torch.equal(out, x)


def test_pinning_for_the_card_copies_into_ordinary_host_memory():
    import torch

    x = torch.randn(4, 6).t()
    pinned = x.pin_memory()  # the card is the accelerator
    assert torch.equal(pinned, x) and pinned.stride() == x.stride()
    assert pinned.data_ptr() != x.data_ptr() and not pinned.is_pinned()
    batches = list(torch.utils.data.DataLoader(torch.arange(6.0), batch_size=4, pin_memory=True))
    assert [b.tolist() for b in batches] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    with pytest.raises(RuntimeError, match="CPU device type not an accelerator"):
        torch.ops.aten._pin_memory(x, torch.device("cpu"))  # another device: torch's kernel answers
