"""``spyre-profile``: the profiler's command line.

Each subcommand is a pair of small functions, one adding its arguments and one running it
(``cmd_<name>(args, console) -> exit status``), registered in :data:`COMMANDS`. Usage
errors exit with 2 (argparse), unreadable or malformed input files with 1, always with a
one-line message and never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from rich import box
from rich.console import Console
from rich.table import Table

from . import compare, optable, view

PROG = "spyre-profile"


class InputError(Exception):
    """A file the user named cannot be used; the message says which and why."""


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Console], int]


# ---- view ----------------------------------------------------------------------------------


def parse_window(text: str) -> tuple[float | None, float | None]:
    """``START:END`` in µs from the trace's first event; either side may be left empty."""
    if text.count(":") != 1:
        raise argparse.ArgumentTypeError(f"expected START:END in µs (e.g. 0:500 or 100:), not {text!r}")
    lo, hi = (part.strip() for part in text.split(":"))
    try:
        a = float(lo) if lo else None
        b = float(hi) if hi else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"START and END must be numbers of µs, not {text!r}") from None
    if a is not None and b is not None and b <= a:
        raise argparse.ArgumentTypeError(f"END must be after START in {text!r}")
    if any(x is not None and x < 0 for x in (a, b)):
        raise argparse.ArgumentTypeError(f"times are µs from the trace's start, not negative: {text!r}")
    return a, b


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, not {n}")
    return n


def _group_by_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-by", choices=optable.GROUPINGS, default=optable.DEFAULT_GROUPING,
                   help="rows of the per-op table: kernel, op (aten ops and module, layers folded "
                        "together; the default), module, or layer")


def _view_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a trace file (Chrome trace-event JSON, plain or .gz)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--window", type=parse_window, metavar="START:END",
                       help="the time window to show, in µs from the trace's first event (default: all)")
    where.add_argument("--span", metavar="NAME",
                       help='the window of a host span, e.g. "decode [prebuilt]" (spans of `spyre-profile run`)')
    p.add_argument("--top", type=positive_int, default=20, metavar="N",
                   help="rows of the per-op table (default 20)")
    _group_by_argument(p)


def _load_trace(path: str) -> view.TraceData:
    return _load(path, results=False)[1]


def _span_window(data: view.TraceData, name: str) -> view.Window:
    found = data.span(name)
    if found is None:
        known = ", ".join(repr(n) for n in list(data.spans)[:8]) or "none"
        raise InputError(f"no host span named {name!r} in the trace (spans: {known})")
    return found


def _load(path: str, results: bool | None) -> tuple[str, object]:
    try:
        return compare.load(path, results)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise InputError(str(e)) from None


def cmd_view(args: argparse.Namespace, console: Console) -> int:
    data = _load_trace(args.trace)
    win = view.window(data, *args.window) if args.window else _span_window(data, args.span) if args.span else None
    view.render(console, data, win, args.top, title=os.path.basename(args.trace), by=args.group_by)
    return 0


# ---- compare -------------------------------------------------------------------------------


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A",
                   help="the baseline: a trace, or a `spyre-profile run --json` result file")
    p.add_argument("b", metavar="B", help="the file to compare with it (of the same kind)")
    p.add_argument("--json", action="store_true",
                   help="read A and B as result files of `spyre-profile run --json` (default: by content)")
    p.add_argument("--top", type=positive_int, default=20, metavar="N",
                   help="rows of the per-op table (default 20)")
    _group_by_argument(p)


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    forced = True if args.json else None
    kind_a, a = _load(args.a, forced)
    kind_b, b = _load(args.b, forced)
    if kind_a != kind_b:
        raise InputError(f"cannot compare a {kind_a} file ({args.a}) with a {kind_b} file ({args.b})")
    la, lb = os.path.basename(args.a), os.path.basename(args.b)
    if la == lb:
        la, lb = args.a, args.b
    cmp = (compare.compare_traces(a, b, la, lb, args.group_by) if kind_a == "trace"
           else compare.compare_results(a, b, la, lb))
    compare.render(console, cmp, args.top)
    return 0


# ---- merge ---------------------------------------------------------------------------------


def _merge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("torch_trace", metavar="TORCH_TRACE",
                   help="a trace torch.profiler exported (prof.export_chrome_trace), plain or .gz")
    p.add_argument("card_traces", metavar="CARD_TRACE", nargs="+",
                   help="card traces of the same run (trace.recording(card).export(...)), one per card")
    p.add_argument("-o", "--output", metavar="FILE", required=True,
                   help="the merged trace (gzip if FILE ends in .gz); open it in ui.perfetto.dev")


def cmd_merge(args: argparse.Namespace, console: Console) -> int:
    from ..trace import merge

    try:
        traces = [merge.read(path) for path in (args.torch_trace, *args.card_traces)]
    except FileNotFoundError as e:
        raise InputError(f"{e.filename}: no such file") from None
    except OSError as e:
        raise InputError(f"{getattr(e, 'filename', '')}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise InputError(str(e)) from None
    merged, report = merge.merge(traces[0], traces[1:])
    from .. import trace

    trace.write(merged, args.output)
    cards = ", ".join(f"spyre:{c}" for c in report.cards)
    console.print(f"{args.output}: {report.jobs:,} jobs of {cards} on the torch.profiler timeline; "
                  f"{report.matched:,} of {report.ranges:,} launch ranges matched to the card's launches")
    if report.ranges == 0:
        console.print("[yellow]the torch trace has no spyre launch ranges: was the card used inside "
                      "torch.profiler.profile()? The card's tracks are placed by their own clock[/]")
    return 0


# ---- run -----------------------------------------------------------------------------------


def _modes(text: str) -> tuple[str, ...]:
    from .run import MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes must be a comma list of {', '.join(MODES)}, not {text!r}")
    return modes


def _card_counts(text: str) -> tuple[int, ...]:
    counts = tuple(positive_int(x.strip()) for x in text.split(",") if x.strip())
    if not counts:
        raise argparse.ArgumentTypeError(f"expected numbers of cards, e.g. 2 or 2,4,8, not {text!r}")
    return counts


def _run_arguments(p: argparse.ArgumentParser) -> None:
    from .run import MODES as RUN_MODES

    p.add_argument("model", metavar="MODEL",
                   help="a model profile name (granite-3.3-8b, granite-3.3-2b, granite-tiny) or a TOML path")
    p.add_argument("--batch", type=positive_int, default=1, metavar="N", help="batch size (default 1)")
    p.add_argument("--seq", type=positive_int, default=1024, metavar="N", help="prompt length (default 1024)")
    p.add_argument("--decode-steps", type=positive_int, default=4, metavar="N",
                   help="greedy decode steps measured per mode (default 4)")
    p.add_argument("--repeats", type=positive_int, default=5, metavar="N",
                   help="measured rounds, each running every mode once (interleaved); latencies are medians "
                        "over the rounds, speedups medians of each round's ratio to construct (default 5)")
    p.add_argument("--modes", type=_modes, default=None, metavar="LIST",
                   help="modes to compare: the dispatch modes and replay, the prebuilt plans driven by "
                        f"captured graphs (default: {','.join(RUN_MODES)})")
    _sim_arguments(p)
    p.add_argument("--trace", metavar="FILE",
                   help="write a Chrome/Perfetto trace of the last measured run of each mode (gzip if FILE ends in .gz)")
    p.add_argument("--trace-detail", choices=("jobs", "commands"), default="jobs",
                   help="jobs: one event per kernel, plus counters (the default); commands: every command of "
                        "every core too (large: use it with few layers)")
    p.add_argument("--whatif-plot", metavar="FILE",
                   help="draw the what-if curve (speedup against construction per kernel) as a PNG "
                        "(needs matplotlib; without it, or without this option, it is drawn in the terminal)")
    p.add_argument("--json", metavar="FILE", help="write every figure of the report as JSON")
    p.add_argument("--tp", type=_card_counts, default=(1,), metavar="N[,N...]",
                   help="shard the model over N cards (tensor parallelism, a process per card) and report it "
                        "against one card; several counts share the one-card run (default 1)")
    p.add_argument("--py-spy", dest="py_spy", nargs="?", const="", default=None, metavar="FILE",
                   help="record the host dispatch path with py-spy (speedscope file; default: beside the trace)")
    p.add_argument("--no-regional", dest="regional", action="store_false",
                   help="trace and compile every decoder layer (by default the layers, one graph, are "
                        "compiled once: regional compilation)")
    p.add_argument("--sweep", action="store_true",
                   help="also sweep batch sizes and sequence lengths, and plot the speedup against sequence "
                        "length and the device efficiency against batch size")
    p.add_argument("--sweep-batch", default="1,8,32", metavar="LIST",
                   help="batch sizes of the sweep (default 1,8,32)")
    p.add_argument("--sweep-seq", default="128,512,1024", metavar="LIST",
                   help="sequence lengths of the sweep (default 128,512,1024)")
    p.add_argument("--plot", metavar="FILE", default="spyre-sweep.png", help="where the sweep plot goes")


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from ..errors import SpyreProfileError
    from . import run as runmod
    from . import sweep as sweepmod

    py_spy = args.py_spy
    if py_spy == "":
        py_spy = (os.path.splitext(args.trace)[0] if args.trace else "spyre-profile") + ".speedscope.json"
    opts = runmod.Options(model=args.model, batch=args.batch, seq=args.seq, decode_steps=args.decode_steps,
                          repeats=args.repeats, modes=args.modes or runmod.MODES, sim_mode=args.sim_mode, layers=args.layers,
                          trace=args.trace, trace_detail=args.trace_detail, whatif_plot=args.whatif_plot, py_spy=py_spy,
                          regional=args.regional)
    sizes = tuple(n for n in args.tp if n > 1)
    try:
        runmod.load_model(args.model)
    except SpyreProfileError as e:
        raise InputError(str(e)) from None
    try:  # before any work: a sweep of sizes it cannot read fails now, not after the run
        sweep_sizes = sweepmod.parse_sizes(args.sweep_batch, args.sweep_seq) if args.sweep else []
    except ValueError as e:
        raise InputError(str(e)) from None
    if sizes:
        if args.sweep:
            raise InputError("--sweep runs on one card: leave out --tp")
        from . import tp as tpmod

        out = tpmod.measure(opts, sizes, console)
        tpmod.render(console, out)
    else:
        out = runmod.measure(opts, console)
        runmod.render(console, out, args.whatif_plot)
    for path in [r["trace"] for r in out.get("runs", ())] if sizes else [args.trace]:
        if path:
            console.print(f"trace written to {path} (open it in ui.perfetto.dev or with `spyre-profile view`)")
    if args.sweep:
        out["sweep"] = sweepmod.sweep(opts, sweep_sizes, console, args.plot)
    if args.json:
        runmod.write_json(out, args.json)
        console.print(f"figures written to {args.json}")
    return 0


# ---- serve ---------------------------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of whole numbers of at least 1, not {text!r}")
    return sizes


def _sim_arguments(p: argparse.ArgumentParser) -> None:
    """How the card is simulated and how much of the model runs: shared by run and serve."""
    sim = p.add_mutually_exclusive_group()
    sim.add_argument("--functional", dest="sim_mode", action="store_const", const="functional",
                     help="compute every value on the card (slow for full-size models)")
    sim.add_argument("--timing", dest="sim_mode", action="store_const", const="timing",
                     help="simulate time only (the default for full-size models)")
    p.add_argument("--layers", type=positive_int, default=None, metavar="N",
                   help="use N layers instead of the profile's (a quicker, smaller run)")


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="a model profile name (granite-3.3-8b, granite-3.3-2b, granite-tiny) or a TOML path")
    p.add_argument("--concurrency", type=_sizes, default=(1, 8, 32), metavar="LIST",
                   help="concurrent requests of each run (default 1,8,32): the decode batch sizes")
    p.add_argument("--input", dest="input_len", type=positive_int, default=256, metavar="N",
                   help="prompt tokens of each request (default 256)")
    p.add_argument("--output", dest="output_len", type=positive_int, default=128, metavar="N",
                   help="output tokens of each request, with ignore_eos (default 128)")
    p.add_argument("--engine", choices=("card", "host"), default="card",
                   help="card: vLLM on the card (the spyre_rt platform); host: the same vLLM runner with the "
                        "model eager on the host CPU, the per-step anchor")
    _sim_arguments(p)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, metavar="N",
                   help="vLLM's token budget of a step (default 8192, vLLM's own for `vllm serve` on a "
                        "device of the card's memory)")
    p.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                   help="vLLM's longest length (default: --input plus --output, rounded up to 64); a decode "
                        "step reads the context bucket of its longest request, not this")
    p.add_argument("--compare-output", type=positive_int, default=None, metavar="N",
                   help="output tokens of the runs through the compiled call, which are for the per-step "
                        "comparison (default: --output)")
    p.add_argument("--trace", metavar="FILE",
                   help="write a card trace (jobs) of the prefill steps and whole-batch decode steps at the "
                        "largest concurrency, a host span per engine step: read it with `spyre-profile view FILE --span NAME`")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")


def cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from ..errors import SpyreProfileError
    from ..serving.bucketing import min_context_tokens
    from . import run as runmod

    if args.max_model_len is not None and args.max_model_len < args.input_len + args.output_len:
        raise InputError(f"--max-model-len {args.max_model_len} is shorter than a request: --input {args.input_len} "
                         f"plus --output {args.output_len}")
    try:
        min_context_tokens()  # the process settings the engine will read, before vLLM is imported
    except ValueError as e:
        raise InputError(str(e)) from None
    try:
        runmod.load_model(args.model)
    except SpyreProfileError as e:
        raise InputError(str(e)) from None
    from . import serve  # imports vLLM only when measured

    opts = serve.Options(model=args.model, concurrency=args.concurrency, input_len=args.input_len,
                         output_len=args.output_len, engine=args.engine, layers=args.layers, sim_mode=args.sim_mode,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                         compare_output=args.compare_output, trace=args.trace)
    try:
        out = serve.measure(opts, console)
    except SpyreProfileError as e:
        raise InputError(str(e)) from None
    serve.render(console, out)
    if args.trace:
        console.print(f"trace written to {args.trace} (read it with `spyre-profile view`)")
    if args.json:
        serve.write_json(out, args.json)
        console.print(f"figures written to {args.json}")
    return 0


# ---- models --------------------------------------------------------------------------------


def _choices(known: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma list of some of `known`, in the order given."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{what} must be a comma list of {', '.join(known)}, not {text!r}")
        return names
    return parse


def _models_arguments(p: argparse.ArgumentParser) -> None:
    from .matrix import DTYPES, MODES
    from .models import FAMILIES

    p.add_argument("--families", type=_choices(list(FAMILIES), "families"), default=tuple(FAMILIES), metavar="LIST",
                   help=f"model families to run (default: all: {','.join(FAMILIES)})")
    p.add_argument("--dtypes", type=_choices(list(DTYPES), "dtypes"), default=tuple(DTYPES), metavar="LIST",
                   help="dtypes to compare (default: fp32,fp16)")
    p.add_argument("--modes", type=_choices(MODES, "modes"), default=MODES, metavar="LIST",
                   help=f"dispatch modes to run each compiled model in (default: {','.join(MODES)})")
    p.add_argument("--json", metavar="FILE", help="write every row of the matrix as JSON")


def cmd_models(args: argparse.Namespace, console: Console) -> int:
    from . import matrix
    from .models import FAMILIES

    families = [FAMILIES[name] for name in args.families]
    rows, host = matrix.run_live(families, args.dtypes, args.modes, console)
    matrix.render(console, rows, args.dtypes, args.modes, host)
    if args.json:
        from .run import write_json

        write_json({"format": matrix.FORMAT, "dtypes": list(args.dtypes), "modes": list(args.modes), "host": host,
                    "rows": [r.as_dict() for r in rows]}, args.json)
        console.print(f"rows written to {args.json}")
    return 0


# ---- info ----------------------------------------------------------------------------------


def _info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=int, default=0, metavar="N", help="the card to test (default 0)")
    p.add_argument("--profile", metavar="NAME_OR_PATH",
                   help="device profile (default: SPYRE_RT_DEVICE_PROFILE or the built-in 'spyre')")
    p.add_argument("--timing", action="store_true", help="open the card in timing mode (no data)")


def cmd_info(args: argparse.Namespace, console: Console) -> int:
    from .. import card as cards
    from ..errors import SpyreProfileError
    from . import info

    if args.profile or args.timing:
        try:
            cards.configure(args.profile, "timing" if args.timing else None)
        except SpyreProfileError as e:
            raise InputError(str(e)) from None
    if not 0 <= args.device < cards.count():
        raise InputError(f"--device {args.device}: the profile has {cards.count()} card(s)")
    return info.render(console, args.device)


# ---- cache ---------------------------------------------------------------------------------


def _cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "inspect", "clear", "stats"),
                   help="list the cached plans, inspect one, clear the cache, or show its statistics")
    p.add_argument("key", nargs="?", help="for inspect: a plan key (or a unique prefix of one)")
    p.add_argument("--dir", metavar="DIR", help="the cache directory (default: SPYRE_RT_CACHE_DIR or ~/.cache)")


def _plans_per_step(cache) -> Table:
    """How many plan files each compiled graph holds: one per distinct size it ran at (a
    graph with dynamic shapes), one for a static graph."""
    steps: dict[str, list[dict]] = {}
    for _, header in cache.headers():
        steps.setdefault(str(header.get("step", "?")), []).append(header)
    t = Table(title="plans per compiled graph", title_justify="left")
    t.add_column("graph")
    t.add_column("plans", justify="right")
    t.add_column("kernels", justify="right")
    t.add_column("sizes")
    for step, headers in sorted(steps.items(), key=lambda kv: -len(kv[1])):
        sizes = sorted({", ".join(f"{k}={v}" for k, v in sorted(h.get("sizes", {}).items())) for h in headers})
        shown = "; ".join(sizes[:6]) + (f"; ... ({len(sizes)} in all)" if len(sizes) > 6 else "")
        t.add_row(step, str(len(headers)), str(max(int(h.get("kernels", 0)) for h in headers)), shown or "static")
    return t


def cmd_cache(args: argparse.Namespace, console: Console) -> int:
    from .. import config, plan_cache
    from ..errors import SpyrePlanCacheError

    s = config.settings()
    cache = plan_cache.PlanCache(args.dir or s.cache_dir, s.cache_max_bytes)
    entries = sorted(cache.entries(), key=lambda e: -e[1].st_mtime)
    if args.action == "clear":
        console.print(f"removed {cache.clear()} plan file(s) from {cache.dir}")
        return 0
    if args.action == "stats":
        total = sum(st.st_size for _, st in entries)
        t = Table(title=f"plan cache {cache.dir}", title_justify="left")
        t.add_column("figure")
        t.add_column("value", justify="right")
        t.add_row("plans", str(len(entries)))
        t.add_row("bytes", f"{total:,}")
        t.add_row("bound (bytes)", f"{cache.max_bytes:,}")
        for k, v in sorted(cache.persistent_stats().items()):
            if k not in ("updated", plan_cache.TRACKED_BYTES):  # the bytes row above is counted
                t.add_row(k, f"{v:,}")
        console.print(t)
        console.print(_plans_per_step(cache))
        return 0
    if args.action == "list":
        t = Table(title=f"plan cache {cache.dir}", title_justify="left")
        for col in ("key", "bytes", "last used"):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for p, st in entries:
            t.add_row(p.stem[:16], f"{st.st_size:,}", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime)))
        console.print(t)
        return 0
    if not args.key:
        raise InputError("cache inspect needs a KEY (see `spyre-profile cache list`)")
    match = [p for p, _ in entries if p.stem.startswith(args.key)]
    if len(match) != 1:
        raise InputError(f"{len(match)} plans match {args.key!r}")
    try:
        entry = plan_cache.decode(match[0].read_bytes())
    except SpyrePlanCacheError as e:
        raise InputError(f"{match[0]}: {e}") from None
    t = Table(title=str(match[0]), title_justify="left")
    t.add_column("field")
    t.add_column("value", overflow="fold")
    for k, v in sorted(entry.header.items()):
        if k != "kernel_info":  # drawn as a table of its own
            t.add_row(k, json.dumps(v) if not isinstance(v, str) else v)
    console.print(t)
    info = entry.header.get("kernel_info")
    if isinstance(info, dict) and info:
        console.print(kernel_info_table(info))
    return 0


def kernel_info_table(info: dict) -> Table:
    """What each kernel of a plan computes (the ``kernel_info`` of a plan file's header)."""
    from ..job_facts import module_path, op_names

    def number(v, scale: float = 1.0, digits: int = 0) -> str:
        return f"{v / scale:,.{digits}f}" if isinstance(v, int | float) and not isinstance(v, bool) else ""

    t = Table(title="kernels: what each computes", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
              pad_edge=False, collapse_padding=True)
    for col in ("kernel", "kind", "op · module", "MFLOP", "min DRAM\nKiB", "DRAM\nKiB", "cores", "LX peak\nKiB"):
        t.add_column(col, justify="left" if col in ("kernel", "kind", "op · module") else "right",
                     overflow="fold" if col == "op · module" else "ellipsis")
    for name, k in info.items():
        k = k if isinstance(k, dict) else {}
        what = " · ".join(x for x in (op_names(k), module_path(k)) if x)
        t.add_row(str(name), str(k.get("kind", "")), what, number(k.get("flops"), 1e6, 1),
                  number(k.get("dram_bytes_min"), 1024), number(k.get("dram_bytes"), 1024), number(k.get("cores")),
                  number(k.get("scratchpad_peak"), 1024))
    return t


# ---- the command ---------------------------------------------------------------------------

COMMANDS: dict[str, Subcommand] = {
    "run": Subcommand("compile a Granite model and measure prefill and decode in every dispatch mode",
                      _run_arguments, cmd_run),
    "serve": Subcommand("vLLM serving a Granite model: a decode step split into vLLM's host time, our dispatch "
                        "and the device, and throughput against the roofline, per concurrency",
                        _serve_arguments, cmd_serve),
    "models": Subcommand("the model-compatibility matrix: small Hugging Face models of each family on the "
                         "card against CPU eager, run live", _models_arguments, cmd_models),
    "cache": Subcommand("the plan cache: list, inspect, clear, stats", _cache_arguments, cmd_cache),
    "info": Subcommand("the device profile (every figure with its source) and a self-test on the card",
                       _info_arguments, cmd_info),
    "view": Subcommand("draw a trace in the terminal: timeline, per-op table, idle time, critical path",
                       _view_arguments, cmd_view),
    "compare": Subcommand("set two traces (or two run result files) side by side with deltas",
                          _compare_arguments, cmd_compare),
    "merge": Subcommand("merge card traces into a torch.profiler trace: aten ops, launches and card work "
                        "on one timeline", _merge_arguments, cmd_merge),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Profile spyre_rt: run models, view and compare traces.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``spyre-profile``; returns the exit status (0 ok, 1 bad input file, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the error
        return e.code if isinstance(e.code, int) else 2
    console = Console()
    try:
        return args.run(args, console)
    except InputError as e:
        Console(stderr=True).print(f"{PROG}: error: {e}", markup=False, highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `spyre-profile view t.json | head`: stop quietly
        try:  # the interpreter flushes stdout again at exit; make that flush go nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
