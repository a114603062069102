"""The model-compatibility matrix: a row per family, measured live, drawn as a table.

Each row is one family (:mod:`.models`) run by :mod:`.parity` in each dtype, compiled once
and run in each dispatch mode: its status (``ok``; ``falls back``: some ops ran on the CPU;
``fails``: a compile error, an error at run time, dispatch modes that disagree, or outputs
beyond the tolerance), the kernels of a step, the ops run on the CPU per step and their share
of the step's time, the largest
difference from CPU eager in fp32 per dtype, and the compile time. ``spyre-profile
models`` prints it; the README carries its output.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import card as cards
from .models import DECODER, SEQ2SEQ, Family
from .parity import (
    DECODE_STEPS,
    DTYPES,
    ENCODER_BATCH,
    ENCODER_SEQ,
    FP16_FLOOR,
    FP16_SLACK,
    FP32_ATOL,
    MODES,
    PROMPT_LEN,
    compare,
    reference,
)

# ---- the matrix -----------------------------------------------------------------------------

OK, FALLS_BACK, FAILS = "ok", "falls back", "fails"
FORMAT = 1  # of the JSON `spyre-profile models --json` writes


@dataclass
class Row:
    """One family's line of the matrix."""

    family: str
    kind: str
    status: str = OK                                   # OK, FALLS_BACK or FAILS
    reason: str = ""                                   # why it fails: the first line of the error
    kernels: dict[str, int] = field(default_factory=dict)             # phase -> kernels per step
    cpu_ops: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> op -> CPU calls per step
    cpu_share: dict[str, float] = field(default_factory=dict)  # phase -> the CPU's share of its time
    error: dict[str, float] = field(default_factory=dict)       # dtype -> worst difference from fp32 CPU eager
    tolerance: dict[str, float] = field(default_factory=dict)   # dtype -> its tolerance
    compile_s: dict[str, float] = field(default_factory=dict)   # dtype -> compile time of its graphs
    distinct_tokens: int | None = None                 # of the reference's greedy decode
    seconds: float = 0.0                               # the whole row's measurement

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def measure(fam: Family, dtypes: tuple[str, ...] = tuple(DTYPES), modes: tuple[str, ...] = MODES) -> Row:
    """One family's row: every dtype compared in every mode. A failure (a compile error, a
    wrong number) is recorded in the row, never raised."""
    t0 = time.perf_counter()
    row = Row(fam.name, fam.kind)
    try:
        _measure(row, fam, dtypes, modes)
    finally:
        row.seconds = time.perf_counter() - t0
    return row


def _measure(row: Row, fam: Family, dtypes: tuple[str, ...], modes: tuple[str, ...]) -> None:
    try:
        ref = reference(fam)
    except Exception as e:  # the CPU itself cannot run it: the config's fault, not the card's
        row.status, row.reason = FAILS, f"on the CPU: {first_line(e)}"
        return
    if fam.kind in (DECODER, SEQ2SEQ):
        row.distinct_tokens = len(set(ref.tokens))
    for dname in dtypes:
        try:
            c = compare(fam, dname, modes, ref)
        except Exception as e:
            _fail(row, f"{dname}: {first_line(e)}")
            continue
        row.kernels = row.kernels or c.census.kernels
        for phase, share in c.census.cpu_share.items():
            row.cpu_share[phase] = max(row.cpu_share.get(phase, 0.0), share)
        for phase, ops in c.census.cpu_ops.items():
            mine = row.cpu_ops.setdefault(phase, {})
            for op, n in ops.items():
                mine[op] = max(mine.get(op, 0), n)
        row.compile_s[dname] = c.compile_s
        row.error[dname], row.tolerance[dname] = c.error(), c.tolerance()
        if not c.modes_agree():
            _fail(row, f"{dname}: the dispatch modes' outputs differ")
        elif not row.error[dname] <= row.tolerance[dname]:
            _fail(row, f"{dname}: off by {row.error[dname]:.3g} (tolerance {row.tolerance[dname]:.3g})")
    if row.status == OK and any(row.cpu_ops.values()):
        row.status = FALLS_BACK


def run_live(families: list[Family], dtypes: tuple[str, ...], modes: tuple[str, ...], console) -> tuple[list[Row], dict]:
    """The rows of `families` as ``spyre-profile models`` measures them: on functional
    cards of their own, every graph compiled afresh (Inductor's FX graph and AOT caches
    off, so that compile times are cold and no compile is answered from a cache), the
    libraries' warnings held back (the rows say what fell back). Also the host."""
    import warnings

    import torch._functorch.config
    import torch._inductor.config
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers.utils import logging as hf_logging

    from . import host

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with (progress, warnings.catch_warnings(), cards.configured(sim_mode="functional"),
              torch._inductor.config.patch(fx_graph_cache=False),
              torch._functorch.config.patch(enable_autograd_cache=False)):
            warnings.simplefilter("ignore")
            task = progress.add_task("", total=len(families))

            def step(fam: Family) -> None:
                progress.update(task, description=f"{fam.name} ({', '.join(dtypes)})", advance=0)

            rows = []
            for fam in families:
                step(fam)
                rows.append(measure(fam, dtypes, modes))
                progress.advance(task)
    finally:
        hf_logging.set_verbosity(verbosity)
    return rows, host.describe()


def _fail(row: Row, reason: str) -> None:
    if row.status != FAILS:  # the first failure is the reason
        row.status, row.reason = FAILS, reason


# ---- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    header: str                      # lines split by "\n"
    cell: Callable[[Row], str]
    keep: int                        # the higher, the longer the column stays when space runs out


def _short_op(name: str) -> str:
    """``aten.gather.default`` -> ``gather``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims") else name


def _cpu_ops_cell(row: Row) -> str:
    """Ops that ran on the CPU, with their calls per step (the decode step's, for a decoder)."""
    step = row.cpu_ops.get("decode") or row.cpu_ops.get("forward") or row.cpu_ops.get("prefill") or {}
    every = {op for ops in row.cpu_ops.values() for op in ops}
    return "\n".join(f"{_short_op(op)} ×{step.get(op, 0)}" for op in sorted(every))


def _kernels_cell(row: Row) -> str:
    k = row.kernels
    return "/".join(str(k[p]) for p in ("prefill", "decode", "forward") if p in k)


def _cpu_share_cell(row: Row) -> str:
    """The CPU's share of a step's time, prefill/decode (encoders: forward), in percent."""
    shares = [row.cpu_share[p] for p in ("prefill", "decode", "forward") if p in row.cpu_share]
    return "/".join(f"{100 * x:.0f}" for x in shares) + " %" if shares else ""


def _error_cell(dname: str) -> Callable[[Row], str]:
    def cell(row: Row) -> str:
        e = row.error.get(dname)
        if e is None:
            return ""
        return "—" if e != e else f"{e:.1e}"  # NaN: the dtype failed
    return cell


def _compile_cell(row: Row) -> str:
    return f"{max(row.compile_s.values()):.1f}" if row.compile_s else ""


def _status_cell(notes: dict[str, int]) -> Callable[[Row], str]:
    def cell(row: Row) -> str:
        return f"{row.status} [{notes[row.family]}]" if row.family in notes else row.status
    return cell


def columns(dtypes: tuple[str, ...], notes: dict[str, int]) -> list[Column]:
    cols = [Column("status", _status_cell(notes), 10),
            Column("kernels\nper step", _kernels_cell, 8),
            Column("on the CPU\n(per step)", _cpu_ops_cell, 9),
            Column("CPU share\nof a step", _cpu_share_cell, 8)]
    cols += [Column(f"{d} max\n|Δ|", _error_cell(d), 7) for d in dtypes]
    cols += [Column(f"{d}\ntolerance", lambda r, d=d: f"{r.tolerance[d]:.1e}" if d in r.tolerance else "", 4)
             for d in dtypes if d != "fp32"]
    cols.append(Column("compile\ns", _compile_cell, 5))
    return cols


def table(rows: list[Row], dtypes: tuple[str, ...], width: int, caption: str | None = None):
    """The matrix drawn to fit `width` columns: the family column keeps its width and the
    other columns give way, least telling first (see :func:`optable.fit_columns`). Why a
    family fails is a numbered note below the table."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from .optable import ellipsize, fit_columns

    failing = [r for r in rows if r.status == FAILS]
    notes = {r.family: k + 1 for k, r in enumerate(failing)}
    cols = columns(dtypes, notes)
    cells = [[c.cell(r) for c in cols] for r in rows]
    shown, name_w = fit_columns([r.family for r in rows] + ["family"], cells, width, cols)
    t = Table(title="model compatibility", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
              pad_edge=False, padding=(0, 1), caption=caption, caption_justify="left", caption_style="dim")
    t.add_column("family", width=name_w, no_wrap=True, overflow="crop")
    for i in shown:
        t.add_column(cols[i].header, justify="left" if i in (0, 2) else "right", no_wrap=True)
    for r, c in zip(rows, cells, strict=True):
        style = {OK: "", FALLS_BACK: "yellow", FAILS: "red"}[r.status]
        t.add_row(Text(ellipsize(r.family, name_w)), *(Text(c[i], style=style if i == 0 else "") for i in shown))
    return t, [f"[{notes[r.family]}] {r.family}: {r.reason}" for r in failing]


def caption(dtypes: tuple[str, ...], modes: tuple[str, ...], host_line: str) -> str:
    what = (f"decoders: a prefill of {PROMPT_LEN} tokens and {DECODE_STEPS} greedy decode steps (static "
            f"cache); encoders: hidden states of {ENCODER_BATCH} sequences of {ENCODER_SEQ}, one padded; "
            f"encoder-decoders: generate() of {DECODE_STEPS + 1} tokens (automatic dynamic shapes). "
            f"Compiled once, run in {', '.join(modes)}; |Δ|: the largest difference from CPU eager in fp32 "
            f"(fp32 tolerance {FP32_ATOL:g}")
    if any(d != "fp32" for d in dtypes):
        what += (f"; fp16: {FP16_SLACK:g}× CPU eager fp16's own |Δ| + {FP16_FLOOR:g}× the largest fp32 "
                 "output")
    return (what + "). kernels per step: prefill/decode (encoders: forward; encoder-decoders: the first step and "
            "the last). compile: Dynamo, AOT and Inductor seconds of the family's prefill and decode graphs (the "
            "slower dtype's). CPU share: of a step's time (prefill/decode), the share spent on the CPU running ops "
            "the card has no kernel for (the op and its copies, host clock) against that plus the card's jobs. "
            + host_line)


def host_line(h: dict) -> str:
    load = f", load {h['load_1m']:.1f}" if h.get("load_1m") is not None else ""
    return f"host: {h['cpu']} ({h['cores']} cores{load}), torch {h['torch']}."


def render(console, rows: list[Row], dtypes: tuple[str, ...], modes: tuple[str, ...], host: dict) -> None:
    t, notes = table(rows, dtypes, console.width, caption(dtypes, modes, host_line(host)))
    console.print(t)
    for note in notes:
        console.print(note, markup=False, highlight=False)
