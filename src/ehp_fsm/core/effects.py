"""Named effects: what an accepted transition writes and asks the shell to do.

An effect gets an `Act` and may patch the instance's data (`set`), patch a global (`set_global`),
emit a `Command` for the shell (`emit`: launch, stop process X, install revision r, ...) or
cascade an event to another machine in the same atomic step (`cascade`: a GPU claimed or
released, a group requeued). It never performs I/O; performing commands is the shell's job.
"""

from __future__ import annotations

from typing import Any

from ehp_fsm.core.guards import BUSY_STEP_STATES, inflight_requests
from ehp_fsm.core.transition import Act, Effect

EFFECTS: dict[str, Effect] = {}
DEFAULT_DEADLINE_S = 300.0


def effect(fn: Effect) -> Effect:
    EFFECTS[fn.__name__] = fn
    return fn


def _copy(value: Any) -> Any:
    """A command's own copy of a map it takes from the world: a shell that edits a command's
    arguments must not rewrite what the world recorded (an identity the guards compare)."""
    return dict(value) if isinstance(value, dict) else value


@effect
def record_host(act: Act) -> None:
    act.set(host=act.payload["host"])


@effect
def set_owner(act: Act) -> None:
    act.set(owner=act.payload["owner"])


@effect
def clear_owner(act: Act) -> None:
    act.data.pop("owner", None)


@effect
def request_free_confirmation(act: Act) -> None:
    act.emit("confirm_gpu_free", host=act.data.get("host"), owner=act.data.get("owner"))


@effect
def remember_state(act: Act) -> None:
    act.set(prior=act.inst.state)


@effect
def forget_state(act: Act) -> None:
    act.data.pop("prior", None)


@effect
def record_reason(act: Act) -> None:
    act.set(reason=str(act.payload.get("reason") or act.event.name))


@effect
def arm_deadline(act: Act) -> None:
    table = act.view.config.get("deadlines", {}).get(act.inst.machine, {})
    seconds = table.get(
        act.transition.dest, act.view.config.get("default_deadline", DEFAULT_DEADLINE_S)
    )
    act.set(deadline=act.event.time + float(seconds))


@effect
def disarm_deadline(act: Act) -> None:
    act.data.pop("deadline", None)


# --- launches, identities, GPUs ---------------------------------------------------------------


@effect
def record_launch(act: Act) -> None:
    p = act.payload
    act.set(host=p["host"], gpus=list(p["gpus"]), tp=p["tp"], token=p["token"])


@effect
def record_allocation(act: Act) -> None:
    act.set(host=act.payload["host"], gpus=list(act.payload["gpus"]))


@effect
def record_token(act: Act) -> None:
    act.set(token=act.payload["token"])


@effect
def claim_gpus(act: Act) -> None:
    for g in act.data["gpus"]:
        act.cascade("gpu", str(g), "assign", owner=act.owner_key)


@effect
def release_gpus(act: Act) -> None:
    """Hand every GPU this instance still owns to the finalizer (quarantined ones reconcile)."""
    owner = act.owner_key
    for g in act.data.get("gpus") or ():
        gpu = act.view.get("gpu", str(g))
        if gpu is not None and gpu.state == "owned" and gpu.get("owner") == owner:
            act.cascade("gpu", str(g), "release", owner=owner)


@effect
def emit_launch(act: Act) -> None:
    act.emit(
        "launch",
        role=act.inst.machine,
        host=act.data["host"],
        gpus=list(act.data["gpus"]),
        token=act.data["token"],
    )


@effect
def record_identity(act: Act) -> None:
    act.set(identity=dict(act.payload["identity"]))


@effect
def emit_stop_process(act: Act) -> None:
    """Stop exactly the identified process; before identification, the launch with our token."""
    ident = act.data.get("identity")
    if ident is not None:
        act.emit("stop_process", identity=dict(ident))
    elif act.data.get("token"):
        act.emit("cancel_launch", host=act.data.get("host"), token=act.data["token"])


# --- rollout engines --------------------------------------------------------------------------


@effect
def emit_install_current(act: Act) -> None:
    rev = act.view.glob("revision")
    if rev >= 1:
        act.emit("install", revision=rev, identity=_copy(act.data.get("identity")))


@effect
def record_installed(act: Act) -> None:
    act.set(installed=act.payload["revision"])


@effect
def record_failure(act: Act) -> None:
    act.set(
        install_failures=int(act.data.get("install_failures", 0)) + 1,
        reason=str(act.payload.get("reason", "install failed")),
    )


@effect
def requeue_inflight(act: Act) -> None:
    for rid in inflight_requests(act.view, act.inst.id):
        act.cascade("request", rid, "abort", reason=f"engine {act.inst.id} {act.event.name}")


@effect
def emit_pause_retract(act: Act) -> None:
    act.emit("pause_generation", mode="retract", identity=_copy(act.data.get("identity")))


# --- hybrid replicas --------------------------------------------------------------------------


@effect
def emit_load_state(act: Act) -> None:
    act.emit(
        "load_state",
        version=act.view.glob("core_version"),
        identity=_copy(act.data.get("identity")),
    )


@effect
def record_loaded_version(act: Act) -> None:
    act.set(loaded_version=act.payload["version"])


@effect
def bump_epoch(act: Act) -> None:
    act.set_global("epoch", act.view.glob("epoch") + 1)


@effect
def bump_epoch_if_active(act: Act) -> None:
    if act.inst.state == "active":
        bump_epoch(act)


# --- training steps ---------------------------------------------------------------------------


@effect
def record_partition(act: Act) -> None:
    # ids as strings: a request's id is the string of its group id (see `partition_is_complete`)
    partition = {str(k): [str(g) for g in v] for k, v in act.payload["partition"].items()}
    act.set(
        epoch=act.view.glob("epoch"),
        groups=[str(g) for g in act.payload["groups"]],
        partition=partition,
        base_revision=act.view.glob("revision"),
    )


@effect
def claim_groups(act: Act) -> None:
    for g in act.data["groups"]:
        act.cascade("request", str(g), "claim", step=act.inst.id)


@effect
def emit_compute(act: Act) -> None:
    partition = {r: list(gs) for r, gs in act.data["partition"].items()}  # not the world's lists
    act.emit("compute", epoch=act.data["epoch"], partition=partition)


@effect
def bump_core_version(act: Act) -> None:
    act.set_global("core_version", act.payload["version"])


@effect
def consume_groups(act: Act) -> None:
    for g in act.data["groups"]:
        act.cascade("request", str(g), "consume", step=act.inst.id)


@effect
def unclaim_groups(act: Act) -> None:
    if act.inst.state in BUSY_STEP_STATES:
        for g in act.data.get("groups") or ():
            act.cascade("request", str(g), "unclaim", step=act.inst.id)


# --- revisions --------------------------------------------------------------------------------


@effect
def record_revision(act: Act) -> None:
    act.set(revision=act.payload["revision"], step=act.payload.get("step"))
    act.set_global("latest_saved", act.payload["revision"])


@effect
def record_manifest(act: Act) -> None:
    act.set(checksum=act.payload.get("checksum"), path=act.payload.get("path"))


@effect
def set_current_revision(act: Act) -> None:
    act.set_global("revision", act.data["revision"])


@effect
def update_serving_engines(act: Act) -> None:
    spec = act.view.world.specs["rollout_engine"]
    for e in act.view.all("rollout_engine"):
        if spec.table.get((e.state, "update")) is not None:
            act.cascade("rollout_engine", e.id, "update", revision=act.data["revision"])


@effect
def emit_delete_revision(act: Act) -> None:
    act.emit("delete_revision", revision=act.data["revision"], path=act.data.get("path"))


# --- requests ---------------------------------------------------------------------------------


@effect
def record_prompt(act: Act) -> None:
    act.set(prompt=act.payload.get("prompt"))


@effect
def record_dispatch(act: Act) -> None:
    eid = act.payload["engine"]  # a string: `step` types ids at the boundary
    engine = act.view.get("rollout_engine", eid)
    act.set(engine=eid, revision=engine.get("installed") if engine else None)


@effect
def emit_generate(act: Act) -> None:
    act.emit(
        "generate",
        engine=act.data["engine"],
        revision=act.data["revision"],
        prompt=act.data.get("prompt"),
    )


@effect
def emit_abort_request(act: Act) -> None:
    act.emit("abort_request", engine=act.data.get("engine"))


@effect
def clear_dispatch(act: Act) -> None:
    act.data.pop("engine", None)
    act.data.pop("revision", None)


@effect
def record_completion(act: Act) -> None:
    act.set(completed_at=act.event.time)


@effect
def record_claim(act: Act) -> None:
    act.set(claimed_by=act.payload["step"])


@effect
def clear_claim(act: Act) -> None:
    act.data.pop("claimed_by", None)


@effect
def record_consumed(act: Act) -> None:
    act.set(consumed_by=act.payload["step"])


# --- planner decisions ------------------------------------------------------------------------


@effect
def record_decision(act: Act) -> None:
    p = act.payload
    act.set(
        based_on_version=p["based_on_version"],
        wanted=p.get("wanted"),
        granted=p.get("granted"),
        reason=str(p.get("reason", "")),
        actions=list(p.get("actions") or ()),
    )


@effect
def record_shortfall(act: Act) -> None:
    act.set(
        shortfall={
            "wanted": act.payload["wanted"],
            "granted": act.payload["granted"],
            "reason": str(act.payload.get("reason", "")),
        }
    )


@effect
def clear_shortfall(act: Act) -> None:
    act.data.pop("shortfall", None)
