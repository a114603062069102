"""What Dynamo and Inductor ask of the device: properties, current device, streams."""

from __future__ import annotations

import torch
from torch._dynamo.device_interface import DeviceInterface
from torch._inductor.codegen.common import DeviceOpOverrides

from spyre_rt import streams


def _props(device=None):
    return torch.spyre.get_device_properties(device)


class SpyreInterface(DeviceInterface):
    # the card's streams and events: torch.Stream / torch.Event subclasses, as Dynamo asks
    Event = streams.Event
    Stream = streams.Stream

    class Worker:
        @staticmethod
        def set_device(device: int) -> None:
            torch.spyre.set_device(device)

        @staticmethod
        def current_device() -> int:
            return torch.spyre.current_device()

        @staticmethod
        def get_device_properties(device=None):
            return _props(device)

    @staticmethod
    def current_device() -> int:
        return torch.spyre.current_device()

    @staticmethod
    def set_device(device) -> None:
        torch.spyre.set_device(device)

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        prev = torch.spyre.current_device()
        torch.spyre.set_device(device)
        return prev

    @staticmethod
    def exchange_device(device: int) -> int:
        return SpyreInterface.maybe_exchange_device(device)

    @staticmethod
    def device_count() -> int:
        return torch.spyre.device_count()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def synchronize(device=None) -> None:
        torch.spyre.synchronize(device)

    @staticmethod
    def stream(stream):
        return streams.stream(stream)

    @staticmethod
    def current_stream():
        return streams.current_stream()

    @staticmethod
    def set_stream(stream) -> None:
        streams.set_stream(stream)

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        streams.set_stream(streams.Stream(device_index, stream_id=stream_id))

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        return 0

    @staticmethod
    def get_compute_capability(device=None) -> str:
        return "spyre"

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def memory_allocated(device=None) -> int:
        return torch.spyre.memory_allocated(device)


class SpyreOpOverrides(DeviceOpOverrides):
    """Strings Inductor splices into Python wrappers; our wrapper emits no Python kernels."""

    def import_get_raw_stream_as(self, name: str) -> str:
        return f"def {name}(idx): return 0"

    def set_device(self, device_idx: int) -> str:
        return "pass"

    def synchronize(self) -> str:
        return "pass"

    def device_guard(self, device_idx: int) -> str:
        return "contextlib.nullcontext()"
