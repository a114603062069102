"""The data-transfer path and the allocator."""

import pytest
import torch

import spyre_rt  # noqa: F401  (registers the device)


@pytest.mark.benchmark(group="memory")
def test_device_allocation(benchmark):
    benchmark(lambda: torch.empty(4096, device="spyre"))


@pytest.mark.benchmark(group="transfer")
def test_small_host_to_device_copy(benchmark):
    src = torch.randn(32, 32)
    dst = torch.empty(32, 32, device="spyre")
    benchmark(dst.copy_, src)


@pytest.mark.benchmark(group="transfer")
def test_large_host_to_device_copy(benchmark):
    src = torch.randn(2048, 2048)
    dst = torch.empty(2048, 2048, device="spyre")
    # 25 rounds: at 5 its median moved by ±10 % from run to run on a shared machine
    benchmark.pedantic(dst.copy_, args=(src,), rounds=25, iterations=1, warmup_rounds=2)
    benchmark.extra_info["bytes"] = src.numel() * 4
