"""Builds every loop kernel of a corpus again and compares its program with the recorded one.

    python tests/check_loop_corpus.py CORPUS.jsonl [--limit N] [--show N] [--asan]

A corpus is JSON lines, one kernel construction each, as a test session recorded them:
``kind``, ``kernel`` (its JSON), ``layouts`` and ``offsets`` of its buffers, ``target``
(the :class:`~spyre_rt.construct.context.Target` field values in declaration order) and the
``sha256`` of the program it encoded. Each loop kernel is built twice, as a launch builds it
(the first build decides, the second takes the decision back), and both programs must have
the recorded digest. Prints the counts and the first differences; exits 1 on any. With
``--asan`` the native builder runs under AddressSanitizer and UBSan (fuzz/sanitize.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

if "--asan" in sys.argv:  # the sanitized native module must be in place before spyre_rt loads
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
    import sanitize

    sanitize.reexec_if_asked(sys.argv)
    sanitize.load_if_active()

from spyre_rt import construct  # noqa: E402
from spyre_rt import kernels as kdesc  # noqa: E402
from spyre_rt.construct.context import BuildContext, Refused, Target  # noqa: E402
from spyre_rt.layout import StickLayout  # noqa: E402


def target_of(values: list) -> Target:
    fields = dataclasses.fields(Target)
    return Target(*[int(v) if f.type == "int" else float(v) for f, v in zip(fields, values, strict=True)])


def build_twice(r: dict):
    target = target_of(r["target"])
    layouts = {b: StickLayout(*lay) for b, lay in r["layouts"].items()}
    kernel = kdesc.from_json(r["kernel"])
    first = BuildContext(target, layouts, offsets=dict(r.get("offsets", {})))
    decided = construct.build(first, kernel)
    again = BuildContext(target, layouts, offsets=dict(r.get("offsets", {})))
    construct.build(again, kernel, decided)
    return first, again


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpus")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--show", type=int, default=10)
    p.add_argument("--asan", action="store_true", help="the native builder under ASan and UBSan")
    args = p.parse_args(argv)
    checked = same = refused = 0
    wrong = []
    t0 = time.time()
    with open(args.corpus) as f:
        for i, line in enumerate(f):
            r = json.loads(line)
            if r["kind"] != "loop":
                continue
            if args.limit and checked >= args.limit:
                break
            checked += 1
            try:
                first, again = build_twice(r)
            except Refused as e:  # the recorded run built it: a refusal now is a difference
                refused += 1
                wrong.append(f"line {i + 1}: refused ({type(e).__name__}: {e})")
                continue
            shas = {hashlib.sha256(bytes(ctx.encode())).hexdigest() for ctx in (first, again)}
            if shas == {r["sha256"]}:
                same += 1
            else:
                wrong.append(f"line {i + 1}: {json.loads(r['kernel'])['name']} from {r.get('source', '?')}")
    print(f"{checked} loop kernels checked, {same} identical, {len(wrong)} different "
          f"({refused} refused), {time.time() - t0:.0f} s")
    for w in wrong[: args.show]:
        print("  " + w)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
