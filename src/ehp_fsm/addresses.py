"""Control-plane addresses, without the control plane: what the plan loader and the transport
both need to know about an endpoint string.

Knows: the loopback rule (which ZeroMQ endpoints provably stay on this machine) and the shape of
an endpoint the controller can bind and other processes reach. Does not know
sockets, frames or ZeroMQ itself — it imports nothing beyond the standard library, so the plan
loader and the embedding API stay free of the runtime's dependencies.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Final


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address or `localhost`."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: not provably loopback


#: The most bytes a Unix socket's path may hold (`sockaddr_un.sun_path` less its NUL).
IPC_PATH_MAX: Final = 107


def endpoint_problem(endpoint: str) -> str | None:
    """Why the controller cannot listen on `endpoint` for its agents (None: it can): they are
    other processes, so `tcp://ADDR:PORT` (PORT 1..65535, or `*` for any free one) or
    `ipc://PATH`. ZeroMQ itself refuses a missing or non-numeric port only at bind, once the
    run has started, and takes a port past 65535 modulo 65536 (another port than written)."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme == "inproc":
        return "inproc:// reaches only this process, and the agents are processes of their own"
    if scheme == "ipc" and sep and rest:
        size = len(os.fsencode(rest))
        if not rest.startswith("@") and size > IPC_PATH_MAX:  # refused at the bind, mid-start
            return (
                f"its path is {size} bytes, and a Unix socket's path holds at most {IPC_PATH_MAX}"
            )
        return None
    if scheme != "tcp" or not sep:
        return "it is not tcp://ADDR:PORT or ipc://PATH"
    host, colon, port = rest.rpartition(":")
    if not colon or not host.strip("[]"):
        return "it names no port: write tcp://ADDR:PORT (PORT 1..65535, or * for any)"
    if port != "*" and not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"port {port[:20]!r} is not 1..65535 or *"
    return None
