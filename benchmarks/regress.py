"""Benchmark a base revision and the working tree interleaved, and gate on the ratio.

Shared machines drift: a benchmark saved yesterday and compared today measures the
machine as much as the change. This script installs both versions side by side (a git
worktree of the base, the working tree as it is, uncommitted changes included), then
runs their benchmark suites alternately, round by round, in one sitting, and compares
each benchmark's median of per-round medians. It exits non-zero when any benchmark got
slower than the threshold allows.

    python benchmarks/regress.py --base HEAD~1 --rounds 5 -k "dispatch or plans"

Each revision runs its own ``benchmarks/`` (a benchmark that exists in only one of them
is listed, not compared). Nothing is downloaded: both are installed with the current
interpreter's packages (``pip install --no-deps --no-build-isolation --target``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, **kw)


def install(source: Path, target: Path) -> None:
    """The package built from `source` (native module included) into `target`."""
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
          "--target", str(target), str(source)], stdout=subprocess.DEVNULL)


def run_suite(source: Path, installed: Path, out: Path, select: str | None,
              workdir: Path) -> tuple[dict[str, float], dict[str, list[str]]]:
    """One pass of `source`'s benchmarks against the package in `installed`: name -> median
    s, and name -> the targets it missed (recorded, not failed: see benchmarks/targets.py)."""
    env = dict(os.environ, PYTHONPATH=str(installed))
    env["SPYRE_RT_CACHE_DIR"] = tempfile.mkdtemp(prefix="plans-", dir=workdir)
    env["SPYRE_RT_BENCH_TARGETS"] = "record"  # a figure is compared with the other revision's, not its target
    cmd = [sys.executable, "-P", "-m", "pytest", str(source / "benchmarks"), "-q", "-p", "no:cacheprovider",
           "--rootdir", str(workdir), "-c", os.devnull, "-m", "not slow", "--benchmark-enable",
           f"--benchmark-json={out}", "-W", "ignore"]
    if select:
        cmd += ["-k", select]
    proc = subprocess.run(cmd, cwd=workdir, env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks of {source} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    medians, missed = {}, {}
    for b in json.loads(out.read_text())["benchmarks"]:
        name = b["fullname"].split("::", 1)[-1]
        medians[name] = b["stats"]["median"]
        if b.get("extra_info", {}).get("missed_targets"):
            missed[name] = b["extra_info"]["missed_targets"]
    return medians, missed


def compare(base: dict[str, list[float]], head: dict[str, list[float]], threshold: float):
    rows, worse = [], []
    for name in sorted(set(base) | set(head)):
        if name not in base or name not in head:  # listed with its median, not compared
            rows.append((name, *(statistics.median(x[name]) if name in x else None for x in (base, head)), None))
            continue
        b, h = statistics.median(base[name]), statistics.median(head[name])
        ratio = h / b if b else float("inf")
        rows.append((name, b, h, ratio))
        if ratio > 1 + threshold:
            worse.append(name)
    return rows, worse


def report(rows, threshold: float, base_rev: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"working tree against {base_rev} (median of per-round medians)", title_justify="left")
    for col, justify in (("benchmark", "left"), ("base", "right"), ("working tree", "right"), ("ratio", "right")):
        t.add_column(col, justify=justify)

    def fmt(v):
        return "—" if v is None else f"{v * 1e3:.3f} ms" if v < 1 else f"{v:.2f} s"

    for name, b, h, ratio in rows:
        if ratio is None:
            cell = "only in one"
        else:
            style = "red" if ratio > 1 + threshold else "green" if ratio < 1 - threshold else ""
            cell = f"[{style}]{ratio:.3f}[/]" if style else f"{ratio:.3f}"
        t.add_row(escape(name), fmt(b), fmt(h), cell)  # a parametrized name's [id] is not markup
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the revision to compare against (default: HEAD)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both suites (default: 3)")
    ap.add_argument("--threshold", type=float, default=0.10,
                    help="fail when a benchmark's median grows by more than this fraction (default: 0.10)")
    ap.add_argument("-k", dest="select", help="pytest -k expression selecting benchmarks")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.threshold <= 0:
        ap.error("--rounds must be at least 1 and --threshold positive")
    with tempfile.TemporaryDirectory(prefix="spyre-rt-regress-") as tmp:
        work = Path(tmp)
        base_src = work / "base-src"
        _run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base_src), args.base])
        try:
            install(base_src, work / "base")
            install(ROOT, work / "head")
            results: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
            missed: dict[str, dict[str, set[str]]] = {"base": {}, "head": {}}
            for r in range(args.rounds):
                order = ("base", "head") if r % 2 == 0 else ("head", "base")
                for which in order:
                    src = base_src if which == "base" else ROOT
                    medians, misses = run_suite(src, work / which, work / f"{which}-{r}.json", args.select, work)
                    for name, m in medians.items():
                        results[which].setdefault(name, []).append(m)
                    for name, messages in misses.items():
                        missed[which].setdefault(name, set()).update(messages)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            _run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_src)])
    rows, worse = compare(results["base"], results["head"], args.threshold)
    report(rows, args.threshold, args.base)
    for which, label in (("base", args.base), ("head", "the working tree")):
        for name, messages in sorted(missed[which].items()):
            print(f"target missed by {label} in a round: {name}: {'; '.join(sorted(messages))}", file=sys.stderr)
    if worse:
        print(f"slower by more than {args.threshold:.0%}: {', '.join(worse)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
