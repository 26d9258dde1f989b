"""Errors of the runtime transport layer, all `EhpError`s (what, why, fix).

    EhpError
    ├── TransportError      the transport was misused or mis-configured (non-loopback bind,
    │   │                   closed endpoint, unknown peer)
    │   └── FrameError      a frame *we* are about to send cannot be encoded (bad payload type,
    │                       over the size limit)
    ├── KeyFileError        CURVE key files are missing, malformed, or would be overwritten
    └── IdentityError       a process identity cannot be captured or checked here

Bad *incoming* bytes are never an error: `protocol.decode` returns a `Dropped` value with the
reason, and the endpoints hand that value to the caller to log.
"""

from __future__ import annotations

from ehp_fsm.errors import EhpError


class TransportError(EhpError):
    """The transport was asked to do something it must not or cannot do."""


class FrameError(TransportError):
    """An outgoing frame cannot be encoded: the caller built it wrongly."""


class KeyFileError(EhpError):
    """CURVE key files are missing, malformed, or would be overwritten."""


class IdentityError(EhpError):
    """A process identity cannot be captured or checked on this host."""
