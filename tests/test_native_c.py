"""The native runtime's own C tests, built with -Wall -Wextra -Werror, run plain and under
AddressSanitizer and UndefinedBehaviorSanitizer (gcc only: no make needed)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

NATIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "native")
sys.path.insert(0, NATIVE)
from build import SOURCES  # noqa: E402

WARN = ["-Wall", "-Wextra", "-Werror", "-Wshadow", "-Wstrict-prototypes", "-Wno-unused-parameter"]
FLAVOURS = {
    "plain": ["-O2"],
    "asan-ubsan": ["-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_native_tests_pass(tmp_path, flavour):
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler (gcc) is needed to build the native runtime"
    exe = tmp_path / f"test_native_{flavour}"
    srcs = [os.path.join(NATIVE, s) for s in SOURCES] + [os.path.join(NATIVE, "tests", "test_native.c")]
    cmd = [cc, "-std=c11", "-D_GNU_SOURCE", "-g", *WARN, *FLAVOURS[flavour], "-I", NATIVE, *srcs, "-o", str(exe),
           "-lm", "-lpthread"]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    run = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "native tests passed" in run.stdout


def _calls_between_files(tmp_path) -> dict[str, set[str]]:
    """For each native/*.c file, the files defining functions or data it uses (from the
    symbols of each file compiled alone)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    nm = shutil.which("nm")
    if not cc or not nm:
        pytest.skip("needs a C compiler and nm")
    defined, used = {}, {}
    for src in SOURCES:
        obj = tmp_path / f"{src}.o"
        build = subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-O0", "-c", "-I", NATIVE,
                                os.path.join(NATIVE, src), "-o", str(obj)], capture_output=True, text=True)
        assert build.returncode == 0, build.stderr
        used[src] = set()
        for line in subprocess.run([nm, "-P", str(obj)], capture_output=True, text=True, check=True).stdout.splitlines():
            name, kind = line.split()[:2]
            if kind == "U":
                used[src].add(name)
            elif kind.isupper():
                defined[name] = src
    return {src: {defined[n] for n in names if n in defined} - {src} for src, names in used.items()}


def _layers() -> dict[str, int]:
    """native/*.c file -> its layer in the picture at the top of internal.h (1 is the top)."""
    with open(os.path.join(NATIVE, "internal.h"), encoding="utf-8") as f:
        text = f.read()
    return {name: int(layer) for layer, names in re.findall(r"^ \*   layer (\d+)  ((?:\S+\.c ?)+)", text, re.M)
            for name in names.split()}


def test_c_files_call_only_into_lower_layers(tmp_path):
    """The picture of internal.h is the code's: every .c file has a layer, and each call
    into another file goes down (so there is no cycle)."""
    graph, layers = _calls_between_files(tmp_path), _layers()
    assert set(layers) == set(SOURCES), "files missing from (or unknown to) internal.h's picture"
    upward = [f"{src} (layer {layers[src]}) -> {dep} (layer {layers[dep]})"
              for src, deps in sorted(graph.items()) for dep in sorted(deps) if layers[dep] <= layers[src]]
    assert not upward, "calls that do not go down a layer: " + "; ".join(upward)
