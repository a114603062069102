"""Fuzzing the native runtime under AddressSanitizer and UndefinedBehaviorSanitizer.

A memory error in C rarely crashes where it happens; under the sanitizers it stops the
process at once with a report. ``--asan`` builds a sanitized copy of ``spyre_rt._native``
with gcc and cffi (cached by a digest of the native sources), then runs the fuzz target again
with the sanitizer runtime preloaded and that copy loaded in place of the installed module.
A sanitizer report ends the process with exit status ``EXIT_STATUS``.

    python fuzz/sanitize.py           # build (or find) the sanitized module; print its path
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "native"
ENV_MODULE = "SPYRE_RT_FUZZ_NATIVE"    # path of the sanitized module, set for the re-run
ENV_CACHE = "SPYRE_RT_FUZZ_CACHE"      # where sanitized builds are kept
EXIT_STATUS = 86
# Every UBSan check, alignment included: the validator requires typed scratchpad operands to
# start on a whole element, so the kernels' typed loads are aligned.
FLAGS = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def cache_root() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spyre_rt" / "fuzz"


def runtime() -> str | None:
    """The AddressSanitizer runtime library to preload, or None when gcc has none."""
    cc = os.environ.get("CC") or shutil.which("gcc")
    if not cc:
        return None
    out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def _sources() -> list[str]:
    sys.path.insert(0, str(NATIVE))
    try:
        from build import SOURCES
    finally:
        sys.path.remove(str(NATIVE))
    return SOURCES


def build() -> Path:
    """The sanitized native module, built unless a build of the same sources exists."""
    sources = _sources()
    h = hashlib.sha256(" ".join(FLAGS + [sys.version]).encode())
    headers = sorted(f.name for f in NATIVE.glob("*.h"))
    for name in sorted(sources) + headers + ["build.py"]:
        h.update(name.encode() + b"\0" + (NATIVE / name).read_bytes())
    target = cache_root() / h.hexdigest()[:16] / "native_sanitized.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(NATIVE))
    try:
        from build import cdef_from_header
        from cffi import FFI
    finally:
        sys.path.remove(str(NATIVE))
    ffi = FFI()
    ffi.cdef(cdef_from_header(str(NATIVE / "spyre.h")))
    ffi.set_source("spyre_rt._native", '#include "spyre.h"', sources=[str(NATIVE / s) for s in sources],
                   include_dirs=[str(NATIVE)], extra_compile_args=["-std=c11", "-D_GNU_SOURCE", *FLAGS],
                   extra_link_args=FLAGS[2:3], libraries=["m", "pthread"])
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = ffi.compile(tmpdir=tmp, verbose=False)
        os.replace(built, target.with_suffix(f".{os.getpid()}.so"))
        os.replace(target.with_suffix(f".{os.getpid()}.so"), target)  # concurrent builders: one wins
    return target


def reexec_if_asked(argv: list[str]) -> None:
    """With --asan on the command line (and not yet under the sanitizers): build the module
    and run this program again with the sanitizer runtime preloaded. Never returns then."""
    if "--asan" not in argv or os.environ.get(ENV_MODULE):
        return
    lib = runtime()
    if lib is None:
        raise SystemExit("--asan needs gcc with AddressSanitizer (gcc -print-file-name=libasan.so)")
    module = build()
    env = dict(os.environ)
    env[ENV_MODULE] = str(module)
    env["LD_PRELOAD"] = " ".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    env["ASAN_OPTIONS"] = f"detect_leaks=0:allocator_may_return_null=1:exitcode={EXIT_STATUS}"
    env["UBSAN_OPTIONS"] = f"halt_on_error=1:print_stacktrace=1:exitcode={EXIT_STATUS}"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def load_if_active() -> str:
    """Under the re-run: put the sanitized module in place of spyre_rt._native (before
    spyre_rt is imported). Returns the sanitizers in use ("" for none)."""
    path = os.environ.get(ENV_MODULE)
    if not path:
        return ""
    if "spyre_rt._native" in sys.modules:
        raise RuntimeError("spyre_rt._native was imported before the sanitized module could replace it")
    spec = importlib.util.spec_from_file_location("spyre_rt._native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["spyre_rt._native"] = module
    return "address,undefined"


if __name__ == "__main__":
    print(build())
