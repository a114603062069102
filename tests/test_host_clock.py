"""The host clock's rule (docs/ARCHITECTURE.md, "Host work and the card's"): host work is CPU
time of the threads calling into the card (CLOCK_THREAD_CPUTIME_ID, Python's
``time.thread_time_ns``), the card's own work on those threads (simulating a job, walking a
resident plan) left out, the waits for the card added. Each claim is checked by bracketing the
card's clocks between readings of the thread's own CPU clock, so no figure depends on how fast
or how loaded the machine is."""

import threading
import time
import warnings

import pytest
import torch

import spyre_rt


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _spin(ns: int) -> None:
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass


def _host_and_card(card, work):
    """(CPU time of the thread between two readings around `work`, at least and at most;
    host clock advance less waits; the card's work in CPU time; its counters' deltas)."""
    outer0 = time.thread_time_ns()
    c0, k0 = card.clock(), card.counters()
    inner0 = time.thread_time_ns()
    work()
    inner1 = time.thread_time_ns()
    k1 = card.counters()
    c1 = card.clock()
    outer1 = time.thread_time_ns()
    host = (c1.host_ns - c0.host_ns) - (k1["wait_ns"] - k0["wait_ns"])
    card_work = k1["sim_cpu_ns"] - k0["sim_cpu_ns"]
    deltas = {k: k1[k] - k0[k] for k in k1}
    return (inner1 - inner0, outer1 - outer0), host, card_work, deltas, (c0, c1)


def test_host_work_is_the_threads_cpu_time(timing_card):
    """With no card work in between, the host clock advances by the thread's CPU time."""
    (least, most), host, card_work, _, _ = _host_and_card(timing_card, lambda: _spin(5_000_000))
    assert card_work == 0
    assert least <= host <= most
    assert host >= 5_000_000


def test_sleeping_is_not_host_work(timing_card):
    (least, most), host, _, _, (c0, c1) = _host_and_card(timing_card, lambda: time.sleep(0.03))
    assert least <= host <= most
    assert host < 30e6                               # a sleep is not CPU time...
    assert c1.host_wall_ns - c0.host_wall_ns >= 30e6  # ...its wall twin counts it


def test_the_cards_work_leaves_the_host_clock(functional_card):
    """A functional matmul's arithmetic runs on the calling thread: all the thread's CPU time
    is either host work or the card's, and the card's is most of it."""
    from test_runtime import matmul_program

    from spyre_rt import jobs
    from spyre_rt.native import lib

    prog = jobs.ResidentProgram(functional_card, matmul_program(256, 256, 256, lib.SPY_DT_F16))
    prog.launch([])
    try:
        (least, most), host, card_work, deltas, _ = _host_and_card(functional_card, lambda: prog.launch([]))
    finally:
        prog.free()
    assert deltas["jobs"] == 1
    assert least <= host + card_work <= most
    assert card_work > host


def test_walking_a_resident_plan_is_the_cards_work(quiet):
    """In timing mode a resident plan's jobs are not simulated again, yet the card walking
    them (relocations, each job's execution) is still the card's: the launch leaves some
    CPU time out of the host clock, and the rest (finding the plan, checking and patching
    the bindings, Python) is the host's."""
    with spyre_rt.configured(sim_mode="timing") as cs:
        card = cs.cards[0]
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).to("spyre")
        step = torch.compile(model, backend="spyre_rt")
        x = torch.randn(16, 64).to("spyre")
        with torch.no_grad():
            step(x)
            step(x)
            (least, most), host, card_work, deltas, _ = _host_and_card(card, lambda: step(x))
    assert deltas["plan_launches"] == 1 and deltas["jobs"] >= 8
    assert least <= host + card_work <= most
    assert card_work > 0 and host > 0


def test_each_calling_thread_hands_over_its_cpu_time(timing_card):
    """Several threads calling into one card: each one's CPU time counts from its first
    call, once, and a thread blocked (joining) counts nothing."""
    spent = {}

    def worker():
        timing_card.host_clock_ns()  # the thread's first call: its count starts here
        t0 = time.thread_time_ns()
        _spin(10_000_000)
        timing_card.host_clock_ns()
        spent["worker"] = time.thread_time_ns() - t0

    def work():
        t = threading.Thread(target=worker)
        t.start()
        t.join()

    (least, most), host, _, _, _ = _host_and_card(timing_card, work)
    assert spent["worker"] >= 10_000_000
    assert least + 10_000_000 <= host <= most + spent["worker"] + 1_000_000
