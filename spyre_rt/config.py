"""Configuration in one place.

Defaults, overridden by ``SPYRE_RT_*`` environment variables, overridden per compile by
``torch.compile(..., options={...})``. The environment is read once per process through
:func:`settings` (tests and tools may call :func:`reload` after changing it). A compile
resolves its settings once (:func:`with_options`) and its step carries them
(:func:`for_step`): the executor, the plan cache and the tracer read them from the step,
never from the process. The card set's profile and mode are the process's alone
(:data:`PROCESS_FIELDS`), so they are refused as compile options.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .dispatch import NAMES as DISPATCH_MODES  # noqa: F401  (the modes by name; their table: dispatch.MODES)
from .dispatch import check as _check_dispatch

SIM_MODES = ("functional", "timing")
MAX_DEVICES = 64   # cards in one machine, as a device profile's [device] count allows


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spyre_rt", "plans")


@dataclasses.dataclass(frozen=True)
class Settings:
    device_profile: str = "spyre"          # a name in profiles/devices, or a path (a separator or .toml)
    sim_mode: str = "functional"           # functional | timing
    device_count: int = 0                  # cards in the machine; 0: the device profile's [device] count
    dispatch: str = "prebuilt"             # a name in spyre_rt.dispatch.MODES
    cache_dir: str = dataclasses.field(default_factory=_default_cache_dir)
    cache_enabled: bool = True
    cache_max_bytes: int = 2 << 30
    cpu_fallback: bool = True
    compute_dtype: str = "auto"            # auto: each kernel computes in its operands' dtype
    fuse_epilogues: bool = True            # pointwise kernels on a matmul's product as its epilogue
    slice_epilogues: bool = True           # and those whose work depends on a column's place in a
                                           # period (RoPE on a projection's heads), in column slices
    split_gated_gemms: bool = True         # a merged gate-and-up GEMM as two, its activation an epilogue
    fuse_residuals: bool = True            # a residual add of a matmul's product as that matmul's epilogue
    fuse_prologues: bool = True            # a kernel that makes a matmul's A (RMSNorm) as its prologue
    group_matmuls: bool = True             # matmuls of one A cut alike (k and v) computed as one
    bound_causal_masks: bool = True        # an attention whose mask the step proves causal up to a
                                           # bound (a static cache's) skips the blocks past it
    trace: bool = False
    trace_commands: bool = True

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r} (use 1/0, true/false, on/off)")


# What each setting shapes: the step's code (part of its plan key), its calls (carried by
# the step), or the process (the card set that every tensor lives on).
COMPILE_FIELDS = ("dispatch", "cpu_fallback", "compute_dtype", "fuse_epilogues", "slice_epilogues", "split_gated_gemms",
                  "fuse_residuals", "fuse_prologues", "group_matmuls", "bound_causal_masks")
STEP_FIELDS = ("cache_dir", "cache_enabled", "cache_max_bytes", "trace", "trace_commands")
PROCESS_FIELDS = {
    "device_profile": "SPYRE_RT_DEVICE_PROFILE",
    "sim_mode": "SPYRE_RT_SIM_MODE",
    "device_count": "SPYRE_RT_DEVICE_COUNT",
}

ENV = {
    "SPYRE_RT_DEVICE_PROFILE": ("device_profile", str),
    "SPYRE_RT_SIM_MODE": ("sim_mode", str),
    "SPYRE_RT_DEVICE_COUNT": ("device_count", int),
    "SPYRE_RT_DISPATCH": ("dispatch", str),
    "SPYRE_RT_CACHE_DIR": ("cache_dir", str),
    "SPYRE_RT_CACHE": ("cache_enabled", _bool),
    "SPYRE_RT_CACHE_MAX_BYTES": ("cache_max_bytes", int),
    "SPYRE_RT_CPU_FALLBACK": ("cpu_fallback", _bool),
    "SPYRE_RT_COMPUTE_DTYPE": ("compute_dtype", str),
    "SPYRE_RT_FUSE_EPILOGUES": ("fuse_epilogues", _bool),
    "SPYRE_RT_SLICE_EPILOGUES": ("slice_epilogues", _bool),
    "SPYRE_RT_SPLIT_GATED_GEMMS": ("split_gated_gemms", _bool),
    "SPYRE_RT_FUSE_RESIDUALS": ("fuse_residuals", _bool),
    "SPYRE_RT_FUSE_PROLOGUES": ("fuse_prologues", _bool),
    "SPYRE_RT_GROUP_MATMULS": ("group_matmuls", _bool),
    "SPYRE_RT_BOUND_CAUSAL_MASKS": ("bound_causal_masks", _bool),
    "SPYRE_RT_TRACE": ("trace", _bool),
    "SPYRE_RT_TRACE_COMMANDS": ("trace_commands", _bool),
}


def validate(s: Settings) -> Settings:
    if s.sim_mode not in SIM_MODES:
        raise ValueError(f"sim_mode must be one of {SIM_MODES}, not {s.sim_mode!r}")
    _check_dispatch(s.dispatch, "dispatch")
    if not 0 <= s.device_count <= MAX_DEVICES:
        raise ValueError(f"device_count must be 1..{MAX_DEVICES} cards (0: the device profile's count), "
                         f"not {s.device_count}")
    if s.compute_dtype != "auto":
        # no other is implemented: accepting one would change nothing the step computes
        raise ValueError(f"compute_dtype must be auto (kernels compute in their operands' dtype), not "
                         f"{s.compute_dtype!r}: convert the model instead (model.half(), model.float())")
    if s.cache_max_bytes <= 0:
        raise ValueError("cache_max_bytes must be positive")
    # a relative or ~ directory is where the compile (or the process) was when it was resolved
    return s.replace(cache_dir=os.path.abspath(os.path.expanduser(s.cache_dir)))


def from_environment() -> Settings:
    values = {}
    for var, (field, parse) in ENV.items():
        raw = os.environ.get(var)
        if raw is not None and raw != "":
            try:
                values[field] = parse(raw)
            except ValueError as e:
                raise ValueError(f"{var}: {e}") from None
    try:
        return validate(Settings(**values))
    except ValueError as e:  # a value that parsed but is not allowed: name the variables set
        given = ", ".join(var for var, (field, _) in ENV.items() if field in values)
        raise ValueError(f"{given}: {e}") from None


_settings: Settings | None = None


def settings() -> Settings:
    global _settings
    if _settings is None:
        _settings = from_environment()
    return _settings


def reload() -> Settings:
    global _settings
    _settings = None
    return settings()


def with_options(options: dict | None) -> Settings:
    """Settings for one compile: the process settings with ``options`` applied.

    Option names are the field names, with ``-`` or ``_`` accepted
    (e.g. ``{"dispatch": "construct", "cpu_fallback": False}``). The card set's fields are
    refused: a compile cannot change the card its tensors are on."""
    base = settings()
    if not options:
        return base
    fields = {f.name for f in dataclasses.fields(Settings)}
    changes = {}
    for key, value in options.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ValueError(f"unknown spyre_rt option {key!r}; known: {sorted(fields)}")
        if name in PROCESS_FIELDS:
            raise ValueError(
                f"spyre_rt option {key!r} cannot apply to one compile: it is the card set's, which every "
                f"tensor of the process lives on. Set {PROCESS_FIELDS[name]} before the cards are first used, "
                f"or open a card set with spyre_rt.configure({name}=...)")
        changes[name] = value
    return validate(base.replace(**changes))


def step_fields(s: Settings) -> dict:
    """The settings a compiled step carries to its calls, as plain data."""
    return {name: getattr(s, name) for name in STEP_FIELDS}


def for_step(fields: dict | None) -> Settings:
    """The settings of a step that carries `fields` (see :func:`step_fields`); a step made
    without the compiler carries none and takes the process settings, once."""
    base = settings()
    if not fields:
        return base
    return validate(base.replace(**{k: v for k, v in fields.items() if k in STEP_FIELDS}))


def cache_path(s: Settings | None = None) -> Path:
    return Path((s or settings()).cache_dir)
