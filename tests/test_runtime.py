"""The native runtime through its Python layer: cost model, validation, clocks.

Figures in the cost tests are computed by hand from profiles/devices/spyre.toml:
  dma_latency_ns 300, core_dma_gbps 48, dram_bandwidth_gbps 150,
  pt_macs_per_ns 1536, pt_utilization 0.7422, pt_latency_ns 20, pt_gran (8, 64, 1),
  pcie_bandwidth_gbps 57.6, pcie_latency_ns 1000, pcie_descriptor_ns 2,
  ring 128 B/cycle at 1.5 GHz, ring_hop_ns 4.
"""

import time

import numpy as np
import pytest
from programs import loads

from spyre_rt import jobs
from spyre_rt.card import MEM_DATA
from spyre_rt.errors import SpyreInvalidCommandError
from spyre_rt.native import lib
from spyre_rt.program import (
    CMD_MM,
    CMD_RING,
    CORE_CARD,
    OP_H2D,
    OP_LOAD,
    OP_MATMUL,
    OP_RING,
    SLOT_DRAM,
    SLOT_HOST,
    ProgramBuilder,
    empty_cmds,
)

MiB = 1 << 20


def busy(card, blob, bindings):
    """Device time of one launch of the program (its upload not included)."""
    prog = jobs.ResidentProgram(card, blob)
    before = card.counters()["device_busy_ns"]
    prog.launch(bindings)
    after = card.counters()["device_busy_ns"]
    prog.free()
    return after - before


def matmul_program(m, n, k, dtype=lib.SPY_DT_F16):
    b = ProgramBuilder()
    c = empty_cmds(1, OP_MATMUL, 0, CMD_MM)
    es = 2 if dtype != lib.SPY_DT_F32 else 4
    c["a_off"], c["b_off"] = 0, m * k * es
    c["c_off"] = m * k * es + k * n * es
    c["m"], c["n"], c["k"] = m, n, k
    c["lda"], c["ldb"], c["ldc"] = k, n, n
    c["a_dtype"] = c["b_dtype"] = dtype
    b.add(c)
    return b.encode()


def test_dram_bound_copy_one_core(timing_card):
    buf = timing_card.malloc(MiB)
    t = busy(timing_card, loads([0], MiB), [buf])
    assert t == pytest.approx(300 + MiB / 48, rel=0.01)


def test_dram_bandwidth_is_shared_by_32_cores(timing_card):
    buf = timing_card.malloc(32 * MiB)
    t = busy(timing_card, loads(list(range(32)), MiB), [buf])
    assert t == pytest.approx(300 + 32 * MiB / 150, rel=0.01)


def test_four_cores_saturate_nothing_below_dram(timing_card):
    buf = timing_card.malloc(4 * MiB)
    t = busy(timing_card, loads([0, 1, 2, 3], MiB), [buf])
    # 4 x 48 = 192 GB/s wanted, 150 available
    assert t == pytest.approx(300 + 4 * MiB / 150, rel=0.01)


def test_compute_bound_matmul_tile(timing_card):
    t = busy(timing_card, matmul_program(256, 256, 512), [])
    assert t == pytest.approx(20 + 256 * 256 * 512 / (1536 * 0.7422), rel=0.01)


def test_matmul_pays_for_array_padding(timing_card):
    t = busy(timing_card, matmul_program(1, 100, 512), [])
    assert t == pytest.approx(20 + 8 * 128 * 512 / (1536 * 0.7422), rel=0.01)


def test_pcie_transfer(timing_card):
    buf = timing_card.malloc(4 * MiB)
    b = ProgramBuilder()
    h, d = b.slot(SLOT_HOST, 4 * MiB), b.slot(SLOT_DRAM, 4 * MiB)
    c = empty_cmds(1, OP_H2D, CORE_CARD)
    c["src_slot"], c["dst_slot"], c["run_bytes"] = h, d, 4 * MiB
    b.add(c)
    host = np.zeros(1, np.uint8)
    t = busy(timing_card, b.encode(), [host.ctypes.data, buf])
    assert t == pytest.approx(1000 + 2 + 4 * MiB / 57.6, rel=0.01)


def test_ring_transfer_takes_the_short_way(timing_card):
    b = ProgramBuilder()
    c = empty_cmds(1, OP_RING, 0, CMD_RING)
    c["dst_core"], c["bytes"] = 31, 96 * 1024
    b.add(c)
    t = busy(timing_card, b.encode(), [])
    assert t == pytest.approx(1 * 4 + 96 * 1024 / (128 * 1.5), rel=0.01)


def test_timing_and_functional_give_the_same_device_time(functional_card, timing_card):
    blob = matmul_program(64, 128, 256)
    assert busy(functional_card, blob, []) == busy(timing_card, blob, [])
    f_buf, t_buf = functional_card.malloc(8 * MiB), timing_card.malloc(8 * MiB)
    blob = loads(list(range(8)), MiB)
    assert busy(functional_card, blob, [f_buf]) == busy(timing_card, blob, [t_buf])


def test_invalid_commands_are_typed_and_named(functional_card):
    buf = functional_card.malloc(4096)
    blob = loads([0], 8192)  # slot extent 8 KiB, bound to a 4 KiB allocation
    with pytest.raises(SpyreInvalidCommandError, match="slot 0") as e:
        jobs.run_once(functional_card, blob, [buf])
    assert e.value.status == "SPY_E_BAD_ADDRESS"
    b = ProgramBuilder()
    s = b.slot(SLOT_DRAM, 4096)
    c = empty_cmds(1, OP_LOAD, 0)
    c["src_slot"], c["run_bytes"], c["dst_off"] = s, 4096, 2 * MiB - 100
    b.add(c)
    with pytest.raises(SpyreInvalidCommandError, match="command 0.*scratchpad") as e:
        jobs.validate(functional_card, b.encode())
    assert e.value.command == 0 and e.value.status == "SPY_E_SCRATCHPAD"
    b = ProgramBuilder()
    s = b.slot(SLOT_DRAM, 4096)
    c = empty_cmds(2, OP_LOAD, np.array([0, 1]))
    c["src_slot"], c["run_bytes"] = s, 128
    c["dep_begin"], c["ndeps"] = [0, 1], 1
    b.add(c, np.array([1, 0]))
    with pytest.raises(SpyreInvalidCommandError, match="cycle") as e:
        jobs.validate(functional_card, b.encode())
    assert e.value.status == "SPY_E_CYCLE"
    # the card still works
    assert busy(functional_card, loads([0], 4096), [buf]) > 0


def test_host_clock_excludes_simulator_arithmetic(functional_card):
    """A functional matmul costs the simulator real time growing with its size; the host
    clock only sees the launch."""
    card = functional_card
    sizes = {}
    for n in (64, 512):
        blob = matmul_program(n, n, n, lib.SPY_DT_F16)
        prog = jobs.ResidentProgram(card, blob)
        prog.launch([])  # warm
        sim0, host0, wall0 = card.counters()["sim_ns"], card.host_clock_ns(), time.perf_counter_ns()
        prog.launch([])
        sizes[n] = (card.counters()["sim_ns"] - sim0, card.host_clock_ns() - host0,
                    time.perf_counter_ns() - wall0)
        prog.free()
    sim_big, host_big, wall_big = sizes[512]
    sim_small, host_small, _ = sizes[64]
    assert sim_big > 50 * sim_small          # 512x more arithmetic
    assert host_big < 0.2 * wall_big         # the wall time is the simulator's
    assert host_big < 20 * max(host_small, 20_000)


def test_native_calls_are_counted(functional_card):
    before = functional_card.counters()["native_calls"]
    functional_card.free(functional_card.malloc(128))
    assert functional_card.counters()["native_calls"] - before == 2


def test_memory_allocation_stats(functional_card):
    st0 = functional_card.mem_stats()
    a = functional_card.malloc(1000, MEM_DATA)
    st = functional_card.mem_stats()
    assert st["allocated"] - st0["allocated"] == 1024  # rounded to the stick
    functional_card.free(a)
    assert functional_card.mem_stats()["allocated"] == st0["allocated"]
