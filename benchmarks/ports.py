"""A free TCP port for the benchmarks' spawned ranks."""

from __future__ import annotations

import socket


def free_port() -> int:
    """Return a TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
