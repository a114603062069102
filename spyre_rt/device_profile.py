"""Device profiles: the card's figures, read from ``profiles/devices/*.toml``.

A profile names every figure the cost model uses, each with its unit and source; a
missing or unknown figure is an error naming it. Which figures there are, with their
native fields, units and scales, is the card's declaration (``SPY_PROFILE_FIGURES`` in
native/spyre.h). Profiles may declare several identical cards (``[device] count``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import math
import os
import tomllib
from pathlib import Path
from typing import Any

from .errors import SpyreProfileError
from .native import check, ffi, lib


def _declared_figures() -> list:
    """The figures the card declares (SPY_PROFILE_FIGURES in native/spyre.h)."""
    table, n = ffi.new("const spy_figure **"), ffi.new("uint32_t *")
    check(lib.spy_profile_figures(table, n), "reading the declared profile figures")
    return [table[0][i] for i in range(n[0])]


_DECLARED = _declared_figures()
# TOML figure -> (native field, scale to the native unit, must be a whole number?)
FIGURES: dict[str, tuple[str, float, bool]] = {
    ffi.string(f.key).decode(): (ffi.string(f.field).decode(), float(f.scale),
                                 f.type != lib.SPY_FIGURE_F64 and f.scale == 1)
    for f in _DECLARED
}
# TOML figure -> the unit its value is in (what the scale above converts from)
UNITS: dict[str, str] = {ffi.string(f.key).decode(): ffi.string(f.unit).decode() for f in _DECLARED}
_NATIVE_INTS = {ffi.string(f.field).decode() for f in _DECLARED if f.type != lib.SPY_FIGURE_F64}
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
    # [interconnect]: the links between the cards of one machine (spyre_rt.distributed.interconnect)
    interconnect: dict[str, Figure] = dataclasses.field(default_factory=dict)

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


def is_path(name_or_path: str | os.PathLike[str]) -> bool:
    """Whether a profile argument names a file: a path object, or a string with a directory
    separator or the ``.toml`` suffix. Anything else is the name of a profile shipped in the
    package (``profiles/<kind>/<name>.toml``), whatever the working directory holds: a
    directory called ``spyre`` there is not the ``spyre`` profile."""
    if isinstance(name_or_path, os.PathLike):
        return True
    s = str(name_or_path)
    return s.endswith(".toml") or os.sep in s or (os.altsep is not None and os.altsep in s)


def read_profile(name_or_path: str | os.PathLike[str], kind: str) -> tuple[str, str] | None:
    """(path, text) of a `kind` profile ("devices", "models") named or given by path; None
    when no shipped profile has that name. A path that is not a file is an error."""
    if is_path(name_or_path):
        p = Path(name_or_path).expanduser()
        if not p.is_file():
            raise SpyreProfileError(f"{kind.removesuffix('s')} profile file {str(name_or_path)!r} does not exist")
        return str(p), p.read_text(encoding="utf-8")
    res = importlib.resources.files("spyre_rt.profiles").joinpath(kind, f"{name_or_path}.toml")
    if not res.is_file():
        return None
    return str(res), res.read_text(encoding="utf-8")


def known(kind: str) -> list[str]:
    """The names of the shipped `kind` profiles."""
    d = importlib.resources.files("spyre_rt.profiles").joinpath(kind)
    return sorted(f.name.removesuffix(".toml") for f in d.iterdir() if f.name.endswith(".toml"))


def _source_text(name_or_path: str) -> tuple[str, str]:
    found = read_profile(name_or_path, "devices")
    if found is None:
        raise SpyreProfileError(
            f"no device profile named {name_or_path!r}; known: {known('devices')} (a file is "
            "given by a path with a directory separator or a .toml suffix, e.g. ./mine.toml)")
    return found


def parse(text: str, path: str = "<string>") -> DeviceProfile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpyreProfileError(f"{path}: not valid TOML: {e}") from None
    unknown_tables = set(doc) - {"device", "figures", "interconnect"}
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
    links = doc.get("interconnect", {})
    if not isinstance(links, dict):
        raise SpyreProfileError(f"{path}: [interconnect] must be a table")
    interconnect = {}
    for key, entry in links.items():
        if key not in INTERCONNECT:
            raise SpyreProfileError(f"{path}: unknown interconnect figure {key!r}; known: {sorted(INTERCONNECT)}")
        if not isinstance(entry, dict) or set(entry) != FIGURE_KEYS:
            raise SpyreProfileError(f"{path}: interconnect figure {key!r} must be a table with value, unit, kind, source")
        value = entry["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise SpyreProfileError(f"{path}: interconnect figure {key!r} must be a positive number, not {value!r}")
        if entry["kind"] not in KINDS or not str(entry["source"]).strip():
            raise SpyreProfileError(f"{path}: interconnect figure {key!r} needs a kind in {sorted(KINDS)} and a source")
        interconnect[key] = Figure(key, float(value), str(entry["unit"]), entry["kind"], str(entry["source"]))
    return DeviceProfile(
        name=str(dev["name"]),
        description=str(dev.get("description", "")),
        count=count,
        figures=figures,
        path=path,
        digest=hashlib.sha256(text.encode()).hexdigest(),
        interconnect=interconnect,
    )


# The figures an [interconnect] table may give (all optional; a profile without them has
# no model of collectives' time): name -> unit.
INTERCONNECT = {"p2p_bandwidth_gbps": "GB/s", "p2p_latency_ns": "ns", "network_bandwidth_gbps": "GB/s",
                "network_latency_ns": "ns"}


def load(name_or_path: str) -> DeviceProfile:
    """Load a device profile by name (``profiles/devices/<name>.toml``) or path."""
    path, text = _source_text(name_or_path)
    return parse(text, path)
