"""Fuzzing in the default run: the plan-file reader, the command validator and the native
builder's decision records, each fuzzed for a bounded time (the builder: a fixed number of
inputs) with a fixed seed, starting from
its seeds (fuzz/seeds) and its kept corpus (fuzz/corpus), guided by the edges its inputs
reach in an instrumented copy of the native module, with the native code under
AddressSanitizer and UBSan when gcc provides them (see fuzz/harness.py).

The targets run at once, each in its own process, so that a crash or a sanitizer report is
seen as the process's exit status instead of taking pytest down. Longer runs:
``python fuzz/fuzz_plan_reader.py --seconds 600 --asan``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
sys.path.insert(0, str(FUZZ))
import instrumented  # noqa: E402

SECONDS = 10
# The builder's run is counted, not timed: which inputs a timed run keeps depends on how
# many the machine's load let it try, and a few of graph.c's edges only a state left by
# earlier inputs reaches (a short run under load kept too few: 329 of 337). 12,000 inputs
# take about 5 s alone, with AddressSanitizer.
BUILDER_RUNS = 12000
SEED = 20240611
MIN_MUTATED = 200  # mutated inputs: far below what either target tries in SECONDS, even on a loaded machine
ENV = dict(os.environ, PYTHONHASHSEED="0")
ASAN = instrumented.runtime() is not None
TARGETS = ("plan_reader", "validator", "builder")


def _sanitized() -> list[str]:
    """--asan when gcc has AddressSanitizer; the instrumented module is built once, cached."""
    flags = ["--asan"] if ASAN else []
    build = subprocess.run([sys.executable, str(FUZZ / "instrumented.py"), *flags], capture_output=True, text=True,
                           timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    return flags


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fuzz targets, run concurrently: {run: (exit status, summary, stderr)}. Each target
    ends by minimising what it kept into a temporary corpus. A short run of the validator
    with the same seed ("again") shows whether the harness is deterministic. The plan
    reader's seeds are plan files, generated here from small compiles (never kept in git)."""
    asan = _sanitized()
    seeds = tmp_path_factory.mktemp("seeds")
    made = subprocess.run([sys.executable, "-W", "ignore", str(FUZZ / "make_corpus.py"), "plan_reader",
                           "--out", str(seeds), *asan], capture_output=True, text=True, env=ENV, timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    commands = {}
    for target in TARGETS:
        budget = ["--runs", str(BUILDER_RUNS), "--seconds", "900"] if target == "builder" else ["--seconds", str(SECONDS)]
        commands[target] = [target, *budget, "--merge", str(tmp_path_factory.mktemp(f"kept-{target}"))]
    commands["plan_reader"] += ["--seeds", str(seeds / "plan_reader")]
    commands["again"] = ["validator", "--runs", "200", "--seconds", "900"]
    procs = {}
    for run, (target, *options) in commands.items():
        findings = tmp_path_factory.mktemp(f"fuzz-{run}")
        procs[run] = subprocess.Popen(
            [sys.executable, "-W", "ignore", str(FUZZ / f"fuzz_{target}.py"), *options, "--seed", str(SEED),
             "--findings", str(findings), "--quiet", *asan],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    out = {}
    for run, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=SECONDS + 900)
        lines = stdout.strip().splitlines()
        summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
        out[run] = (proc.returncode, summary, stderr)
    return out


def _survived(run) -> dict:
    status, summary, stderr = run
    assert status in (0, 3), f"the fuzzed process died (exit status {status}):\n{stderr[-4000:]}"
    assert summary is not None, stderr[-3000:]
    return summary


# distinct outcomes the mutations must reach: a decision record has fewer checks than a program
OUTCOMES = {"plan_reader": 20, "validator": 20, "builder": 12}
# Edges of each target's own files that its seeds and kept corpus reach, at least: 95 % of
# what they reached when the corpus was kept (fuzz/README.md), in the sanitized and in the
# plain build (gcc places their blocks differently). The seeds alone reach far fewer
# (sanitized: plan.c 155, program.c 325 and 368, construct.c 164, graph.c 103).
CORPUS_EDGES = {
    True: {"plan_reader": {"plan.c": 198, "program.c": 482}, "validator": {"program.c": 538},
           "builder": {"construct.c": 226, "graph.c": 126}},
    False: {"plan_reader": {"plan.c": 236, "program.c": 539}, "validator": {"program.c": 599},
            "builder": {"construct.c": 268, "graph.c": 164}},
}[ASAN]


@pytest.mark.parametrize("target", TARGETS)
def test_the_fuzzed_process_survives_every_input(runs, target):
    summary = _survived(runs[target])
    assert summary["mutated"] >= MIN_MUTATED, summary
    assert summary["seeds_accepted"] == summary["seeds"], "a seed was rejected"
    tried = summary["accepted"] + summary["rejected"] + sum(summary["findings"].values())
    assert tried + sum(summary["suppressed"].values()) == summary["inputs"]
    assert summary["rejected"] > 0 and summary["outcomes"] > OUTCOMES[target], "the mutations reach few checks"
    assert summary["sanitizers"] == ("address,undefined" if ASAN else "none")
    print(f"{target}: {summary['inputs']} inputs in {summary['seconds']} s (sanitizers: {summary['sanitizers']}), "
          f"{summary['accepted']} accepted, {summary['rejected']} rejected with typed errors, "
          f"{summary['outcomes']} distinct outcomes, edges {summary['edges_by_file']}, "
          f"lines {summary['lines']}, suppressed {summary['suppressed']}")


@pytest.mark.parametrize("target", TARGETS)
def test_the_kept_corpus_reaches_the_edges_it_was_kept_for(runs, target):
    """The seeds and the kept corpus, run once before any mutation, reach the edges of the
    target's files they reached when the corpus was minimised (less a margin)."""
    start = _survived(runs[target])["start"]["edges_by_file"]
    reached = {f: start.get(f, 0) for f in CORPUS_EDGES[target]}
    assert all(reached[f] >= n for f, n in CORPUS_EDGES[target].items()), (reached, CORPUS_EDGES[target])


@pytest.mark.parametrize("target", TARGETS)
def test_the_inputs_a_run_keeps_reach_the_edges_the_run_reached(runs, target):
    """Minimised after the run and measured again from nothing, the inputs kept (the seeds,
    the corpus and what the run found) reach the edges the whole run reached in the
    target's files, less the few that only a state left by earlier inputs reaches."""
    summary = _survived(runs[target])
    merged, reached = summary["merged"]["edges_by_file"], summary["edges_by_file"]
    for f in CORPUS_EDGES[target]:
        assert merged.get(f, 0) >= 0.98 * reached.get(f, 0), (f, merged, reached)
    assert summary["merged"]["inputs"] <= summary["corpus_in"] + summary["discoveries"]


def test_a_run_is_the_same_for_the_same_seed(runs):
    """Two runs from the same corpus with the same seed try the same inputs, with the same
    outcomes and new features, in the same order: the digest of the first inputs is one."""
    first, again = _survived(runs["validator"]), _survived(runs["again"])
    assert again["mutated"] == again["digest"]["inputs"] == 200
    assert first.get("digest") == again["digest"]
    start = [{k: v for k, v in run["start"].items() if k != "seconds"} for run in (first, again)]
    assert start[0] == start[1]


def test_the_validator_accepts_or_rejects_every_input_with_a_typed_error(runs):
    summary = _survived(runs["validator"])
    assert summary["findings"] == {}, summary["findings"]


def test_the_builder_refuses_every_corrupt_record_with_a_typed_error_and_builds_only_valid_programs(runs):
    summary = _survived(runs["builder"])
    assert summary["findings"] == {}, summary["findings"]


def test_the_plan_reader_accepts_or_rejects_every_input_with_a_typed_error(runs):
    """decode raises only SpyrePlanCacheError (a header without its key, when read without
    one as `spyre-profile cache inspect` does, and a deeply nested header once raised
    KeyError and RecursionError)."""
    summary = _survived(runs["plan_reader"])
    assert summary["findings"] == {}, summary["findings"]


def shared_dependency_windows(n: int = 64) -> bytes:
    """Barriers that all depend on the same two dependency entries (windows overlap)."""
    from spyre_rt.program import CORE_CARD, OP_BARRIER, ProgramBuilder, empty_cmds

    b = ProgramBuilder()
    cmds = empty_cmds(n, OP_BARRIER, CORE_CARD)
    cmds["ndeps"] = 2  # commands 2.. depend on entries [0, 2): commands 0 and 1
    cmds["ndeps"][:2] = [0, 1]
    b.add(cmds, np.array([0, 1]))
    return b.encode().tobytes()


def test_commands_sharing_dependency_entries_are_validated_and_run_safely(tmp_path):
    """Commands whose dependency windows [dep_begin, +ndeps) overlap have more edges than
    dependency entries: the validator and the simulator size their arrays by the edges
    (found by fuzzing under ASan, once a heap overflow)."""
    path = tmp_path / "shared-dependencies.bin"
    path.write_bytes(shared_dependency_windows())
    out = subprocess.run([sys.executable, "-W", "ignore", str(FUZZ / "fuzz_validator.py"), "--replay", str(path),
                          *_sanitized()], capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stdout[-500:]}{out.stderr[-3000:]}"
    assert out.stdout.strip().endswith("accepted"), out.stdout[-500:]  # validated, committed and run


def test_shared_dependency_entries_keep_cycles_and_bad_dependencies_rejected():
    from spyre_rt import card as cards
    from spyre_rt import jobs
    from spyre_rt.errors import SpyreInvalidCommandError

    card = cards.get(0)
    blob = np.frombuffer(shared_dependency_windows(), np.uint8).copy()
    assert jobs.validate(card, blob)["ncmds"] == 64
    jobs.run_once(card, blob, [])
    deps_at = 64 + 64 * 128  # header, no slots, 64 commands
    for dep, status in ((64, "SPY_E_BAD_COMMAND"), (40, "SPY_E_BAD_COMMAND")):  # out of range; 40 on itself
        bad = blob.copy()
        bad[deps_at: deps_at + 4].view(np.uint32)[0] = dep
        with pytest.raises(SpyreInvalidCommandError) as e:
            jobs.validate(card, bad)
        assert e.value.status == status, str(e.value)



def test_a_program_with_too_many_dependency_edges_is_refused():
    """Shared windows multiply edges: 8193 commands each waiting for the same 8192 entries
    make 2^26 + 8192 edges from 32 KiB of entries, which the validator refuses to allocate."""
    from spyre_rt import card as cards
    from spyre_rt import jobs
    from spyre_rt.errors import SpyreInvalidCommandError
    from spyre_rt.program import CORE_CARD, OP_BARRIER, ProgramBuilder, empty_cmds

    n = 8192
    b = ProgramBuilder()
    cmds = empty_cmds(2 * n + 1, OP_BARRIER, CORE_CARD)
    cmds["ndeps"][n:] = n  # every command after the first n waits for entries [0, n): those n
    b.add(cmds, np.arange(n))
    with pytest.raises(SpyreInvalidCommandError) as e:
        jobs.validate(cards.get(0), b.encode())
    assert e.value.status == "SPY_E_BAD_PROGRAM" and "dependency edges" in str(e.value)
