"""The planner's inputs and outputs: a world snapshot, metrics, policy, memory, and the decision.

What it knows: the shape of every value the global resource planner (GRP) reads or returns, and
the consistency rules a snapshot must satisfy to be planned on (ids unique, GPUs on the host of
whoever holds them, no GPU listed by two live holders, owners that exist). Every value is a
frozen, keyword-only dataclass validated in `__post_init__`; a bad value raises
`PlannerInputError` naming the field, the reason and the fix.

What it does not know: how a decision is computed (`ehp_fsm.core.planner`) nor how it is carried
out (the engine's machines do that, re-checking every action with their guards). State names are
plain strings from the shared vocabulary, so a caller can pass its own enums' `.value`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import ClassVar, Final

from ehp_fsm.errors import EhpError

__all__ = [
    "ENGINE_STATES",
    "GPU_STATES",
    "HYBRID_CURRENT",
    "HYBRID_JOINING",
    "HYBRID_STATES",
    "Action",
    "CancelJoin",
    "ClusterView",
    "CoreLayout",
    "Decision",
    "EngineView",
    "GpuView",
    "HybridView",
    "Metrics",
    "PlannerInputError",
    "PlannerPolicy",
    "PlannerState",
    "RestartEngine",
    "Shortfall",
    "StartHybrid",
    "StopEngine",
    "StopHybrid",
]


class PlannerInputError(EhpError):
    """A planner input (snapshot, metrics, policy, memory) is inconsistent or out of range."""

    def __init__(self, field: str, why: str, fix: str) -> None:
        self.field = field
        super().__init__(f"planner input `{field}` is invalid", why, fix)


GPU_STATES: Final = frozenset({"free", "owned", "releasing", "quarantined", "failed"})
ENGINE_STATES: Final = (
    "starting",
    "installing",
    "serving",
    "updating",
    "draining",
    "stopping",
    "stopped",
    "failed",
)
ENGINE_TERMINAL: Final = frozenset({"stopped", "failed"})
HYBRID_STATES: Final = (
    "requested",
    "allocated",
    "launching",
    "loading",
    "ready",
    "active",
    "leaving",
    "stopped",
    "cancelled",
    "failed",
)
HYBRID_TERMINAL: Final = frozenset({"stopped", "cancelled", "failed"})
HYBRID_JOINING: Final = ("allocated", "launching", "loading", "ready")
#: Replicas that count as "current": asked for, joining, or active. `leaving` is on its way out.
HYBRID_CURRENT: Final = ("requested", *HYBRID_JOINING, "active")
DIRECTIONS: Final = frozenset({"borrow", "return", "hold"})
_OWNER_PREFIXES: Final = ("engine:", "hybrid:")


def _bad(field: str, why: str, fix: str) -> PlannerInputError:
    return PlannerInputError(field, why, fix)


def _need_nonneg_int(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(field, f"it is {value!r}, not a non-negative int", "pass a count >= 0")


def _need_finite(field: str, value: float, *, low: float = 0.0, strict: bool = False) -> None:
    ok = isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (value > low if strict else value >= low)
    if not ok:
        rel = ">" if strict else ">="
        raise _bad(field, f"it is {value!r}", f"pass a finite number {rel} {low}")


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuView:
    """One physical GPU. `owner` is `core`, `engine:<id>`, `hybrid:<id>`, or None (free)."""

    gpu_id: str
    host: str
    state: str
    owner: str | None = None

    def __post_init__(self) -> None:
        where = f"gpus[{self.gpu_id}]"
        if self.state not in GPU_STATES:
            raise _bad(f"{where}.state", f"{self.state!r} is not a GPU state", _one_of(GPU_STATES))
        if self.state == "free" and self.owner is not None:
            raise _bad(f"{where}.owner", "a free GPU has no owner", "set owner=None or state")
        if self.state in ("owned", "releasing") and self.owner is None:
            raise _bad(f"{where}.owner", f"a {self.state} GPU needs an owner", "name the owner")
        if self.owner is not None and self.owner != "core":
            kind, _, ident = self.owner.partition(":")
            if f"{kind}:" not in _OWNER_PREFIXES or not ident:
                raise _bad(
                    f"{where}.owner",
                    f"{self.owner!r} is not `core`, `engine:<id>` or `hybrid:<id>`",
                    "use the shared owner strings",
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineView:
    """One rollout engine: `tp` GPUs of one host. Load is what it holds now (for tie-breaks)."""

    engine_id: str
    host: str
    tp: int
    gpu_ids: tuple[str, ...]
    state: str
    active_requests: int = 0
    queued_requests: int = 0
    #: `engine:<engine_id>`, derived (not passed).
    owner: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "owner", f"engine:{self.engine_id}")
        where = f"engines[{self.engine_id}]"
        if self.state not in ENGINE_STATES:
            raise _bad(
                f"{where}.state", f"{self.state!r} is not an engine state", _one_of(ENGINE_STATES)
            )
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise _bad(f"{where}.tp", f"it is {self.tp!r}", "pass a TP size >= 1")
        if len(self.gpu_ids) != self.tp or len(set(self.gpu_ids)) != self.tp:
            raise _bad(
                f"{where}.gpu_ids",
                f"a TP{self.tp} engine lists {len(self.gpu_ids)} GPU id(s), distinct or not",
                "list exactly tp distinct GPU ids",
            )
        _need_nonneg_int(f"{where}.active_requests", self.active_requests)
        _need_nonneg_int(f"{where}.queued_requests", self.queued_requests)

    @property
    def live(self) -> bool:
        return self.state not in ENGINE_TERMINAL


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridView:
    """One Hybrid replica. A `requested` replica may list no GPUs yet."""

    hybrid_id: str
    host: str
    gpu_ids: tuple[str, ...]
    state: str

    def __post_init__(self) -> None:
        where = f"hybrids[{self.hybrid_id}]"
        if self.state not in HYBRID_STATES:
            raise _bad(
                f"{where}.state", f"{self.state!r} is not a Hybrid state", _one_of(HYBRID_STATES)
            )
        if len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise _bad(f"{where}.gpu_ids", "a GPU id is listed twice", "list each GPU once")
        if not self.gpu_ids and self.state not in ("requested", *HYBRID_TERMINAL):
            raise _bad(
                f"{where}.gpu_ids",
                f"a Hybrid in state {self.state!r} holds GPUs but lists none",
                "list its allocated GPUs",
            )

    @property
    def owner(self) -> str:
        return f"hybrid:{self.hybrid_id}"

    @property
    def live(self) -> bool:
        return self.state not in HYBRID_TERMINAL


@dataclass(frozen=True, kw_only=True, slots=True)
class CoreLayout:
    """The fixed Core training layout: `replicas` data-parallel replicas of `replica_size` GPUs."""

    replicas: int
    replica_size: int

    def __post_init__(self) -> None:
        _need_nonneg_int("core.replicas", self.replicas)
        if isinstance(self.replica_size, bool) or not isinstance(self.replica_size, int):
            raise _bad("core.replica_size", f"it is {self.replica_size!r}", "pass an int >= 1")
        if self.replica_size < 1:
            raise _bad("core.replica_size", f"it is {self.replica_size}", "pass an int >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterView:
    """A consistent snapshot of the world, taken at world version `version`."""

    version: int
    hosts: tuple[str, ...]
    gpus: tuple[GpuView, ...]
    engines: tuple[EngineView, ...]
    hybrids: tuple[HybridView, ...]
    core: CoreLayout

    def __post_init__(self) -> None:
        _need_nonneg_int("version", self.version)
        if not _snapshot_consistent(self.hosts, self.gpus, self.engines, self.hybrids):
            _explain_snapshot(self.hosts, self.gpus, self.engines, self.hybrids)


def _snapshot_consistent(
    hosts: tuple[str, ...],
    gpus: tuple[GpuView, ...],
    engines: tuple[EngineView, ...],
    hybrids: tuple[HybridView, ...],
) -> bool:
    """Whether `_explain_snapshot` would accept the snapshot: one dict look-up per listed GPU.

    Accepts exactly what `_explain_snapshot` accepts (tests check the two agree on random and
    corrupted snapshots and on edge cases); it only says yes or no, so a no is followed by
    `_explain_snapshot`, which names the first problem. Two facts keep it to one pass:
    * every GPU owned by an engine or replica is listed by that holder exactly when the listed
      GPUs owned by their lister are as many as the GPUs with such an owner (each holder lists a
      GPU once, and holder ids are unique);
    * two live holders can list one GPU only if it is lost (no owner): a GPU with an owner is
      that owner's for both, and only one of them is the owner.
    """
    host_set = set(hosts)
    by_id = {g.gpu_id: g for g in gpus}
    if (
        len(host_set) != len(hosts)
        or len(by_id) != len(gpus)
        or not {g.host for g in gpus} <= host_set
        or len({e.engine_id for e in engines}) != len(engines)
        or len({h.hybrid_id for h in hybrids}) != len(hybrids)
    ):
        return False
    # Generators, not lists: a list of one tuple per holder would be kept alive and tracked by
    # the garbage collector, which then walks it again and again on a large snapshot.
    holders = itertools.chain(
        ((e.host, e.owner, e.state not in ENGINE_TERMINAL, e.gpu_ids) for e in engines),
        ((h.host, h.owner, h.state not in HYBRID_TERMINAL, h.gpu_ids) for h in hybrids),
    )
    matched = 0
    lost_listed: set[str] = set()
    for host, owner, live, gpu_ids in holders:
        for gid in gpu_ids:
            g = by_id.get(gid)
            if g is None or g.host != host:
                return False
            if g.owner == owner:
                matched += 1
            elif live:
                if g.owner is not None or g.state not in ("quarantined", "failed"):
                    return False
                if gid in lost_listed:
                    return False
                lost_listed.add(gid)
    held = len([g for g in gpus if g.owner is not None and g.owner != "core"])
    return matched == held


def _explain_snapshot(
    hosts: tuple[str, ...],
    gpus: tuple[GpuView, ...],
    engines: tuple[EngineView, ...],
    hybrids: tuple[HybridView, ...],
) -> None:
    """Check a snapshot record by record; raise `PlannerInputError` naming the first problem."""
    host_set = set(hosts)
    if len(host_set) != len(hosts):
        raise _bad("hosts", "a host name is listed twice", "list each host once")
    by_id: dict[str, GpuView] = {}
    for g in gpus:
        if g.gpu_id in by_id:
            raise _bad(f"gpus[{g.gpu_id}]", "the GPU id is listed twice", "use unique GPU ids")
        if g.host not in host_set:
            raise _bad(f"gpus[{g.gpu_id}].host", f"{g.host!r} is not in hosts", "add the host")
        by_id[g.gpu_id] = g
    holders: dict[str, tuple[str, tuple[str, ...], str, bool]] = {}
    for e in engines:
        _holders_add(holders, "engine", e.engine_id, e.host, e.gpu_ids, e.live, e.owner)
    for h in hybrids:
        _holders_add(holders, "hybrid", h.hybrid_id, h.host, h.gpu_ids, h.live, h.owner)
    live_user: dict[str, str] = {}
    for owner, (host, gpu_ids, where, live) in holders.items():
        for gid in gpu_ids:
            held = by_id.get(gid)
            if held is None:
                raise _bad(f"{where}.gpu_ids", f"GPU {gid!r} is not in gpus", "list known GPUs")
            g = held
            if g.host != host:
                raise _bad(
                    f"{where}.gpu_ids",
                    f"GPU {gid!r} is on host {g.host!r}, not {host!r}",
                    "an engine or replica lives on one host",
                )
            if not live:
                continue
            if gid in live_user:
                raise _bad(
                    f"{where}.gpu_ids",
                    f"GPU {gid!r} is also held by {live_user[gid]} (two owners)",
                    "reconcile the ledger before planning",
                )
            live_user[gid] = owner
            lost = g.state in ("quarantined", "failed") and g.owner is None
            if g.owner != owner and not lost:
                raise _bad(
                    f"gpus[{gid}].owner",
                    f"it is {g.owner!r} while live {owner} lists the GPU",
                    "snapshot the ledger and the machines at the same version",
                )
    for g in gpus:
        if g.owner is None or g.owner == "core":
            continue
        entry = holders.get(g.owner)
        if entry is None or g.gpu_id not in entry[1]:
            raise _bad(
                f"gpus[{g.gpu_id}].owner",
                f"owner {g.owner!r} does not exist or does not list this GPU",
                "snapshot the ledger and the machines at the same version",
            )


def _holders_add(
    holders: dict[str, tuple[str, tuple[str, ...], str, bool]],
    kind: str,
    ident: str,
    host: str,
    gpu_ids: tuple[str, ...],
    live: bool,
    owner: str,
) -> None:
    """Record one engine or replica for `ClusterView`'s cross-checks (ids must be unique)."""
    where = f"{kind}s[{ident}]"
    if owner in holders:
        raise _bad(where, f"the {kind} id is listed twice", f"use unique {kind} ids")
    holders[owner] = (host, gpu_ids, where, live)


def _one_of(names: frozenset[str] | tuple[str, ...]) -> str:
    return "use one of " + ", ".join(sorted(names))


# --------------------------------------------------------------------------- metrics, policy


@dataclass(frozen=True, kw_only=True, slots=True)
class Metrics:
    """Recent rollout and training measurements.

    `train_seconds` / `rollout_seconds`: time of the last step's training and rollout phases (or
    their moving averages); their ratio is the main signal. `queue_pressure`: queued groups per
    group the serving engines can take at once (>= 1 means a backlog). `active_pressure`:
    in-flight requests over serving capacity. `accepted` / `rejected`: admissions since the last
    decision. `steps_left`: the steps still to train after this decision (None: unknown); a move
    is made only when the time it is predicted to save over them outweighs what it costs.
    """

    train_seconds: float
    rollout_seconds: float
    queue_pressure: float = 0.0
    active_pressure: float = 0.0
    accepted: int = 0
    rejected: int = 0
    steps_left: int | None = None

    def __post_init__(self) -> None:
        _need_finite("metrics.train_seconds", self.train_seconds, strict=True)
        _need_finite("metrics.rollout_seconds", self.rollout_seconds, strict=True)
        _need_finite("metrics.queue_pressure", self.queue_pressure)
        _need_finite("metrics.active_pressure", self.active_pressure)
        _need_nonneg_int("metrics.accepted", self.accepted)
        _need_nonneg_int("metrics.rejected", self.rejected)
        if self.steps_left is not None:
            _need_nonneg_int("metrics.steps_left", self.steps_left)

    @property
    def train_rollout_ratio(self) -> float:
        return self.train_seconds / self.rollout_seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerPolicy:
    """The plan's EHP policy.

    Borrow when train/rollout time ratio >= `borrow_threshold`, return when it is <=
    `release_threshold`, hold in between (hysteresis: the band must be non-empty). A change may
    not be reversed for `cooldown_s` plus the time its own actions take to settle:
    `engine_restart_s` when it stopped or restarted an engine, `release_resume_s` otherwise.
    `rollout_reserve` is counted in physical GPUs of serving engines. `saturation_pressure`:
    queue or active pressure at which rollout counts as saturated (no borrowing, and restarted
    engines use the smallest allowed TP).

    What the planner needs to predict a move's step time (`ehp_fsm.core.planner_predict`):
    `groups_per_step`, the G groups of one step that the training replicas share (0: unknown,
    training time is then taken to scale with 1/replicas), and `rollout_overlaps_training`
    (max_staleness >= 1: the step takes the longer of training and rollout, else their sum).

    `min_hybrids`: a floor the operator sets — while fewer Hybrids are current, the planner
    borrows up to it whatever the measured times predict (within the reserve, the batch's
    groups and a return's cooldown), and a return never takes the count below it.
    """

    rollout_reserve: int
    replica_size: int
    allowed_engine_tps: tuple[int, ...]
    borrow_threshold: float
    release_threshold: float
    cooldown_s: float
    engine_restart_s: float
    release_resume_s: float
    max_hybrids: int
    saturation_pressure: float = 1.0
    groups_per_step: int = 0
    rollout_overlaps_training: bool = True
    min_hybrids: int = 0

    def __post_init__(self) -> None:
        _need_nonneg_int("policy.rollout_reserve", self.rollout_reserve)
        _need_nonneg_int("policy.min_hybrids", self.min_hybrids)
        _need_nonneg_int("policy.groups_per_step", self.groups_per_step)
        if not isinstance(self.rollout_overlaps_training, bool):
            raise _bad(
                "policy.rollout_overlaps_training",
                f"it is {self.rollout_overlaps_training!r}",
                "pass True (max_staleness >= 1) or False",
            )
        _need_nonneg_int("policy.max_hybrids", self.max_hybrids)
        if self.min_hybrids > self.max_hybrids:
            raise _bad(
                "policy.min_hybrids",
                f"{self.min_hybrids} is above max_hybrids {self.max_hybrids}",
                "set min_hybrids between 0 and max_hybrids",
            )
        if isinstance(self.replica_size, bool) or not isinstance(self.replica_size, int):
            raise _bad("policy.replica_size", f"it is {self.replica_size!r}", "pass an int >= 1")
        if self.replica_size < 1:
            raise _bad("policy.replica_size", f"it is {self.replica_size}", "pass an int >= 1")
        tps = self.allowed_engine_tps
        if not tps or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tps):
            raise _bad("policy.allowed_engine_tps", f"it is {tps!r}", "list TP sizes >= 1")
        if tuple(sorted(set(tps))) != tps:
            raise _bad(
                "policy.allowed_engine_tps", f"{tps!r} is not sorted and unique", "sort them"
            )
        _need_finite("policy.release_threshold", self.release_threshold, strict=True)
        _need_finite("policy.borrow_threshold", self.borrow_threshold, strict=True)
        if self.borrow_threshold <= self.release_threshold:
            raise _bad(
                "policy.borrow_threshold",
                f"{self.borrow_threshold} <= release_threshold {self.release_threshold}, "
                "so there is no hysteresis band and decisions would flap",
                "set borrow_threshold above release_threshold",
            )
        _need_finite("policy.cooldown_s", self.cooldown_s)
        _need_finite("policy.engine_restart_s", self.engine_restart_s)
        _need_finite("policy.release_resume_s", self.release_resume_s)
        if self.release_resume_s > self.engine_restart_s:
            raise _bad(
                "policy.release_resume_s",
                f"{self.release_resume_s} s exceeds engine_restart_s {self.engine_restart_s} s",
                "a release/resume is the cheap path; check the two costs",
            )
        _need_finite("policy.saturation_pressure", self.saturation_pressure, strict=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerState:
    """The planner's own memory, returned in every `Decision.next_state` and passed back in."""

    last_change_at: float | None = None
    last_direction: str | None = None
    settle_s: float = 0.0

    def __post_init__(self) -> None:
        if self.last_direction not in (None, "borrow", "return"):
            raise _bad("state.last_direction", f"it is {self.last_direction!r}", "borrow/return")
        if (self.last_change_at is None) != (self.last_direction is None):
            raise _bad(
                "state.last_change_at",
                "last_change_at and last_direction are set together or not at all",
                "pass both or neither",
            )
        if self.last_change_at is not None:
            _need_finite("state.last_change_at", self.last_change_at, low=-math.inf)
        _need_finite("state.settle_s", self.settle_s)

    def blocks(self, direction: str, now: float) -> bool:
        """True when `direction` would reverse the last change before it has settled."""
        if self.last_change_at is None or direction == self.last_direction:
            return False
        return now < self.last_change_at + self.settle_s


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, kw_only=True, slots=True)
class StopEngine:
    """Drain and stop a serving engine; all `gpu_ids` leave rollout (physical accounting)."""

    kind: ClassVar[str] = "stop_engine"
    engine_id: str
    host: str
    gpu_ids: tuple[str, ...]
    reason: str

    @property
    def key(self) -> str:
        return f"stop_engine:{self.engine_id}"


@dataclass(frozen=True, kw_only=True, slots=True)
class StartHybrid:
    """Start a Hybrid replica on a complete one-host GPU set, once `after_stops` have stopped."""

    kind: ClassVar[str] = "start_hybrid"
    host: str
    gpu_ids: tuple[str, ...]
    after_stops: tuple[str, ...]
    reason: str

    @property
    def key(self) -> str:
        return f"start_hybrid:{self.host}:{','.join(self.gpu_ids)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class StopHybrid:
    """Make an active Hybrid replica leave at the next step boundary and release its GPUs."""

    kind: ClassVar[str] = "stop_hybrid"
    hybrid_id: str
    host: str
    gpu_ids: tuple[str, ...]
    reason: str

    @property
    def key(self) -> str:
        return f"stop_hybrid:{self.hybrid_id}"


@dataclass(frozen=True, kw_only=True, slots=True)
class CancelJoin:
    """Cancel a replica that is requested or joining (allocated..ready); releases its GPUs."""

    kind: ClassVar[str] = "cancel_join"
    hybrid_id: str
    host: str
    gpu_ids: tuple[str, ...]
    reason: str

    @property
    def key(self) -> str:
        return f"cancel_join:{self.hybrid_id}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartEngine:
    """Start a TP`tp` engine on `gpu_ids` of `host`, once `after_hybrids` released them."""

    kind: ClassVar[str] = "restart_engine"
    host: str
    gpu_ids: tuple[str, ...]
    tp: int
    after_hybrids: tuple[str, ...]
    reason: str

    @property
    def key(self) -> str:
        return f"restart_engine:{self.host}:{','.join(self.gpu_ids)}"


Action = StopEngine | StartHybrid | StopHybrid | CancelJoin | RestartEngine


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True, kw_only=True, slots=True)
class Shortfall:
    """A capacity shortfall: the planner wanted more Hybrid replicas than it could grant."""

    wanted: int
    granted: int
    reason: str

    def __post_init__(self) -> None:
        if not 0 <= self.granted < self.wanted:
            raise _bad("shortfall", f"granted {self.granted} of wanted {self.wanted}", "0<=g<w")

    def as_record(self) -> dict[str, object]:
        """Flat dict for a transition-log record or a `check` summary."""
        return {"wanted": self.wanted, "granted": self.granted, "reason": self.reason}


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """What the planner decided from the world at `based_on_version`.

    `current`: Hybrid replicas counted before (requested, joining or active). `wanted`: what the
    metrics ask for. `granted`: how many there will be once the actions are carried out.
    `serving_gpus` / `serving_gpus_after`: physical GPUs of serving engines before and after the
    actions (restarted engines are not serving yet). `shortfall` is set exactly when
    wanted > granted.
    """

    based_on_version: int
    now: float
    direction: str
    current: int
    wanted: int
    granted: int
    actions: tuple[Action, ...]
    shortfall: Shortfall | None
    reason: str
    serving_gpus: int
    serving_gpus_after: int
    next_state: PlannerState

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise _bad("decision.direction", f"it is {self.direction!r}", _one_of(DIRECTIONS))
        if (self.shortfall is not None) != (self.wanted > self.granted):
            raise _bad(
                "decision.shortfall",
                f"wanted {self.wanted}, granted {self.granted}, shortfall {self.shortfall}",
                "record a shortfall exactly when wanted > granted",
            )

    def summary(self) -> str:
        """One line for `check`-style summaries."""
        short = "" if self.shortfall is None else f"; shortfall {self.shortfall.reason}"
        return (
            f"on world version {self.based_on_version}, {self.direction}: hybrids "
            f"{self.current}->"
            f"{self.granted} (wanted {self.wanted}), {len(self.actions)} action(s), serving "
            f"GPUs {self.serving_gpus}->{self.serving_gpus_after}{short}"
        )
