"""cffi build script: compiles native/ into the private module ``spyre_rt._native``.

The C declarations handed to cffi come from ``spyre.h`` itself (comments and
preprocessor lines stripped, integer ``#define``s kept), so the header stays the one
contract between the runtime and the Python layer.
"""

from __future__ import annotations

import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# Every .c file of native/ is part of the runtime (native/Makefile builds the same set).
SOURCES = sorted(name for name in os.listdir(HERE) if name.endswith(".c"))


def cdef_from_header(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            m = re.match(r"#define\s+(SPY_\w+)\s+(0x[0-9A-Fa-f]+u?|\d+u?)\s*$", stripped)
            if m:
                lines.append(f"#define {m.group(1)} {m.group(2).rstrip('u')}")
            continue
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
