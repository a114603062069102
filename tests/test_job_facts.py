"""The kernel-info registry: what each kernel computes, by its job name."""

import threading

import pytest

from spyre_rt import job_facts

UP_PROJ = {"kind": "matmul", "op": "aten.mm", "module": "model.layers.3.mlp.up_proj", "flops": 2 * 64 * 64 * 64,
           "dram_bytes_min": 3 * 64 * 64 * 2, "dram_bytes": 4 * 64 * 64 * 2, "cores": 32, "scratchpad_peak": 8192}


@pytest.fixture(autouse=True)
def _empty_registry():
    job_facts.clear()
    yield
    job_facts.clear()


def test_lookup_returns_what_was_registered():
    job_facts.register("k12", UP_PROJ)
    assert job_facts.lookup("k12") == UP_PROJ
    assert job_facts.lookup("k13") is None


def test_the_registry_keeps_its_own_copy():
    info = dict(UP_PROJ)
    job_facts.register("k12", info)
    info["flops"] = 0
    assert job_facts.lookup("k12")["flops"] == UP_PROJ["flops"]


def test_registering_again_replaces_the_info():
    job_facts.register("k12", UP_PROJ)
    job_facts.register("k12", {"op": "aten.add"})
    assert job_facts.lookup("k12") == {"op": "aten.add"}


@pytest.mark.parametrize("name, info, error", [("", {}, ValueError), (None, {}, ValueError),
                                                ("k1", [("op", "mm")], TypeError)])
def test_bad_registrations_are_refused(name, info, error):
    with pytest.raises(error):
        job_facts.register(name, info)


def test_threads_register_and_look_up_at_once():
    def work(t):
        for i in range(500):
            job_facts.register(f"t{t}-k{i}", {"flops": i})
            assert job_facts.lookup(f"t{t}-k{i}") == {"flops": i}

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(job_facts.lookup(f"t{t}-k499") == {"flops": 499} for t in range(4))
