"""Named guards: pure predicates over (view, instance, event) that return a reason or None.

Each guard is one rule of `DESIGN.md` and its reason says what was wrong and what to do. Guards
read the world through the `View` of the pending step and never write. What they do not know: how
an accepted transition changes anything (see `effects`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from ehp_fsm.core.index import ROLLOUT_STATES
from ehp_fsm.core.transition import Ctx, Guard, View
from ehp_fsm.core.world import Instance

GUARDS: dict[str, Guard] = {}

_IDENTITY_KEYS = ("host", "pid", "start_time", "token")
_IDENTITY_NEEDED = (
    "payload needs `identity` with host (a string), pid (a positive integer), start_time (a "
    "number of seconds, 0 or more) and token (the launch token, a string)"
)
BUSY_STEP_STATES = frozenset({"computing", "reducing", "stepping"})
_OWNER_MACHINE = {"engine": "rollout_engine", "hybrid": "hybrid_replica"}  # owner kind -> machine


def guard(fn: Guard) -> Guard:
    GUARDS[fn.__name__] = fn
    return fn


def live_replicas(view: View) -> list[str]:
    """The training replicas of the current epoch: the fixed Core ones and active Hybrids."""
    core = [str(r) for r in view.config.get("core_replicas", ())]
    hybrids = [f"hybrid:{h.id}" for h in view.all("hybrid_replica") if h.state == "active"]
    return core + hybrids


def inflight_requests(view: View, engine_id: str) -> list[str]:
    """The groups in flight on `engine_id`, in id order: `inflight_requests_scan`'s answer,
    from the world's index (`core.index`) and the pending step's own request changes."""
    pending = [inst for (m, _), inst in view.changes.items() if m == "request"]
    ids = view.world.index.inflight_on(engine_id)
    if not pending:
        return sorted(ids)
    changed = {inst.id for inst in pending}
    left = [i for i in ids if i not in changed]
    left += [r.id for r in pending if r.state == "dispatched" and r.data.get("engine") == engine_id]
    return sorted(left)


def inflight_requests_scan(view: View, engine_id: str) -> list[str]:
    """What `inflight_requests` answers, by its definition: a scan of every group."""
    return sorted(
        r.id
        for r in view.each("request")
        if r.state == "dispatched" and r.get("engine") == engine_id
    )


def _is_int(value: object) -> TypeGuard[int]:
    """A version or revision number: an int, not a bool or a float that happens to be equal."""
    return type(value) is int


def _gpus(ctx: Ctx) -> list[str] | None:
    """The payload's `gpus` as a list of GPU ids; None when it is not a list of strings."""
    gpus = ctx.payload.get("gpus")
    if not isinstance(gpus, list | tuple) or not all(type(g) is str for g in gpus):
        return None
    return list(gpus)


def _bad_gpus(ctx: Ctx) -> str:
    return f"payload `gpus` must be a list of GPU ids (strings), got {ctx.payload.get('gpus')!r}"


# --- GPU ledger -------------------------------------------------------------------------------


@guard
def host_given(ctx: Ctx) -> str | None:
    host = ctx.payload.get("host")
    return None if isinstance(host, str) and host else "payload needs a non-empty `host`"


@guard
def owner_claims_gpu(ctx: Ctx) -> str | None:
    owner = ctx.payload.get("owner")
    gpu = ctx.inst.id
    core = ctx.view.world.core_gpu_set  # config["core_gpus"] as a set: O(1), same answer
    in_core = gpu in (core if core is not None else ctx.view.config.get("core_gpus", ()))
    if owner == "core":
        if in_core:
            return None
        return f"GPU {gpu} is not in the plan's Core layout; only engines and Hybrids may take it"
    if in_core:
        return (
            f"GPU {gpu} belongs to the plan's Core layout, fixed for the run; engines and "
            "Hybrids take rollout GPUs only"
        )
    if not isinstance(owner, str) or ":" not in owner:
        return f"owner must be 'core', 'engine:<id>' or 'hybrid:<id>', got {owner!r}"
    kind, _, oid = owner.partition(":")
    machine = _OWNER_MACHINE.get(kind)
    if machine is None:
        return f"unknown owner kind {kind!r} in {owner!r}"
    holder = ctx.view.get(machine, oid)
    if holder is None:
        return f"owner {owner} does not exist"
    if holder.state in ctx.view.world.specs[machine].terminal:
        return f"owner {owner} is {holder.state} and can own nothing"
    if gpu not in (holder.get("gpus") or ()):
        return f"owner {owner} does not list GPU {gpu} in its allocation"
    if holder.get("host") != ctx.inst.get("host"):
        return f"GPU {gpu} is on host {ctx.inst.get('host')}, owner {owner} on {holder.get('host')}"
    return None


def _live_holder(ctx: Ctx, owner: object) -> str | None:
    """The engine or Hybrid named by `owner` if it is still live and lists this GPU."""
    if not isinstance(owner, str):
        return None
    kind, _, oid = owner.partition(":")
    machine = _OWNER_MACHINE.get(kind)
    holder = ctx.view.get(machine, oid) if machine else None
    if holder is None or holder.state in ctx.view.world.specs[holder.machine].terminal:
        return None
    return holder.state if ctx.inst.id in (holder.get("gpus") or ()) else None


@guard
def released_by_owner(ctx: Ctx) -> str | None:
    owner = ctx.inst.get("owner")
    if ctx.payload.get("owner") != owner:
        return f"GPU {ctx.inst.id} is owned by {owner}, not {ctx.payload.get('owner')}"
    if owner == "core":
        busy = busy_steps(ctx.view)
        if busy:
            return (
                f"Core GPU {ctx.inst.id} is in use by step {busy[0]}, which is computing, "
                "reducing or stepping; release it after the step ends or fails"
            )
    live = _live_holder(ctx, owner)
    if live is not None:
        return (
            f"{owner} is still {live} and holds GPU {ctx.inst.id}; "
            "stop or fail it and its exit releases the GPU"
        )
    return None


@guard
def finalizer_confirmed(ctx: Ctx) -> str | None:
    p = ctx.payload
    owner = ctx.inst.get("owner")
    if p.get("owner") != owner:
        return f"confirmation names {p.get('owner')}, but GPU {ctx.inst.id} was released by {owner}"
    if p.get("processes_exited") is not True:
        return f"{owner}'s processes on GPU {ctx.inst.id} have not been confirmed exited"
    if p.get("memory_free") is not True:
        return f"memory on GPU {ctx.inst.id} has not been confirmed free"
    return None


@guard
def was_owned_and_owner_alive(ctx: Ctx) -> str | None:
    if ctx.inst.get("prior") != "owned":
        return f"GPU {ctx.inst.id} was {ctx.inst.get('prior')} before quarantine, not owned"
    owner = ctx.inst.get("owner")
    if ctx.payload.get("owner") != owner:
        return (
            f"agent reports owner {ctx.payload.get('owner')}, ledger says "
            f"{owner}; reconcile as released instead"
        )
    if owner != "core" and _live_holder(ctx, owner) is None:
        return f"owner {owner} is gone or no longer lists GPU {ctx.inst.id}; reconcile as released"
    return None


@guard
def had_owner(ctx: Ctx) -> str | None:
    owner = ctx.inst.get("owner")
    if owner is None:
        return f"GPU {ctx.inst.id} had no owner; use reconcile_free"
    live = _live_holder(ctx, owner)
    if live is not None:
        return f"{owner} is still {live} and holds GPU {ctx.inst.id}; reconcile it as owned"
    return None


@guard
def had_no_owner(ctx: Ctx) -> str | None:
    owner = ctx.inst.get("owner")
    if owner is not None:
        return f"GPU {ctx.inst.id} is owned by {owner}; its release must be confirmed first"
    return None


# --- allocations, identities, deadlines -------------------------------------------------------


@guard
def engine_gpus_match_tp(ctx: Ctx) -> str | None:
    gpus, tp = _gpus(ctx), ctx.payload.get("tp")
    if gpus is None:
        return _bad_gpus(ctx)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:  # (True passed as 1)
        return f"`tp` must be a positive integer, got {tp!r}"
    if len(gpus) != tp or len(set(gpus)) != len(gpus):
        return f"a TP{tp} engine needs {tp} distinct GPUs, got {gpus!r}"
    return None


@guard
def complete_one_host_set(ctx: Ctx) -> str | None:
    gpus, size = _gpus(ctx), ctx.view.config.get("replica_size")
    if gpus is None:
        return _bad_gpus(ctx)
    if len(set(gpus)) != len(gpus) or len(gpus) != size:
        return f"a Hybrid replica needs exactly replica_size={size} distinct GPUs, got {gpus!r}"
    return None


@guard
def gpus_on_one_host(ctx: Ctx) -> str | None:
    host, gpus = ctx.payload.get("host"), _gpus(ctx)
    if gpus is None:
        return _bad_gpus(ctx)
    if host is None:  # (was "GPU h1:g1 is on host h1, not None")
        return "payload needs the `host` its GPUs are on"
    for g in gpus:
        gpu = ctx.view.get("gpu", g)
        if gpu is None:
            return f"GPU {g} is not in the inventory"
        if gpu.get("host") != host:
            return f"GPU {g} is on host {gpu.get('host')}, not {host}: allocations never span hosts"
    return None


@guard
def launch_token_given(ctx: Ctx) -> str | None:
    token = ctx.payload.get("token")
    return None if isinstance(token, str) and token else "payload needs a non-empty launch `token`"


def _identity(value: object) -> Mapping[str, Any] | None:
    """`value` when it is a process identity of the types `runtime.identity.ProcessIdentity`
    holds (host and token non-empty strings, pid a positive int, start_time a finite number
    ≥ 0: `ehp-fsm simulate`'s processes start at virtual time 0); None otherwise. Its keys
    alone were checked: `pid: "x"`, `start_time: {}` were accepted and recorded, for a later
    `stop_process` to carry (an auditor's find)."""
    if not isinstance(value, Mapping) or not all(k in value for k in _IDENTITY_KEYS):
        return None
    host, pid, start, token = (value[k] for k in _IDENTITY_KEYS)
    if not (isinstance(host, str) and host and isinstance(token, str) and token):
        return None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    if isinstance(start, bool) or not isinstance(start, int | float):
        return None
    return value if math.isfinite(start) and start >= 0 else None  # (0: a virtual clock's)


@guard
def launch_token_matches(ctx: Ctx) -> str | None:
    ident = _identity(ctx.payload.get("identity"))
    if ident is None:
        return _IDENTITY_NEEDED
    if ident["token"] != ctx.inst.get("token"):
        return (
            f"process reports launch token {ident['token']!r}, this controller launched "
            f"{ctx.inst.get('token')!r}: it is not our process"
        )
    if ident["host"] != ctx.inst.get("host"):
        return f"process is on host {ident['host']}, launched on {ctx.inst.get('host')}"
    return None


@guard
def identity_matches(ctx: Ctx) -> str | None:
    ident = _identity(ctx.payload.get("identity"))
    known = _identity(ctx.inst.get("identity"))
    if ident is None:
        return _IDENTITY_NEEDED
    if known is None:
        return f"{ctx.inst.id} has no recorded process identity; it was never launched or adopted"
    for key in _IDENTITY_KEYS:
        if ident[key] != known[key]:
            extra = " — a reused pid is not the same process" if key == "start_time" else ""
            return f"process {key} {ident[key]!r} differs from the recorded {known[key]!r}{extra}"
    return None


@guard
def deadline_passed(ctx: Ctx) -> str | None:
    deadline = ctx.inst.get("deadline")
    if deadline is None:
        return f"no deadline is armed in state {ctx.inst.state}"
    if ctx.event.time < deadline:
        return f"deadline {deadline} has not passed at time {ctx.event.time}"
    return None


# --- readiness --------------------------------------------------------------------------------


@guard
def installed_current_revision(ctx: Ctx) -> str | None:
    current = ctx.view.glob("revision")
    rev = ctx.payload.get("revision")
    if current < 1:
        return "no revision is published yet; an engine never serves base weights"
    if not _is_int(rev) or rev != current:
        return f"installed revision {rev!r} is not the current revision {current}; install it first"
    return None


@guard
def revision_newer_than_installed(ctx: Ctx) -> str | None:
    rev = ctx.payload.get("revision")
    installed = ctx.inst.get("installed") or 0
    if not _is_int(rev) or rev <= installed:
        return f"revision {rev!r} is not newer than installed revision {installed}"
    return None


@guard
def no_inflight_requests(ctx: Ctx) -> str | None:
    left = inflight_requests(ctx.view, ctx.inst.id)
    return f"groups still in flight: {left}; requeue them first" if left else None


@guard
def loaded_version_given(ctx: Ctx) -> str | None:
    v = ctx.payload.get("version")
    return None if _is_int(v) and v >= 0 else f"`version` must be an int >= 0, got {v!r}"


@guard
def loaded_version_stale(ctx: Ctx) -> str | None:
    if ctx.inst.get("loaded_version") == ctx.view.glob("core_version"):
        return "loaded state is already the Core's current version"
    return None


@guard
def loaded_version_current(ctx: Ctx) -> str | None:
    loaded, core = ctx.inst.get("loaded_version"), ctx.view.glob("core_version")
    if loaded != core:
        return f"loaded Core state v{loaded} but the Core is at v{core}; reload before joining"
    return None


def busy_steps(view: View) -> list[str]:
    """The training steps that are computing, reducing or stepping (they hold the Core's GPUs
    and their groups)."""
    return [s.id for s in view.all("training_step") if s.state in BUSY_STEP_STATES]


@guard
def at_step_boundary(ctx: Ctx) -> str | None:
    busy = busy_steps(ctx.view)
    return f"step {busy[0]} is in progress; membership changes wait for its end" if busy else None


# --- capacity rules: the rollout reserve and the Hybrid limit --------------------------------

#: Hybrid states that hold GPUs and a trainer worker and count against `max_hybrids` (the
#: planner's "current" replicas beyond `requested`; a leaving one is on its way out).
HYBRID_HOLDING = frozenset({"allocated", "launching", "loading", "ready", "active"})


def rollout_gpus(view: View, *, without: str | None = None) -> int:
    """`rollout_gpus_scan`'s answer from the world's index (`core.index`): its sum of the
    engines' shares, with the share of each engine the pending step touches (the engine
    itself, or the owner of a GPU it changes) and of `without` counted again from the view."""
    idx = view.world.index
    touched: set[str] = set()
    for (m, iid), inst in view.changes.items():
        if m == "rollout_engine":
            touched.add(iid)
        elif m == "gpu":
            for o in (idx.owner.get(iid), inst.data.get("owner")):
                if type(o) is str and o.startswith("engine:"):
                    touched.add(o[7:])
    total = idx.rollout
    if without is not None:
        touched.add(without)
    for eid in touched:
        total -= idx.share.get(eid, 0)
        e = view.get("rollout_engine", eid) if eid != without else None
        if e is not None:
            total += _rollout_share(view, e)
    return total


def rollout_gpus_scan(view: View, *, without: str | None = None) -> int:
    """Physical GPUs owned by rollout engines in `ROLLOUT_STATES` (all of each engine's GPUs
    that the ledger says it owns), leaving out engine `without`: `rollout_gpus` by its
    definition, a scan of every engine."""
    return sum(_rollout_share(view, e) for e in view.all("rollout_engine") if e.id != without)


def _rollout_share(view: View, e: Instance) -> int:
    """Engine `e`'s rollout GPUs as the view sees them: in `ROLLOUT_STATES`, each of its GPUs
    the ledger says it owns."""
    if e.state not in ROLLOUT_STATES:
        return 0
    key = f"engine:{e.id}"
    owned = (view.get("gpu", str(g)) for g in e.get("gpus") or ())
    return sum(
        1 for gpu in owned if gpu is not None and gpu.state == "owned" and gpu.get("owner") == key
    )


@guard
def keeps_rollout_reserve(ctx: Ctx) -> str | None:
    """Stopping an engine takes all of its physical GPUs out of rollout: the GPUs the other
    engines still serve with must stay at or above `rollout_reserve`."""
    reserve = ctx.view.config.get("rollout_reserve")
    if not reserve:
        return None
    left = rollout_gpus(ctx.view, without=ctx.inst.id)
    if left < reserve:
        gpus = len(ctx.inst.get("gpus") or ())
        return (
            f"draining engine {ctx.inst.id} ({gpus} GPUs) would leave {left} GPUs serving "
            f"rollout, below the rollout reserve of {reserve}; drain another engine or none"
        )
    return None


@guard
def within_max_hybrids(ctx: Ctx) -> str | None:
    limit = ctx.view.config.get("max_hybrids")
    if limit is None:
        return None
    held = [
        h.id
        for h in ctx.view.all("hybrid_replica")
        if h.state in HYBRID_HOLDING and h.id != ctx.inst.id
    ]
    if len(held) >= limit:
        return (
            f"{len(held)} Hybrid replicas already hold GPUs ({held}); max_hybrids is {limit}: "
            "cancel this one or wait for one to stop"
        )
    return None


# --- training steps ---------------------------------------------------------------------------


@guard
def step_is_next(ctx: Ctx) -> str | None:
    step, core = ctx.payload.get("step"), ctx.view.glob("core_version")
    return (
        None
        if _is_int(step) and step == core + 1
        else f"step {step!r} is not the next step {core + 1}"
    )


@guard
def no_open_step(ctx: Ctx) -> str | None:
    spec = ctx.view.world.specs["training_step"]
    open_ = [s.id for s in ctx.view.all("training_step") if s.state not in spec.terminal]
    return f"step {open_[0]} is still open" if open_ else None


@guard
def partition_is_complete(ctx: Ctx) -> str | None:
    raw = ctx.payload.get("groups") or ()
    if not isinstance(raw, list | tuple):
        return f"payload `groups` must be a list of group ids, got {type(raw).__name__}"
    groups = list(raw)
    if not all(type(g) in (str, int) for g in groups):
        return "payload `groups` must hold group ids (strings or integers)"
    partition = ctx.payload.get("partition")
    want = ctx.view.config.get("groups_per_step")
    if len(groups) != want or len(set(groups)) != len(groups):
        return f"a step consumes exactly {want} distinct groups, got {len(groups)}"
    if not isinstance(partition, Mapping) or not all(
        isinstance(gs, list | tuple) for gs in partition.values()
    ):
        return "payload needs `partition`: {replica: [group ids]}"
    live = live_replicas(ctx.view)
    if len(partition) != len(live) or set(partition) != set(live):
        return f"partition covers {list(partition)}, the live replicas are {sorted(live)}"
    assigned = [g for gs in partition.values() for g in gs]
    if not all(type(g) in (str, int) for g in assigned):
        return "`partition` must map replicas to lists of group ids"
    if len(assigned) != len(groups) or set(assigned) != set(groups):
        return "partition does not assign every group exactly once"
    for g in groups:
        req = ctx.view.get("request", str(g))
        if req is None or req.state != "completed":
            return f"group {g} is {req.state if req else 'unknown'}, not completed"
    return None


@guard
def epoch_unchanged(ctx: Ctx) -> str | None:
    e, now = ctx.inst.get("epoch"), ctx.view.glob("epoch")
    return None if e == now else f"partitioned for epoch {e}, membership is now epoch {now}"


@guard
def all_delivered(ctx: Ctx) -> str | None:
    raw = ctx.payload.get("replicas") or ()
    if not isinstance(raw, list | tuple) or not all(type(r) is str for r in raw):
        return f"payload `replicas` must be a list of replica names, got {raw!r}"
    got = list(raw)
    want = sorted(ctx.inst.get("partition") or {})
    # Set lookups, not list scans: a step of a 1,024-host cluster has over a thousand
    # replicas (every Hybrid is one), and the scans (`r not in got`, `got.count(r)` for each)
    # made this one guard O(replicas²): 1.5 % of a simulated 1,024-host run with Hybrids
    # (8 steps), growing with the square of the cluster. The same answers and reasons
    # (`tests/core/test_delivered.py` compares them with the scans).
    seen = set(got)
    missing = [r for r in want if r not in seen]
    if missing:
        return f"deliveries missing from {missing}"
    wanted = set(want)
    extra = sorted({r for r in got if r not in wanted})
    if extra:
        return f"deliveries from {extra}, which are not in the step's partition {want}"
    if len(seen) != len(got):
        twice = sorted(r for r, n in Counter(got).items() if n > 1)
        return f"deliveries from {twice} are listed more than once"
    return None


@guard
def version_is_next(ctx: Ctx) -> str | None:
    v, core = ctx.payload.get("version"), ctx.view.glob("core_version")
    return (
        None
        if _is_int(v) and v == core + 1
        else f"version {v!r} is not the next Core version {core + 1}"
    )


@guard
def revision_is_current(ctx: Ctx) -> str | None:
    rev, cur = ctx.payload.get("revision"), ctx.view.glob("revision")
    if not _is_int(rev) or rev != cur:
        return f"revision {rev!r} is not the current published revision {cur}"
    base = ctx.inst.get("base_revision")
    if base is not None and rev <= base:
        return (
            f"revision {rev} was already current when step {ctx.inst.id} was partitioned: "
            "publish the step's own revision first"
        )
    return None


# --- revisions --------------------------------------------------------------------------------


@guard
def revision_increasing(ctx: Ctx) -> str | None:
    rev, last = ctx.payload.get("revision"), ctx.view.glob("latest_saved") or 0
    if not _is_int(rev) or rev <= last:
        return f"revision {rev!r} is not above the latest saved revision {last}"
    step = ctx.payload.get("step")
    if step is not None and (not _is_int(step) or step < 0):
        return f"step {step!r} is not the number of a training step (an int >= 0, or none)"
    return None


@guard
def revision_newer_than_current(ctx: Ctx) -> str | None:
    rev, cur = ctx.inst.get("revision"), ctx.view.glob("revision")
    return None if rev > cur else f"revision {rev} is not newer than the current revision {cur}"


@guard
def revision_unreferenced(ctx: Ctx) -> str | None:
    rev = ctx.inst.get("revision")
    if rev == ctx.view.glob("revision"):
        return f"revision {rev} is the current revision"
    spec = ctx.view.world.specs["rollout_engine"]
    for e in ctx.view.all("rollout_engine"):
        if e.state in spec.terminal:
            continue
        if e.get("installed") == rev:
            return f"engine {e.id} has revision {rev} installed"
        installed = e.get("installed")
        if e.state in ("installing", "updating") and (installed is None or installed < rev):
            return f"engine {e.id} is installing and may be reading revision {rev}"
    # the first in id order, as a sorted scan would name it — without sorting every group
    in_flight = [
        r.id
        for r in ctx.view.each("request")
        if r.state == "dispatched" and r.get("revision") == rev
    ]
    if in_flight:
        return f"request {min(in_flight)} in flight was served from revision {rev}"
    return None


# --- requests ---------------------------------------------------------------------------------


@guard
def engine_is_serving(ctx: Ctx) -> str | None:
    eid = ctx.payload.get("engine")
    if type(eid) is not str:
        return f"payload `engine` must be an engine id (a string), got {eid!r}"
    e = ctx.view.get("rollout_engine", eid)
    if e is None or e.state != "serving":
        return f"engine {eid} is {e.state if e else 'unknown'}; only serving engines take requests"
    return None


@guard
def completed_by_dispatched_engine(ctx: Ctx) -> str | None:
    p, d = ctx.payload, ctx.inst
    if type(p.get("engine")) is not str:
        return f"payload `engine` must be an engine id (a string), got {p.get('engine')!r}"
    if p.get("engine") != d.get("engine"):
        return (
            f"completion from engine {p.get('engine')}, but it was dispatched to {d.get('engine')}"
        )
    if p.get("revision") != d.get("revision"):
        return f"completion tagged revision {p.get('revision')}, dispatched at {d.get('revision')}"
    return None


def _staleness(ctx: Ctx) -> tuple[int, int]:
    floor = ctx.view.glob("revision") - int(ctx.view.config.get("max_staleness", 0))
    return int(ctx.inst.get("revision") or 0), floor


@guard
def fresh_enough(ctx: Ctx) -> str | None:
    rev, floor = _staleness(ctx)
    return None if rev >= floor else f"group from revision {rev} is older than the bound {floor}"


@guard
def too_stale(ctx: Ctx) -> str | None:
    rev, floor = _staleness(ctx)
    return None if rev < floor else f"group from revision {rev} is within the bound {floor}"


_STEP_STATE_FOR = {"claim": "computing", "consume": "publishing", "unclaim": "failed"}


@guard
def step_holds_group(ctx: Ctx) -> str | None:
    """Groups are claimed, consumed and handed back only by a training step's own transition
    (partition, optimizer step, failure): nothing else can consume a group without training."""
    sid = ctx.payload.get("step")
    if not isinstance(sid, str) or not sid:
        return "payload needs the training `step` that claims, consumes or releases the group"
    step = ctx.view.get("training_step", sid)
    if step is None:
        return (
            f"training step {sid!r} does not exist; groups change hands only through training steps"
        )
    want = _STEP_STATE_FOR.get(ctx.event.name)
    if step.state != want:
        return (
            f"step {sid} is {step.state}; a group's {ctx.event.name} comes only with the "
            f"step's move to {want}"
        )
    if ctx.inst.id not in _group_set(step.get("groups") or ()):
        return f"group {ctx.inst.id} is not in step {sid}'s partition"
    return None


#: The groups of recent steps as sets, by the identity of the step's (never mutated) list: a
#: step claims and consumes each of its G groups once, and a list scan per group made each of
#: those O(G²) per step (found by `ehp-fsm simulate` at 16,384 groups per step). The entry
#: keeps its list alive, so an id is never reused while cached.
_GROUP_SETS: dict[int, tuple[object, frozenset[object]]] = {}


def _group_set(groups: Sequence[object]) -> frozenset[object]:
    hit = _GROUP_SETS.get(id(groups))
    if hit is not None and hit[0] is groups:
        return hit[1]
    found = frozenset(groups)
    if len(_GROUP_SETS) >= 8:
        _GROUP_SETS.clear()
    _GROUP_SETS[id(groups)] = (groups, found)
    return found


@guard
def claimed_by_step(ctx: Ctx) -> str | None:
    step, claim = ctx.payload.get("step"), ctx.inst.get("claimed_by")
    return None if step == claim else f"group is claimed by {claim}, not {step}"


# --- planner decisions ------------------------------------------------------------------------


@guard
def decision_is_current(ctx: Ctx) -> str | None:
    based, now = ctx.payload.get("based_on_version"), ctx.view.world.version
    if based != now:
        return (
            f"decision computed from world version {based!r}, the world is at {now}; "
            "recompute it from the current world"
        )
    actions = ctx.payload.get("actions")
    if actions is not None and not isinstance(actions, list | tuple):
        return f"payload `actions` must be a list of the decision's actions, got {actions!r}"
    return None


@guard
def shortfall_given(ctx: Ctx) -> str | None:
    wanted, granted = ctx.payload.get("wanted"), ctx.payload.get("granted")
    if not (_is_int(wanted) and _is_int(granted) and wanted > granted >= 0):
        return f"a shortfall needs wanted > granted >= 0, got {wanted!r} > {granted!r}"
    return None
