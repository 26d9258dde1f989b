"""The engine world: every machine instance, the global counters, and the static config.

What it knows: instances keyed by (machine, id), each with a state and a small data mapping; the
globals (`core_version`, `epoch`, `revision`, ...) and the config taken from the plan. What it
does not know: how states change — only `ehp_fsm.core.engine.step` computes changes, and
`World.apply` is the one place they are written. A rejected event never reaches `apply`.

Instance data is never mutated in place: a transition builds a new mapping, so an `Instance`
handed out earlier stays a faithful picture of the past.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ehp_fsm.core.spec import MachineSpec

EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Instance:
    machine: str
    id: str
    state: str
    data: Mapping[str, Any] = field(default_factory=lambda: EMPTY)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened or is asked for. `time` and ids come from the caller."""

    machine: str
    instance: str
    name: str
    time: float
    payload: Mapping[str, Any] = field(default_factory=lambda: EMPTY)
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


class World:
    """Mutable container, written only by `apply`. Read it freely.

    The GPU ledger starts as `config["inventory"]` ({gpu id: host}), every GPU free; GPUs that
    join later come in through the gpu machine's `register` event."""

    __slots__ = ("config", "globals", "instances", "specs", "version")

    def __init__(
        self,
        specs: Mapping[str, MachineSpec],
        config: Mapping[str, Any],
        globals_: Mapping[str, Any] | None = None,
    ) -> None:
        self.specs = specs
        self.config = config
        self.globals: dict[str, Any] = {"core_version": 0, "epoch": 0, "revision": 0}
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

    def get(self, machine: str, instance_id: str) -> Instance | None:
        return self.instances[machine].get(instance_id)

    def of(self, machine: str) -> Mapping[str, Instance]:
        return self.instances[machine]

    def __iter__(self) -> Iterator[Instance]:
        for by_id in self.instances.values():
            yield from by_id.values()

    def apply(
        self, changes: Mapping[tuple[str, str], Instance], globals_: Mapping[str, Any]
    ) -> None:
        """Write the changes of one accepted step. Called by the engine shell and by replay."""
        for (machine, iid), inst in changes.items():
            self.instances[machine][iid] = inst
        self.globals.update(globals_)
        self.version += 1

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
