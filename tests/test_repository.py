"""The repository keeps no generated file: plan caches, traces, benchmark and hypothesis data
go to temporary or ignored folders, never into git."""

import shutil
import subprocess
from pathlib import Path

import pytest

from spyre_rt import plan_cache

ROOT = Path(__file__).resolve().parent.parent
# Mutated plan files the plan reader's fuzzer keeps because they reach native edges the
# generated seeds do not: hostile inputs, not caches (fuzz/README.md).
FUZZ_CORPUS = "fuzz/corpus/plan_reader/"


def _git(*args: str) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def test_no_tracked_file_is_one_gitignore_calls_generated():
    assert _git("ls-files", "--cached", "--ignored", "--exclude-standard") == []


def test_no_plan_cache_file_is_tracked():
    plans = []
    for name in _git("ls-files"):
        path = ROOT / name
        if path.is_file() and not name.startswith(FUZZ_CORPUS):
            with path.open("rb") as f:
                if f.read(len(plan_cache.MAGIC)) == plan_cache.MAGIC:
                    plans.append(name)
    assert plans == []
