"""A free local TCP port, for the processes we start that listen on one (the DeepSpeed rendezvous of a single-rank
run, llama-server)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on now (the OS picks it; free again once this returns)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
