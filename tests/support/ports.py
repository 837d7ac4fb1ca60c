"""Loopback ports: the one free-port helper, and a wait until something listens on a port.

Servers the tests start in this process bind port 0 and report the port they got; these are for
the others, started as processes, which must be told a port before they bind it.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

LOOPBACK = "127.0.0.1"
LISTEN_TIMEOUT_S = 60.0


def free_ports(count: int) -> list[int]:
    """count distinct free TCP ports on 127.0.0.1 (bound to port 0 together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_port(port: int, timeout: float = LISTEN_TIMEOUT_S, alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:port; fails early once alive() is false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server on port {port} died before it was ready")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=1.0):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {LOOPBACK}:{port} after {timeout} s")
