"""Where a compiled step's buffers are, for one input geometry: one frozen value, made once
per executable and read by everything that addresses them (construction, the plans and
their cache key, CPU ops, kernels run on the host, collectives, the call's slot).

A call binds the arena of intermediates (binding 0), every input and constant, and a buffer
per output (``names``). Every buffer the step's kernels name (its own, its inputs' and
constants', their aliases, the saves of mutated inputs) has a stick layout and an element
offset in its storage, and is relocated against the bindings: ``relocs`` maps it to
(binding, byte offset).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..ir import Buffer
from ..layout import StickLayout
from .memory import root_of

ARENA = 0  # binding 0 is the arena of intermediates


@dataclass(frozen=True, eq=False)
class Bindings:
    names: tuple[str, ...]                   # the buffer of each binding; names[0] is the arena
    layouts: Mapping[str, StickLayout]       # every buffer's storage layout (an alias: its base's)
    offsets: Mapping[str, int]               # each buffer's first element in its storage
    relocs: Mapping[str, tuple[int, int]]    # buffer -> (binding, byte offset)
    arena_bytes: int
    buffers: Mapping[str, Buffer]            # the description of every buffer, input, constant, alias
    aliases: Mapping[str, tuple]             # alias -> (the buffer it views, offset, sizes, strides)

    @classmethod
    def of(cls, names, layouts: dict, offsets: dict, relocs: dict, arena_bytes: int, buffers: dict,
           aliases: Mapping) -> Bindings:
        """Freeze the tables the executable planned (copies: later changes do not leak in)."""
        return cls(tuple(names), MappingProxyType(dict(layouts)), MappingProxyType(dict(offsets)),
                   MappingProxyType(dict(relocs)), arena_bytes, MappingProxyType(dict(buffers)),
                   MappingProxyType(dict(aliases)))

    def base_of(self, name: str) -> str:
        """The buffer an alias finally names (a buffer names itself)."""
        return root_of(self.aliases, name)

    def buffer(self, name: str) -> Buffer:
        """The description of a buffer, input, constant or alias."""
        return self.buffers[name]

    def address(self, table, name: str) -> int:
        """The device address of `name`'s storage in a call bound by `table`."""
        b, off = self.relocs[name]
        return table[b] + off

    def limits(self) -> list[int]:
        """The bytes a call binds at each binding: the arena's, each storage's."""
        return [self.arena_bytes] + [self.layouts[n].nbytes for n in self.names[1:]]

    def stick_layouts(self) -> list[StickLayout | None]:
        """The stick layout a call binds at each binding: none for the arena (which records
        none), the storage's for every input, constant and output."""
        return [None] + [self.layouts[n] for n in self.names[1:]]
