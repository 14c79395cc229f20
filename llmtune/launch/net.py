"""Ports and addresses: what the lobby (machines checking in) and the runner (the launch) both need.

Kept apart so that neither imports the other: the runner calls the lobby, and both bind the rendezvous port.
"""

from __future__ import annotations

import socket

from llmtune.errors import UserError


def free_port() -> int:
    """A port nothing listens on now: single-machine runs need no fixed rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def local_address_towards(host: str) -> str | None:
    """This machine's address on the interface that routes to `host` (no packet is sent); None if unknown."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


def bind_port(sock: socket.socket, port: int) -> None:
    """Bind to the rendezvous port on every interface, or say clearly that it is taken."""
    try:
        sock.bind(("", port))
    except OSError:
        raise UserError(f"--main-process-port {port} is already in use on this machine",
                        "choose another port, or stop the process holding it") from None  # fmt: skip


def check_port_free(port: int) -> None:
    """Fail before launching when the rendezvous port is taken (instead of a hang or a cryptic error)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as the store will: connections of an earlier run left in TIME_WAIT don't make the port busy
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bind_port(probe, port)
