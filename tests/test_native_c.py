"""The native runtime's own C tests, built with -Wall -Wextra -Werror, run plain and under
AddressSanitizer and UndefinedBehaviorSanitizer (gcc only: no make needed)."""

import os
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
