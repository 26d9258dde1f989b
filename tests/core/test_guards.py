"""Each guard refuses with a reason, and a refused event changes nothing.

Scenarios run on the engine built from `tests/core/plan.toml` (Core DP2 on h0; h1 has two
devices, h2 one) with invariant checking on after every accepted step.
"""

from __future__ import annotations

import pytest

from tests.core.scenario import Scenario, identity


@pytest.fixture
def s() -> Scenario:
    return Scenario()


# --- GPU ledger and finalizer ----------------------------------------------------------------


def test_core_gpus_are_owned_by_core_from_the_start(s: Scenario) -> None:
    assert s.world.get("gpu", "h0:g0").get("owner") == "core"
    assert s.state("gpu", "h1:g0") == "free"


def test_owner_must_exist_and_claim_the_gpu(s: Scenario) -> None:
    assert "does not exist" in s.no("gpu", "h1:g0", "assign", owner="engine:ghost")
    assert "only engines and Hybrids" in s.no("gpu", "h1:g0", "assign", owner="core")
    assert "unknown owner kind" in s.no("gpu", "h1:g0", "assign", owner="robot:1")
    s.serving_engine("e0", "h1:g0")
    assert "does not list GPU h1:g1" in s.no("gpu", "h1:g1", "assign", owner="engine:e0")


def test_a_gpu_never_gets_a_second_owner(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    reason = s.no("rollout_engine", "e1", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t")
    assert "cascaded 'assign' to gpu 'h1:g0' was refused" in reason
    assert s.world.get("rollout_engine", "e1") is None  # the whole step was refused


def test_gpu_is_free_again_only_after_the_finalizer(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.reserve_engine()
    s.stop_engine("e0")
    assert s.state("gpu", "h1:g0") == "releasing"
    reason = s.no("rollout_engine", "e1", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t")
    assert "not allowed" in reason and "releasing" in reason
    assert "not been confirmed exited" in s.no(
        "gpu", "h1:g0", "confirm_free", owner="engine:e0", processes_exited=False, memory_free=True
    )
    assert "memory" in s.no(
        "gpu", "h1:g0", "confirm_free", owner="engine:e0", processes_exited=True, memory_free=False
    )
    assert "released by engine:e0" in s.no(
        "gpu", "h1:g0", "confirm_free", owner="hybrid:x", processes_exited=True, memory_free=True
    )
    s.confirm_free("h1:g0", "engine:e0")
    assert s.state("gpu", "h1:g0") == "free"
    assert s.world.get("gpu", "h1:g0").get("owner") is None


def test_release_only_by_owner(s: Scenario) -> None:
    assert "owned by core, not engine:e0" in s.no("gpu", "h0:g0", "release", owner="engine:e0")


def test_quarantine_keeps_owner_until_reconciled(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.ok("gpu", "h1:g0", "quarantine")
    assert s.world.get("gpu", "h1:g0").get("owner") == "engine:e0"
    assert "owned by engine:e0" in s.no("gpu", "h1:g0", "reconcile_free")
    assert "ledger says engine:e0" in s.no("gpu", "h1:g0", "reconcile_owned", owner="engine:e9")
    s.ok("gpu", "h1:g0", "reconcile_owned", owner="engine:e0")
    assert s.state("gpu", "h1:g0") == "owned"
    s.ok("gpu", "h1:g1", "quarantine")
    assert "had no owner" in s.no("gpu", "h1:g1", "reconcile_released")
    s.ok("gpu", "h1:g1", "reconcile_free")


def test_register_needs_a_host(s: Scenario) -> None:
    assert "host" in s.no("gpu", "h3:g0", "register")
    s.ok("gpu", "h3:g0", "register", host="h3")


# --- process identity ------------------------------------------------------------------------


def test_launch_needs_token_and_matching_tp(s: Scenario) -> None:
    s.publish(1)
    assert "launch `token`" in s.no(
        "rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1
    )
    assert "needs 2 distinct GPUs" in s.no(
        "rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=2, token="t"
    )
    assert "allocations never span hosts" in s.no(
        "rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0", "h2:g0"], tp=2, token="t"
    )
    assert "not in the inventory" in s.no(
        "rollout_engine", "e0", "launch", host="h1", gpus=["h9:g0"], tp=1, token="t"
    )


def test_healthy_only_from_our_launch(s: Scenario) -> None:
    s.publish(1)
    s.ok("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="ours")
    assert "not our process" in s.no(
        "rollout_engine", "e0", "healthy", identity=identity("h1", "theirs")
    )
    assert "launched on h1" in s.no(
        "rollout_engine", "e0", "healthy", identity=identity("h2", "ours")
    )
    assert "needs `identity`" in s.no("rollout_engine", "e0", "healthy", identity={"pid": 1})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pid", "x"),
        ("pid", True),
        ("pid", 0),
        ("pid", 1.5),
        ("start_time", {}),
        ("start_time", "5"),
        ("start_time", True),
        ("start_time", -1.0),
        ("host", 7),
        ("host", ""),
        ("token", ["ours"]),
    ],
)
def test_an_identity_of_the_wrong_types_is_refused(s: Scenario, field: str, value: object) -> None:
    """The guards checked an identity's keys, not their values: `pid: "x"`, `start_time: {}`
    were accepted and recorded as the engine's process, for a later `stop_process` to carry
    (an auditor's find). Each is refused now, naming the types, and changes nothing."""
    s.publish(1)
    s.ok("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="ours")
    bad = {**identity("h1", "ours"), field: value}
    assert "pid (a positive integer)" in s.no("rollout_engine", "e0", "healthy", identity=bad)
    assert s.state("rollout_engine", "e0") == "starting"
    s.ok("rollout_engine", "e0", "healthy", identity=identity("h1", "ours"))


def test_a_tp_of_true_is_refused(s: Scenario) -> None:
    """`tp = True` passed as 1 (a bool is an int in Python)."""
    s.publish(1)
    reason = s.no("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=True, token="t")
    assert "`tp` must be a positive integer, got True" in reason


def test_stop_confirmation_refuses_a_recycled_pid(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.reserve_engine()
    s.ok("rollout_engine", "e0", "drain")
    s.ok("rollout_engine", "e0", "drained")
    recycled = identity("h1", "t-e0", pid=100, start=99.0)
    reason = s.no("rollout_engine", "e0", "exited", identity=recycled)
    assert "a reused pid is not the same process" in reason
    assert s.state("gpu", "h1:g0") == "owned"  # nothing was released
    s.ok("rollout_engine", "e0", "exited", identity=identity("h1", "t-e0"))


def test_stop_command_carries_the_launched_identity(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.reserve_engine()
    s.ok("rollout_engine", "e0", "drain")
    out = s.ok("rollout_engine", "e0", "drained")
    (stop,) = [c for c in out.commands if c.kind == "stop_process"]
    assert stop.args["identity"] == identity("h1", "t-e0")


# --- readiness -------------------------------------------------------------------------------


def test_install_before_serve(s: Scenario) -> None:
    s.ok("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t")
    s.ok("rollout_engine", "e0", "healthy", identity=identity("h1", "t"))
    assert "never serves base weights" in s.no("rollout_engine", "e0", "installed", revision=0)
    s.publish(1)
    s.publish(2)
    assert "not the current revision 2" in s.no("rollout_engine", "e0", "installed", revision=1)
    s.ok("rollout_engine", "e0", "installed", revision=2)
    assert s.state("rollout_engine", "e0") == "serving"


def test_publication_moves_serving_engines_to_updating(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.ok("revision", "r2", "save", revision=2, step=1)
    s.ok("revision", "r2", "saved")
    out = s.ok("revision", "r2", "publish")
    assert s.state("rollout_engine", "e0") == "updating"
    assert [c.args["revision"] for c in out.commands if c.kind == "install"] == [2]
    s.ok("request", "g0", "enqueue")
    assert "engine e0 is updating" in s.no("request", "g0", "dispatch", engine="e0")


def test_requests_go_only_to_serving_engines(s: Scenario) -> None:
    s.ok("request", "g0", "enqueue", prompt="1+2=")
    assert "unknown" in s.no("request", "g0", "dispatch", engine="e0")
    s.publish(1)
    s.ok("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t")
    assert "only serving engines" in s.no("request", "g0", "dispatch", engine="e0")


def test_failed_install_keeps_engine_out_of_routing(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.ok("revision", "r2", "save", revision=2, step=1)
    s.ok("revision", "r2", "saved")
    s.ok("revision", "r2", "publish")
    out = s.ok("rollout_engine", "e0", "install_failed", reason="bad checksum")
    assert s.state("rollout_engine", "e0") == "installing"
    assert [c.kind for c in out.commands] == ["install"]  # retried with the current revision
    s.ok("request", "g0", "enqueue")
    assert "only serving engines" in s.no("request", "g0", "dispatch", engine="e0")
    s.ok("rollout_engine", "e0", "installed", revision=2)
    s.ok("request", "g0", "dispatch", engine="e0")


def test_drain_requeues_inflight_groups_and_drained_waits_for_them(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.reserve_engine()
    s.ok("request", "g0", "enqueue")
    s.ok("request", "g0", "dispatch", engine="e0")
    out = s.ok("rollout_engine", "e0", "drain")
    assert s.state("request", "g0") == "queued"
    assert {c.kind for c in out.commands} == {"pause_generation", "abort_request"}
    s.ok("rollout_engine", "e0", "drained")


def test_no_inflight_guard_when_a_request_is_still_dispatched(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.reserve_engine()
    s.ok("rollout_engine", "e0", "drain")
    s.ok("request", "g0", "enqueue")
    assert "only serving engines" in s.no("request", "g0", "dispatch", engine="e0")
    # Drain requeues everything, so no event sequence leaves a group dispatched to a draining
    # engine; the guard is defence in depth. Plant one in the world (as a corrupted restore would)
    # and check that the engine still refuses to stop with it in flight.
    from ehp_fsm.core.world import Instance

    s.world.instances["request"]["g0"] = Instance(
        "request", "g0", "dispatched", {"engine": "e0", "revision": 1}
    )
    s.world.reindex()  # written behind `World.apply`: its index is rebuilt, as a restore does
    assert "groups still in flight: ['g0']" in s.no("rollout_engine", "e0", "drained")
    s.world.instances["request"]["g0"] = Instance("request", "g0", "queued", {})
    s.world.reindex()
    s.ok("rollout_engine", "e0", "drained")


def test_engine_failure_requeues_and_releases(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.ok("request", "g0", "enqueue")
    s.ok("request", "g0", "dispatch", engine="e0")
    out = s.ok("rollout_engine", "e0", "fail", reason="oom")
    assert s.state("request", "g0") == "queued"
    assert s.state("gpu", "h1:g0") == "releasing"
    assert "stop_process" in {c.kind for c in out.commands}
    assert "terminal state 'failed'" in s.no("rollout_engine", "e0", "drain")


# --- hybrid replicas -------------------------------------------------------------------------


def test_hybrid_needs_complete_one_host_set(s: Scenario) -> None:
    s.ok("hybrid_replica", "x0", "request")
    assert "exactly replica_size=1" in s.no(
        "hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g0", "h1:g1"]
    )
    assert "never span hosts" in s.no("hybrid_replica", "x0", "allocate", host="h2", gpus=["h1:g0"])
    s.serving_engine("e0", "h1:g0")
    assert "was refused" in s.no("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g0"])
    s.ok("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g1"])
    assert s.world.get("gpu", "h1:g1").get("owner") == "hybrid:x0"


def test_activate_needs_current_version_and_step_boundary(s: Scenario) -> None:
    s.serving_engine("e0", "h2:g0", host="h2")
    s.ready_hybrid("x0", "h1:g0")
    s.ok("training_step", "step-1", "begin", step=1)
    groups = s.completed_groups(8)
    s.ok(
        "training_step",
        "step-1",
        "partition",
        groups=groups,
        partition={"core:0": groups[:4], "core:1": groups[4:]},
    )
    assert "in progress" in s.no("hybrid_replica", "x0", "activate")
    s.ok("training_step", "step-1", "delivered", replicas=["core:0", "core:1"])
    s.ok("training_step", "step-1", "reduced")
    s.ok("training_step", "step-1", "stepped", version=1)
    assert "reload before joining" in s.no("hybrid_replica", "x0", "activate")
    s.ok("hybrid_replica", "x0", "reload")
    assert "`version` must be an int" in s.no("hybrid_replica", "x0", "loaded", version="v1")
    s.ok("hybrid_replica", "x0", "loaded", version=1)
    assert "already the Core's current version" in s.no("hybrid_replica", "x0", "reload")
    epoch = s.world.globals["epoch"]
    s.ok("hybrid_replica", "x0", "activate")
    assert s.world.globals["epoch"] == epoch + 1


def test_deadline_fires_only_after_it_passed_and_releases(s: Scenario) -> None:
    s.ok("hybrid_replica", "x0", "request")
    s.ok("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g0"])
    s.ok("hybrid_replica", "x0", "launch", token="t")
    s.ok("hybrid_replica", "x0", "launched", identity=identity("h1", "t"))
    armed = s.world.get("hybrid_replica", "x0").get("deadline")
    assert "has not passed" in s.no("hybrid_replica", "x0", "deadline")
    s.now = armed
    out = s.ok("hybrid_replica", "x0", "deadline")
    assert s.state("hybrid_replica", "x0") == "failed"
    assert s.state("gpu", "h1:g0") == "releasing"
    assert "stop_process" in {c.kind for c in out.commands}


def test_cancel_before_launch_releases_without_a_process(s: Scenario) -> None:
    s.ok("hybrid_replica", "x0", "request")
    s.ok("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g0"])
    out = s.ok("hybrid_replica", "x0", "cancel", reason="planner returned")
    assert s.state("gpu", "h1:g0") == "releasing"
    assert "stop_process" not in {c.kind for c in out.commands}


def test_launched_checks_token(s: Scenario) -> None:
    s.ok("hybrid_replica", "x0", "request")
    s.ok("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g0"])
    s.ok("hybrid_replica", "x0", "launch", token="mine")
    assert "not our process" in s.no(
        "hybrid_replica", "x0", "launched", identity=identity("h1", "other")
    )


# --- training steps and groups ---------------------------------------------------------------


def test_step_order_and_partition_rules(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    assert "not the next step 1" in s.no("training_step", "step-2", "begin", step=2)
    s.ok("training_step", "step-1", "begin", step=1)
    assert "still open" in s.no("training_step", "step-1b", "begin", step=1)
    groups = s.completed_groups(8)
    assert "exactly 8 distinct groups" in s.no(
        "training_step", "step-1", "partition", groups=groups[:7], partition={}
    )
    assert "live replicas are" in s.no(
        "training_step", "step-1", "partition", groups=groups, partition={"core:0": groups}
    )
    assert "exactly once" in s.no(
        "training_step",
        "step-1",
        "partition",
        groups=groups,
        partition={"core:0": groups, "core:1": groups[:1]},
    )
    s.ok(
        "training_step",
        "step-1",
        "partition",
        groups=groups,
        partition={"core:0": groups[:5], "core:1": groups[5:]},
    )
    assert all(s.state("request", g) == "claimed" for g in groups)
    assert "missing from ['core:1']" in s.no(
        "training_step", "step-1", "delivered", replicas=["core:0"]
    )
    s.ok("training_step", "step-1", "delivered", replicas=["core:0", "core:1"])
    s.ok("training_step", "step-1", "reduced")
    assert "not the next Core version 1" in s.no("training_step", "step-1", "stepped", version=3)
    s.ok("training_step", "step-1", "stepped", version=1)
    assert all(s.state("request", g) == "consumed" for g in groups)
    assert "not the current published revision" in s.no(
        "training_step", "step-1", "published", revision=2
    )
    s.publish(2)
    s.ok("training_step", "step-1", "published", revision=2)


def test_failed_step_hands_groups_back(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.ok("training_step", "step-1", "begin", step=1)
    groups = s.completed_groups(8)
    s.ok(
        "training_step",
        "step-1",
        "partition",
        groups=groups,
        partition={"core:0": groups[:4], "core:1": groups[4:]},
    )
    s.ok("training_step", "step-1", "fail", reason="replica died")
    assert all(s.state("request", g) == "completed" for g in groups)
    s.ok("training_step", "step-1b", "begin", step=1)
    s.ok(
        "training_step",
        "step-1b",
        "partition",
        groups=groups,
        partition={"core:0": groups[:4], "core:1": groups[4:]},
    )


def test_epoch_change_during_a_step_is_refused(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.ok("training_step", "step-1", "begin", step=1)
    groups = s.completed_groups(8)
    s.ok(
        "training_step",
        "step-1",
        "partition",
        groups=groups,
        partition={"core:0": groups[:4], "core:1": groups[4:]},
    )
    s.world.globals["epoch"] += 1  # simulate a membership change the guards must catch
    assert "membership is now epoch 1" in s.no(
        "training_step", "step-1", "delivered", replicas=["core:0", "core:1"]
    )


def test_stale_groups_are_not_trained_on(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    groups = s.completed_groups(8)
    s.publish(2)
    s.publish(3)  # max_staleness = 1 → groups from revision 1 are too old
    s.ok("training_step", "step-1", "begin", step=1)
    reason = s.no(
        "training_step",
        "step-1",
        "partition",
        groups=groups,
        partition={"core:0": groups[:4], "core:1": groups[4:]},
    )
    assert "older than the bound 2" in reason
    assert "a group's claim comes only with the step's move to computing" in s.no(
        "request", "g0", "claim", step="step-1"
    )
    s.ok("request", "g0", "expire")
    assert s.state("request", "g0") == "queued"


def test_completion_must_match_dispatch(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.ok("request", "g0", "enqueue")
    s.ok("request", "g0", "dispatch", engine="e0")
    assert "dispatched to e0" in s.no("request", "g0", "complete", engine="e1", revision=1)
    assert "dispatched at 1" in s.no("request", "g0", "complete", engine="e0", revision=7)
    s.ok("request", "g0", "complete", engine="e0", revision=1)
    assert "within the bound" in s.no("request", "g0", "expire")


def test_groups_change_hands_only_through_training_steps(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    groups = s.completed_groups(8)
    g = groups[0]
    assert "payload needs the training `step`" in s.no("request", g, "claim")
    assert "does not exist" in s.no("request", g, "claim", step="step-9")
    s.ok("training_step", "step-1", "begin", step=1)
    assert "comes only with the step's move to computing" in s.no(
        "request", g, "claim", step="step-1"
    )
    s.ok(
        "training_step",
        "step-1",
        "partition",
        groups=groups,
        partition={"core:0": groups[:4], "core:1": groups[4:]},
    )
    # a caller cannot consume a claimed group without the step's optimizer step
    assert "comes only with the step's move to publishing" in s.no(
        "request", g, "consume", step="step-1"
    )
    assert "comes only with the step's move to failed" in s.no(
        "request", g, "unclaim", step="step-1"
    )
    s.ok("training_step", "step-1", "delivered", replicas=["core:0", "core:1"])
    s.ok("training_step", "step-1", "reduced")
    s.ok("training_step", "step-1", "stepped", version=1)
    assert s.state("request", g) == "consumed"
    assert "terminal" in s.no("request", g, "unclaim", step="step-1")


# --- revisions -------------------------------------------------------------------------------


def test_revisions_strictly_increase_and_retire_only_unreferenced(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    assert "not above the latest saved revision 1" in s.no("revision", "r1b", "save", revision=1)
    assert "is the current revision" in s.no("revision", "r1", "retire")
    s.ok("request", "g0", "enqueue")
    s.ok("request", "g0", "dispatch", engine="e0")
    s.publish(2)
    assert "engine e0 has revision 1 installed" in s.no("revision", "r1", "retire")
    s.ok("rollout_engine", "e0", "installed", revision=2)
    assert "request g0 in flight" in s.no("revision", "r1", "retire")
    s.ok("request", "g0", "complete", engine="e0", revision=1)
    out = s.ok("revision", "r1", "retire")
    assert [c.kind for c in out.commands] == ["delete_revision"]


def test_a_revisions_step_is_a_step_number_or_none(s: Scenario) -> None:
    for bad in ("3", -1, 2.5, True, [1], {"n": 1}):
        why = s.no("revision", "r1", "save", revision=1, step=bad)
        assert f"step {bad!r} is not the number of a training step" in why
    s.ok("revision", "r1", "save", revision=1, step=0)
    s.ok("revision", "r2", "save", revision=2)  # a revision made outside a step
    assert s.state("revision", "r1") == "saving"


def test_publish_only_newer(s: Scenario) -> None:
    s.ok("revision", "r1", "save", revision=1)
    s.ok("revision", "r2", "save", revision=2)
    s.ok("revision", "r1", "saved")
    s.ok("revision", "r2", "saved")
    s.ok("revision", "r2", "publish")
    assert "not newer than the current revision 2" in s.no("revision", "r1", "publish")
