"""What a host agent needs to start one rank of the run's trainer pool on its host: the
`trainer` field of a `launch` command, checked field by field, and the worker's command line and
environment built from it.

A Hybrid borrowed on a host trains on that host, so the pool's warm worker for the host is
launched by the host's agent (`launch` {machine: "pool_worker", role: "pool_worker", instance,
gpus, token, trainer}), not by the run. The controller sends *what* to start — the pool's
endpoints, its token, its configuration and the rank — never *how*: the agent builds the argv
itself with the pool's own `worker_argv`, with itself as the worker's parent (the worker exits
when its agent is gone; the agent stops its processes when the controller's lease lapses, so a
dead run leaves no worker). A field that is missing, unknown, of the wrong type or too long, or
an endpoint that is not one, is refused with its name at once (`TrainerLaunch(...)`); a
configuration that does not parse, or a rank outside its world, when the configuration is read
(`pool_config`, which imports torch: the agent does it in the launch's thread, off its loop).

    trainer = {
        "rank": int,               # the pool rank, within the configuration's world
        "control": str,            # the pool's ZeroMQ endpoint: tcp://HOST:PORT
        "rendezvous": str,         # the Gloo init method: file:///ABS/PATH or tcp://HOST:PORT
        "pool_token": str,         # the pool's launch token (its hellos must carry it)
        "config": str,             # PoolConfig JSON (`PoolConfig.to_json`)
        "standby": bool,           # a replacement warm worker (joins when admitted)
        "curve_server_key": str | None,  # the pool's CURVE public key (Z85), or None
        "route": str,              # this launch's secret route (32 hex digits)
    }

Environment: the agent's usual launch environment plus `EHP_POOL_ROUTE` (the route),
`EHP_POOL_TOKEN` (the pool's launch token, which the worker's hellos carry; its
`EHP_LAUNCH_TOKEN` is the agent launch's own) and, when `curve_server_key` is given,
`EHP_POOL_CURVE_SERVER` (that key) and `EHP_POOL_CURVE_CLIENT` (the path of the agent's own
CURVE secret key file, with which the worker authenticates to the pool). An agent without CURVE
keys refuses such a launch (the worker could not connect).

The route: the pool's ROUTER hands a connection the route of the name it announces (a
replacement worker reuses its rank's name), so a worker's routing id is its name *and* a secret
made for its launch, `trainer-<rank>/<route>` (`routing_id`). The route travels only in the
worker's environment and in the launch command over the run's (CURVE) control plane — never in
a command line, which every user of the node can read with `ps` — so a process that can reach
the pool's port but did not get the route cannot take a rank's route (before, the name alone
did: `trainer-0` took the Core's commands, and the Core looked dead to the pool).
The pool's launch token travels the same way, for the same reason: it is what proves to
`ehp-fsm stop` that a trainer worker is the run's (`run.owned`), and a token `ps` showed could
be copied into a forged run folder (it was the worker's `--launch-token`).

Knows: the field rules, the argv, the variables. Does not know: sockets, processes, the
pool's protocol (it asks `training.pool_protocol`, imported when a configuration is read: an
agent that never launches a pool worker does not import torch).
"""

from __future__ import annotations

import hmac
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from ehp_fsm.runtime.identity import ProcessIdentity
from ehp_fsm.runtime.workers import WorkerError

if TYPE_CHECKING:
    from ehp_fsm.training.pool_protocol import PoolConfig

CURVE_SERVER_ENV: Final = "EHP_POOL_CURVE_SERVER"
CURVE_CLIENT_ENV: Final = "EHP_POOL_CURVE_CLIENT"
ROUTE_ENV: Final = "EHP_POOL_ROUTE"
#: The pool's launch token, in a pool worker's environment (never on its command line).
POOL_TOKEN_ENV: Final = "EHP_POOL_TOKEN"  # noqa: S105 - a variable's name, not a token
ROUTE: Final = re.compile(r"[0-9a-f]{32}")

MAX_ENDPOINT_CHARS: Final = 255
MAX_RENDEZVOUS_CHARS: Final = 4096
MAX_CONFIG_CHARS: Final = 256 * 1024  # a PoolConfig is ~1 KiB of JSON
_TCP: Final = re.compile(
    r"tcp://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):(\d{1,5})"
)
_FILE: Final = re.compile(r"file:///[^\x00-\x1f\x7f]*")
#: A launch token (the pool's, or the agent launch's): what `new_launch_token` makes, and kin.
TOKEN: Final = re.compile(r"[A-Za-z0-9_-]{8,128}")
_Z85_KEY: Final = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
#: A launch's instance names its log file: letters, digits and `._:-` only (never a path).
INSTANCE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")

#: trainer field → (exact types, required)
FIELDS: Final[Mapping[str, tuple[tuple[type, ...], bool]]] = {
    "rank": ((int,), True),
    "control": ((str,), True),
    "rendezvous": ((str,), True),
    "pool_token": ((str,), True),
    "config": ((str,), True),
    "standby": ((bool,), False),
    "curve_server_key": ((str, type(None)), False),
    "route": ((str,), True),
}


def new_route() -> str:
    """A fresh secret route for one launch of a pool worker (or of a lane's TP follower)."""
    return secrets.token_hex(16)


def routing_id(name: str, route: str) -> bytes:
    """The ZeroMQ routing id of worker `name` (`trainer-<rank>`, `trainer-<rank>.tp<k>`) in
    the launch whose route is `route`."""
    return f"{name}/{route}".encode()


def split_routing_id(peer: bytes) -> tuple[str, str]:
    """(name, route) of a routing id (`routing_id`); ("", "") when it is not one."""
    name, sep, route = peer.decode("ascii", "replace").rpartition("/")
    return (name, route) if sep and ROUTE.fullmatch(route) else ("", "")


def same_route(a: str, b: str) -> bool:
    """Whether two routes are the same (compared in constant time: the route is a secret)."""
    return hmac.compare_digest(a.encode("ascii", "replace"), b.encode("ascii", "replace"))


def route_from_env(environ: Mapping[str, str]) -> str:
    """The worker's route from `EHP_POOL_ROUTE`; an error naming the variable when it is
    missing or malformed."""
    route = environ.get(ROUTE_ENV, "")
    if not ROUTE.fullmatch(route):
        raise WorkerError(
            f"{ROUTE_ENV} is {'missing' if not route else 'not 32 lowercase hex digits'}",
            "a pool worker's routing id holds the secret route its launcher made for it",
            "start pool workers through the pool (`TrainerPool`) or a host agent's launch, "
            "which set it",
        )
    return route


def pool_token_from_env(environ: Mapping[str, str]) -> str:
    """The worker's pool launch token from `EHP_POOL_TOKEN`; an error naming the variable when
    it is missing or malformed."""
    token = environ.get(POOL_TOKEN_ENV, "")
    if not TOKEN.fullmatch(token):
        raise WorkerError(
            f"{POOL_TOKEN_ENV} is {'missing' if not token else 'not a launch token'}",
            "a pool worker's hellos carry its pool's launch token, which reaches it in its "
            "environment (a command line is readable by every user of the machine)",
            "start pool workers through the pool (`TrainerPool`) or a host agent's launch, "
            "which set it (`TrainerPool.worker_env`)",
        )
    return token


class TrainerLaunchError(WorkerError):
    """A `trainer` field the agent will not start a worker from."""


class BoundPool(Protocol):
    """What `TrainerLaunch.for_pool` reads of a pool (`training.pool.TrainerPool`)."""

    @property
    def config(self) -> PoolConfig: ...

    control: str
    rendezvous: str
    launch_token: str

    def route(self, rank: int) -> str: ...


def _refuse(field: str, why: str, fix: str) -> TrainerLaunchError:
    return TrainerLaunchError(f"trainer.{field} is refused", why, fix)


def _tcp_problem(value: str) -> str | None:
    m = _TCP.fullmatch(value)
    if m is None:
        return f"{value[:80]!r} is not tcp://HOST:PORT"
    if not 0 < int(m.group(1)) < 65536:
        return f"port {m.group(1)} is outside 1..65535"
    return None


@dataclass(frozen=True, kw_only=True)
class TrainerLaunch:
    """One pool rank to start (see the module docstring); checked when built."""

    rank: int
    control: str
    rendezvous: str
    pool_token: str
    config: str
    standby: bool = False
    curve_server_key: str | None = None
    route: str

    def __post_init__(self) -> None:
        """The checks that need no pool configuration (no torch): types, lengths, endpoints,
        token, key. `pool_config()` checks the rest."""
        for name, (types, _) in FIELDS.items():
            value = getattr(self, name)
            if type(value) not in types:  # exact: a bool is no rank
                want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
                raise _refuse(name, f"it is {type(value).__name__}, not {want}", f"send {want}")
        if self.rank < 0:
            raise _refuse("rank", f"rank {self.rank} is negative", "send a pool rank (>= 0)")
        self._check_text()

    def pool_config(self) -> PoolConfig:
        """The pool's configuration, and the checks that need it (the rank within its world,
        standby only for a warm rank). It imports the pool's protocol (torch: a second or
        more), so an agent calls it off its loop."""
        cfg = self._parse_config()
        if not 0 <= self.rank < cfg.world_size:
            raise _refuse(
                "rank",
                f"rank {self.rank} is outside the pool's world of {cfg.world_size}",
                f"send a rank in [0, {cfg.world_size})",
            )
        if self.standby and self.rank < cfg.core_dp:
            raise _refuse(
                "standby",
                f"rank {self.rank} is a Core rank; only a warm worker starts on standby",
                f"send a warm rank (>= {cfg.core_dp}) or standby false",
            )
        return cfg

    def _check_text(self) -> None:
        if len(self.control) > MAX_ENDPOINT_CHARS:
            why: str | None = f"it has {len(self.control)} characters"
        else:
            why = _tcp_problem(self.control)
        if why is not None:
            raise _refuse("control", why, "send the pool's endpoint, tcp://HOST:PORT")
        rdv = self.rendezvous
        if len(rdv) > MAX_RENDEZVOUS_CHARS:
            raise _refuse("rendezvous", f"it has {len(rdv)} characters", "send a shorter path")
        if not (_FILE.fullmatch(rdv) or (rdv.startswith("tcp://") and not _tcp_problem(rdv))):
            raise _refuse(
                "rendezvous",
                f"{rdv[:80]!r} is no Gloo init method",
                "send file:///ABSOLUTE/PATH or tcp://HOST:PORT",
            )
        if not TOKEN.fullmatch(self.pool_token):
            raise _refuse(
                "pool_token",
                "it is not 8..128 letters, digits, '_' or '-'",
                "send the pool's launch token (TrainerPool.launch_token)",
            )
        if len(self.config) > MAX_CONFIG_CHARS:
            raise _refuse(
                "config", f"it has {len(self.config)} characters", "send PoolConfig.to_json()"
            )
        if not ROUTE.fullmatch(self.route):
            raise _refuse(
                "route", "it is not 32 lowercase hex digits", "send the launch's route (new_route)"
            )
        key = self.curve_server_key
        if key is not None and not _Z85_KEY.fullmatch(key):
            raise _refuse(
                "curve_server_key",
                "it is not a 40-character Z85 CURVE public key",
                "send the pool's public key as Z85 text, or null without CURVE",
            )

    def _parse_config(self) -> PoolConfig:
        from ehp_fsm.training.pool_protocol import PoolConfig

        try:
            return PoolConfig.from_json(self.config)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # JSON errors too
            raise _refuse(
                "config",
                f"it is not a pool configuration ({type(exc).__name__}: {str(exc)[:200]})",
                "send PoolConfig.to_json() of the run's pool",
            ) from None

    # -- the wire ---------------------------------------------------------------------------
    @classmethod
    def from_wire(cls, obj: Any) -> TrainerLaunch:
        """A launch command's `trainer` field, checked but for its configuration
        (`TrainerLaunchError` names the field)."""
        if type(obj) is not dict:
            raise TrainerLaunchError(
                "the launch's trainer field is refused",
                f"it is {type(obj).__name__}, not a map",
                f"send a map of {sorted(FIELDS)}",
            )
        unknown = sorted(str(k)[:40] for k in obj if k not in FIELDS)
        if unknown:
            raise TrainerLaunchError(
                "the launch's trainer field is refused",
                f"it has unknown keys {unknown[:5]} (an agent builds the worker's command line "
                "itself: no argv, module or option is taken from a launch)",
                f"send only {sorted(FIELDS)}",
            )
        missing = [k for k, (_, required) in FIELDS.items() if required and k not in obj]
        if missing:
            raise _refuse(missing[0], "it is missing", f"send {sorted(FIELDS)}")
        return cls(**obj)

    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def for_pool(
        cls,
        pool: BoundPool,
        rank: int,
        *,
        standby: bool = False,
        curve_server_key: str | None = None,
        route: str | None = None,
    ) -> TrainerLaunch:
        """Rank `rank` of a bound pool (`TrainerPool.bind`), fully checked; `route`: the
        launch's (None: the pool's current one for that rank)."""
        launch = cls(
            rank=rank,
            control=pool.control,
            rendezvous=pool.rendezvous,
            pool_token=pool.launch_token,
            config=pool.config.to_json(),
            standby=standby,
            curve_server_key=curve_server_key,
            route=pool.route(rank) if route is None else route,
        )
        launch.pool_config()
        return launch

    # -- the process ------------------------------------------------------------------------
    def argv(self, *, parent: ProcessIdentity, python: str = sys.executable) -> list[str]:
        """The worker's command line: the pool's own (`pool_protocol.worker_argv`), with
        `parent` (the launching agent) as the process whose death ends the worker. Checks the
        configuration first (`pool_config`)."""
        from ehp_fsm.training.pool_protocol import worker_argv

        return worker_argv(
            self.pool_config(),
            rank=self.rank,
            control=self.control,
            rendezvous=self.rendezvous,
            parent=parent,
            python=python,
            standby=self.standby,
        )

    def env(self, curve_client_key_file: Path | None) -> dict[str, str]:
        """The worker's route, pool token and CURVE variables (no CURVE ones without
        `curve_server_key`). Refused when the pool wants CURVE and the agent has no key file to
        give the worker."""
        if self.curve_server_key is None:
            return {ROUTE_ENV: self.route, POOL_TOKEN_ENV: self.pool_token}
        if curve_client_key_file is None:
            raise TrainerLaunchError(
                "the pool's control channel needs CURVE keys this agent does not have",
                "the launch names the pool's CURVE server key; the worker authenticates with "
                "its agent's secret key, and this agent was started without --keys",
                "start the agent with --keys DIR (the run's key directory), as the plan's "
                "transport.curve_keys says",
            )
        return {
            ROUTE_ENV: self.route,
            POOL_TOKEN_ENV: self.pool_token,
            CURVE_SERVER_ENV: self.curve_server_key,
            CURVE_CLIENT_ENV: str(curve_client_key_file),
        }


def pool_instance(rank: int) -> str:
    """The instance name of pool rank `rank`'s launch (its log file, its events)."""
    return f"pool-r{rank}"
