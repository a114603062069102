"""The private native module and the one place its status codes become exceptions."""

from __future__ import annotations

from . import _native
from .errors import (
    SpyreCollectiveError,
    SpyreDeviceError,
    SpyreDeviceLostError,
    SpyreDMAError,
    SpyreError,
    SpyreIndexError,
    SpyreInvalidCommandError,
    SpyreLayoutError,
    SpyreOutOfMemoryError,
    SpyreProfileError,
)

ffi = _native.ffi
lib = _native.lib

_INVALID = {
    lib.SPY_E_BAD_ADDRESS,
    lib.SPY_E_SCRATCHPAD,
    lib.SPY_E_CYCLE,
    lib.SPY_E_BAD_COMMAND,
    lib.SPY_E_BAD_PROGRAM,
    lib.SPY_E_NOT_COMMITTED,
}


_COLLECTIVE = {lib.SPY_E_CCL_TIMEOUT, lib.SPY_E_CCL_MISMATCH, lib.SPY_E_CCL_PEER}


def last_error() -> tuple[str, int]:
    return ffi.string(lib.spy_last_error()).decode(errors="replace"), int(lib.spy_last_error_command())


def error_for(status: int, context: str = "") -> SpyreError:
    """The typed exception for a failing native status (reads the thread's last error).
    Its ``job`` is the index of the plan job that failed (-1 outside plan launches)."""
    err = _typed_error(status, context)
    err.job = int(lib.spy_last_error_job())
    return err


def _typed_error(status: int, context: str) -> SpyreError:
    message, command = last_error()
    name = ffi.string(lib.spy_status_name(status)).decode()
    text = f"{context}: {message}" if context else message
    if status == lib.SPY_E_OOM:
        return SpyreOutOfMemoryError(text)
    if status in _INVALID:
        return SpyreInvalidCommandError(f"{text} [{name}]", name, command)
    if status == lib.SPY_E_INDEX:
        return SpyreIndexError(text, command)
    if status == lib.SPY_E_DMA:
        return SpyreDMAError(text, name, command)
    if status == lib.SPY_E_DEVICE_LOST:
        return SpyreDeviceLostError(text, name, command)
    if status == lib.SPY_E_COMMAND_FAULT:
        return SpyreDeviceError(text, name, command)
    if status == lib.SPY_E_LAYOUT:
        return SpyreLayoutError(f"{text} [{name}]")
    if status == lib.SPY_E_PROFILE:
        return SpyreProfileError(text)
    if status in _COLLECTIVE:
        return SpyreCollectiveError(f"{text} [{name}]", name)
    return SpyreError(f"{text} [{name}]")


def check(status: int, context: str = "") -> None:
    if status != lib.SPY_OK:
        raise error_for(status, context)
