"""cffi build script: compiles native/ into the private module ``spyre_rt._native``.

The C declarations handed to cffi come from ``spyre.h`` itself, run through the C
preprocessor with ``SPY_CDEF`` defined (the header then skips its system includes and
its compile-time checks): what the compiler sees is what cffi sees, tables written as
X-macros included, and integer ``#define``s are kept as constants. The header stays the
one contract between the runtime and the Python layer.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# Every .c file of native/ is part of the runtime (native/Makefile builds the same set).
SOURCES = sorted(name for name in os.listdir(HERE) if name.endswith(".c"))
_INT_DEFINE = re.compile(r"#define\s+(SPY_\w+)\s+(0x[0-9A-Fa-f]+u?|\d+u?)\s*$")


def _preprocess(path: str) -> str:
    """The header as the C compiler sees it, with its macro definitions (-dD)."""
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("gcc") or shutil.which("cc") or "cc"]
    cmd = [*cc, "-E", "-P", "-dD", "-DSPY_CDEF", "-x", "c", path]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"preprocessing {path} failed ({' '.join(cmd)}):\n{out.stderr}")
    return out.stdout


def cdef_from_header(path: str) -> str:
    lines = []
    for line in _preprocess(path).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            m = _INT_DEFINE.match(stripped)
            if m and m.group(1) != "SPY_CDEF":
                lines.append(f"#define {m.group(1)} {m.group(2).rstrip('u')}")
            continue
        if stripped:
            lines.append(line)
    return "\n".join(lines)


ffibuilder = FFI()
ffibuilder.cdef(cdef_from_header(os.path.join(HERE, "spyre.h")))
ffibuilder.set_source(
    "spyre_rt._native",
    '#include "spyre.h"',
    sources=[os.path.relpath(os.path.join(HERE, s)) for s in SOURCES],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=["-std=c11", "-D_GNU_SOURCE", "-O2", "-Wall", "-Wextra", "-Werror",
                        "-Wno-unused-parameter"],
    libraries=["m", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
