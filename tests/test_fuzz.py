"""Fuzzing in the default run: the plan-file reader, the command validator and the native
builder's decision records, each fuzzed for a bounded time with a fixed seed from the
corpus in fuzz/corpus (see fuzz/harness.py), with the native code under AddressSanitizer
and UBSan when gcc provides them.

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
import sanitize  # noqa: E402

SECONDS = 22
SEED = 20240611
MIN_INPUTS = 2000  # far below what either target tries in SECONDS, even on a slow machine
ENV = dict(os.environ, PYTHONHASHSEED="0")
ASAN = sanitize.runtime() is not None


def _sanitized() -> list[str]:
    """--asan when gcc has AddressSanitizer (the sanitized module is built once, cached)."""
    if not ASAN:
        return []
    build = subprocess.run([sys.executable, str(FUZZ / "sanitize.py")], capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    return ["--asan"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fuzz targets, run concurrently: {target: (exit status, summary, stderr)}."""
    asan = _sanitized()
    procs = {}
    for target in ("plan_reader", "validator", "builder"):
        findings = tmp_path_factory.mktemp(f"fuzz-{target}")
        procs[target] = subprocess.Popen(
            [sys.executable, "-W", "ignore", str(FUZZ / f"fuzz_{target}.py"), "--seconds", str(SECONDS),
             "--seed", str(SEED), "--findings", str(findings), "--quiet", *asan],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    out = {}
    for target, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=SECONDS + 900)
        lines = stdout.strip().splitlines()
        summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
        out[target] = (proc.returncode, summary, stderr)
    return out


def _survived(run) -> dict:
    status, summary, stderr = run
    assert status in (0, 3), f"the fuzzed process died (exit status {status}):\n{stderr[-4000:]}"
    assert summary is not None, stderr[-3000:]
    return summary


# distinct outcomes the mutations must reach: a decision record has fewer checks than a program
OUTCOMES = {"plan_reader": 20, "validator": 20, "builder": 12}


@pytest.mark.parametrize("target", ["plan_reader", "validator", "builder"])
def test_the_fuzzed_process_survives_every_input(runs, target):
    summary = _survived(runs[target])
    assert summary["inputs"] >= MIN_INPUTS, summary
    assert summary["seeds_accepted"] == summary["seeds"], "a seed of the corpus was rejected"
    tried = summary["accepted"] + summary["rejected"] + sum(summary["findings"].values())
    assert tried + sum(summary["suppressed"].values()) == summary["inputs"]
    assert summary["rejected"] > 0 and summary["outcomes"] > OUTCOMES[target], "the mutations reach few checks"
    assert summary["sanitizers"] == ("address,undefined" if ASAN else "none")
    print(f"{target}: {summary['inputs']} inputs in {summary['seconds']} s (sanitizers: {summary['sanitizers']}), "
          f"{summary['accepted']} accepted, {summary['rejected']} rejected with typed errors, "
          f"{summary['outcomes']} distinct outcomes, suppressed {summary['suppressed']}")


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
