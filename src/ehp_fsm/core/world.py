"""The engine world: every machine instance, the global counters, and the static config.

What it knows: instances keyed by (machine, id), each with a state and a small data mapping; the
globals (`core_version`, `epoch`, `revision`, ...) and the config taken from the plan. What it
does not know: how states change — only `ehp_fsm.core.transition.step` computes changes, and
`World.apply` is the one place they are written. A rejected event never reaches `apply`.
`apply` also keeps `index` (`core.index`): the answers to the guards' cluster-wide questions
(groups in flight per engine, GPUs serving rollout), so those guards do not scan the world;
whoever writes `instances` another way calls `reindex`. A world may forget finished instances
(replay's, `ehp_fsm.finished`): `forgotten` then answers a lookup of one it no longer holds, and
`get`, like the step's lookups (`core.transition`), asks it after a miss.

Instance data is never mutated in place: a transition builds a new mapping, so an `Instance`
handed out earlier stays a faithful picture of the past. The engine stores that mapping as a
plain dict (a read-only proxy per step cost more than the rest of the step); treat `data` as
read-only all the same — nothing in the engine writes to it after the step that built it.

`Instance` and `Event` are frozen `msgspec.Struct`s: immutable, compared field by field, and
built by a constructor written in C (the engine builds several objects per transition; a frozen
dataclass `__init__` cost more than the rest of a step). They hold plain data and never refer
back to anything that holds them, so they are not tracked by the cycle collector (`gc=False`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from ehp_fsm.core.index import Index
from ehp_fsm.core.spec import MachineSpec

EMPTY: Mapping[str, Any] = MappingProxyType({})
INDEXED = frozenset({"gpu", "rollout_engine", "request"})  # machines `core.index` reads


class Instance(msgspec.Struct, frozen=True, gc=False):
    machine: str
    id: str
    state: str
    data: Mapping[str, Any] = EMPTY

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def __deepcopy__(self, memo: dict[int, Any]) -> Instance:
        """Itself: an instance is frozen and its data a read-only view that nothing writes
        (`copy.deepcopy(world)` failed: a mappingproxy cannot be pickled)."""
        return self


class Event(msgspec.Struct, frozen=True, gc=False, rename={"name": "event"}):
    """Something that happened or is asked for. `time` and ids come from the caller. In JSON
    (`to_dict`, the transition log) its `name` is called `event`."""

    machine: str
    instance: str
    name: str
    time: float
    payload: Mapping[str, Any] = EMPTY
    correlation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "instance": self.instance,
            "event": self.name,
            "time": self.time,
            "payload": dict(self.payload),
            "correlation": self.correlation,
        }


def _as_set(value: object) -> frozenset[Any] | None:
    if type(value) is list or type(value) is tuple:
        try:
            return frozenset(value)
        except TypeError:
            return None
    return None


#: The config keys the engine's guards and effects read (`plan.Plan.world_config` writes them)
#: that hold a count; an absent key takes the reader's default.
CONFIG_COUNTS = (
    "replica_size",
    "groups_per_step",
    "group_size",
    "max_staleness",
    "rollout_reserve",
    "max_hybrids",
    "core_version",
)


def _number(v: object) -> bool:
    return type(v) is int or type(v) is float


def config_problem(config: Mapping[str, Any]) -> str | None:
    """Why the engine cannot read `config`, naming the key (None: it can). The guards and
    effects read these keys as the plan writes them — counts, lists of ids, a table of deadline
    seconds — and a value of another kind (a log header anyone may have written) raised a bare
    TypeError out of the step. Keys the engine does not read are not looked at."""
    inventory = config.get("inventory", {})
    if type(inventory) is not dict or not all(type(h) is str for h in inventory.values()):
        return "`inventory` is not a map of GPU id to host id"
    for key in ("core_gpus", "core_replicas"):
        ids = config.get(key, [])
        if type(ids) is not list or not all(type(x) is str for x in ids):
            return f"`{key}` is not a list of ids (strings)"
    for key in CONFIG_COUNTS:
        if key in config and type(config[key]) is not int:
            shown = msgspec.json.encode(config[key])[:40].decode(errors="replace")
            return f"`{key}` is {shown}, not an integer"
    if "default_deadline" in config and not _number(config["default_deadline"]):
        return "`default_deadline` is not a number of seconds"
    deadlines = config.get("deadlines", {})
    if type(deadlines) is not dict or not all(
        type(t) is dict and all(_number(s) for s in t.values()) for t in deadlines.values()
    ):
        return "`deadlines` is not a map of machine to {state: seconds}"
    return None


class World:
    """Mutable container, written only by `apply`. Read it freely.

    The GPU ledger starts as `config["inventory"]` ({gpu id: host}), every GPU free; GPUs that
    join later come in through the gpu machine's `register` event."""

    __slots__ = (
        "config",
        "core_gpu_set",
        "forgotten",
        "globals",
        "index",
        "instances",
        "specs",
        "version",
    )

    def __init__(
        self,
        specs: Mapping[str, MachineSpec],
        config: Mapping[str, Any],
        globals_: Mapping[str, Any] | None = None,
    ) -> None:
        self.specs = specs
        self.config = config
        # `config["core_gpus"]` as a set, for guards that ask "is this a Core GPU?" once per
        # step (a list scan grows with the cluster); None when it is not a list of hashables,
        # and those guards then read the config as it is. `config` is never changed afterwards.
        self.core_gpu_set: frozenset[Any] | None = _as_set(config.get("core_gpus"))
        self.globals: dict[str, Any] = {"core_version": 0, "epoch": 0, "revision": 0}
        start = config.get("core_version", 0)  # a resumed run's Core starts at its saved step
        if type(start) is int and start > 0:
            self.globals["core_version"] = start
        if globals_:
            self.globals.update(globals_)
        self.instances: dict[str, dict[str, Instance]] = {name: {} for name in specs}
        self.version = 0  # number of accepted events so far
        inventory: Mapping[str, str] = config.get("inventory") or {}
        if inventory and "gpu" in specs:
            initial = specs["gpu"].initial
            self.instances["gpu"] = {
                gid: Instance("gpu", gid, initial, MappingProxyType({"host": host}))
                for gid, host in inventory.items()
            }
        #: What the cluster-wide guards ask, kept by `apply` (`core.index`).
        self.index = Index.build(self.instances)
        #: (machine, id) -> a stand-in for an instance this world forgot (in its state), or None;
        #: None: the world holds every instance (see the module docstring).
        self.forgotten: Callable[[str, str], Instance | None] | None = None

    def get(self, machine: str, instance_id: str) -> Instance | None:
        inst = self.instances[machine].get(instance_id)
        if inst is None and self.forgotten is not None:
            return self.forgotten(machine, instance_id)
        return inst

    def of(self, machine: str) -> Mapping[str, Instance]:
        return self.instances[machine]

    def __iter__(self) -> Iterator[Instance]:
        for by_id in self.instances.values():
            yield from by_id.values()

    def apply(
        self, changes: Mapping[tuple[str, str], Instance], globals_: Mapping[str, Any]
    ) -> None:
        """Write the changes of one accepted step. Called by the engine shell and by replay."""
        instances, index = self.instances, self.index
        for (machine, iid), inst in changes.items():
            by_id = instances[machine]
            if machine == "request":  # `index.change`'s first case, without its call (9 in 10)
                index.request_changed(iid, by_id.get(iid), inst)
            elif machine in INDEXED:
                index.change(machine, iid, by_id.get(iid), inst)
            by_id[iid] = inst
        if globals_:
            self.globals.update(globals_)
        self.version += 1

    def reindex(self) -> None:
        """Rebuild `index` after `instances` was written other than by `apply` (a checkpoint
        restored, a test setting an instance directly)."""
        self.index = Index.build(self.instances)

    def snapshot(self) -> dict[str, Any]:
        """A plain-data picture (for `replay --at`, diagnostics and equality in tests)."""
        return {
            "version": self.version,
            "globals": dict(self.globals),
            "instances": {
                m: {i: {"state": x.state, **dict(x.data)} for i, x in sorted(by_id.items())}
                for m, by_id in self.instances.items()
            },
        }
