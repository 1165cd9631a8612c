"""Loopback helpers the tests share: a free TCP port on 127.0.0.1 for a server a test starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
