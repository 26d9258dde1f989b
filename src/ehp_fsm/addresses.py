"""Control-plane addresses, without the control plane: what the plan loader and the transport
both need to know about an endpoint string.

Knows: the loopback rule (which ZeroMQ endpoints provably stay on this machine). Does not know
sockets, frames or ZeroMQ itself — it imports nothing beyond the standard library, so the plan
loader and the embedding API stay free of the runtime's dependencies.
"""

from __future__ import annotations

import ipaddress


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
