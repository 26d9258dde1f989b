"""The controller's side of the pool workers its agents launch: the run asks a host's agent to
start one rank of its trainer pool, and hears back whether it runs, failed to start, or exited.

A pool worker is no machine of the engine world. Its news — the agent's `launched`,
`launch_failed` and `exited` events for machine `pool_worker`, a refused launch, what an agent's
reconcile report says of it — never becomes an event of the state machines: it becomes a
`PoolWorkerEvent` for the run, handed to each listener (`subscribe`, called on the controller
loop's thread) and put on a thread-safe queue (`drain`, for the thread that steps the pool).

Which pool workers may run: those of launches the run asked for (`launch`) of the current pool
(the pool token of the run's live pool) that it has not stopped. An agent's report naming any
other pool worker — a stale launch after the run restarted (a fresh controller knows no launch:
every pool worker its agents still run is stopped), a launch of a retired pool, a process under
a known token with another identity — makes the controller stop that process by its identity.
A launch the agent does not run any more, by its reconcile, is reported gone (`launch_failed`
before it ran, else `exited`).

Knows: the launches (`PoolLaunch`, by the agent launch token), the current pool token, the
agent commands that launch and stop them. Does not know: the pool (the run feeds what it learns
here to its `TrainerPool`), the engine world, sockets (it sends through the reconciler's `send`:
held until the agent has reconciled).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from ehp_fsm.errors import EhpError
from ehp_fsm.runtime.identity import same_record as same_identity
from ehp_fsm.runtime.identity import token_hint
from ehp_fsm.runtime.pool_launch import TOKEN, TrainerLaunch, pool_instance
from ehp_fsm.runtime.workers import ROLE_POOL_WORKER

POOL_MACHINE: Final = ROLE_POOL_WORKER

EventKind = Literal["launched", "launch_failed", "exited"]
LaunchState = Literal["sent", "running", "stopping", "gone"]


class PoolWorkersError(EhpError):
    """The run asked for a pool worker launch the controller will not send."""


@dataclass(frozen=True, kw_only=True)
class PoolWorkerEvent:
    """What happened to one pool worker launch (see the module docstring).

    `token`: the launch's agent token (the one given to `launch`); `identity`: the process as
    its agent knows it, `{host (plan host id), pid, start_time, token}` (`launched`, and
    `exited` once known); `returncode`: the exit code when the agent saw it (None when the
    agent does not know: an adopted process, a process its reconcile no longer reports);
    `stopped`: the agent stopped it (the run's `stop`, the controller's lease, the agent's
    shutdown); `reason`: why a launch failed or a worker is reported gone without its exit."""

    kind: EventKind
    host: str
    rank: int
    token: str
    pool_token: str
    identity: Mapping[str, Any] | None = None
    returncode: int | None = None
    stopped: bool = False
    reason: str = ""


@dataclass
class PoolLaunch:
    """One pool worker launch the run asked for."""

    host: str
    token: str
    trainer: TrainerLaunch
    gpus: tuple[str, ...] = ()
    state: LaunchState = "sent"
    identity: dict[str, Any] | None = None

    @property
    def rank(self) -> int:
        return self.trainer.rank

    @property
    def instance(self) -> str:
        return pool_instance(self.trainer.rank)


Send = Callable[[str, str, str, Mapping[str, Any]], None]  # (op, host, instance, args)
Listener = Callable[[PoolWorkerEvent], None]


def is_pool_entry(entry: Mapping[str, Any]) -> bool:
    """Whether an agent's reconcile entry is a pool worker."""
    labels = entry.get("labels") or {}
    return POOL_MACHINE in (labels.get("machine"), labels.get("role"))


class PoolWorkers:
    """The run's pool worker launches (see the module docstring). Not thread-safe except
    `drain`: call the rest on the controller loop's thread."""

    def __init__(self, *, send: Send, log: Any) -> None:
        self._send = send
        self.log = log
        self.pool_token: str | None = None
        self.launches: dict[str, PoolLaunch] = {}
        self._listeners: list[Listener] = []
        self._queue: queue.SimpleQueue[PoolWorkerEvent] = queue.SimpleQueue()

    # -- the run's side ----------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        """Call `listener(event)` for every event, on the controller loop's thread (it must
        not block: the loop serves every agent)."""
        self._listeners.append(listener)

    def drain(self) -> list[PoolWorkerEvent]:
        """Every event not drained yet, oldest first (any thread may call it)."""
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def launch(
        self, host: str, trainer: TrainerLaunch, token: str, *, gpus: Sequence[str] = ()
    ) -> None:
        """Ask `host`'s agent to start `trainer` (sent once the agent has reconciled). The
        first launch names the current pool; a launch for another pool is refused until the
        run `retire`s the current one. Raises `TrainerLaunchError` for a `trainer` its agent
        would refuse (the run learns it here, not later from the agent)."""
        trainer.pool_config()
        if not TOKEN.fullmatch(token):
            raise PoolWorkersError(
                f"launch token {token[:40]!r} is refused",
                "it is not 8..128 letters, digits, '_' or '-'",
                "pass identity.new_launch_token()",
            )
        if token in self.launches:
            raise PoolWorkersError(
                f"launch token {token_hint(token)} was used already",  # a secret: its start
                "a token names one launch (an agent answers a repeated one as done)",
                "pass a fresh token for each launch",
            )
        if self.pool_token is not None and trainer.pool_token != self.pool_token:
            raise PoolWorkersError(
                "this launch is for another pool than the current one",
                "pool workers of one pool at a time may run: the others are stopped",
                "retire the current pool first (retire_pool)",
            )
        self.pool_token = trainer.pool_token
        launch = PoolLaunch(host=host, token=token, trainer=trainer, gpus=tuple(gpus))
        self.launches[token] = launch
        self.log.info("pool_worker_launch", host=host, rank=trainer.rank, token=token)
        self._send(
            "launch",
            host,
            launch.instance,
            {
                "machine": POOL_MACHINE,
                "instance": launch.instance,
                "role": POOL_MACHINE,
                "gpus": list(launch.gpus),
                "token": token,
                "trainer": trainer.to_wire(),
            },
        )

    def stop(self, token: str) -> bool:
        """Stop launch `token`'s worker (by its identity; before it is known, by its token).
        Its `exited` (stopped=True) follows. False when there is nothing to stop."""
        launch = self.launches.get(token)
        if launch is None or launch.state in ("gone", "stopping"):
            return False
        launch.state = "stopping"
        self._send_stop(launch)
        return True

    def retire(self) -> list[str]:
        """Stop every worker of the current pool and forget it (a new pool may launch)."""
        stopped = [t for t in list(self.launches) if self.stop(t)]
        self.pool_token = None
        return stopped

    def _send_stop(self, launch: PoolLaunch) -> None:
        args: dict[str, Any] = {"machine": POOL_MACHINE, "instance": launch.instance}
        if launch.identity is not None:
            self._send(
                "stop_process",
                launch.host,
                launch.instance,
                {**args, "identity": dict(launch.identity)},
            )
        else:
            self._send(
                "cancel_launch", launch.host, launch.instance, {**args, "token": launch.token}
            )

    def _stop_stray(self, host: str, instance: str, identity: Mapping[str, Any], why: str) -> None:
        self.log.warning(
            "pool_worker_stray_stopped",
            host=host,
            pid=identity.get("pid"),
            token=identity.get("token"),
            why=why,
        )
        args = {"machine": POOL_MACHINE, "instance": instance, "identity": dict(identity)}
        self._send("stop_process", host, instance, args)

    def _emit(self, launch: PoolLaunch, kind: EventKind, **fields: Any) -> None:
        if kind != "launched":
            launch.state = "gone"
        event = PoolWorkerEvent(
            kind=kind,
            host=launch.host,
            rank=launch.rank,
            token=launch.token,
            pool_token=launch.trainer.pool_token,
            **fields,
        )
        self.log.info(
            "pool_worker_event", kind=kind, host=launch.host, rank=launch.rank, token=launch.token
        )
        self._queue.put(event)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception as exc:  # a failing listener must not stop the loop
                self.log.error("pool_worker_listener_failed", kind=kind, error=repr(exc))

    def _owned(self, token: str, host: str) -> PoolLaunch | None:
        """The live launch `token` on `host` of the current pool; None: nobody wants it."""
        launch = self.launches.get(token)
        if launch is None or launch.host != host or launch.state == "gone":
            return None
        if launch.trainer.pool_token != self.pool_token and launch.state != "stopping":
            return None
        return launch

    # -- the agents' side (the reconciler calls these on the loop's thread) ------------------
    def on_event(self, host: str, name: str, data: Mapping[str, Any]) -> None:
        """An agent event about a pool worker (its sender already checked)."""
        ident = data.get("identity")
        token = str(ident.get("token") if isinstance(ident, Mapping) else data.get("token"))
        launch = self._owned(token, host)
        if name == "launched" and isinstance(ident, Mapping):
            if launch is None:
                self._stop_stray(
                    host, str(data.get("instance", "")), ident, "no live pool asked for it"
                )
            elif launch.identity is None:
                self._up(launch, dict(ident))
            elif not same_identity(launch.identity, ident):
                self._stop_stray(host, launch.instance, ident, "another process under its token")
        elif name == "launch_failed" and launch is not None:
            self._emit(
                launch,
                "launch_failed",
                reason=f"launch failed on {host}: {data.get('reason', '')}"[:500],
            )
        elif name == "exited" and launch is not None and isinstance(ident, Mapping):
            if launch.identity is not None and not same_identity(launch.identity, ident):
                return  # another process under its token exited (a stray we stopped)
            code = data.get("returncode")
            self._emit(
                launch,
                "exited",
                identity=dict(ident),
                returncode=code if type(code) is int else None,
                stopped=data.get("stopped") is True,
            )
        else:
            self.log.info("pool_worker_event_ignored", host=host, name=name, token=token[:64])

    def _up(self, launch: PoolLaunch, identity: dict[str, Any]) -> None:
        launch.identity = identity
        if launch.state == "sent":
            launch.state = "running"
        elif launch.state == "stopping":
            self._send_stop(launch)  # a stop sent by token before it ran: now by identity
        self._emit(launch, "launched", identity=identity)

    def on_reply(self, op: str, host: str, args: Mapping[str, Any], ok: bool, result: Any) -> None:
        """An agent's reply to a pool worker command: a refused launch is `launch_failed`; a
        refused stop because the process is gone is `exited`, and so is a stop by token of a
        launch the agent never ran (stopped before it was sent: nothing else would follow)."""
        if ok:
            launch = self.launches.get(str(args.get("token")))
            cancelled = result.get("cancelled") if isinstance(result, Mapping) else None
            if (
                op == "cancel_launch"
                and cancelled == "not_running"
                and launch is not None
                and launch.state == "stopping"
                and launch.identity is None
            ):
                why = "stopped before its process started"
                self._emit(launch, "exited", stopped=True, reason=why)
            return
        self.log.warning("pool_worker_command_refused", op=op, host=host, result=result)
        res = result if isinstance(result, Mapping) else {}
        if op == "launch":
            launch = self._owned(str(args.get("token")), host)
            if (
                launch is not None
                and launch.state in ("sent", "stopping")
                and launch.identity is None
            ):
                why = (
                    f"agent {host} refused the launch: {res.get('reason')}: {res.get('detail', '')}"
                )
                self._emit(launch, "launch_failed", reason=why[:1000])
        elif op == "stop_process" and res.get("reason") == "not_same_process":
            ident = args.get("identity")
            if not isinstance(ident, Mapping):
                return
            launch = self._owned(str(ident.get("token")), host)
            if launch is not None and same_identity(launch.identity, ident):
                why = "its process is gone (the agent found the pid absent or reused)"
                self._emit(
                    launch,
                    "exited",
                    identity=dict(ident),
                    stopped=launch.state == "stopping",
                    reason=why,
                )

    def still_wanted(self, op: str, args: Mapping[str, Any]) -> bool:
        """Whether a pool worker command given up (or held) is still worth sending."""
        if op != "launch":
            return True  # stops: an extra one is harmless (agents are idempotent)
        launch = self.launches.get(str(args.get("token")))
        return (
            launch is not None
            and launch.state == "sent"
            and launch.trainer.pool_token == self.pool_token
        )

    def reconcile(
        self,
        host: str,
        entries: Mapping[str, tuple[dict[str, Any], Mapping[str, Any]]],
        launching: set[str],
    ) -> None:
        """An agent's report of its pool workers (`entries`: launch token → (identity record,
        labels); `launching`: launch tokens still in flight or held for it): a launch it runs
        that we did not know up is `launched`; one it does not run is gone; a worker nobody
        wants is stopped."""
        reported = dict(entries)
        for launch in [x for x in self.launches.values() if x.host == host]:
            if launch.state == "gone":
                continue
            entry = reported.pop(launch.token, None)
            if entry is None:
                if launch.token in launching and launch.identity is None:
                    continue
                why = f"agent {host} does not run it (reconcile)"
                if launch.identity is None and launch.state == "sent":
                    self._emit(launch, "launch_failed", reason=why)
                else:
                    self._emit(
                        launch,
                        "exited",
                        identity=launch.identity,
                        stopped=launch.state == "stopping",
                        reason=why,
                    )
                continue
            ident, labels = entry
            if labels.get("phase") == "starting":
                continue
            if self._owned(launch.token, host) is None:
                reported[launch.token] = entry  # a retired pool's: stopped below
            elif launch.identity is None:
                self._up(launch, ident)
            elif not same_identity(launch.identity, ident):
                self._stop_stray(host, launch.instance, ident, "another process under its token")
            elif launch.state == "stopping" and labels.get("phase") != "stopping":
                self._send_stop(launch)
        for token, (ident, labels) in reported.items():
            instance = str(labels.get("instance", ""))
            if labels.get("phase") == "starting":
                args = {"machine": POOL_MACHINE, "instance": instance, "token": token}
                self._send("cancel_launch", host, instance, args)
            else:
                self._stop_stray(host, instance, ident, "no live pool asked for it")
