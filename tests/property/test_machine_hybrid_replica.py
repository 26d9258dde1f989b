"""The hybrid_replica machine under random events, illegal ones included: allocations that are
incomplete, span hosts, repeat a GPU or take GPUs someone owns; launch reports with a foreign
token; loads of a stale Core version; activation or leaving mid-step; exits reported by a
recycled pid; deadlines fired early; events after `stopped`/`cancelled`/`failed`.

The GPU cascade is checked on every accepted event (`_gpu_cascade`): `allocate` claims every
GPU of the allocation for `hybrid:<id>`; `exited`/`cancel`/`fail`/`deadline` hand every GPU the
replica still owned to `releasing` (the finalizer asks its agent to confirm) and the `finalize`
rule's `confirm_free` makes them free again. Plus `strategies.Harness`'s invariants."""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from ehp_fsm.core.transition import Outcome
from ehp_fsm.core.world import Event, Instance, World
from tests.property.role_edges import check_role
from tests.property.strategies import ROLLOUT_GPUS, RoleMachine

_RELEASING_EVENTS = frozenset({"exited", "cancel", "fail", "deadline"})


class HybridReplicas(RoleMachine):
    FOCUS = ("hybrid_replica",)
    SUPPORT = ("gpu", "training_step", "rollout_engine")

    def setup(self) -> None:
        self.publish("r1", 1)
        self.serve("e1", "h2", ["h2:g0"])  # h2 is half taken: a Hybrid fits only on h1
        self.h.hooks.append(self._gpu_cascade)
        self.owned_before: dict[str, Any] = {}

    @rule(data=st.data())
    def stale_load(self, data: st.DataObject) -> None:
        """A replica reports a load of a version the Core is not at: it is ready but may not
        join until it reloads (`reload` is accepted only while the version is stale)."""
        world = self.h.world
        loading = sorted(x.id for x in world.of("hybrid_replica").values() if x.state == "loading")
        if not loading:
            return
        hid = data.draw(st.sampled_from(loading))
        version = world.globals["core_version"] + 1
        assert self.h.fire("hybrid_replica", hid, "loaded", {"version": version}).accepted
        assert not self.h.fire("hybrid_replica", hid, "activate").accepted
        assert self.h.fire("hybrid_replica", hid, "reload").accepted
        assert not self.h.fire("hybrid_replica", hid, "activate").accepted  # still loading

    @rule(gid=st.sampled_from(ROLLOUT_GPUS), ok=st.sampled_from([True, True, False]))
    def finalize(self, gid: str, ok: bool) -> None:
        """The releasing owner's agent confirms (or fails to confirm) its processes are gone."""
        g = self.h.world.get("gpu", gid)
        assert g is not None
        payload = {"owner": g.get("owner"), "processes_exited": True, "memory_free": ok}
        out = self.h.fire("gpu", gid, "confirm_free", payload)
        assert out.accepted == (g.state == "releasing" and ok)
        if out.accepted:
            after = self.h.world.get("gpu", gid)
            assert after is not None and after.state == "free" and after.get("owner") is None

    def _gpu_cascade(self, event: Event, inst: Instance | None, world: World, out: Outcome) -> None:
        if not out.accepted or event.machine != "hybrid_replica":
            return
        x = world.get("hybrid_replica", event.instance)
        assert x is not None
        me = f"hybrid:{x.id}"
        gpus = [world.get("gpu", g) for g in x.get("gpus") or ()]
        if event.name == "allocate":
            assert len(gpus) == world.config["replica_size"]
            assert all(g is not None and g.state == "owned" and g.get("owner") == me for g in gpus)
            assert len({g.get("host") for g in gpus if g is not None}) == 1
            claimed = [r.instance for r in out.records if r.event == "assign"]
            assert sorted(claimed) == sorted(x.get("gpus"))
        if event.name in _RELEASING_EVENTS:
            assert x.state in ("stopped", "cancelled", "failed")
            released = {r.instance for r in out.records if r.event == "release"}
            for g in gpus:
                assert g is not None
                assert not (g.state == "owned" and g.get("owner") == me), f"{g.id} still owned"
                if g.id in released:
                    assert g.state == "releasing" and g.get("owner") == me
            asked = [c for c in out.commands if c.kind == "confirm_gpu_free"]
            assert len(asked) == len(released)


HybridReplicas.TestCase.settings = settings(
    HybridReplicas.TestCase.settings, stateful_step_count=30
)


def test_hybrid_replicas_hold_and_accept_every_edge() -> None:
    """Run in a fresh process (`role_edges.check_role`: why there), derandomized with the `ci`
    profile's examples: every invariant holds and every edge it is responsible for is
    accepted."""
    check_role(HybridReplicas)
