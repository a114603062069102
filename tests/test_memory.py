"""Device memory: lifetimes, statistics, out-of-memory."""

import gc

import pytest
import torch

import spyre_rt
from spyre_rt import card as cards


def test_memory_follows_tensor_lifetimes():
    start = torch.spyre.memory_allocated()
    t = torch.empty(1000, device="spyre")
    assert torch.spyre.memory_allocated() - start == 4096  # 4000 bytes, whole sticks
    v = t[10:20]
    del t
    assert torch.spyre.memory_allocated() - start == 4096  # the view keeps the storage
    del v
    assert torch.spyre.memory_allocated() == start


def test_peak_reserved_and_empty_cache():
    torch.spyre.reset_peak_memory_stats()
    torch.spyre.empty_cache()
    base = torch.spyre.memory_allocated()
    reserved = torch.spyre.memory_reserved()  # what live tensors and compiled steps' pools hold
    t = torch.empty(1 << 20, dtype=torch.uint8, device="spyre")
    assert torch.spyre.max_memory_allocated() >= base + (1 << 20)
    del t
    assert torch.spyre.memory_reserved() >= reserved + (1 << 20)  # kept for reuse
    torch.spyre.empty_cache()
    assert torch.spyre.memory_reserved() <= reserved


def test_out_of_memory_is_a_torch_oom_naming_sizes(small_profile_path):
    with cards.configured(small_profile_path):
        start = torch.spyre.memory_allocated()
        keep = torch.empty(512 * 1024, dtype=torch.uint8, device="spyre")
        with pytest.raises(torch.OutOfMemoryError) as e:
            torch.empty(1 << 20, dtype=torch.uint8, device="spyre")
        assert isinstance(e.value, spyre_rt.SpyreOutOfMemoryError)
        assert e.value.requested == 1 << 20 and e.value.free == 512 * 1024
        assert "requested 1048576 bytes" in str(e.value) and "524288 bytes free" in str(e.value)
        del keep
        assert torch.spyre.memory_allocated() == start
        x = torch.empty(1 << 20, dtype=torch.uint8, device="spyre")  # fits again
        del x


def test_no_leak_over_ten_thousand_allocations(small_profile_path):
    with cards.configured(small_profile_path):
        gc.disable()
        try:
            start = torch.spyre.memory_allocated()
            for i in range(10_000):
                t = torch.empty(64 + i % 50, device="spyre")
                v = t[3:].view(-1, 1).t()
                del t
                del v
            assert torch.spyre.memory_allocated() == start
            st = cards.get(0).mem_stats()
            assert st["total_allocs"] - st["total_frees"] == st["num_allocs"]
        finally:
            gc.enable()
