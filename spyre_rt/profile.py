"""Device profiles: the card's figures, read from ``profiles/devices/*.toml``.

A profile names every figure the cost model uses, each with its unit and source; a
missing or unknown figure is an error naming it. Profiles may declare several identical
cards (``[device] count``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import math
import tomllib
from pathlib import Path
from typing import Any

from .errors import SpyreProfileError

# TOML figure -> (native field, scale to the native unit, must be a whole number?)
FIGURES: dict[str, tuple[str, float, bool]] = {
    "num_cores": ("num_cores", 1, True),
    "corelets_per_core": ("corelets_per_core", 1, True),
    "scratchpad_mib": ("scratchpad_bytes", 1 << 20, False),
    "dram_gib": ("dram_bytes", 1 << 30, False),
    "stick_bytes": ("stick_bytes", 1, True),
    "dram_burst_bytes": ("dram_burst_bytes", 1, True),
    "clock_ghz": ("clock_ghz", 1, False),
    "pt_macs_per_ns": ("pt_macs_per_ns", 1, False),
    "pt_utilization": ("pt_utilization", 1, False),
    "pt_fp32_ratio": ("pt_fp32_ratio", 1, False),
    "pt_gran_m": ("pt_gran_m", 1, True),
    "pt_gran_n": ("pt_gran_n", 1, True),
    "pt_gran_k": ("pt_gran_k", 1, True),
    "pt_latency_ns": ("pt_latency_ns", 1, False),
    "sfu_elems_per_cycle": ("sfu_elems_per_cycle", 1, False),
    "sfu_transcendental_cycles": ("sfu_transcendental_cycles", 1, False),
    "sfu_latency_ns": ("sfu_latency_ns", 1, False),
    "dram_bandwidth_gbps": ("dram_bytes_per_ns", 1, False),  # GB/s == bytes/ns
    "core_dma_gbps": ("core_dma_bytes_per_ns", 1, False),
    "dma_latency_ns": ("dma_latency_ns", 1, False),
    "pcie_bandwidth_gbps": ("pcie_bytes_per_ns", 1, False),
    "pcie_latency_ns": ("pcie_latency_ns", 1, False),
    "pcie_descriptor_ns": ("pcie_descriptor_ns", 1, False),
    "ring_bytes_per_cycle": ("ring_bytes_per_cycle", 1, False),
    "ring_hop_ns": ("ring_hop_ns", 1, False),
    "barrier_ns": ("barrier_ns", 1, False),
    "job_launch_ns": ("job_launch_ns", 1, False),
}
_NATIVE_INTS = {"num_cores", "corelets_per_core", "scratchpad_bytes", "dram_bytes", "stick_bytes",
                "dram_burst_bytes", "pt_gran_m", "pt_gran_n", "pt_gran_k"}
FIGURE_KEYS = {"value", "unit", "kind", "source"}
KINDS = {"public", "derived", "assumption"}


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    kind: str
    source: str


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    count: int
    figures: dict[str, Figure]
    path: str
    digest: str  # sha256 of the file: part of every plan's cache key

    def native_fields(self) -> dict[str, Any]:
        out = {}
        for key, (field, scale, _) in FIGURES.items():
            v = self.figures[key].value * scale
            out[field] = int(round(v)) if field in _NATIVE_INTS else float(v)
        return out

    def __getitem__(self, key: str) -> float:
        return self.figures[key].value

    # convenient derived figures
    @property
    def num_cores(self) -> int:
        return int(self["num_cores"])

    @property
    def scratchpad_bytes(self) -> int:
        return int(self["scratchpad_mib"] * (1 << 20))

    @property
    def dram_bytes(self) -> int:
        return int(self["dram_gib"] * (1 << 30))

    @property
    def stick_bytes(self) -> int:
        return int(self["stick_bytes"])


def _source_text(name_or_path: str) -> tuple[str, str]:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise SpyreProfileError(f"device profile file {name_or_path!r} does not exist")
        return str(p), p.read_text(encoding="utf-8")
    res = importlib.resources.files("spyre_rt.profiles").joinpath("devices", f"{name_or_path}.toml")
    if not res.is_file():
        known = sorted(
            f.name.removesuffix(".toml")
            for f in importlib.resources.files("spyre_rt.profiles").joinpath("devices").iterdir()
            if f.name.endswith(".toml")
        )
        raise SpyreProfileError(f"no device profile named {name_or_path!r}; known: {known}")
    return str(res), res.read_text(encoding="utf-8")


def parse(text: str, path: str = "<string>") -> DeviceProfile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpyreProfileError(f"{path}: not valid TOML: {e}") from None
    unknown_tables = set(doc) - {"device", "figures"}
    if unknown_tables:
        raise SpyreProfileError(f"{path}: unknown table(s) {sorted(unknown_tables)}")
    dev = doc.get("device")
    if not isinstance(dev, dict):
        raise SpyreProfileError(f"{path}: missing [device] table")
    for key in ("name", "count"):
        if key not in dev:
            raise SpyreProfileError(f"{path}: [device] is missing {key!r}")
    unknown = set(dev) - {"name", "description", "count"}
    if unknown:
        raise SpyreProfileError(f"{path}: [device] has unknown key(s) {sorted(unknown)}")
    count = dev["count"]
    if not isinstance(count, int) or not 1 <= count <= 64:
        raise SpyreProfileError(f"{path}: [device] count must be an integer in 1..64, not {count!r}")
    figs = doc.get("figures")
    if not isinstance(figs, dict):
        raise SpyreProfileError(f"{path}: missing [figures] table")
    missing = [k for k in FIGURES if k not in figs]
    if missing:
        raise SpyreProfileError(f"{path}: missing figure(s) {missing}")
    unknown = [k for k in figs if k not in FIGURES]
    if unknown:
        raise SpyreProfileError(f"{path}: unknown figure(s) {unknown}")
    figures = {}
    for key, entry in figs.items():
        if not isinstance(entry, dict):
            raise SpyreProfileError(f"{path}: figure {key!r} must be a table with value, unit, kind, source")
        extra = set(entry) - FIGURE_KEYS
        lacking = FIGURE_KEYS - set(entry)
        if extra or lacking:
            raise SpyreProfileError(
                f"{path}: figure {key!r}: missing {sorted(lacking)} / unknown {sorted(extra)} keys"
            )
        value = entry["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpyreProfileError(f"{path}: figure {key!r} value must be a number, not {value!r}")
        _, scale, whole = FIGURES[key]
        if whole and (not float(value).is_integer() or value <= 0):
            raise SpyreProfileError(f"{path}: figure {key!r} must be a positive integer, not {value!r}")
        if value < 0:
            raise SpyreProfileError(f"{path}: figure {key!r} must not be negative, not {value!r}")
        if scale > 1 and not float(value * scale).is_integer():
            raise SpyreProfileError(f"{path}: figure {key!r} must be a whole number of bytes")
        if entry["kind"] not in KINDS:
            raise SpyreProfileError(f"{path}: figure {key!r} kind must be one of {sorted(KINDS)}")
        if not str(entry["source"]).strip():
            raise SpyreProfileError(f"{path}: figure {key!r} needs a source")
        figures[key] = Figure(key, float(value), str(entry["unit"]), entry["kind"], str(entry["source"]))
    return DeviceProfile(
        name=str(dev["name"]),
        description=str(dev.get("description", "")),
        count=count,
        figures=figures,
        path=path,
        digest=hashlib.sha256(text.encode()).hexdigest(),
    )


def load(name_or_path: str) -> DeviceProfile:
    """Load a device profile by name (``profiles/devices/<name>.toml``) or path."""
    path, text = _source_text(name_or_path)
    return parse(text, path)
