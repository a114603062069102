"""What the fuzz inputs reach in the native code: the edges of the instrumented files
(fuzz/edges.c, per input: the harness keeps an input that has a new one) and the lines of
each file (gcov, for the whole run). instrumented.py builds the module both come from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from instrumented import NATIVE, instrumented_sources


class Coverage:
    """The coverage recorder of the loaded instrumented module (`lib`, its build in `build_dir`)."""

    def __init__(self, ffi, lib, build_dir: Path):
        self.ffi, self.lib, self.build_dir = ffi, lib, build_dir
        # gcov's counters of the run so far: each dump adds to the files there
        self.counters = Path(tempfile.mkdtemp(prefix="spyre-fuzz-gcov-"))
        self.file_of: dict[int, str] = {}  # block address -> native file, from addr2line

    # ---- edges, per input -------------------------------------------------------------

    def begin(self) -> None:
        self.lib.fuzz_edges_begin()

    def end(self) -> int:
        """The features (an edge, or an edge's hit-count class) the input since begin()
        reached first."""
        return int(self.lib.fuzz_edges_end())

    def clear(self) -> None:
        """Forget the edges seen (a new measurement)."""
        self.lib.fuzz_edges_clear()

    def edges(self) -> int:
        return int(self.lib.fuzz_edges_count())

    def edge_list(self) -> list[tuple[int, int, str]]:
        """Every edge seen: (from, to) as offsets into the module, and the native file of its
        destination block (the file a helper was inlined into)."""
        n = max(self.edges(), 1)
        src, dst = self.ffi.new("uint64_t[]", n), self.ffi.new("uint64_t[]", n)
        n = int(self.lib.fuzz_edges_list(src, dst, n))
        new = sorted({int(dst[i]) for i in range(n)} - self.file_of.keys())
        if new:  # the recorded address is the callback's return address: the call is just before it
            r = subprocess.run(["addr2line", "-a", "-i", "-e", str(self.build_dir / "native.so")],
                               input="\n".join(hex(a - 1) for a in new), capture_output=True, text=True, check=True)
            files = []  # the outermost frame of each address: the function the block is in
            for line in r.stdout.splitlines():
                if line.startswith("0x"):
                    files.append("?")
                else:
                    files[-1] = os.path.basename(line.split(":")[0])
            self.file_of.update(zip(new, files, strict=True))
        return sorted((int(src[i]), int(dst[i]), self.file_of[int(dst[i])]) for i in range(n))

    def edges_by_file(self) -> dict[str, int]:
        """Edges seen, counted by the native file of their destination block."""
        return dict(sorted(Counter(f for _, _, f in self.edge_list()).items()))

    # ---- lines, per run -------------------------------------------------------------------

    def reset_lines(self) -> None:
        """Count lines from now on."""
        self.lib.fuzz_gcov_reset()
        for f in self.counters.glob("*.gcda"):
            f.unlink()

    def lines(self, annotate: Path | None = None) -> dict[str, list[int]]:
        """[lines reached, lines with code] per instrumented file since reset_lines(), from
        the gcov counters (added to the run's counter files and read with gcov). With
        `annotate`, gcov's annotated sources (``plan.c.gcov``, ...) are written there."""
        if not self._dump():
            return {}
        self.lib.fuzz_gcov_reset()  # counted in the files now; and lets the next dump happen
        names = [s for s in instrumented_sources() if (self.counters / f"{Path(s).stem}.gcda").exists()]
        for name in names:
            shutil.copy(self.build_dir / f"{Path(name).stem}.gcno", self.counters)
        r = subprocess.run(["gcov", "--json-format", "--stdout", "-o", str(self.counters), *names],
                           cwd=self.counters, capture_output=True, text=True, check=True)
        if annotate:
            annotate.mkdir(parents=True, exist_ok=True)
            subprocess.run(["gcov", "-o", str(self.counters), *[str(NATIVE / n) for n in names]], cwd=annotate,
                           capture_output=True, check=True)
        out = {}
        for doc in r.stdout.splitlines():
            for f in json.loads(doc)["files"] if doc.strip() else []:
                path = Path(f["file"])
                if path.parent == NATIVE and path.name in names:  # headers count in the files using them
                    reached = {ln["line_number"] for ln in f["lines"] if ln["count"] > 0}
                    out[path.name] = [len(reached), len({ln["line_number"] for ln in f["lines"]})]
        return dict(sorted(out.items()))

    def _dump(self) -> bool:
        saved = os.environ.get("GCOV_PREFIX")
        os.environ["GCOV_PREFIX"] = str(self.counters)
        try:
            return bool(self.lib.fuzz_gcov_dump())
        finally:
            if saved is None:
                del os.environ["GCOV_PREFIX"]
            else:
                os.environ["GCOV_PREFIX"] = saved

    def close(self) -> None:
        self._dump()  # the last one: the process's exit then writes no counters
        shutil.rmtree(self.counters, ignore_errors=True)
