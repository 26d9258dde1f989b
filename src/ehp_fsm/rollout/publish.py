"""Publication through the machines: revisions saved, published, installed on every engine.

What it knows: the order of the revision machine's events (`save` → the store writes the
revision atomically → `saved` with its checksum and path → `publish`), how to perform the
`install` commands the machines emit (on `publish` for serving/installing engines, on `healthy`
for a new or restarted engine — install-before-serve — and again after `install_failed`) with
SGLang's `/update_weights_from_disk` (`model_path` = the revision's folder, `weight_version` =
`str(revision)`), and how to report the outcome: `installed` (the engine serves again) or
`install_failed` (it stays out of routing, in `installing`, and the install is retried with a
growing back-off until one succeeds or `give_up_after_s` passes — then the engine's `fail`). An
engine whose process is gone is reported with `fail` at once. The machine's own `deadline` is
fired for an engine stuck in installing/updating past the deadline the machine armed.

Retirement: a revision older than the current one is offered to the machine with `retire` only
when the publisher is not installing it (nor waiting on an install that got no answer: the
server may still be reading it); the machine's guard refuses it while an engine has it
installed or an in-flight group refers to it. Only an accepted `retire` deletes it from the
store (its `delete_revision` command), so disk stays bounded by the revisions still referenced.

What it does not know: requests (see `dispatch`), engine processes (the fleet shell launches and
stops them and fires `launch`/`exited`), or training. Installs run on a small thread pool, one
at a time per engine (the newest wanted revision wins); results come back through a queue that
`poll()` drains, so `Engine.handle` is only called from the caller's thread.

    pub = Publisher(engine, RevisionStore(root))
    pub.attach("e0", SGLangClient(url), alive=handle.is_alive)
    pub.engine_healthy("e0", identity)      # installs the current revision before it serves
    pub.save(revision=r, step=s, state_dict=sd, base=model_dir)  # an HF directory
    pub.publish(r)                          # every serving engine: updating → installed r
    pub.wait_installed(timeout_s=60)        # or call pub.poll() from the run loop
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.transition import Accepted, Command, Outcome, Rejected, step
from ehp_fsm.core.world import Event
from ehp_fsm.rollout.client import SGLangClient
from ehp_fsm.rollout.errors import EngineError, EngineUnreachable, RevisionError
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.shell.loop import ANY, Door, Route, no_wake

REVISION = "revision"
ROLLOUT_ENGINE = "rollout_engine"
OWN_COMMANDS = frozenset({"install", "delete_revision"})
_INSTALLING = frozenset({"installing", "updating"})
_LIVE = frozenset({"starting", "installing", "serving", "updating", "draining"})


def revision_id(revision: int) -> str:
    """The revision machine's instance id of `revision` ("r7")."""
    return f"r{revision}"


@dataclass(frozen=True, kw_only=True)
class PublishConfig:
    """`install_timeout_s` bounds one `/update_weights_from_disk` call; a failed install is
    retried after `retry_backoff_s`, doubling up to `max_backoff_s`, for at most
    `give_up_after_s` since the first failure in a row (then the engine's `fail`)."""

    install_timeout_s: float = 60.0
    retry_backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    give_up_after_s: float = 60.0
    max_workers: int = 4
    auto_retire: bool = True

    def __post_init__(self) -> None:
        if self.install_timeout_s <= 0 or self.give_up_after_s <= 0:
            raise ValueError(
                "install_timeout_s and give_up_after_s must be > 0: an install without a "
                "deadline can hang forever (a known SGLang weight-update failure mode)"
            )
        if self.retry_backoff_s < 0 or self.max_backoff_s < self.retry_backoff_s:
            raise ValueError("need 0 ≤ retry_backoff_s ≤ max_backoff_s")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be ≥ 1, got {self.max_workers}")


@dataclass(kw_only=True)
class PublishStats:
    installs: int = 0
    #: of `installs`: engines found already serving the revision (they started from it)
    installs_skipped: int = 0
    install_failures: int = 0
    engines_failed: int = 0
    retired: list[int] = field(default_factory=list)
    retire_errors: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class _Engine:
    client: SGLangClient
    alive: Callable[[], bool] | None
    wanted: int = 0  # newest revision an `install` command asked for
    running: int | None = None  # revision being installed now
    next_try: float = 0.0
    failing_since: float | None = None
    failures_in_row: int = 0
    # revisions whose install got no answer (a client-side timeout, a dropped connection): the
    # server may still be reading them, so they stay referenced until a later install on this
    # engine succeeds (the server installs one at a time) or the engine is detached
    unsettled: set[int] = field(default_factory=set)
    # when the engine's install that is still unfinished began (None: none is), and when the
    # install running now was sent: a settled world waits for an install only while it is no
    # slower than the run's installs so far (`Publisher.lagging`)
    busy_since: float | None = None
    sent_at: float = 0.0


#: `Publisher.settle_s`: an install is waited for at least this long, and up to this many times
#: the slowest install the run has completed (never past the install deadline)
SETTLE_FLOOR_S: Final = 3.0
SETTLE_FACTOR: Final = 4.0


@dataclass(frozen=True, kw_only=True)
class _Done:
    engine: str
    revision: int
    error: str | None = None
    unanswered: bool = False  # no answer came back: the server may still be installing
    skipped: bool = False  # the engine already served the revision: nothing was loaded


class Publisher:
    """See the module docstring. Every public method must be called from one thread."""

    def __init__(
        self,
        door: Door,
        store: RevisionStore,
        *,
        config: PublishConfig | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.door = door
        # called by an install thread once its result is queued (`Loop.wake`): the install
        # is reported in this loop turn, not when the turn's wait runs out
        self._wake = wake or no_wake
        self.routes: frozenset[Route] = frozenset((ANY, k) for k in OWN_COMMANDS)
        self.store = store
        self.config = config or PublishConfig()
        self.stats = PublishStats()
        self._engines: dict[str, _Engine] = {}
        self._pending: dict[str, int] = {}  # installs asked for engines not attached yet
        self._done: queue.Queue[_Done] = queue.Queue()
        self._pool = ThreadPoolExecutor(self.config.max_workers, thread_name_prefix="ehp-install")
        self._slowest = 0.0  # the longest install an engine completed (seconds)

    # -- engines ---------------------------------------------------------------------------
    def attach(
        self, engine_id: str, client: SGLangClient, *, alive: Callable[[], bool] | None = None
    ) -> None:
        """Install on `engine_id` through `client`; `alive()` tells a dead process apart."""
        st = _Engine(client=client, alive=alive)
        st.wanted = self._pending.pop(engine_id, 0)
        self._engines[engine_id] = st
        self._kick(engine_id)

    def detach(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)
        self._pending.pop(engine_id, None)

    def engine_healthy(self, engine_id: str, identity: Mapping[str, Any]) -> Outcome:
        """Fire `healthy` for a launched engine; its install of the current revision starts at
        once (install-before-serve). Attach the engine first."""
        return self._fire(ROLLOUT_ENGINE, engine_id, "healthy", identity=dict(identity))

    # -- revisions -------------------------------------------------------------------------
    def save(
        self,
        *,
        revision: int,
        step: int,
        state_dict: Mapping[str, torch.Tensor],
        base: str | os.PathLike[str],
    ) -> Outcome:
        """`save`, write the revision atomically — `state_dict`'s tensors with the config and
        tokenizer files of the HF model directory `base` — then `saved` (or `fail` and
        re-raise)."""
        first = self._fire(REVISION, revision_id(revision), "save", revision=revision, step=step)
        if isinstance(first, Rejected):
            return first
        try:
            self.store.save(revision=revision, step=step, state_dict=state_dict, base=base)
        except BaseException as exc:
            self._fire(REVISION, revision_id(revision), "fail", reason=f"save failed: {exc}")
            raise
        return self._saved(revision)

    def register_saved(self, revision: int) -> Outcome:
        """`save` + `saved` for a revision some other writer already put in the store."""
        manifest = self.store.manifest(revision)
        first = self._fire(
            REVISION, revision_id(revision), "save", revision=revision, step=manifest.step
        )
        return first if isinstance(first, Rejected) else self._saved(revision)

    def _saved(self, revision: int) -> Outcome:
        manifest = self.store.manifest(revision)
        return self._fire(
            REVISION,
            revision_id(revision),
            "saved",
            checksum=manifest.checksum,
            path=str(self.store.path(revision)),
        )

    def publish(self, revision: int) -> Outcome:
        """`publish` a saved revision: it becomes current and every serving, updating or
        installing engine is sent to install it."""
        return self._fire(REVISION, revision_id(revision), "publish")

    def save_and_publish(
        self,
        *,
        revision: int,
        step: int,
        state_dict: Mapping[str, torch.Tensor],
        base: str | os.PathLike[str],
    ) -> Outcome:
        out = self.save(revision=revision, step=step, state_dict=state_dict, base=base)
        return out if isinstance(out, Rejected) else self.publish(revision)

    def retire_unreferenced(self) -> list[int]:
        """Offer every revision older than the current one to `retire`; the accepted ones are
        deleted from the store. Returns the revisions retired now."""
        current = int(self.door.world.globals.get("revision", 0))
        busy = self._in_hand()
        busy |= {st.wanted for st in self._engines.values()} | set(self._pending.values())
        retired = []
        for inst in list(self.door.world.of(REVISION).values()):
            rev = int(inst.get("revision") or 0)
            if inst.state not in ("saved", "published") or rev >= current or rev in busy:
                continue
            # Ask the machine first (a pure step, nothing logged): a revision an engine still
            # holds is refused by its guard every step until the engine moves on, and a log
            # of the same refusal each step says nothing.
            probe = Event(REVISION, inst.id, "retire", self.door.now(), {})
            if not step(self.door.world, probe, GUARDS, EFFECTS).accepted:
                continue
            if isinstance(self._fire(REVISION, inst.id, "retire"), Accepted):
                retired.append(rev)
        return retired

    # -- commands and results --------------------------------------------------------------
    def perform(self, command: Command) -> None:
        """Perform an `install` or a `delete_revision` (the loop's routes)."""
        if command.kind == "install":
            self._want(command.instance, int(command.args["revision"]))
        elif command.kind == "delete_revision":
            self._delete(int(command.args["revision"]))

    def poll(self, timeout_s: float = 0.0) -> int:
        """Report finished installs (waiting up to `timeout_s` for the first), start retries
        that are due, fire deadlines that passed; returns the number of installs reported."""
        n = 0
        try:
            item: _Done | None = (
                self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait()
            )
        except queue.Empty:
            item = None
        while item is not None:
            self._report(item)
            n += 1
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                item = None
        for eid in list(self._engines):
            self._kick(eid)
        self._fire_deadlines()
        if n and self.config.auto_retire:
            self.retire_unreferenced()
        return n

    def busy(self) -> bool:
        """True while an install is running or wanted on some engine still installing."""
        for eid, st in self._engines.items():
            state = self._engine_state(eid)
            if st.running is not None or state in _INSTALLING:
                return True
        return False

    def settle_s(self) -> float:
        """How long an install is worth waiting for before deciding without its engine:
        `SETTLE_FACTOR` × the slowest install completed so far, at least `SETTLE_FLOOR_S`, at
        most the install deadline (`install_timeout_s`)."""
        return min(
            self.config.install_timeout_s, max(SETTLE_FLOOR_S, SETTLE_FACTOR * self._slowest)
        )

    def lagging(self) -> list[str]:
        """Engines installing or updating for longer than `settle_s`: not answering (a frozen
        process, a hung weight update) or far slower than every install so far. Their own
        deadline fails them; until then nothing else should wait for them."""
        now, bound = self.door.now(), self.settle_s()
        return [
            eid
            for eid, st in self._engines.items()
            if st.busy_since is not None
            and now - st.busy_since > bound
            and self._engine_state(eid) in _INSTALLING
        ]

    def settled(self) -> bool:
        """`busy()` but for the `lagging` engines: every install still worth waiting for is
        done. A loop that waits for a settled world (the planner between steps) goes on at the
        pace of the engines that answer, not at the install deadline of one that does not."""
        lagging = set(self.lagging())
        for eid, st in self._engines.items():
            if eid in lagging:
                continue
            if st.running is not None or self._engine_state(eid) in _INSTALLING:
                return False
        return True

    def wait_installed(self, *, timeout_s: float) -> bool:
        """Poll until no engine is installing or updating; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll(timeout_s=0.02)
            if not self.busy():
                return True
            if time.monotonic() > deadline:
                return False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals -------------------------------------------------------------------------
    def _fire(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        return self.door.event(machine, instance, name, **payload)

    def _engine_state(self, eid: str) -> str | None:
        inst = self.door.world.get(ROLLOUT_ENGINE, eid)
        return None if inst is None else str(inst.state)

    def _want(self, eid: str, revision: int) -> None:
        st = self._engines.get(eid)
        if st is None:
            self._pending[eid] = max(self._pending.get(eid, 0), revision)
            return
        st.wanted = max(st.wanted, revision)
        self._kick(eid)

    def _kick(self, eid: str) -> None:
        """Start the wanted install on `eid` if none is running and no back-off is pending."""
        st = self._engines.get(eid)
        if st is None or st.running is not None or st.wanted < 1:
            return
        if self._engine_state(eid) not in _INSTALLING or self.door.now() < st.next_try:
            return
        rev = st.wanted
        st.running = rev
        st.sent_at = self.door.now()
        if st.busy_since is None:
            st.busy_since = st.sent_at
        try:
            path = str(self.store.path(rev))
        except RevisionError as exc:
            self._done.put(_Done(engine=eid, revision=rev, error=str(exc)))
            return
        started = self._engine_state(eid) == "installing"  # just launched (or a failed install)
        self._pool.submit(self._install, eid, st.client, rev, path, started)

    def _install(
        self, eid: str, client: SGLangClient, revision: int, path: str, started: bool
    ) -> None:
        """Worker thread: one `/update_weights_from_disk`; never touches the engine world. An
        engine that was launched from this very revision (its weight version says so) is not
        loaded twice: the agent starts engines from the newest revision directory."""
        try:
            if started and client.weight_version() == str(revision):
                self._done.put(_Done(engine=eid, revision=revision, skipped=True))
                self._wake()
                return
            client.update_weights_from_disk(
                path,
                weight_version=str(revision),
                flush_cache=True,
                timeout_s=self.config.install_timeout_s,
            )
            done = _Done(engine=eid, revision=revision)
        except EngineUnreachable as exc:
            done = _Done(engine=eid, revision=revision, error=str(exc), unanswered=True)
        except EngineError as exc:
            done = _Done(engine=eid, revision=revision, error=str(exc))
        except Exception as exc:  # a malformed answer counts as a failed install
            done = _Done(engine=eid, revision=revision, error=f"{type(exc).__name__}: {exc}")
        self._done.put(done)
        self._wake()

    def _report(self, d: _Done) -> None:
        st = self._engines.get(d.engine)
        if st is None:
            return
        st.running = None
        if d.unanswered:
            st.unsettled.add(d.revision)
        if d.error is None:
            st.unsettled.clear()
            self.stats.installs += 1
            self.stats.installs_skipped += int(d.skipped)
            # it answered: the next install (a newer revision published meanwhile) is timed anew
            self._slowest = max(self._slowest, self.door.now() - st.sent_at)
            st.busy_since = None
            out = self._fire(ROLLOUT_ENGINE, d.engine, "installed", revision=d.revision)
            if isinstance(out, Accepted):
                st.failing_since, st.failures_in_row = None, 0
            # refused: a newer revision was published meanwhile (its install is wanted) or the
            # engine left installing/updating; either way nothing else to do here
            return
        self.stats.install_failures += 1
        now = self.door.now()
        state = self._engine_state(d.engine)
        if state not in _INSTALLING:
            return
        if st.alive is not None and not st.alive():
            self._fail(d.engine, f"process gone during install of revision {d.revision}: {d.error}")
            return
        if st.failing_since is None:
            st.failing_since = now
        st.failures_in_row += 1
        if now - st.failing_since > self.config.give_up_after_s:
            self._fail(
                d.engine,
                f"install of revision {d.revision} kept failing for "
                f"{now - st.failing_since:.1f}s: {d.error}",
            )
            return
        backoff = min(
            self.config.max_backoff_s,
            self.config.retry_backoff_s * 2.0 ** min(st.failures_in_row - 1, 32),
        )
        st.next_try = now + backoff
        self._fire(
            ROLLOUT_ENGINE,
            d.engine,
            "install_failed",
            revision=d.revision,
            reason=d.error[:500],
        )

    def _fail(self, eid: str, reason: str) -> None:
        if isinstance(self._fire(ROLLOUT_ENGINE, eid, "fail", reason=reason[:500]), Accepted):
            self.stats.engines_failed += 1

    def _fire_deadlines(self) -> None:
        now = self.door.now()
        for eid in list(self._engines):
            inst = self.door.world.get(ROLLOUT_ENGINE, eid)
            if inst is None or inst.state not in _INSTALLING:
                continue
            deadline = inst.get("deadline")
            if deadline is not None and now >= float(deadline):
                self._fire(ROLLOUT_ENGINE, eid, "deadline", reason="install deadline passed")

    def _referenced(self) -> set[int]:
        world = self.door.world
        refs = {
            int(e.get("installed"))
            for e in world.of(ROLLOUT_ENGINE).values()
            if e.state in _LIVE and e.get("installed") is not None
        }
        refs |= {
            int(r.get("revision"))
            for r in world.of("request").values()
            if r.state == "dispatched" and r.get("revision") is not None
        }
        return refs | self._in_hand()

    def _in_hand(self) -> set[int]:
        """Revisions an engine's server may be reading now: the install running and those
        whose install went unanswered (see `_Engine.unsettled`)."""
        held: set[int] = set()
        for st in self._engines.values():
            held |= st.unsettled
            if st.running is not None:
                held.add(st.running)
        return held

    def _delete(self, revision: int) -> None:
        try:
            self.store.retire(revision, referenced=self._referenced())
            self.stats.retired.append(revision)
        except RevisionError as exc:  # the machine retired it; the disk keeps it (reported)
            self.stats.retire_errors.append(str(exc))
