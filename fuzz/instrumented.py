"""The native module as the fuzzers load it: ``native/*.c`` compiled by gcc into a cache
directory, never into the source tree, and loaded in place of ``spyre_rt._native`` before
spyre_rt is imported.

Every build records coverage. Every file but the arithmetic units (``UNINSTRUMENTED``) is
compiled with ``-fsanitize-coverage=trace-pc``, whose callback (``fuzz/edges.c``, linked
in, not instrumented) records the edges each input takes, and with ``--coverage``, whose
gcov counters give the lines reached (native_coverage.py reads both). The arithmetic units are
left uninstrumented: their loops run per element and say nothing about the structure of
an input.

With ``--asan`` the whole module is also built under AddressSanitizer and UBSan, and the
fuzz target runs again with the sanitizer runtime preloaded: a memory error in C rarely
crashes where it happens, under the sanitizers it stops the process at once with a report
and exit status ``EXIT_STATUS``.

    python fuzz/instrumented.py [--asan]   # build (or find) the module; print its path

Needs gcc 9 or later (trace-pc, gcov's JSON output), addr2line and gcov, which come with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NATIVE = ROOT / "native"
ENV_MODULE = "SPYRE_RT_FUZZ_NATIVE"    # path of the module to load, set for the sanitized re-run
ENV_CACHE = "SPYRE_RT_FUZZ_CACHE"      # where builds are kept
EXIT_STATUS = 86
MODULE = "native.so"
# Not instrumented: the arithmetic units, whose loops run per element.
UNINSTRUMENTED = {"gemm.c", "sfu.c", "half.c"}
BASE_FLAGS = ["-std=c11", "-D_GNU_SOURCE", "-O1", "-g", "-fPIC", "-fno-omit-frame-pointer"]
COVERAGE_FLAGS = ["-fsanitize-coverage=trace-pc", "--coverage"]
# Every UBSan check, alignment included: the validator requires typed scratchpad operands to
# start on a whole element, so the kernels' typed loads are aligned.
SANITIZER_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
RECORDER_CDEF = """
void fuzz_edges_begin(void);
uint32_t fuzz_edges_end(void);
uint32_t fuzz_edges_count(void);
void fuzz_edges_clear(void);
uint32_t fuzz_edges_dropped(void);
uint32_t fuzz_edges_list(uint64_t *from, uint64_t *to, uint32_t n);
int fuzz_gcov_reset(void);
int fuzz_gcov_dump(void);
"""


def cache_root() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spyre_rt" / "fuzz"


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "")) or [shutil.which("gcc") or "gcc"]


def runtime() -> str | None:
    """The AddressSanitizer runtime library to preload, or None when gcc has none."""
    out = subprocess.run([*compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def _native_build():
    sys.path.insert(0, str(NATIVE))
    try:
        import build
    finally:
        sys.path.remove(str(NATIVE))
    return build


def sources() -> list[str]:
    return _native_build().SOURCES


def instrumented_sources() -> list[str]:
    return [s for s in sources() if s not in UNINSTRUMENTED]


def build(asan: bool = False) -> Path:
    """The directory of the instrumented module (and its gcov notes), built unless a build
    of the same sources and flags exists."""
    srcs = sources()
    h = hashlib.sha256(" ".join([*BASE_FLAGS, *COVERAGE_FLAGS, *(SANITIZER_FLAGS if asan else []), sys.version,
                                 *sorted(UNINSTRUMENTED), *compiler()]).encode())
    headers = sorted(f.name for f in NATIVE.glob("*.h"))
    for path in [NATIVE / n for n in sorted(srcs) + headers + ["build.py"]] + [HERE / "edges.c"]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    target = cache_root() / f"{h.hexdigest()[:16]}{'-asan' if asan else ''}"
    if (target / MODULE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{target.name}.tmp"))
    try:
        _compile(tmp, srcs, asan)
        try:
            os.rename(tmp, target)   # concurrent builders: one wins
        except OSError:
            if not (target / MODULE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _compile(out: Path, srcs: list[str], asan: bool) -> None:
    from cffi import FFI

    nb = _native_build()
    ffi = FFI()
    ffi.cdef(nb.cdef_from_header(str(NATIVE / "spyre.h")) + RECORDER_CDEF)
    ffi.set_source("spyre_rt._native", '#include "spyre.h"\n' + RECORDER_CDEF)
    with contextlib.redirect_stdout(io.StringIO()):  # cffi names the file it writes
        ffi.emit_c_code(str(out / "_native.c"))
    san = SANITIZER_FLAGS if asan else []
    py = ["-I", sysconfig.get_paths()["include"]]
    jobs = [(NATIVE / s, [*BASE_FLAGS, *san, *([] if s in UNINSTRUMENTED else COVERAGE_FLAGS)]) for s in srcs]
    jobs.append((out / "_native.c", [*BASE_FLAGS, *san, *py]))
    jobs.append((HERE / "edges.c", ["-O2", "-fPIC", "-DFUZZ_GCOV"]))

    def cc(job):
        src, flags = job
        obj = out / (src.stem + ".o")
        r = subprocess.run([*compiler(), *flags, "-I", str(NATIVE), "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {src.name} for fuzzing failed:\n{r.stderr}")
        return str(obj)

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        objs = list(pool.map(cc, jobs))
    r = subprocess.run([*compiler(), "-shared", *objs, "-o", str(out / MODULE), "--coverage", *san[:1],
                        "-lm", "-lpthread", "-ldl"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"linking the fuzzing module failed:\n{r.stderr}")
    for obj in objs:
        os.unlink(obj)
    os.unlink(out / "_native.c")


def reexec_if_asked(argv: list[str]) -> None:
    """With --asan on the command line (and not yet under the sanitizers): build the module
    and run this program again with the sanitizer runtime preloaded. Never returns then."""
    if "--asan" not in argv or os.environ.get(ENV_MODULE):
        return
    lib = runtime()
    if lib is None:
        raise SystemExit("--asan needs gcc with AddressSanitizer (gcc -print-file-name=libasan.so)")
    module = build(asan=True) / MODULE
    env = dict(os.environ)
    env[ENV_MODULE] = str(module)
    env["LD_PRELOAD"] = " ".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    env["ASAN_OPTIONS"] = f"detect_leaks=0:allocator_may_return_null=1:exitcode={EXIT_STATUS}"
    env["UBSAN_OPTIONS"] = f"halt_on_error=1:print_stacktrace=1:exitcode={EXIT_STATUS}"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def load():
    """Put the instrumented module in place of spyre_rt._native (before spyre_rt is
    imported): the sanitized build under the --asan re-run, else the plain one. Returns the
    module, its build directory and the sanitizers in use ("" for none)."""
    if "spyre_rt._native" in sys.modules:
        raise RuntimeError("spyre_rt._native was imported before the instrumented module could replace it")
    path = Path(os.environ[ENV_MODULE]) if os.environ.get(ENV_MODULE) else build() / MODULE
    # gcov writes its counters where the harness says (native_coverage.py), never into the build
    os.environ.setdefault("GCOV_PREFIX", str(path.parent / "exit-counters"))
    os.environ.setdefault("GCOV_PREFIX_STRIP", "99")
    spec = importlib.util.spec_from_file_location("spyre_rt._native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["spyre_rt._native"] = module
    return module, path.parent, "address,undefined" if os.environ.get(ENV_MODULE) else ""


if __name__ == "__main__":
    print(build(asan="--asan" in sys.argv[1:]) / MODULE)
