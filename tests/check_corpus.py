"""Build every kernel of a recorded corpus again and compare each program with its digest.

    python tests/check_corpus.py CORPUS.jsonl [--kind matmul] [--again]

A corpus is JSON lines, one kernel each, as ``tests/make_program_digests.py`` records them
plus the card they were built for: ``kind``, ``kernel`` (its JSON description), ``layouts``
and ``offsets`` of its buffers, ``target`` (the :class:`Target` field values in declaration
order) and ``sha256`` of the program construction encoded when it was recorded. Each kernel
is built as its first launch builds it (deciding), and with ``--again`` also as every later
launch does (from the first build's decisions); any program whose bytes changed is named.
The default test run holds a smaller set of such digests (tests/test_program_digests.py);
this checks a whole corpus, such as every kernel the test suites build, before a change to
construction is merged. Exit status 1 when a program changed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import sys

from spyre_rt import construct
from spyre_rt import kernels as kdesc
from spyre_rt.construct.context import BuildContext, Target
from spyre_rt.layout import StickLayout


def target_of(values: list) -> Target:
    """The Target a record names by its field values, in declaration order."""
    fields = dataclasses.fields(Target)
    return Target(**{f.name: (int(v) if f.type in ("int", int) else float(v)) for f, v in zip(fields, values,
                                                                                                strict=True)})


def programs(r: dict, again: bool) -> list:
    """The programs of a record's kernel: its first build's, and a later launch's."""
    target = target_of(r["target"])
    layouts = {b: StickLayout(*lay) for b, lay in r["layouts"].items()}
    kernel = kdesc.from_json(r["kernel"])
    first = BuildContext(target, layouts, offsets=dict(r.get("offsets", {})))
    decided = construct.build(first, kernel)
    out = [first.encode()]
    if again:
        later = BuildContext(target, layouts, offsets=dict(r.get("offsets", {})))
        construct.build(later, kernel, decided)
        out.append(later.encode())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus")
    ap.add_argument("--kind", action="append", help="only kernels of this kind (repeatable; default: all but copies)")
    ap.add_argument("--again", action="store_true", help="also build each as a later launch does")
    args = ap.parse_args(argv)
    counts, changed = collections.Counter(), []
    with open(args.corpus) as f:
        for line_no, line in enumerate(f, 1):
            r = json.loads(line)
            if r["kind"] == "copy" or (args.kind and r["kind"] not in args.kind):
                continue
            counts[r["kind"]] += 1
            for blob in programs(r, args.again):
                if hashlib.sha256(bytes(blob)).hexdigest() != r["sha256"]:
                    changed.append(f"line {line_no} ({r['kind']}, {r.get('source', '?')})")
                    break
    print(f"{sum(counts.values())} kernels built ({dict(counts)}): {len(changed)} programs changed")
    for c in changed[:20]:
        print("  changed:", c)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
