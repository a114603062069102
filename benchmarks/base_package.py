"""An importable copy of spyre_rt at a git revision, to measure beside the working tree.

    python benchmarks/base_package.py REV DIR
    SPYRE_RT_BENCH_BASE=DIR pytest benchmarks/test_bench_compiler.py --benchmark-enable

DIR then holds the package ``spyre_rt`` of REV as the editable install lays it out
(``compiler/`` as ``spyre_rt.compiler``, ``profiles/`` as ``spyre_rt.profiles``); a process
started with ``PYTHONPATH=DIR`` and ``python -P`` imports it instead of the working tree.
The native module is the working tree's when REV's ``native/`` is the same, else it is
built from REV's sources (cffi, as the package build does).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make(rev: str, out: Path) -> Path:
    """Write REV's package into `out` (replacing what was there); `out`."""
    with tempfile.TemporaryDirectory(prefix="spyre-rt-base-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev],
                                 check=True, capture_output=True).stdout
        tar = Path(tmp) / "rev.tar"
        tar.write_bytes(archive)
        with tarfile.open(tar) as t:
            t.extractall(src, filter="data")
        if out.exists():
            shutil.rmtree(out)
        pkg = out / "spyre_rt"
        shutil.copytree(src / "spyre_rt", pkg)
        shutil.copytree(src / "compiler", pkg / "compiler")
        shutil.copytree(src / "profiles", pkg / "profiles")
        for old in pkg.glob("_native*.so"):
            old.unlink()
        same = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", "native"]).returncode == 0
        if same:
            for so in (ROOT / "spyre_rt").glob("_native*.so"):
                shutil.copy2(so, pkg / so.name)
        else:
            _build_native(src, pkg)
    return out


def _build_native(src: Path, pkg: Path) -> None:
    # built inside native/, its sources named from there: older build scripts name them
    # relative to the working directory, which a build in another directory breaks
    code = "import sys; sys.path.insert(0, '.'); from build import ffibuilder; print(ffibuilder.compile(tmpdir='.'))"
    built = subprocess.run([sys.executable, "-c", code], cwd=src / "native", capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"building the native module of the base revision:\n{built.stderr[-4000:]}")
    shutil.copy2(built.stdout.strip().splitlines()[-1], pkg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev")
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    print(make(args.rev, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
