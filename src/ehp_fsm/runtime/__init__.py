"""The runtime's transport layer: what crosses the wire between controller and agents.

Layout (each module says what it knows and what it does not):
    protocol     versioned msgpack frames, strict validation, `Dropped` with a reason
    reliability  retries (Outbox), dedup memory (DedupCache), peer liveness — pure bookkeeping
    deliveries   what poll() returns: Received, Acked, Replied, GaveUp, Peer*, FdReady, LinkChanged
    endpoint     TransportConfig and the shared Endpoint base: one socket, one poll()
    transport    ControllerEndpoint (ROUTER) and AgentEndpoint (DEALER): sockets, CURVE
    keys         CURVE key files: generate (`ehp-fsm keys DIR`) and load
    identity     ProcessIdentity, same_process (pid reuse), ProcessWatcher (pidfd exit events)
    faultproxy   a seeded drop/delay/duplicate/reorder proxy for tests
    errors       TransportError, FrameError, KeyFileError, IdentityError

The controller and agent logic builds on this (imported from their modules, not re-exported):
    controller       Controller: the loop around the engine, command dispatch, shutdown
    reconcile        AgentSync (mixed into Controller): agent news → engine events, reconcile
    recovery         rebuild the world from the transition log after a controller crash
    agent            Agent: the host agent's loop, its protocol side, `ehp-fsm agent`
    agent_processes  ProcessTable (owned by Agent): launch, watch, stop, GPU finalizer, state
    workers          what the agent launches per role (LaunchSpec, WorkerRegistry)
"""

from ehp_fsm.runtime.endpoint import Endpoint
from ehp_fsm.runtime.errors import FrameError, IdentityError, KeyFileError, TransportError
from ehp_fsm.runtime.faultproxy import FaultProxy, FaultSchedule
from ehp_fsm.runtime.identity import (
    ProcessExit,
    ProcessIdentity,
    ProcessWatcher,
    capture,
    is_alive,
    new_launch_token,
    same_process,
    this_host,
)
from ehp_fsm.runtime.keys import (
    CurveClientKeys,
    CurveServerKeys,
    KeyLayout,
    generate_keys,
    load_client_keys,
    load_server_keys,
)
from ehp_fsm.runtime.protocol import (
    PROTOCOL_VERSION,
    Dropped,
    DropReason,
    Frame,
    Kind,
    decode,
    encode,
    process_entry,
)
from ehp_fsm.runtime.transport import (
    Acked,
    AgentEndpoint,
    ControllerEndpoint,
    FdReady,
    GaveUp,
    Incoming,
    LinkChanged,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    PeerUnreachable,
    Received,
    Replied,
    Stalled,
    TransportConfig,
    is_loopback_endpoint,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Acked",
    "AgentEndpoint",
    "ControllerEndpoint",
    "CurveClientKeys",
    "CurveServerKeys",
    "DropReason",
    "Dropped",
    "Endpoint",
    "FaultProxy",
    "FaultSchedule",
    "FdReady",
    "Frame",
    "FrameError",
    "GaveUp",
    "IdentityError",
    "Incoming",
    "KeyFileError",
    "KeyLayout",
    "Kind",
    "LinkChanged",
    "PeerJoined",
    "PeerRestarted",
    "PeerReturned",
    "PeerSilent",
    "PeerUnreachable",
    "ProcessExit",
    "ProcessIdentity",
    "ProcessWatcher",
    "Received",
    "Replied",
    "Stalled",
    "TransportConfig",
    "TransportError",
    "capture",
    "decode",
    "encode",
    "generate_keys",
    "is_alive",
    "is_loopback_endpoint",
    "load_client_keys",
    "load_server_keys",
    "new_launch_token",
    "process_entry",
    "same_process",
    "this_host",
]
