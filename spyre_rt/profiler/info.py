"""``spyre-profile info``: the device profile, and a self-test on the card."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from .. import card as cards
from . import roofline


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    device_us: float
    host_us: float


def profile_table(cs: cards.CardSet) -> Table:
    p = cs.profile
    t = Table(title=f"{p.name}: {p.description}", caption=f"{p.path} · {p.count} card(s) · {cs.sim_mode} mode",
              title_justify="left", caption_justify="left", expand=False)
    t.add_column("figure", style="bold")
    t.add_column("value", justify="right")
    t.add_column("unit")
    t.add_column("kind")
    t.add_column("source", overflow="fold", max_width=70)
    kind_style = {"public": "green", "derived": "cyan", "assumption": "yellow"}
    for f in p.figures.values():
        value = f"{f.value:g}"
        t.add_row(f.name, value, f.unit, f"[{kind_style[f.kind]}]{f.kind}[/]", f.source)
    assumed = [f.name for f in p.figures.values() if f.kind == "assumption"]
    roof = roofline.assumptions(p)
    t.caption += (f"\n{len(assumed)} of {len(p.figures)} figures are assumptions (not published; the source "
                  f"column gives the reasoning): {', '.join(assumed)}")
    if roof:
        t.caption += f"\nthe roofline rests on assumptions: {', '.join(roof)}"
    return t


def _measure(card: cards.Card, fn) -> tuple[object, float, float]:
    """Run fn; return its result, the device time it caused and the host time (µs)."""
    card.synchronize()
    busy0, host0 = card.counters()["device_busy_ns"], card.host_clock_ns()
    out = fn()
    card.synchronize()
    busy1, host1 = card.counters()["device_busy_ns"], card.host_clock_ns()
    return out, (busy1 - busy0) / 1e3, (host1 - host0) / 1e3


def self_test(index: int = 0) -> list[Check]:
    card = cards.get(index)
    dev = torch.device("spyre", index)
    checks = []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 300, generator=g).to(torch.float16)
    if card.functional:
        back, d_us, h_us = _measure(card, lambda: x.to(dev).cpu())
        ok = torch.equal(back.view(torch.int16), x.view(torch.int16))
        checks.append(Check("round trip fp16 128x300", ok, "bit-exact" if ok else "values differ", d_us, h_us))
    else:
        _, d_us, h_us = _measure(card, lambda: x.to(dev))
        checks.append(Check("host->device fp16 128x300", True, "timing mode: time only", d_us, h_us))
    a = torch.randn(256, 512, generator=g).to(torch.float16)
    b = torch.randn(512, 256, generator=g).to(torch.float16)
    mm = torch.compile(lambda p, q: p @ q, backend="spyre_rt", dynamic=False)
    da, db = a.to(dev), b.to(dev)
    t0 = time.perf_counter()
    out = mm(da, db)  # compiles
    compile_s = time.perf_counter() - t0
    out, d_us, h_us = _measure(card, lambda: mm(da, db))
    if card.functional:
        ref = a.float() @ b.float()
        err = ((out.cpu().float() - ref).abs().max() / ref.abs().max()).item()
        ok = err < 2e-3
        detail = f"max error {err:.1e} of the largest value (fp16 output); compiled in {compile_s:.1f} s"
    else:
        ok, detail = True, f"timing mode: time only; compiled in {compile_s:.1f} s"
    checks.append(Check("matmul fp16 256x512x256", ok, detail, d_us, h_us))
    return checks


def render(console: Console, index: int = 0) -> int:
    cs = cards.card_set()
    console.print(profile_table(cs))
    t = Table(title="self-test on the card", title_justify="left")
    for col in ("check", "result", "device µs", "host µs (CPU)", "detail"):
        t.add_column(col, justify="right" if "µs" in col else "left")
    checks = self_test(index)
    for c in checks:
        t.add_row(c.name, "[green]pass[/]" if c.ok else "[red]FAIL[/]", f"{c.device_us:,.1f}",
                  f"{c.host_us:,.1f}", c.detail)
    console.print(t)
    return 0 if all(c.ok for c in checks) else 1
