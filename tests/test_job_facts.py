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


@pytest.mark.parametrize("qualified, path", [
    ("L['self'].model.layers[3].mlp", "model.layers.3.mlp"),
    ("G['m'].model.layers[0].self_attn.q_proj", "model.layers.0.self_attn.q_proj"),
    ("L['fn'].__closure__[2].cell_contents.model.layers[0]", "model.layers.0"),
    ("L['model']", ""),
])
def test_a_module_path_drops_the_frames_local_global_or_closure_cell(qualified, path):
    from spyre_rt.compiler.inductor.record import _module_path

    assert _module_path(qualified) == path


def test_a_kernels_module_is_where_its_last_node_ran_not_where_most_of_them_did():
    """A kernel that recomputes a rotary table inline holds more nodes of the rotary module
    than of the attention it ends in."""
    import torch
    from spyre_rt.compiler.inductor.record import module_of

    g = torch.fx.Graph()
    x = g.placeholder("x")
    nodes = [g.call_function(torch.cos, (x,)) for _ in range(3)] + [g.call_function(torch.neg, (x,))]
    for n in nodes[:3]:
        n.meta["nn_module_stack"] = {"a": ("L['self'].model", None), "b": ("L['self'].model.rotary_emb", None)}
    nodes[3].meta["nn_module_stack"] = {"a": ("L['self'].model.layers[1].self_attn", None)}
    assert module_of(reversed(nodes)) == "model.layers.1.self_attn"
    assert module_of([]) == ""
