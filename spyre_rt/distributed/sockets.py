"""The ranks of a group on several machines: which machine each is on, and a socket
between every two of them (the ring's transport between machines, native/ccl.c).

A rank's machine is its host id: ``SPYRE_RT_HOST_ID`` when set (to tell ranks on one host
that they are on different machines, as a test does, or ranks in containers that they share
one), else the host name and the kernel's boot id. A rank listens on the address its
machine reaches the rendezvous by (``SPYRE_RT_SOCKET_ADDR`` when set, else the address of
the route to ``MASTER_ADDR``), names it in the store, connects to every lower rank and
accepts every higher one; each connection opens with the connecting rank's number.
"""

from __future__ import annotations

import os
import socket
import struct
from datetime import timedelta

from ..errors import SpyreCollectiveError


def host_id() -> str:
    """This process's machine (see the module docstring)."""
    given = os.environ.get("SPYRE_RT_HOST_ID")
    if given:
        return given
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def one_machine(store, rank: int, size: int, timeout: timedelta) -> bool:
    """Whether every rank of the group has this rank's host id (one exchange in the store)."""
    store.set(f"host/{rank}", host_id())
    keys = [f"host/{r}" for r in range(size)]
    store.wait(keys, timeout)
    return len({store.get(k) for k in keys}) == 1


def _address() -> str:
    given = os.environ.get("SPYRE_RT_SOCKET_ADDR")
    if given:
        return given
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
            probe.connect((master, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def connect(store, rank: int, size: int, timeout: timedelta) -> list[int]:
    """A connected stream socket to every other rank (-1 for this one), as file descriptors
    the caller owns."""
    seconds = timeout.total_seconds()
    fds = [-1] * size
    addr = _address()
    with socket.create_server((addr, 0)) as server:
        server.settimeout(seconds)
        store.set(f"socket/{rank}", f"{addr}:{server.getsockname()[1]}")
        try:
            for j in range(rank):  # lower ranks listen already (the store said where)
                host, port = store.get(f"socket/{j}").decode().rsplit(":", 1)
                s = socket.create_connection((host, int(port)), timeout=seconds)
                s.sendall(struct.pack("<I", rank))
                fds[j] = _handed_over(s)
            for _ in range(size - 1 - rank):
                s, _ = server.accept()
                s.settimeout(seconds)
                j = struct.unpack("<I", _read(s, 4))[0]
                if not rank < j < size or fds[j] != -1:
                    s.close()
                    raise SpyreCollectiveError(f"spyreccl rank {rank}: a connection from rank {j} it did not expect")
                fds[j] = _handed_over(s)
        except (OSError, SpyreCollectiveError) as e:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            if isinstance(e, SpyreCollectiveError):
                raise
            raise SpyreCollectiveError(f"spyreccl rank {rank} of {size}: connecting to its peers failed ({e})") from e
    return fds


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("the peer closed the connection while saying who it is")
        data += chunk
    return data


def _handed_over(s: socket.socket) -> int:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a round's frame goes at once
    s.settimeout(None)
    return s.detach()
