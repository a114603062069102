"""Build every kernel of a recorded corpus again and compare each program's digest.

    python tests/check_corpus.py CORPUS.jsonl [--kind attention] [--verbose]

A corpus is JSON lines, one kernel construction each, as a recording of the test suites
makes them: its kind, the kernel's description (JSON), the stick layouts and logical
offsets of its buffers, the card's figures (``target``: the values of
:class:`~spyre_rt.cost.CostModel`'s fields in declaration order) and the sha256
of the program it encoded. Each kernel is built twice, as a launch builds it: from
nothing, then from the decisions the first build returned. The exit status is the number
of programs that changed (0: every one byte for byte). ``tests/program_digests.json``
(``tests/test_program_digests.py``) keeps a fixed selection of such records in the
default test run; this checks a whole recording.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import sys

from spyre_rt import construct, device_profile
from spyre_rt import ir as kdesc
from spyre_rt.construct import copy
from spyre_rt.construct.context import BuildContext
from spyre_rt.cost import CostModel
from spyre_rt.layout import StickLayout


def target_of(values: list) -> CostModel:
    """A cost model from its field values (recorded as floats) in declaration order; a
    field added since the recording (``gran_k``) takes the shipped profile's value."""
    shipped = CostModel.of_figures(device_profile.load("spyre"))
    fields = dataclasses.fields(CostModel)
    given = {f.name: int(v) if f.type == "int" else float(v) for f, v in zip(fields, values, strict=False)}
    return dataclasses.replace(shipped, **given)


def build(r: dict) -> tuple[bytes, bytes]:
    """The program of one record built from nothing, and again from the first build's decisions."""
    target = target_of(r["target"])
    layouts = {b: StickLayout(*lay) for b, lay in r["layouts"].items()}
    if r["kind"] == "copy":
        ctx = BuildContext(target, layouts)
        copy.build(ctx, [copy.Copy(*c) for c in r["copies"]])
        return bytes(ctx.encode()), bytes(ctx.encode())
    kernel = kdesc.from_json(r["kernel"])
    first = BuildContext(target, layouts, offsets=dict(r.get("offsets", {})))
    decisions = construct.build(first, kernel)
    again = BuildContext(target, layouts, offsets=dict(r.get("offsets", {})))
    construct.build(again, kernel, decisions)
    return bytes(first.encode()), bytes(again.encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus")
    ap.add_argument("--kind", help="only kernels of this kind (loop, matmul, attention, copy)")
    ap.add_argument("--verbose", action="store_true", help="name every kernel that changed")
    args = ap.parse_args(argv)
    same, changed = collections.Counter(), collections.Counter()
    with open(args.corpus) as f:
        for i, line in enumerate(f):
            r = json.loads(line)
            if args.kind and r["kind"] != args.kind:
                continue
            first, again = build(r)
            ok = all(hashlib.sha256(b).hexdigest() == r["sha256"] for b in (first, again))
            (same if ok else changed)[r["kind"]] += 1
            if not ok and args.verbose:
                print(f"changed: line {i + 1} {r['kind']} {r.get('source', '')}")
    for kind in sorted(same.keys() | changed.keys()):
        print(f"{kind:10s} {same[kind]:5d} identical  {changed[kind]:5d} changed")
    return min(sum(changed.values()), 255)


if __name__ == "__main__":
    sys.exit(main())
