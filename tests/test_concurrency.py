"""Concurrency: threads running compiled models on one card, threads on two cards, and
processes sharing one plan cache."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from small_profiles import small_profile_text

from spyre_rt import card as cards
from spyre_rt import dispatch, plan_cache
from spyre_rt import executor as step_mod
from spyre_rt.dispatch import dispatch_mode

MODES = dispatch.NAMES  # every dispatch mode, from the table


def mlp(x, w1, w2):
    return torch.relu(x @ w1.t()) @ w2.t() + 1


_G = torch.Generator().manual_seed(21)
W1, W2 = torch.randn(96, 64, generator=_G), torch.randn(40, 96, generator=_G)


def inputs(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 64, generator=g) for _ in range(n)]


def run_threads(target, n: int) -> list[str]:
    """Run target(k) on n threads started together; the errors they raised."""
    errors, barrier = [], threading.Barrier(n)

    def body(k):
        try:
            barrier.wait()
            target(k)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(f"thread {k}: {e!r}")

    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.fixture(scope="module")
def compiled():
    f = torch.compile(mlp, backend="spyre_rt", dynamic=False)
    w = [W1.to("spyre"), W2.to("spyre")]
    with dispatch_mode("prebuilt"):
        x = inputs(0, 1)[0]
        assert torch.allclose(f(x.to("spyre"), *w).cpu(), mlp(x, W1, W2), rtol=1e-4, atol=1e-3)
    return f, w


def test_threads_running_one_compiled_model_on_one_card_get_their_own_results(compiled):
    f, w = compiled
    card = cards.get(0)
    threads, calls = 4, 20
    xs = {k: inputs(100 + k, calls) for k in range(threads)}
    with dispatch_mode("prebuilt"):
        alone = {k: [f(x.to("spyre"), *w).cpu() for x in xs[k]] for k in range(threads)}
        before = card.counters()["plan_launches"]
        f(xs[0][0].to("spyre"), *w)
        per_call = card.counters()["plan_launches"] - before
    for k in range(threads):
        for x, out in zip(xs[k], alone[k], strict=True):
            assert torch.allclose(out, mlp(x, W1, W2), rtol=1e-4, atol=1e-3)
    wrong = []

    def worker(k):
        with dispatch_mode("prebuilt"):
            for n, x in enumerate(xs[k]):
                if not torch.equal(f(x.to("spyre"), *w).cpu(), alone[k][n]):
                    wrong.append((k, n))

    before = card.counters()["plan_launches"]
    assert run_threads(worker, threads) == []
    assert wrong == [], "a thread got another thread's results"
    assert card.counters()["plan_launches"] - before == threads * calls * per_call


def test_threads_in_every_dispatch_mode_at_once_give_the_single_threaded_numbers(compiled):
    f, w = compiled
    xs = inputs(7, 12)
    with dispatch_mode("construct"):
        alone = [f(x.to("spyre"), *w).cpu() for x in xs]
    for x, out in zip(xs, alone, strict=True):  # the single-threaded numbers are the right ones
        assert torch.allclose(out, mlp(x, W1, W2), rtol=1e-4, atol=1e-3)
    got = {}

    def worker(k):
        mode = MODES[k % len(MODES)]
        with dispatch_mode(mode):
            got[k] = [f(x.to("spyre"), *w).cpu() for x in xs]

    assert run_threads(worker, 6) == []
    for k, outs in got.items():
        assert all(torch.equal(a, b) for a, b in zip(outs, alone, strict=True)), f"thread {k} ({MODES[k % len(MODES)]})"


def test_the_first_prebuilt_call_from_many_threads_makes_the_plans_once():
    f = torch.compile(lambda x, w: torch.sigmoid(x @ w.t()) * 2 - x.sum(), backend="spyre_rt", dynamic=False)
    w = W1.to("spyre")
    xs = inputs(9, 4)
    with dispatch_mode("construct"):
        f(xs[0].to("spyre"), w)  # compiled; no plan yet
    made = dict(step_mod.stats)
    outs = {}

    def worker(k):
        with dispatch_mode("prebuilt"):
            outs[k] = f(xs[k].to("spyre"), w).cpu()

    assert run_threads(worker, 4) == []
    plans = (step_mod.stats["plans_built"] - made["plans_built"]) + (step_mod.stats["plans_loaded"] - made["plans_loaded"])
    assert plans == 1, f"{plans} plans made for one segment"
    for k, x in enumerate(xs):
        assert torch.allclose(outs[k], torch.sigmoid(x @ W1.t()) * 2 - x.sum(), rtol=1e-4, atol=1e-4)


# ---- two cards ---------------------------------------------------------------------------
# In a fresh process, so that the two-card set's cards are the first the process opens (see
# test_a_tensor_keeps_its_layout_when_another_card_set_reuses_its_address for cards of two sets).

TWO_CARDS = textwrap.dedent(r"""
    import json, sys, threading
    import torch
    from spyre_rt import card as cards
    from spyre_rt.dispatch import dispatch_mode

    def mlp(x, w1, w2):
        return torch.relu(x @ w1.t()) @ w2.t() + 1

    g = torch.Generator().manual_seed(21)
    w1, w2 = torch.randn(96, 64, generator=g), torch.randn(40, 96, generator=g)
    f = torch.compile(mlp, backend="spyre_rt", dynamic=False)
    threads, calls = int(sys.argv[2]), int(sys.argv[3])
    result = {"errors": [], "wrong": [], "calls": 0}
    lock, barrier = threading.Lock(), threading.Barrier(threads)
    with cards.configured(sys.argv[1]) as cs:
        weights = {i: [w1.to(f"spyre:{i}"), w2.to(f"spyre:{i}")] for i in (0, 1)}
        with dispatch_mode("prebuilt"):
            f(torch.zeros(5, 64).to("spyre:1"), *weights[1])  # compile once
        before = [c.counters()["plan_launches"] for c in cs.cards]

        def worker(k):
            card = k % 2
            gen = torch.Generator().manual_seed(100 + k)
            try:
                with dispatch_mode("prebuilt"):
                    barrier.wait()
                    for n in range(calls):
                        x = torch.randn(5, 64, generator=gen)
                        out = f(x.to(f"spyre:{card}"), *weights[card])
                        ok = out.device == torch.device("spyre", card) and torch.allclose(
                            out.cpu(), mlp(x, w1, w2), rtol=1e-4, atol=1e-3)
                        with lock:
                            result["calls"] += 1
                            if not ok:
                                result["wrong"].append([k, n, str(out.device)])
            except BaseException as e:
                with lock:
                    result["errors"].append(f"thread {k}: {e!r}")

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        result["launches"] = [c.counters()["plan_launches"] - b for c, b in zip(cs.cards, before)]
    print(json.dumps(result))
""")


def test_threads_on_two_cards_use_their_own_card(tmp_path):
    profile = tmp_path / "two.toml"
    profile.write_text(textwrap.dedent(small_profile_text(dram_gib=1 / 16, count=2)))
    threads, calls = 4, 10
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", TWO_CARDS, str(profile), str(threads), str(calls)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == [] and result["wrong"] == []
    assert result["calls"] == threads * calls
    per_card = threads // 2 * calls
    assert result["launches"][0] == result["launches"][1] and result["launches"][0] % per_card == 0
    assert result["launches"][0] >= per_card  # both cards ran their own threads' steps


def test_a_tensor_keeps_its_layout_when_another_card_set_reuses_its_address(tmp_path):
    """Two card sets each have a spyre:0 whose first allocation is a tensor: each tensor
    keeps its own card and layout inside and after the block that opened the second set,
    for copies and for one compiled function called on either card."""
    profile = tmp_path / "one.toml"
    profile.write_text(textwrap.dedent(small_profile_text(dram_gib=1 / 64)))
    script = textwrap.dedent("""
        import sys, torch
        from spyre_rt import SpyreError, card as cards, tensors
        ref = torch.arange(256, dtype=torch.float32).reshape(2, 128)
        other = torch.arange(256, dtype=torch.float32).reshape(128, 2)
        f = torch.compile(lambda a: a * 2 + 1, backend="spyre_rt", dynamic=False)
        x = ref.to("spyre")                              # the first allocation of spyre:0
        card_x = tensors.card_of(x)
        assert torch.equal(f(x).cpu(), ref * 2 + 1)
        with cards.configured(sys.argv[1]) as cs:
            y = other.to("spyre")                        # the first allocation of another spyre:0
            card_y = tensors.card_of(y)
            assert card_y is cs.cards[0] and card_x is not card_y
            assert x.data_ptr() != y.data_ptr()
            assert torch.equal(x.cpu(), ref), "the first set's tensor, read inside the block"
            out = f(x)                                   # runs on x's card, not the current spyre:0
            assert tensors.card_of(out) is card_x and torch.equal(out.cpu(), ref * 2 + 1)
            z = ref.flip(0).to("spyre")
            assert torch.equal(f(z).cpu(), ref.flip(0) * 2 + 1)
            assert tensors.card_of(f(z)) is card_y
            w = torch.empty(2, 128, device="spyre")
            w.copy_(x)                                   # from one set's card to the other's
            assert torch.equal(w.cpu(), ref)
        assert torch.equal(x.cpu(), ref)
        assert torch.equal(y.cpu(), other)
        assert torch.equal(w.cpu(), ref)
        assert torch.equal(f(x).cpu(), ref * 2 + 1)
        assert torch.equal(f(w).cpu(), ref * 2 + 1)     # w lives on the second set's card
        g = torch.compile(lambda a, b: a + b, backend="spyre_rt", dynamic=False)
        try:
            g(x, w)                                      # a step runs on one card
        except SpyreError as e:
            assert "inputs are on two different spyre:0 cards" in str(e), e
        else:
            raise AssertionError("a step ran on tensors of two cards")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script, str(profile)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


# ---- processes sharing one plan cache ------------------------------------------------------

CLIENT = textwrap.dedent(r"""
    import json, torch
    from spyre_rt import plan_cache
    from spyre_rt import executor as step
    def f(x, w):
        return torch.softmax(torch.tanh(x @ w.t()) * 4, -1)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 64, generator=g), torch.randn(80, 64, generator=g)
    fc = torch.compile(f, backend="spyre_rt", dynamic=False)
    wd = w.to("spyre")
    ok = all(torch.allclose(fc(x.to("spyre"), wd).cpu(), f(x, w), rtol=1e-4, atol=1e-6) for _ in range(3))
    print(json.dumps({"ok": ok, "step": step.stats, "cache": plan_cache.stats.as_dict()}))
""")


def test_processes_compiling_the_same_function_share_one_valid_plan_file(tmp_path):
    clients = 3
    env = dict(os.environ, SPYRE_RT_CACHE_DIR=str(tmp_path), SPYRE_RT_DISPATCH="prebuilt")
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", CLIENT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(clients)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * clients, [e[-1500:] for _, e in outs]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert all(r["ok"] for r in results)
    files = [p for p in tmp_path.iterdir() if p.suffix == ".plan"]
    assert len(files) == 1 and not files[0].name.startswith(".tmp-")
    entry = plan_cache.decode(files[0].read_bytes(), files[0].stem)
    assert entry.header["kernels"] > 0
    built = sum(r["step"]["plans_built"] > 0 for r in results)
    loaded = sum(r["step"]["plans_loaded"] > 0 for r in results)
    assert built + loaded == clients and built >= 1
    shared = plan_cache.PlanCache(tmp_path, 1 << 30).persistent_stats()
    assert shared.get("hits", 0) + shared.get("misses", 0) == clients, f"lost counter updates: {shared}"
    assert shared.get("writes", 0) == shared.get("misses", 0) == built
    assert shared.get("corrupt", 0) == 0
