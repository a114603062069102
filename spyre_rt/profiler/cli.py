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

from rich.console import Console

from . import compare, view

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


def _view_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a trace file (Chrome trace-event JSON written by spyre_rt.trace)")
    p.add_argument("--window", type=parse_window, metavar="START:END",
                   help="the time window to show, in µs from the trace's first event (default: all)")
    p.add_argument("--top", type=positive_int, default=20, metavar="N",
                   help="ops in the summary table (default 20)")


def _load_trace(path: str) -> view.TraceData:
    return _load(path, results=False)[1]


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
    win = view.window(data, *args.window) if args.window else None
    view.render(console, data, win, args.top, title=os.path.basename(args.trace))
    return 0


# ---- compare -------------------------------------------------------------------------------


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A",
                   help="the baseline: a trace, or a `spyre-profile run --json` result file")
    p.add_argument("b", metavar="B", help="the file to compare with it (of the same kind)")
    p.add_argument("--json", action="store_true",
                   help="read A and B as result files of `spyre-profile run --json` (default: by content)")
    p.add_argument("--top", type=positive_int, default=20, metavar="N",
                   help="ops in the per-op table (default 20)")


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    forced = True if args.json else None
    kind_a, a = _load(args.a, forced)
    kind_b, b = _load(args.b, forced)
    if kind_a != kind_b:
        raise InputError(f"cannot compare a {kind_a} file ({args.a}) with a {kind_b} file ({args.b})")
    la, lb = os.path.basename(args.a), os.path.basename(args.b)
    if la == lb:
        la, lb = args.a, args.b
    cmp = compare.compare_traces(a, b, la, lb) if kind_a == "trace" else compare.compare_results(a, b, la, lb)
    compare.render(console, cmp, args.top)
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


def cmd_cache(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

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
            if k != "updated":
                t.add_row(k, f"{v:,}")
        console.print(t)
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
        t.add_row(k, json.dumps(v) if not isinstance(v, str) else v)
    console.print(t)
    return 0


# ---- the command ---------------------------------------------------------------------------

COMMANDS: dict[str, Subcommand] = {
    "cache": Subcommand("the plan cache: list, inspect, clear, stats", _cache_arguments, cmd_cache),
    "info": Subcommand("the device profile (every figure with its source) and a self-test on the card",
                       _info_arguments, cmd_info),
    "view": Subcommand("draw a trace in the terminal: timeline, per-op table, idle time, critical path",
                       _view_arguments, cmd_view),
    "compare": Subcommand("set two traces (or two run result files) side by side with deltas",
                          _compare_arguments, cmd_compare),
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
