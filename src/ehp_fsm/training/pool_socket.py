"""The trainer pool's control socket: where it listens, and who may speak on it.

On one machine the pool's ROUTER listens on loopback (`listen="tcp://127.0.0.1"`, the default, a
random port) without keys, as it always did. Warm workers on other machines need it on another
interface, and there the plain socket is refused: anyone who can reach the port could connect as
`trainer-<rank>`, and the ROUTER's handover (a replacement worker reuses its rank's name) would
give them that rank's route. A non-loopback `listen` therefore requires CURVE, set up as the run's
own control plane does (`runtime.transport`):

- the server keys are the run's transport server keys (`load_server_keys` of the plan's
  `transport.curve_keys` directory), so a pool needs no keys of its own;
- only clients whose public key is in the allow-list directory (`authorized/`, one key per host)
  complete the handshake (`zmq.auth.thread.ThreadAuthenticator`);
- each rank is bound to a host (`rank_hosts`: the host whose agent launched it; the ranks the
  coordinator launches itself are on its own host), and a frame from `trainer-<rank>` is taken
  only when its ZAP User-Id (the client's key) is the one `hosts.json` binds to that host
  (`key_problem`; else the channel drops and logs it, like transport's `_key_problem`).

A worker learns the keys from its environment (`worker_env` writes the two variables,
`client_keys_from_env` reads them): `EHP_POOL_CURVE_SERVER`, the pool's public key (Z85 text,
`PoolSocket.curve_public`), and `EHP_POOL_CURVE_CLIENT`, the path of the worker host's secret key
file (`DIR/agents/<host>.key_secret`, 0600). Neither set: a plain connection, as on one machine.

A routing id is not a name alone: it is `trainer-<rank>/<route>`, the route a secret made for
each launch and given only to the process launched (`pool_launch.routing_id`). Before, a holder of
*another* host's valid key — or, on loopback without keys, any local user — could connect as
`trainer-<rank>` and, by the handover, take that rank's route: the commands then went to it and
the rank looked dead to the pool. Now the handover only moves a route between processes that hold
its secret (a worker that reconnects).

Does not know: frames, commands, worker records (`pool_channel.WorkerChannel` owns those).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

import zmq
import zmq.auth.thread

from ehp_fsm.addresses import is_loopback_endpoint
from ehp_fsm.runtime.errors import KeyFileError, TransportError
from ehp_fsm.runtime.keys import CurveClientKeys, CurveServerKeys, load_keypair
from ehp_fsm.runtime.pool_launch import CURVE_CLIENT_ENV, CURVE_SERVER_ENV
from ehp_fsm.training.pool_protocol import DEFAULT_MAX_MESSAGE_BYTES, PoolError

SERVER_ENV: Final = CURVE_SERVER_ENV  # the agent sets them (`runtime.pool_launch`)
CLIENT_ENV: Final = CURVE_CLIENT_ENV
LOOPBACK: Final = "tcp://127.0.0.1"
_WORKER_PREFIX: Final = "trainer-"


class _Context(zmq.Context[zmq.Socket[bytes]]):
    """The pool's ZeroMQ context. Terminating it stops its ZAP authenticator first: the
    authenticator's thread holds a socket of this context, so a plain `term()` (what the pool's
    shutdown calls) would wait for it for ever."""

    auth: zmq.auth.thread.ThreadAuthenticator | None = None

    def term(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        super().term()


def _listen_host(listen: str) -> str:
    """The address part of `listen` (`tcp://ADDRESS`, no port), refused when it is not one
    address a worker can connect to."""
    scheme, sep, host = listen.partition("://")
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        ip = None
    if scheme != "tcp" or not sep or ip is None or (":" in host and not host.startswith("[")):
        raise TransportError(
            f"pool listen address {listen!r} is not tcp://ADDRESS",
            "the pool binds a random port on one interface address, and hands workers that "
            "address (no port, no host name, no interface name)",
            "give e.g. tcp://127.0.0.1 (one machine) or tcp://10.0.0.5 (the head node's "
            "address on the network its workers reach it by); IPv6 as tcp://[fd00::5]",
        )
    if ip.is_unspecified:
        raise TransportError(
            f"pool listen address {listen!r} is a wildcard",
            "workers are told the address to connect to, and a wildcard is none",
            "give the address of the interface the workers reach this host by",
        )
    return host


class PoolSocket:
    """The pool's bound ROUTER, its context and (with CURVE) its authenticator and binding.

    `listen`: `tcp://ADDRESS` (see the module docstring); `curve`: the run's transport server
    keys (None: plain, loopback only); `rank_hosts`: every pool rank → the host id whose agent
    launched it (CURVE only); `local_client_key`: the secret key file the ranks this coordinator
    launches itself connect with (its own host's agent key, `DIR/agents/<host>.key_secret`);
    `max_message_bytes`: the largest frame libzmq takes (`zmq.MAXMSGSIZE`; a larger one cuts its
    sender's connection before a byte of it is held: a 1 GiB frame from any local process grew
    the run process by 2 GB before it was dropped).
    """

    def __init__(
        self,
        *,
        ranks: Iterable[int],
        listen: str = LOOPBACK,
        curve: CurveServerKeys | None = None,
        rank_hosts: Mapping[int, str] | None = None,
        local_client_key: Path | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        host = _listen_host(listen)
        if curve is None and not is_loopback_endpoint(f"{listen}:0"):
            raise TransportError(
                f"refusing to open the trainer pool's channel on {listen} without CURVE",
                "it is not a loopback address: anyone who reaches the port could connect as "
                "trainer-<rank> and take that rank's route",
                "give the run's transport server keys (curve=load_server_keys(curve_keys)) and "
                "rank_hosts, or listen on tcp://127.0.0.1",
            )
        self._curve = curve
        self._rank_hosts = _check_binding(list(ranks), curve, rank_hosts, local_client_key)
        self._local_client_key = local_client_key
        self.curve_public: str | None = None if curve is None else curve.public.decode("ascii")
        self.context = _Context()
        self.sock: zmq.Socket[bytes] = self.context.socket(zmq.ROUTER)
        sock = self.sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting worker keeps its route
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if host.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if curve is not None:
                self.context.auth = zmq.auth.thread.ThreadAuthenticator(self.context)
                self.context.auth.start()
                self.context.auth.configure_curve(domain="*", location=str(curve.authorized_dir))
                sock.curve_secretkey = curve.secret
                sock.curve_publickey = curve.public
                sock.curve_server = True
            port = sock.bind_to_random_port(listen)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(
                f"cannot open the trainer pool's channel on {listen}",
                str(exc),
                "give an address of one of this host's interfaces",
            ) from exc
        self.control = f"{listen}:{port}"

    def key_problem(self, peer: str, body: zmq.Frame) -> str | None:
        """Why the frame `body` that arrived from worker `peer` (its routing id's name) may not
        speak for that rank (None: it may; always None without CURVE)."""
        if self._curve is None:
            return None
        try:
            user_id = body.get("User-Id")  # the ZAP handler's user id: the client's Z85 key
        except zmq.ZMQError:
            user_id = None
        rank = _rank_of(peer)
        if rank is None or rank not in self._rank_hosts:
            return f"routing id {peer[:64]!r} names no rank of this pool"
        host = self._rank_hosts[rank]
        if user_id != self._curve.hosts[host]:
            return (
                f"the key {str(user_id)[:12]}... is not the one bound to host {host!r}, whose "
                f"agent launched rank {rank}"
            )
        return None

    def launch_env(self, rank: int) -> dict[str, str] | None:
        """The environment of rank `rank` when this coordinator launches it itself (None: this
        process's own). With CURVE, its host's client key (`local_client_key`); without, this
        environment minus any pool key variables (a plain pool's worker connects plainly)."""
        if self._curve is None:
            if SERVER_ENV not in os.environ and CLIENT_ENV not in os.environ:
                return None
            return {k: v for k, v in os.environ.items() if k not in (SERVER_ENV, CLIENT_ENV)}
        if self._local_client_key is None:
            raise PoolError(
                f"this pool cannot launch rank {rank} itself",
                "its channel uses CURVE, and the ranks it launches need a client key",
                "pass local_client_key=DIR/agents/<this host>.key_secret, or have the host's "
                "agent launch the rank",
            )
        public = load_keypair(self._local_client_key)[0].decode("ascii")
        host = self._rank_hosts[rank]
        if public != self._curve.hosts[host]:
            raise PoolError(
                f"local_client_key {self._local_client_key} is not the key of host {host!r}",
                f"rank {rank} is bound to host {host!r} (rank_hosts), and the pool takes its "
                "frames only with that host's key",
                f"map the ranks this coordinator launches to its own host, or pass "
                f"DIR/agents/{host}.key_secret",
            )
        assert self.curve_public is not None
        return {**os.environ, **worker_env(self.curve_public, self._local_client_key)}

    def close(self) -> None:
        """Close the socket and the context (the authenticator first)."""
        self.sock.close(0)
        self.context.term()


def _rank_of(peer: str) -> int | None:
    if not peer.startswith(_WORKER_PREFIX):
        return None
    digits = peer.removeprefix(_WORKER_PREFIX)
    return int(digits) if digits.isdigit() and digits.isascii() else None


def _check_binding(
    ranks: list[int],
    curve: CurveServerKeys | None,
    rank_hosts: Mapping[int, str] | None,
    local_client_key: Path | None,
) -> dict[int, str]:
    """`rank_hosts` checked against the pool's ranks and the keys' host binding."""
    if curve is None:
        if rank_hosts is not None or local_client_key is not None:
            raise PoolError(
                "rank_hosts and local_client_key were given without CURVE keys",
                "they bind ranks to host keys, which only a CURVE channel checks",
                "give curve=load_server_keys(curve_keys) too, or drop them",
            )
        return {}
    hosts = dict(rank_hosts or {})
    missing = [r for r in ranks if r not in hosts]
    if missing:
        raise PoolError(
            f"ranks {missing} have no host in rank_hosts",
            "with CURVE a rank's frames are taken only with the key of the host that launched it",
            "map every pool rank to its host id (the coordinator's own for the ranks it launches)",
        )
    unbound = sorted({h for r, h in hosts.items() if r in ranks and h not in curve.hosts})
    if unbound:
        raise PoolError(
            f"hosts {unbound} have no key in the binding (hosts.json)",
            "no frame of theirs could ever be taken",
            "make the keys with `ehp-fsm keys DIR --agent HOST ...` for every host id",
        )
    return {r: hosts[r] for r in ranks}


def worker_env(server_public: str, client_key: str | os.PathLike[str]) -> dict[str, str]:
    """The variables that make a pool worker connect with CURVE (what an agent that launches
    one adds to its environment): the pool's public key and the worker host's key file."""
    return {SERVER_ENV: server_public, CLIENT_ENV: str(client_key)}


def client_keys_from_env(environ: Mapping[str, str]) -> CurveClientKeys | None:
    """The worker's CURVE keys from `EHP_POOL_CURVE_SERVER` and `EHP_POOL_CURVE_CLIENT` (None
    when neither is set); an error naming the variable (and file) that cannot be used."""
    server, client = environ.get(SERVER_ENV), environ.get(CLIENT_ENV)
    if server is None and client is None:
        return None
    fix = f"the agent that launches a pool worker sets both {SERVER_ENV} and {CLIENT_ENV}"
    if server is None or client is None:
        have, lack = (SERVER_ENV, CLIENT_ENV) if client is None else (CLIENT_ENV, SERVER_ENV)
        raise KeyFileError(f"{have} is set but {lack} is not", "CURVE needs both", fix)
    server_key = server.encode("ascii", "replace")
    if len(server_key) != 40:
        raise KeyFileError(
            f"{SERVER_ENV}={server[:60]!r} is not a 40-character Z85 public key",
            "it must be the pool's public key (the run's controller.key)",
            fix,
        )
    try:
        public, secret = load_keypair(client)
    except KeyFileError as exc:
        raise KeyFileError(f"{CLIENT_ENV}={client}: {exc.what}", exc.why, exc.fix) from None
    return CurveClientKeys(public=public, secret=secret, server_public=server_key)


def connect(sock: zmq.Socket[bytes], control: str, curve: CurveClientKeys | None) -> None:
    """Connect a worker's DEALER to the pool at `control`, as a CURVE client when `curve`."""
    if "[" in control:
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        sock.curve_secretkey = curve.secret
        sock.curve_publickey = curve.public
        sock.curve_serverkey = curve.server_public
    sock.connect(control)
