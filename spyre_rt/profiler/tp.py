"""``spyre-profile run MODEL --tp N``: the model sharded over N cards, against one card.

The run is made twice: on one card (as ``run`` makes it), then on N cards, one process
per card as ``torchrun`` starts them (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, the store on 127.0.0.1), in a ``spyreccl`` group. Each rank builds the
model on the meta device, shards it with Hugging Face's tensor-parallel plan
(``apply_tensor_parallelism`` on a ``"spyre"`` device mesh: attention heads and MLP columns
split, an all-reduce after each row-parallel projection, the LM head gathered), compiles
it and measures the same modes; its collectives are jobs of its plans. A phase of the
sharded model lasts what its slowest card takes.

On a machine with fewer cores than ranks the ranks share the cores: they compile a few at
a time (one per core: a rank holds a lock file while Dynamo compiles, so N compiles do not
fight for the cores and the memory at once), and a rank waiting for its peers in a
collective naps instead of spinning (native/ccl.c). Host figures are CPU time of each
rank's thread, which the sharing does not move; timing mode moves no data.

The report gives each mode's prefill and decode latency on one card and on N, the speedup,
an ideal-sharding estimate beside it (the one-card time divided by N, plus the time the
interconnect model gives the step's collectives: T1 / (T1/N + collectives)), and the share
of the time in collectives. The ranks' traces are merged into one, a track per card.
"""

from __future__ import annotations

import dataclasses
import fcntl
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from ..errors import SpyreError
from . import run as runmod

RANK_TIMEOUT = timedelta(minutes=30)  # a collective waits this long for a rank still compiling


# ---- a rank ----------------------------------------------------------------------------


def _compile_in_turn(lock_dir: str, local_rank: int, slots: int) -> None:
    """While Dynamo compiles, hold lock file ``local_rank % slots``: at most `slots` ranks
    compile at once."""
    from torch._dynamo.callback import callback_handler

    lock = open(os.path.join(lock_dir, f"compile-{local_rank % slots}.lock"), "a+")  # noqa: SIM115 (the rank's life)
    callback_handler.register_start_callback(lambda _: fcntl.flock(lock, fcntl.LOCK_EX))
    callback_handler.register_end_callback(lambda _: fcntl.flock(lock, fcntl.LOCK_UN))


def rank_main(argv: list[str]) -> int:
    """``python -m spyre_rt.profiler.tp OPTIONS_JSON OUT_DIR SLOTS``: one rank's run."""
    import torch.distributed as dist

    import spyre_rt.distributed  # noqa: F401  (registers spyreccl)

    options, out_dir, slots = json.loads(argv[0]), argv[1], int(argv[2])
    opts = runmod.Options(**{**options, "modes": tuple(options["modes"])})
    rank = int(os.environ["RANK"])
    dist.init_process_group(backend="cpu:gloo,spyre:spyreccl", timeout=RANK_TIMEOUT)
    _compile_in_turn(out_dir, int(os.environ["LOCAL_RANK"]), slots)
    if opts.trace:
        opts = dataclasses.replace(opts, trace=os.path.join(out_dir, f"rank{rank}.trace.json"))
    from rich.console import Console

    quiet = Console(file=io.StringIO())
    out = runmod.measure(opts, quiet)
    runmod.write_json(out, os.path.join(out_dir, f"rank{rank}.json"))
    dist.destroy_process_group()
    return 0


# ---- the launcher ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_profile(cards: int, directory: str) -> str:
    """A copy of the configured device profile declaring `cards` cards (one per rank)."""
    from .. import config
    from .. import device_profile as profiles

    found = profiles.read_profile(config.settings().device_profile, "devices")
    if found is None:
        raise SpyreError(f"no device profile {config.settings().device_profile!r}")
    text, n = re.subn(r"(?m)^count\s*=\s*\d+", f"count = {cards}", found[1], count=1)
    if not n:
        raise SpyreError(f"{found[0]}: the device profile declares no [device] count")
    path = os.path.join(directory, "device.toml")
    Path(path).write_text(text)
    return path


# a line of a rank's log that names an exception: "[rank1]: NotImplementedError: ..."
_RAISED = re.compile(r"^(\[rank\d+\]: )?([\w.]+(Error|Exception|Failed)|\w+Interrupt)\b")


def _failure(lines: list[str], tail: int = 15) -> str:
    """What a failed rank's log says: the exceptions it names (torch's compile errors end in
    many lines of advice), then its last lines."""
    named = [line for line in lines[:-tail] if _RAISED.match(line)]
    return "".join(named[-3:] + (["...\n"] if named else []) + lines[-tail:])


def launch(opts: runmod.Options, console) -> list[dict]:
    """Run `opts.tp` ranks, a process each, and return each rank's results."""
    tp = opts.tp
    slots = max(1, len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory(prefix="spyre-tp-") as tmp:
        env = dict(os.environ, WORLD_SIZE=str(tp), LOCAL_WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()), SPYRE_RT_DEVICE_PROFILE=_device_profile(tp, tmp),
                   OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
        options = json.dumps(dataclasses.asdict(dataclasses.replace(opts, py_spy=None, whatif_plot=None)))
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(tp)]  # noqa: SIM115
        procs = [subprocess.Popen([sys.executable, "-m", "spyre_rt.profiler.tp", options, tmp, str(slots)],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=logs[r],
                                  stderr=subprocess.STDOUT)
                 for r in range(tp)]
        console.print(f"[dim]{opts.model} on {tp} card{'s' if tp > 1 else ''}: a process per card, "
                      f"{min(slots, tp)} compiling at a time[/]")
        try:
            failed = _wait(procs)
        except BaseException:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            raise
        if failed is not None:
            logs[failed].seek(0)
            tail = _failure(logs[failed].readlines())
            raise SpyreError(f"rank {failed} of the --tp {tp} run failed (exit {procs[failed].returncode}):\n{tail}")
        outs = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(tp)]
        if opts.trace:
            from .. import trace
            from ..trace import merge

            merged = merge.merge_ranks([merge.read(os.path.join(tmp, f"rank{r}.trace.json")) for r in range(tp)])
            trace.write(merged, opts.trace)
        for f in logs:
            f.close()
    return outs


def _wait(procs: list[subprocess.Popen]) -> int | None:
    """Wait for every rank; the first that fails stops the others. Its index, or None."""
    while True:
        codes = [p.poll() for p in procs]
        bad = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if bad is not None:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait()
            return bad
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.2)


def measure(opts: runmod.Options, sizes: tuple[int, ...], console) -> dict:
    """The one-card run, then a run on each number of cards in `sizes`; the figures of each
    against one card. With several sizes a trace file gets the size in its name."""
    # in a process of its own as the ranks are: this one stays small while they run
    one = launch(dataclasses.replace(opts, tp=1, trace=None), console)[0]
    runs = []
    for tp in sizes:
        trace = opts.trace
        if trace and len(sizes) > 1:
            root, ext = os.path.splitext(trace)
            if ext == ".gz":
                root, inner = os.path.splitext(root)
                ext = inner + ext
            trace = f"{root}-tp{tp}{ext}"
        ranks = launch(dataclasses.replace(opts, tp=tp, trace=trace), console)
        runs.append({**combine(one, ranks), "trace": trace})
    return {"format": runmod.FORMAT, "one_card": one, "tp": [r["tp"] for r in runs], "runs": runs}


def combine(one: dict, ranks: list[dict]) -> dict:
    """Per mode and phase: the one-card latency, the sharded one (its slowest card), the
    speedup and the ideal-sharding estimate; the share of time in collectives."""
    tp = len(ranks)
    results, speedups, ideal = {}, {}, {}
    coll = {phase: max(r["collectives"].get(phase, {}).get("ms", 0.0) for r in ranks) for phase in runmod.PHASES}
    for mode in ranks[0]["results"]:
        results[mode] = {key: max(r["results"][mode][key] for r in ranks) for key in runmod.KEYS.values()}
        base = one["results"].get(mode)
        if base is None:
            continue
        speedups[mode] = {phase: base[key] / results[mode][key] for phase, key in runmod.KEYS.items()}
        # a decode phase's collectives were counted for one token; a prefill's for the prompt
        ideal[mode] = {phase: base[key] / (base[key] / tp + coll[phase]) for phase, key in runmod.KEYS.items()}
    share = {phase: max(r["collectives"].get(phase, {}).get("share", 0.0) for r in ranks) for phase in runmod.PHASES}
    return {
        "tp": tp, "results": results, "speedups": speedups, "ideal": ideal,
        "collectives": {phase: {"ms": coll[phase], "share": share[phase]} for phase in runmod.PHASES},
        "ranks": ranks,
    }


def render(console, out: dict) -> None:
    """A row per mode and number of cards: prefill and decode latency, the speedup over one
    card and the ideal-sharding estimate beside it, the share of time in collectives."""
    from rich import box
    from rich.table import Table

    one = out["one_card"]
    t = Table(title=f"{one['model']} ({one['layers']} layers, {one['dtype']}), batch {one['batch']}, sequence "
                    f"{one['seq']}: tensor parallel against one card — {one['device_profile']}, {one['sim_mode']} "
                    f"mode; the slowest card of each run", title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, padding=(0, 0), caption=runmod.clock_label(one), caption_justify="left",
              caption_style="dim")
    for col in ("mode", "cards", "prefill ms", "speedup", "ideal", "decode ms/tok", "speedup", "ideal",
                "in collectives pre/dec"):
        t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=col == "mode")
    for mode, r in one["results"].items():
        t.add_row(mode, "1", runmod.ms_text(r["prefill_ms"]), "", "", runmod.ms_text(r["decode_ms_per_token"]), "", "", "")
        for run in out["runs"]:
            if mode not in run["results"]:
                continue
            x, sp, ideal, c = run["results"][mode], run["speedups"][mode], run["ideal"][mode], run["collectives"]
            t.add_row("", str(run["tp"]), runmod.ms_text(x["prefill_ms"]), f"{sp['prefill']:.2f}x",
                      f"{ideal['prefill']:.2f}x", runmod.ms_text(x["decode_ms_per_token"]), f"{sp['decode']:.2f}x",
                      f"{ideal['decode']:.2f}x",
                      f"{c['prefill']['share'] * 100:.1f} / {c['decode']['share'] * 100:.1f} %")
    console.print(t)
    console.print("[dim]ideal: one card's latency / N + the time the interconnect model gives the step's "
                  "collectives; in collectives: their share of a prefill and of a decode token (prebuilt plans). "
                  "Each run on N cards is N processes on this machine, one card each, in a spyreccl group "
                  f"(its shared-memory ring), compiling {max(1, len(os.sched_getaffinity(0)))} at a time[/]")


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
