"""A trace file read as a stream of events, never parsed whole.

A default ``spyre-profile run`` trace holds a few hundred thousand events, a trace with
every command millions: ``json.load`` would build the whole document before the first
event could be counted. :class:`TraceFile` reads the text in chunks (gzip or plain, told
apart by the magic bytes), parses the top-level object key by key, and hands out the
``traceEvents`` array one event at a time; the other keys (``metadata``, ...) are small and
parsed whole. The object form and the bare-array form of the Chrome trace format are
both read.

Events are parsed a batch at a time by the C JSON decoder: a chunk is cut after a ``},``
and parsed as one array. A cut inside a nested object or a string leaves the text
unbalanced, so it cannot parse; then an earlier cut is tried, and at worst one event is
decoded on its own.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from typing import Any

from .. import trace as trace_format

_CHUNK = 1 << 20  # characters read at a time
_CUTS_TRIED = 4  # batch cuts tried before decoding events one by one
_ONE_BY_ONE = 1024  # events decoded one by one after a batch found no cut
_WS = " \t\n\r"
_decoder = json.JSONDecoder()


class TraceFile:
    """The top-level keys and the events of a trace file.

    ``header`` holds the keys before ``traceEvents`` as soon as the file is opened;
    :meth:`events` streams the array (once); afterwards :meth:`document` has every other
    key. A file without ``traceEvents`` (a ``spyre-profile run`` result, say) is parsed
    whole into ``header`` and ``has_events`` is False. Errors are ValueErrors naming the
    file and the character offset; OSError (missing, unreadable) passes through."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._f = trace_format.open_text(self.path)
        self._buf = ""
        self._pos = 0
        self._done = 0  # characters dropped from the front of the buffer
        self._eof = False
        self.header: dict[str, Any] = {}
        self.trailer: dict[str, Any] = {}
        self.bare_array = False
        self.has_events = False
        self._streamed = False
        self._singles = 0  # events still to decode one by one
        try:
            self._open_document()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def document(self) -> dict[str, Any]:
        """Every top-level key but ``traceEvents`` (the trailer only once events were read)."""
        return {**self.header, **self.trailer}

    def events(self) -> Iterator[Any]:
        """The elements of the ``traceEvents`` array, in file order, unvalidated."""
        if self._streamed:
            raise RuntimeError(f"{self.path}: the events of a trace file can be read once")
        self._streamed = True
        if not self.has_events:
            return
        yield from self._array()
        if not self.bare_array:
            self._read_members(self.trailer, first=False, stop_at_events=False)
        self._expect_end()

    def validated_events(self) -> Iterator[dict[str, Any]]:
        """:meth:`events`, each checked as :func:`spyre_rt.trace.validate` checks it."""
        for i, ev in enumerate(self.events()):
            problem = trace_format.event_problem(ev)
            if problem:
                raise ValueError(f"{self.path}: traceEvents[{i}]: {problem}")
            yield ev

    # ---- the document ----

    def _open_document(self) -> None:
        first = self._peek()
        if first == "[":
            self._pos += 1
            self.bare_array = self.has_events = True
        elif first == "{":
            self._pos += 1
            self.has_events = self._read_members(self.header, first=True, stop_at_events=True)
            if not self.has_events:
                self._expect_end()
        else:
            value = self._value()
            self._expect_end()
            raise ValueError(f"{self.path}: a trace is a JSON object with 'traceEvents' (or an array of "
                             f"events), not a JSON {type(value).__name__}")

    def _read_members(self, into: dict[str, Any], first: bool, stop_at_events: bool) -> bool:
        """Read ``"key": value`` members into `into` up to the object's end, or (when
        `stop_at_events`) up to the start of the ``traceEvents`` array: True then. `first`:
        no member of this object was read yet (so no ',' comes first)."""
        while True:
            c = self._peek()
            if c == "}":
                self._pos += 1
                return False
            if not first:
                self._expect(",")
                c = self._peek()
            first = False
            if c != '"':
                self._fail("expected a key")
            key = self._value()
            self._expect(":")
            if key == "traceEvents":
                if not stop_at_events:
                    self._fail("a second 'traceEvents'")
                if self._peek() != "[":
                    value = self._value()
                    raise ValueError(f"{self.path}: 'traceEvents' must be an array, not {type(value).__name__}")
                self._pos += 1
                return True
            into[key] = self._value()

    def _array(self) -> Iterator[Any]:
        """The elements of an array whose '[' was read, through its ']'."""
        if self._peek() == "]":
            self._pos += 1
            return
        while True:
            batch = self._batch()
            if batch is None:
                yield self._value()
            else:
                yield from batch
            c = self._peek()
            self._pos += 1
            if c == "]":
                return
            if c != ",":
                self._pos -= 1
                self._fail("expected ',' or ']' between events")

    def _batch(self) -> list[Any] | None:
        """The events from here up to a cut near the buffer's end, parsed at once; None when
        the caller should decode one event instead (for a while after no cut parsed: a
        file whose events never end in '},' should not pay for failed batches)."""
        if self._singles:
            self._singles -= 1
            return None
        self._fill()
        buf, pos = self._buf, self._pos
        cut = buf.rfind("},", pos)
        for _ in range(_CUTS_TRIED):
            if cut < pos:
                return None
            try:
                events = json.loads(f"[{buf[pos:cut + 1]}]")
            except json.JSONDecodeError:
                cut = buf.rfind("},", pos, cut)
                continue
            self._pos = cut + 1
            return events
        self._singles = _ONE_BY_ONE
        return None

    # ---- the text ----

    def _fill(self, need_more: bool = False) -> bool:
        """Keep at least a chunk ahead of the read position; False at the end of the file."""
        if self._eof or (len(self._buf) - self._pos >= _CHUNK and not need_more):
            return not self._eof
        try:
            more = self._f.read(_CHUNK)
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: not a UTF-8 text file ({e.reason})") from None
        except (gzip.BadGzipFile, EOFError, OSError) as e:
            if isinstance(e, OSError) and not isinstance(e, gzip.BadGzipFile):
                raise
            raise ValueError(f"{self.path}: a broken gzip file ({e})") from None
        self._done += self._pos
        self._buf = self._buf[self._pos:] + more
        self._pos = 0
        self._eof = not more
        return bool(more)

    def _peek(self) -> str:
        """The next character that is not white space ('' at the end of the file)."""
        while True:
            buf, pos = self._buf, self._pos
            n = len(buf)
            while pos < n and buf[pos] in _WS:
                pos += 1
            self._pos = pos
            if pos < n:
                return buf[pos]
            if not self._fill(need_more=True):
                return ""

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            self._fail(f"expected {char!r}")
        self._pos += 1

    def _expect_end(self) -> None:
        if self._peek():
            self._fail("extra data after the document")

    def _value(self) -> Any:
        """One JSON value from the read position, reading on until it is complete."""
        self._peek()
        while True:
            try:
                value, end = _decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as e:
                # A value cut off by the buffer's end fails near that end (an unterminated
                # string: at its start); then read on. Anything else is an error now.
                cut_off = len(self._buf) - e.pos < _CHUNK or e.msg.startswith("Unterminated string")
                if cut_off and self._fill(need_more=True):
                    continue
                raise ValueError(f"{self.path}: not valid JSON ({e.msg} at character {self._done + e.pos})") \
                    from None
            # A number at the buffer's end may go on in the next chunk ("12" of "1234").
            if end == len(self._buf) and not self._eof and self._fill(need_more=True):
                continue
            self._pos = end
            return value

    def _fail(self, what: str) -> None:
        at = self._done + self._pos
        raise ValueError(f"{self.path}: not valid JSON ({what} at character {at})")
