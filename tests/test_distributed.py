"""Several cards: the spyreccl backend under torchrun, 2 processes on 127.0.0.1.

Each suite of tests/distributed_worker.py runs once per module in its own torchrun (a
free port, a strict timeout, functional cards from a 2-card profile); each test reads the
lines its case printed on every rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
NPROC = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(suite: str, profile: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPYRE_RT_SIM_MODE="functional", SPYRE_RT_DEVICE_PROFILE=profile,
               OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "--monitor-interval=0.1", str(HERE / "distributed_worker.py"), suite]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def collectives(two_card_profile):
    return torchrun("collectives", two_card_profile)


CASES = ["device_of_rank", "all_reduce_ops", "all_reduce_noncontiguous_and_cpu", "all_gather", "reduce_scatter",
         "broadcast_reduce_gather_scatter", "all_to_all", "send_recv_barrier", "functional_collectives",
         "sub_groups", "large_message", "interconnect_time", "compiled_collectives", "collective_the_ring_cannot_move",
         "compiled_gather_of_dynamic_rows", "compiled_collectives_time"]


@pytest.mark.parametrize("case", CASES)
def test_collective(collectives, case):
    ok = collectives.stdout.count(f"CASE case_{case} OK")
    assert ok == NPROC, f"{case}: OK on {ok} of {NPROC} ranks\n{collectives.stdout}\n{collectives.stderr[-3000:]}"


def test_collectives_run_exits_cleanly(collectives):
    assert collectives.returncode == 0, collectives.stdout + collectives.stderr[-3000:]


@pytest.fixture(scope="module")
def faults(two_card_profile):
    return torchrun("faults", two_card_profile)


def test_mismatched_shapes_fail_on_every_rank(faults):
    assert faults.stdout.count("CASE case_mismatched_shapes OK") == NPROC, faults.stdout + faults.stderr[-3000:]


def test_a_collective_on_tensors_of_two_cards_is_refused(faults):
    _ok(faults, "tensors_of_two_cards")


def test_a_card_fault_in_a_compiled_step_aborts_the_group_and_restores_the_inputs(faults):
    """Rank 0's card fails mid-step: rank 0 gets the card's error, rank 1 a collective error
    naming it instead of waiting, and both ranks' mutated inputs are as they were; the
    group, rearmed by both ranks, runs the step again."""
    _ok(faults, "card_fault_in_a_compiled_step")


def test_a_rank_that_dies_is_an_error_on_the_survivor(faults):
    """Rank 1 leaves after the barrier; rank 0's all_reduce fails (its peer exited) instead of waiting."""
    assert faults.stdout.count("CASE case_rank_dies OK") == 1, faults.stdout + faults.stderr[-3000:]


@pytest.fixture(scope="module")
def tensor_parallel(two_card_profile):
    pytest.importorskip("accelerate")
    return torchrun("tp", two_card_profile, timeout=900)


def _ok(run, case: str) -> None:
    ok = run.stdout.count(f"CASE case_{case} OK")
    assert ok == NPROC, f"{case}: OK on {ok} of {NPROC} ranks\n{run.stdout}\n{run.stderr[-3000:]}"


@pytest.mark.parametrize("family", ["llama", "granite", "mixtral"])
def test_hf_tp_plan_auto_compiled_matches_one_cpu_process(tensor_parallel, family):
    """The same model compiled for the card (Mixtral's experts sharded): each collective a
    job of the step's one plan, logits within 1e-4 of one CPU process; for Llama also
    generate()'s tokens on a static cache and a torch.spyre.graph replay of the forward."""
    _ok(tensor_parallel, f"tp_compiled_{family}")


@pytest.fixture(scope="module")
def tensor_parallel_generate(two_card_profile):
    pytest.importorskip("accelerate")
    return torchrun("tp_generate", two_card_profile, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["granite", "mixtral"])
def test_hf_tp_plan_auto_compiled_generate(tensor_parallel_generate, family):
    """generate() through the compiled tensor-parallel Granite and Mixtral: the tokens of one
    CPU process (Mixtral's forward replayed through torch.spyre.graph too)."""
    _ok(tensor_parallel_generate, f"tp_compiled_generate_{family}")


@pytest.mark.parametrize("family", ["llama", "granite"])
def test_hf_tp_plan_auto_matches_one_cpu_process(tensor_parallel, family):
    """from_pretrained(tp_plan="auto") on a spyre device mesh of 2: the weights sharded on
    the cards, logits within 1e-5 of one CPU process and generate()'s tokens equal."""
    ok = tensor_parallel.stdout.count(f"CASE case_tp_{family} OK")
    assert ok == NPROC, f"{family}: OK on {ok} of {NPROC} ranks\n{tensor_parallel.stdout}\n{tensor_parallel.stderr[-3000:]}"


def torchrun_nodes(suite: str, profile: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Two torchrun "nodes" on 127.0.0.1, one process each, told they are on different hosts."""
    port = free_port()
    procs = []
    for node in range(2):
        env = dict(os.environ, SPYRE_RT_SIM_MODE="functional", SPYRE_RT_DEVICE_PROFILE=profile, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(HERE), SPYRE_RT_HOST_ID=f"node{node}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", "--monitor-interval=0.1",
               str(HERE / "distributed_worker.py"), suite]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
    return subprocess.CompletedProcess(["torchrun --nnodes 2"], max(p.returncode for p in procs),
                                       "".join(o for o, _ in outs), "".join(e for _, e in outs))


@pytest.fixture(scope="module")
def nodes(two_card_profile):
    return torchrun_nodes("nodes", two_card_profile)


NODE_CASES = ["between_machines", "all_reduce_ops", "all_gather", "reduce_scatter", "broadcast_reduce_gather_scatter",
              "functional_collectives", "large_message", "interconnect_time", "compiled_collectives",
              "card_fault_in_a_compiled_step"]


@pytest.mark.parametrize("case", NODE_CASES)
def test_two_machines_over_sockets(nodes, case):
    """torchrun --nnodes 2 on 127.0.0.1, the nodes told they are two hosts: the group's ring
    goes over TCP, with the same data, results, faults and (the network's) timing."""
    _ok(nodes, case)


def test_a_rank_of_another_machine_that_dies_is_an_error_on_the_survivor(nodes):
    assert nodes.stdout.count("CASE case_rank_dies OK") == 1, nodes.stdout + nodes.stderr[-3000:]
