"""Shared scenario builders for the engine's property tests: a small in-memory plan, a checked
`Harness` around a real `Orchestrator` (real JSONL log in a temp dir, replayed at the end), and
payload builders that draw valid and deliberately wrong payloads for every (machine, event).

What the harness checks on every event it fires (independently of the guards it exercises):
a rejected event leaves the world (deep-copied snapshot) unchanged and yields exactly one
rejected record; an accepted event bumps the world version by one and every record it carries is
an edge of the spec's table (or the create edge); an event on a terminal instance is rejected;
`check_invariants(world) == []`; an owned GPU's engine/Hybrid owner is live and lists it; a GPU
changes owner only through the finalizer (releasing --confirm_free--> free); and, per guard name,
an oracle restating the rule the guard enforces (identity, token, deadline, install-before-serve,
...). `finish()` replays the log and compares the rebuilt world with the live one.

What it does not know: which events are interesting — the role tests choose them.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ehp_fsm.core.guards import (
    BUSY_STEP_STATES,
    inflight_requests,
    inflight_requests_scan,
    rollout_gpus,
    rollout_gpus_scan,
)
from ehp_fsm.core.index import Index
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.spec import NEW, MachineSpec
from ehp_fsm.core.transition import Accepted, Outcome, Rejected, View
from ehp_fsm.core.world import Event, Instance, World
from ehp_fsm.embedded import Orchestrator
from ehp_fsm.finished import FORGETTABLE, WRITER_FORGETS, Forgetter
from ehp_fsm.plan import Plan, parse_plan
from ehp_fsm.replay import _stretch, replay

# Three hosts of two GPUs; Core TP2 DP1 on h0, so replica_size = 2 and a Hybrid needs both GPUs
# of one host. Engines in the plan only validate it: the tests launch engines through events.
PLAN_DOC: dict[str, Any] = {
    "run": {"name": "prop", "seed": 0},
    "hosts": [
        {"id": "h0", "gpus": 2},
        {"id": "h1", "gpus": 2},
        {"id": "h2", "gpus": 2},
    ],
    "core": {"tp": 2, "pp": 1, "cp": 1, "dp": 1, "gpus": ["h0:g0", "h0:g1"]},
    "engines": [
        {"id": "e0", "host": "h1", "tp": 2},
        {"id": "e1", "host": "h2", "tp": 1},
        {"id": "e2", "host": "h2", "tp": 1},
    ],
    "rollout": {"reserve": 1},
    "grpo": {"prompts_per_step": 2, "group_size": 2, "steps": 3, "max_staleness": 1},
    "ehp": {"replica_size": 2, "cooldown_s": 1.0},
}
HOSTS = ("h0", "h1", "h2")
ROLLOUT_GPUS = ("h1:g0", "h1:g1", "h2:g0", "h2:g1")

ENGINE_IDS = ("e0", "e1", "e2")
HYBRID_IDS = ("x0", "x1", "x2")
STEP_IDS = ("s1", "s2", "s3")
REVISION_IDS = ("r1", "r2", "r3", "r4")
REQUEST_IDS = ("g0", "g1", "g2", "g3", "g4")
IDS: dict[str, tuple[str, ...]] = {
    "gpu": ("h0:g0", "h0:g1", *ROLLOUT_GPUS, "h3:g0", "ghost"),
    "rollout_engine": (*ENGINE_IDS, "e9"),
    "hybrid_replica": (*HYBRID_IDS, "x9"),
    "training_step": (*STEP_IDS, "s9"),
    "revision": (*REVISION_IDS, "r9"),
    "request": (*REQUEST_IDS, "g9"),
    "capacity": ("grp", "grp9"),
}
# Wrong values for any payload key: wrong types, empty, negative, bool-for-int, foreign ids.
JUNK = st.sampled_from(
    [None, "", "x", -1, 0, 1, 2, 2.5, True, False, [], ["h1:g0"], ["h1:g0", "h2:g0"], {"a": 1}]
)
PAYLOAD_KEYS = (
    "host",
    "owner",
    "gpus",
    "tp",
    "token",
    "identity",
    "revision",
    "version",
    "step",
    "groups",
    "partition",
    "replicas",
    "engine",
    "processes_exited",
    "memory_free",
    "reason",
)
BOGUS_EVENTS = ("explode", "to_serving", "register", "launch", "request", "save")
# The event that moves an instance along its role's main path, per state (what `advance` prefers,
# so that random walks reach the deep states before a cancel or fail ends them).
FORWARD: dict[str, dict[str, str]] = {
    "gpu": {"releasing": "confirm_free", "quarantined": "reconcile_released"},
    "rollout_engine": {
        "starting": "healthy",
        "installing": "installed",
        "updating": "installed",
        "serving": "drain",
        "draining": "drained",
        "stopping": "exited",
    },
    "hybrid_replica": {
        "requested": "allocate",
        "allocated": "launch",
        "launching": "launched",
        "loading": "loaded",
        "ready": "activate",
        "active": "leave",
        "leaving": "exited",
    },
    "training_step": {
        "collecting": "partition",
        "computing": "delivered",
        "reducing": "reduced",
        "stepping": "stepped",
        "publishing": "published",
    },
    "revision": {"saving": "saved", "saved": "publish", "published": "retire"},
    "capacity": {"steady": "fell_short", "short": "decided"},
    "request": {
        "queued": "dispatch",
        "dispatched": "complete",
    },
}
# Events the specs mean to arrive only as cascades of a training step's own transitions: the
# `step_holds_group` guard refuses them when fired directly (pinned by
# test_machine_training_step.py and the `direct_hand_over` rule of test_request_lifecycle.py).
# The random walks here do not fire them directly, so their steps go to everything else.
CASCADE_ONLY = frozenset({("request", "claim"), ("request", "unclaim"), ("request", "consume")})
_OWNER_PREFIX = {"rollout_engine": "engine", "hybrid_replica": "hybrid"}
_HOLDS = {
    "rollout_engine": frozenset(
        {"starting", "installing", "serving", "updating", "draining", "stopping"}
    ),
    "hybrid_replica": frozenset(
        {"allocated", "launching", "loading", "ready", "active", "leaving"}
    ),
}


def small_plan(**overrides: Any) -> Plan:
    doc = copy.deepcopy(PLAN_DOC)
    doc.update(overrides)
    return parse_plan(doc, file="<property test plan>")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def edge_in_spec(spec: MachineSpec, source: str, event: str, dest: str) -> bool:
    if source == NEW:
        return event == spec.create.event and dest == spec.initial
    t = spec.table.get((source, event))
    return t is not None and t.dest == dest


_IMMUTABLE = (str, int, float, bool, type(None))


def plain_copy(value: Any) -> Any:
    """`copy.deepcopy` of plain data (dicts, lists, tuples of scalars), several times faster: a
    world snapshot is copied before every fired event. Anything else goes to `deepcopy`."""
    t = type(value)
    if t is dict:
        return {k: plain_copy(v) for k, v in value.items()}
    if t is list:
        return [plain_copy(v) for v in value]
    if t is tuple:
        return tuple(plain_copy(v) for v in value)
    if t in _IMMUTABLE:
        return value
    return copy.deepcopy(value)


def index_problems(world: World) -> list[str]:
    """The world's index (`core.index`, kept by `World.apply`) against one built from scratch,
    and the guards' indexed answers against their scans, for every engine."""
    problems = []
    fresh = Index.build(world.instances)
    for name in ("groups", "inflight", "owner", "share", "rollout"):
        kept, built = getattr(world.index, name), getattr(fresh, name)
        if kept != built:
            problems.append(f"index.{name} {kept!r} != rebuilt {built!r}")
    view = View(world)
    for eid in [None, *world.of("rollout_engine"), "nowhere"]:
        if eid is not None and inflight_requests(view, eid) != inflight_requests_scan(view, eid):
            problems.append(f"inflight_requests({eid!r}) differs from the scan")
        if rollout_gpus(view, without=eid) != rollout_gpus_scan(view, without=eid):
            problems.append(f"rollout_gpus(without={eid!r}) differs from the scan")
    if sorted(check_invariants(world, indexed=True)) != sorted(check_invariants(world)):
        problems.append("check_invariants(indexed=True) differs from the full scan")
    return problems


def ownership_problems(world: World) -> list[str]:
    """An owned GPU whose owner is an engine or Hybrid must be held (listed) by a live one."""
    problems = []
    for g in world.of("gpu").values():
        owner = g.get("owner")
        if g.state != "owned" or not isinstance(owner, str) or owner == "core":
            continue
        kind, _, oid = owner.partition(":")
        machine = {"engine": "rollout_engine", "hybrid": "hybrid_replica"}.get(kind)
        holder = world.get(machine, oid) if machine else None
        if holder is None or holder.state not in _HOLDS[holder.machine]:
            state = holder.state if holder else "absent"
            problems.append(f"GPU {g.id} is owned by {owner}, which is {state}: a leaked GPU")
        elif g.id not in (holder.get("gpus") or ()):
            problems.append(f"GPU {g.id} is owned by {owner}, which does not list it")
    return problems


#: Every (machine, source state, event) each `RoleMachine` class's harnesses saw accepted (root
#: and cascaded records), by class name, for the role tests' coverage (`role_edges.py`).
ROLE_EDGES: defaultdict[str, Counter[tuple[str, str, str]]] = defaultdict(Counter)


def spec_edges(specs: Mapping[str, MachineSpec]) -> set[tuple[str, str, str]]:
    """Every (machine, source state, event) a spec accepts: its create edge and each expanded
    source of each transition."""
    out = set()
    for name, spec in specs.items():
        out.add((name, NEW, spec.create.event))
        out.update((name, state, event) for state, event in spec.table)
    return out


class Harness:
    """A checked `Orchestrator` on `small_plan()` with its log in a fresh temp dir.
    `forget_finished`: the orchestrator's (off by default: the machines' rules here read the
    data of finished instances, a consumed group's `consumed_by`, a retired revision's number;
    on for the embedded caller's own view, `test_embedded_api`)."""

    def __init__(self, plan: Plan | None = None, *, forget_finished: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ehp-prop-"))
        self.log_path = self.dir / "transitions.jsonl"
        self.engine = Orchestrator.from_plan(
            plan or small_plan(),
            log_path=self.log_path,
            check=True,
            forget_finished=forget_finished,
        )
        assert self.engine.log is not None
        # The plan's inventory events (Core GPUs assigned, the planner's record created) were
        # accepted by `from_plan` before the harness could watch.
        #: What this harness saw accepted (see `ROLE_EDGES`).
        self.edges: Counter[tuple[str, str, str]] = Counter({("capacity", NEW, "start"): 1})
        self.engine.log.checkpoint_every = 3  # checkpoints in every run: replay checks them
        self.engine.log.checkpoint_events_per_instance = 0.0
        self.now = 0.0
        self.stats: Counter[tuple[str, str, bool]] = Counter()
        self.hooks: list[Callable[[Event, Instance | None, World, Outcome], None]] = []
        self._seq = 0

    @property
    def world(self) -> World:
        return self.engine.world

    def token(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}-t{self._seq}"

    def fire(
        self, machine: str, iid: str, name: str, payload: Mapping[str, Any] | None = None
    ) -> Outcome:
        world = self.world
        spec = world.specs.get(machine)
        inst = world.instances[machine].get(iid) if spec is not None else None
        before = plain_copy(world.snapshot())
        version = world.version
        event = Event(machine, iid, name, self.now, dict(payload or {}), correlation="prop")
        outcome = self.engine.handle(event)
        self.stats[(machine, name, outcome.accepted)] += 1
        if isinstance(outcome, Rejected):
            assert world.snapshot() == before, f"rejected {name} changed the world"
            assert world.version == version
            assert len(outcome.records) == 1 and not outcome.records[0].accepted
            assert outcome.reason, "a rejection must say why"
            if spec is not None and inst is not None and inst.state in spec.terminal:
                assert "terminal" in outcome.reason
        else:
            assert isinstance(outcome, Accepted)
            assert spec is not None
            assert inst is None or inst.state not in spec.terminal, (
                f"{machine} {iid} in terminal state {inst.state} accepted {name}"
            )
            assert world.version == version + 1
            root = outcome.records[0]
            assert (root.machine, root.instance, root.event, root.cause) == (
                machine,
                iid,
                name,
                None,
            )
            for i, r in enumerate(outcome.records):
                self.edges[(r.machine, r.source, r.event)] += 1
                assert r.accepted and not r.reason
                assert edge_in_spec(world.specs[r.machine], r.source, r.event, r.dest), (
                    f"accepted edge {r.source} --{r.event}--> {r.dest} of {r.machine} "
                    "is not in its spec"
                )
                assert i == 0 or (r.cause is not None and r.cause < i)
            self._oracles(event, inst, before, outcome)
        assert check_invariants(world) == []
        assert ownership_problems(world) == []
        assert index_problems(world) == []
        for hook in self.hooks:
            hook(event, inst, world, outcome)
        return outcome

    def _oracles(
        self, event: Event, inst: Instance | None, before: dict[str, Any], out: Accepted
    ) -> None:
        """Restate, per guard that passed, the rule it enforces — from the raw data."""
        world, p = self.world, event.payload
        spec = world.specs[event.machine]
        t = spec.create if inst is None else spec.table[(inst.state, event.name)]
        g_before = before["globals"]
        for g in t.guards:
            if g == "identity_matches":
                assert inst is not None
                assert dict(p["identity"]) == dict(inst.get("identity")), "identity differs"
            elif g == "launch_token_matches":
                assert inst is not None
                ident = p["identity"]
                assert (ident["token"], ident["host"]) == (inst.get("token"), inst.get("host"))
            elif g == "deadline_passed":
                assert inst is not None and inst.get("deadline") is not None
                assert event.time >= inst.get("deadline"), "deadline fired early"
            elif g == "installed_current_revision":
                rev = p.get("revision")
                assert is_int(rev) and rev == g_before["revision"] >= 1, (
                    f"an engine served after installing {rev!r}, current {g_before['revision']}"
                )
            elif g == "loaded_version_current":
                assert inst is not None
                assert inst.get("loaded_version") == g_before["core_version"]
            elif g == "loaded_version_given":
                assert is_int(p.get("version"))
            elif g == "at_step_boundary":
                steps = before["instances"]["training_step"].values()
                assert not [s for s in steps if s["state"] in BUSY_STEP_STATES]
            elif g == "released_by_owner":
                assert inst is not None and p.get("owner") == inst.get("owner")
            elif g == "finalizer_confirmed":
                assert inst is not None and p.get("owner") == inst.get("owner")
                assert p.get("processes_exited") is True and p.get("memory_free") is True
            elif g == "engine_is_serving":
                e = before["instances"]["rollout_engine"].get(str(p.get("engine")))
                assert e is not None and e["state"] == "serving"
            elif g in ("complete_one_host_set", "gpus_on_one_host"):
                gpus = list(p["gpus"])
                ledger = before["instances"]["gpu"]
                hosts = {ledger.get(str(x), {}).get("host") for x in gpus}
                assert hosts == {p.get("host")}, f"allocation {gpus} is not on {p.get('host')}"
                if g == "complete_one_host_set":
                    assert len(set(gpus)) == len(gpus) == world.config["replica_size"]
            elif g in ("revision_increasing", "revision_newer_than_installed"):
                assert is_int(p.get("revision"))
            elif g in ("step_is_next", "version_is_next"):
                key = "step" if g == "step_is_next" else "version"
                assert is_int(p.get(key)) and p[key] == g_before["core_version"] + 1
        # A GPU changes owner only through the finalizer: releasing --confirm_free--> free.
        gpus_before = before["instances"]["gpu"]
        for gid, g in world.of("gpu").items():
            old = gpus_before.get(gid)
            if old is None or old.get("owner") is None or old.get("owner") == g.get("owner"):
                continue
            assert old["state"] == "releasing" and g.state == "free", (
                f"GPU {gid} changed owner {old.get('owner')} -> {g.get('owner')} "
                f"({old['state']} -> {g.state}) without the finalizer"
            )

    def discard(self) -> None:
        """Close the log and delete it without replaying (for tests that stop halfway)."""
        self.engine.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _replay_from_a_checkpoint(self, transitions: int) -> None:
        """The stretch from the middle checkpoint to the end verifies too: a world restored from
        a checkpoint behaves as the live one did (what parallel replay relies on)."""
        raw = self.log_path.read_bytes()
        starts = [m.start() + 1 for m in re.finditer(rb'\n(?=\{"checkpoint":)', raw)]
        assert starts, "no checkpoint line found: the check from a mid checkpoint cannot run"
        at = starts[len(starts) // 2]
        line = raw.count(b"\n", 0, at) + 1
        cp = json.loads(raw[at : raw.index(b"\n", at)])
        config = json.loads(raw[: raw.index(b"\n")])["config"]
        got = _stretch(  # (schema 4: from a checkpoint, a stretch forgets as the writer did)
            str(self.log_path),
            config,
            at,
            line,
            cp["checkpoint"],
            len(raw),
            True,
            None,
            tuple(FORGETTABLE),
        )
        assert got == ("done", transitions - cp["checkpoint"], got[2]), got

    def finish(self) -> None:
        """Close the log, replay it, and compare the rebuilt world with the live one."""
        try:
            log = self.engine.log
            assert log is not None
            log.checkpoint(self.world)  # at least one, however short the run
            self.engine.close()
            result = replay(self.log_path)
            if self.engine.forget_finished:  # what the live world forgot as it went
                Forgetter(result.world, WRITER_FORGETS)
            assert result.world.snapshot() == self.world.snapshot(), "replay(log(run)) != run"
            assert result.transitions == self.engine.log.next_seq - 1  # type: ignore[union-attr]
            assert result.world.version == self.world.version
            self._replay_from_a_checkpoint(result.transitions)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


# --- payloads ---------------------------------------------------------------------------------

Draw = Callable[[st.SearchStrategy[Any]], Any]


def junk_payload(draw: Draw) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(PAYLOAD_KEYS), max_size=4, unique=True))
    return {k: draw(JUNK) for k in keys}


def _free_on(world: World, host: str) -> list[str]:
    return sorted(
        g.id for g in world.of("gpu").values() if g.state == "free" and g.get("host") == host
    )


def pick(draw: Draw, clean: bool, options: list[Any] | tuple[Any, ...]) -> Any:
    """The first option (the right one) when `clean`, else any of them (mistakes included)."""
    return options[0] if clean else draw(st.sampled_from(options))


def _identity(draw: Draw, inst: Instance, h: Harness, clean: bool) -> dict[str, Any]:
    """The recorded identity (or a fresh one with the launch token), possibly subtly wrong."""
    known = inst.get("identity")
    ident = (
        dict(known)
        if known
        else {
            "host": inst.get("host"),
            "pid": draw(st.integers(100, 103)),
            "start_time": pick(draw, clean, [1000.0, 1000.5]),
            "token": inst.get("token"),
        }
    )
    wrong = pick(draw, clean, [None] * 6 + ["pid", "start_time", "token", "host", "gone"])
    if wrong == "pid":
        ident["pid"] = int(ident.get("pid") or 0) + 1
    elif wrong == "start_time":  # the pid was recycled by another process
        ident["start_time"] = float(ident.get("start_time") or 0) + 7.0
    elif wrong == "token":
        ident["token"] = h.token("stranger")
    elif wrong == "host":
        ident["host"] = "h0" if ident.get("host") != "h0" else "h1"
    elif wrong == "gone":
        ident.pop("start_time", None)
    return ident


def _gpu_set(draw: Draw, world: World, n: int, clean: bool) -> tuple[str, list[str]]:
    kind = pick(draw, clean, ["free", "free", "free", "any", "span", "short", "dup"])
    roomy = [x for x in HOSTS if len(_free_on(world, x)) >= n]
    host = pick(draw, clean, roomy if kind == "free" and roomy else HOSTS)
    on_host = sorted(g.id for g in world.of("gpu").values() if g.get("host") == host)
    pool = _free_on(world, host) if kind == "free" else on_host
    if kind == "span":
        pool = [on_host[0], *ROLLOUT_GPUS]
    chosen = pool[:n] if kind != "any" else draw(st.permutations(on_host))[:n]
    if kind == "short":
        chosen = chosen[: max(0, n - 1)]
    if kind == "dup" and chosen:
        chosen = [chosen[0]] * n
    return host, chosen


def valid_payload(
    draw: Draw, h: Harness, machine: str, iid: str, name: str, *, clean: bool = False
) -> dict[str, Any]:
    """A payload built from the world that the guards would usually accept, with its values
    sometimes shifted to the classic mistakes (stale, off-by-one, foreign, recycled)."""
    world = h.world
    inst = world.get(machine, iid) if machine in world.specs else None
    g = world.globals
    off = pick(draw, clean, [0, 0, 0, 0, -1, 1])
    if machine == "gpu":
        owner = inst.get("owner") if inst else None
        if name == "register":
            return {"host": pick(draw, clean, [*HOSTS, "h3"])}
        if name == "assign":
            holders = [f"engine:{e}" for e in ENGINE_IDS] + [f"hybrid:{x}" for x in HYBRID_IDS]
            return {"owner": pick(draw, clean, ["core", *holders])}
        if name in ("release", "reconcile_owned"):
            return {"owner": pick(draw, clean, [owner, owner, "core", "engine:e1"])}
        if name == "confirm_free":
            return {
                "owner": pick(draw, clean, [owner, owner, owner, "hybrid:x1"]),
                "processes_exited": pick(draw, clean, [True, True, True, False, None]),
                "memory_free": pick(draw, clean, [True, True, True, False, "yes"]),
            }
        return {"reason": "test"} if name == "fail" else {}
    if machine == "rollout_engine":
        if name == "launch":
            tp = pick(draw, clean, [1, 1, 2, 0])
            host, gpus = _gpu_set(draw, world, max(tp, 1), clean)
            token = pick(draw, clean, [h.token("launch"), h.token("launch"), ""])
            return {"host": host, "gpus": gpus, "tp": tp, "token": token}
        if name in ("healthy", "exited"):
            return {"identity": _identity(draw, inst, h, clean)} if inst else {}
        if name in ("installed", "update"):
            rev = g["revision"] + off
            return {"revision": pick(draw, clean, [rev, rev, str(rev), float(rev)])}
        if name in ("install_failed", "fail"):
            return {"reason": "oom"}
        return {}
    if machine == "hybrid_replica":
        if name == "allocate":
            host, gpus = _gpu_set(draw, world, world.config["replica_size"], clean)
            return {"host": host, "gpus": gpus}
        if name == "launch":
            return {"token": pick(draw, clean, [h.token("hyb"), h.token("hyb"), None])}
        if name in ("launched", "exited"):
            return {"identity": _identity(draw, inst, h, clean)} if inst else {}
        if name == "loaded":
            return {"version": pick(draw, clean, [g["core_version"] + off, -1])}
        return {"reason": "test"} if name in ("cancel", "fail") else {}
    if machine == "training_step":
        if name == "begin":
            return {"step": g["core_version"] + 1 + off}
        if name == "partition":
            return _partition(draw, world, clean)
        if name == "delivered":
            replicas = sorted((inst.get("partition") or {}) if inst else {})
            if pick(draw, clean, [False, True]) and replicas:
                replicas = replicas[:-1] if draw(st.booleans()) else [*replicas, "hybrid:x9"]
            return {"replicas": replicas}
        if name == "stepped":
            return {"version": g["core_version"] + 1 + off}
        if name == "published":
            return {"revision": g["revision"] + off}
        return {"reason": "test"} if name == "fail" else {}
    if machine == "revision":
        if name == "save":
            rev = int(g.get("latest_saved") or 0) + pick(draw, clean, [1, 1, 2, 0, -1])
            return {"revision": rev, "step": g["core_version"]}
        if name == "saved":
            return {"checksum": "abc", "path": f"/tmp/rev-{iid}"}
        return {"reason": "disk full"} if name == "fail" else {}
    if machine == "capacity":
        if name in ("decided", "fell_short"):
            wanted = draw(st.integers(0, 3))
            granted = wanted - 1 if name == "fell_short" else wanted
            granted = pick(draw, clean, [granted, granted, wanted, -1])
            based = world.version + pick(draw, clean, [0, 0, 0, -1])
            return {
                "based_on_version": based,
                "wanted": wanted,
                "granted": granted,
                "reason": "test",
                "actions": [],
            }
        return {}
    if machine == "request":
        if name == "enqueue":
            return {"prompt": f"prompt {iid}"}
        if name == "dispatch":
            serving = sorted(
                e.id for e in world.of("rollout_engine").values() if e.state == "serving"
            )
            return {"engine": pick(draw, clean, [*serving, *serving, *ENGINE_IDS, "e9"])}
        if name == "complete":
            engine = inst.get("engine") if inst else None
            rev = inst.get("revision") if inst else None
            wrong = pick(draw, clean, [None, None, None, "engine", "revision"])
            if wrong == "engine":
                engine = "e1" if engine != "e1" else "e2"
            elif wrong == "revision":
                rev = (rev or 0) + 1
            return {"engine": engine, "revision": rev}
        if name in ("claim", "unclaim", "consume"):
            claim = inst.get("claimed_by") if inst else None
            return {"step": pick(draw, clean, [claim, claim, *STEP_IDS])}
        return {}
    return {}


def _partition(draw: Draw, world: World, clean: bool) -> dict[str, Any]:
    from ehp_fsm.core.guards import live_replicas
    from ehp_fsm.core.transition import View

    want = world.config["groups_per_step"]
    completed = sorted(r.id for r in world.of("request").values() if r.state == "completed")
    others = sorted(r.id for r in world.of("request").values() if r.state != "completed")
    groups = completed[:want]
    kind = pick(draw, clean, ["ok", "ok", "ok", "short", "foreign", "replicas", "dup"])
    if kind == "short":
        groups = groups[:-1]
    elif kind == "foreign" and others:
        groups = [*groups[:-1], others[0]]
    elif kind == "dup" and groups:
        groups = [groups[0]] * want
    live = live_replicas(View(world))
    if kind == "replicas":
        live = [*live[:-1], "hybrid:x9"] if len(live) > 1 else [*live, "hybrid:x9"]
    partition: dict[str, list[str]] = {r: [] for r in live}
    for i, gid in enumerate(groups):
        partition[live[i % len(live)]].append(gid)
    return {"groups": groups, "partition": partition}


def pick_event(draw: Draw, world: World, machine: str, iid: str) -> str:
    """Mostly an event the spec allows in the instance's state; sometimes any event at all."""
    spec = world.specs[machine]
    inst = world.get(machine, iid)
    allowed = (spec.create.event,) if inst is None else spec.allowed_events(inst.state)
    everything = (*spec.events, *BOGUS_EVENTS)
    if allowed and draw(st.integers(0, 9)) < 7:
        return str(draw(st.sampled_from(allowed)))
    return str(draw(st.sampled_from(everything)))


# --- the shared rule-based machine ------------------------------------------------------------


def _open(world: World, machine: str, iid: str) -> bool:
    """Whether instance `iid` is yet to be created or still live."""
    inst = world.get(machine, iid)
    return inst is None or inst.state not in world.specs[machine].terminal


class RoleMachine(RuleBasedStateMachine):
    """Fires events at a `Harness`: targeted ones (an event the state allows, a payload built
    from the world and sometimes shifted to a classic mistake) on `FOCUS` machines, the
    occasional one on `SUPPORT` machines (to create owners, revisions, groups), wild ones
    (any event, junk payload, unknown instances), and clock ticks that pass deadlines."""

    FOCUS: tuple[str, ...] = ()
    SUPPORT: tuple[str, ...] = ()
    #: Machines whose `CASCADE_ONLY` edges (fired only by another machine's cascade) this role
    #: reaches and must accept: a training step claims, unclaims and consumes groups.
    CASCADES: tuple[str, ...] = ()

    @classmethod
    def required_edges(cls, specs: Mapping[str, MachineSpec]) -> set[tuple[str, str, str]]:
        """The edges this role must accept (`role_edges.check_role`): every edge of its `FOCUS`
        machines but their cascade-only ones, and the cascade-only edges of its `CASCADES`."""
        return {
            (m, state, event)
            for m, state, event in spec_edges(specs)
            if (m in cls.FOCUS and (m, event) not in CASCADE_ONLY)
            or (m in cls.CASCADES and (m, event) in CASCADE_ONLY)
        }

    def __init__(self) -> None:
        super().__init__()
        self._fresh = 0
        self.h = Harness()
        self.setup()

    def setup(self) -> None:
        """Role-specific starting world, built through checked events."""

    def must(self, machine: str, iid: str, name: str, **payload: Any) -> Accepted:
        out = self.h.fire(machine, iid, name, payload)
        assert isinstance(out, Accepted), f"set-up {machine} {iid} {name}: {out.reason}"
        return out

    def publish(self, iid: str, revision: int) -> None:
        self.must("revision", iid, "save", revision=revision, step=0)
        self.must("revision", iid, "saved", checksum="c", path=f"/tmp/{iid}")
        self.must("revision", iid, "publish")

    def serve(self, eid: str, host: str, gpus: list[str]) -> None:
        token = self.h.token(eid)
        self.must("rollout_engine", eid, "launch", host=host, gpus=gpus, tp=len(gpus), token=token)
        ident = {"host": host, "pid": 100, "start_time": 1000.0, "token": token}
        self.must("rollout_engine", eid, "healthy", identity=ident)
        self.must("rollout_engine", eid, "installed", revision=self.h.world.globals["revision"])

    def complete_group(self, gid: str, eid: str) -> None:
        self.must("request", gid, "enqueue", prompt=gid)
        self.must("request", gid, "dispatch", engine=eid)
        rev = self.h.world.get("request", gid).get("revision")  # type: ignore[union-attr]
        self.must("request", gid, "complete", engine=eid, revision=rev)

    @rule(data=st.data())
    def targeted(self, data: st.DataObject) -> None:
        machines = self.FOCUS * 3 + self.SUPPORT
        machine = data.draw(st.sampled_from(machines))
        iid = data.draw(st.sampled_from(IDS[machine]))
        name = pick_event(data.draw, self.h.world, machine, iid)
        if (machine, name) in CASCADE_ONLY:
            return
        self.h.fire(machine, iid, name, valid_payload(data.draw, self.h, machine, iid, name))

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Move a live instance of a focus machine along an edge its state has."""
        world = self.h.world
        live = [
            (m, i.id)
            for m in self.FOCUS
            for i in world.of(m).values()
            if i.state not in world.specs[m].terminal
        ]
        if not live:
            return
        machine, iid = data.draw(st.sampled_from(sorted(live)))
        inst = world.get(machine, iid)
        assert inst is not None
        forward = FORWARD.get(machine, {}).get(inst.state)
        if forward is not None and data.draw(st.integers(0, 3)) > 0:
            name = forward
        else:
            allowed = world.specs[machine].allowed_events(inst.state)
            name = data.draw(st.sampled_from(allowed))
        if (machine, name) in CASCADE_ONLY:
            return
        self.h.fire(machine, iid, name, valid_payload(data.draw, self.h, machine, iid, name))

    @rule(data=st.data(), steps=st.integers(1, 8))
    def journey(self, data: st.DataObject, steps: int) -> None:
        """Walk one focus instance up to `steps` edges along its main path with right payloads
        (so deep states are reached); the other rules then interleave mistakes."""
        machine = data.draw(st.sampled_from(self.FOCUS))
        iid = data.draw(st.sampled_from(IDS[machine][:-1]))
        world = self.h.world
        spec = world.specs[machine]
        for _ in range(steps):
            inst = world.get(machine, iid)
            if inst is not None and inst.state in spec.terminal:
                return
            name = spec.create.event if inst is None else FORWARD[machine].get(inst.state)
            if name is None:
                return
            payload = valid_payload(data.draw, self.h, machine, iid, name, clean=True)
            if not self.h.fire(machine, iid, name, payload).accepted:
                return

    @rule(data=st.data(), clean=st.booleans())
    def side_exit(self, data: st.DataObject, clean: bool) -> None:
        """Draw an edge (state, event) of a focus machine's spec, walk one instance down its
        main path to that state and leave it by that edge (a cancel, a fail, a reload, a
        deadline — the clock moved to the armed deadline): so every (state, event) a spec
        accepts is reached, not only the main path (`test_edge_coverage` checks it)."""
        machine = data.draw(st.sampled_from(self.FOCUS))
        world = self.h.world
        spec = world.specs[machine]
        want, name = data.draw(st.sampled_from(sorted(spec.table)))
        if (machine, name) in CASCADE_ONLY:
            return
        live = [i for i in IDS[machine][:-1] if world.get(machine, i) is not None]
        live = [i for i in live if _open(world, machine, i)]
        if live and data.draw(st.booleans()):
            iid = data.draw(st.sampled_from(live))
        else:  # a fresh instance, one the other rules never touch
            self._fresh += 1
            iid = f"{IDS[machine][0]}-side{self._fresh}"
        for gpu in world.of("gpu").values():  # the agents confirm every release: GPUs to take
            if gpu.state == "releasing":
                ok = {"owner": gpu.get("owner"), "processes_exited": True, "memory_free": True}
                self.h.fire("gpu", gpu.id, "confirm_free", ok)
        walk_clean = data.draw(st.integers(0, 3)) > 0
        for _ in range(8):
            inst = world.get(machine, iid)
            if inst is not None and (inst.state == want or inst.state in spec.terminal):
                break
            if (machine, want, getattr(inst, "state", None)) == (
                "rollout_engine",
                "updating",
                "serving",
            ):
                # the way into `updating`: a newer revision is published
                rev = int(world.globals.get("latest_saved") or 0) + 1
                self.publish(f"r-side{rev}", rev)
                continue
            step = spec.create.event if inst is None else FORWARD[machine].get(inst.state)
            if step is None:
                break
            payload = valid_payload(data.draw, self.h, machine, iid, step, clean=walk_clean)
            if not self.h.fire(machine, iid, step, payload).accepted:
                break
        inst = world.get(machine, iid)
        if inst is None or inst.state != want:
            return
        deadline = inst.get("deadline")
        if name == "deadline" and deadline is not None:
            self.h.now = max(self.h.now, float(deadline))
        self.h.fire(
            machine, iid, name, valid_payload(data.draw, self.h, machine, iid, name, clean=clean)
        )

    @rule(data=st.data())
    def wild(self, data: st.DataObject) -> None:
        machine = data.draw(st.sampled_from(self.FOCUS + self.SUPPORT))
        spec = self.h.world.specs[machine]
        iid = data.draw(st.sampled_from(IDS[machine]))
        name = data.draw(st.sampled_from((*spec.events, *BOGUS_EVENTS)))
        if (machine, name) in CASCADE_ONLY:
            return
        self.h.fire(machine, iid, name, junk_payload(data.draw))

    @rule(dt=st.sampled_from([0.5, 5.0, 40.0, 400.0]))
    def tick(self, dt: float) -> None:
        self.h.now += dt

    @invariant()
    def world_is_sound(self) -> None:
        assert check_invariants(self.h.world) == []
        assert ownership_problems(self.h.world) == []

    def teardown(self) -> None:
        self.h.finish()
        ROLE_EDGES[type(self).__name__].update(self.h.edges)
