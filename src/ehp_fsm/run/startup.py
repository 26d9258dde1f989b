"""Start-up of one run: the pieces `Job.start` puts together, one plain function each.

In order: the controller's port is checked (`check_controller_port`, before anything of the
previous run is removed); the run directory is cleared of the previous run's revisions, trainer
and agent state; the operational log goes to `controller.log` beside the transition log; the
trainer pool (Core ranks + warm Hybrid workers, one Gloo world) is spawned with the run's
optimizer; one host agent per host is started as a subprocess pointed at the controller; the
rollout performers (publisher, dispatcher, the engines' HTTP clients) are built over the loop's
door; and revision 1 — the initial weights every engine installs before it serves — is saved and
published.

Knows: the plan's hosts, Core and EHP settings, the agent's command line, how the publisher and
the dispatcher reach the world (the loop's door, on its clock). Does not know: the order
the job calls these in, how long it waits for agents or engines, or what happens when they do
not come (`job`); the step loop, the planner or the end of a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import ipaddress
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

import structlog

from ehp_fsm.addresses import is_loopback_endpoint
from ehp_fsm.data.task import DatasetTask
from ehp_fsm.errors import EhpError
from ehp_fsm.fspaths import open_own
from ehp_fsm.plan import Host, Plan
from ehp_fsm.rollout.client import SGLangClient
from ehp_fsm.rollout.connections import EngineConnections
from ehp_fsm.rollout.dispatch import DispatchConfig, Dispatcher
from ehp_fsm.rollout.publish import PublishConfig, Publisher
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.run.decisions import Decisions
from ehp_fsm.run.engines import engine_launch
from ehp_fsm.run.hybrids import WarmHybrids
from ehp_fsm.run.inputs import CLEARED_SUBFOLDERS, core_device
from ehp_fsm.run.placement import (
    core_lane_hosts,
    local_lenders,
    local_warm_lanes,
    remote_warm_lanes,
    unseen_write,
)
from ehp_fsm.run.resume import segments_of
from ehp_fsm.run.samples import SAMPLES_FILE
from ehp_fsm.run.step import Trainer
from ehp_fsm.runtime.controller import Controller, transport_config
from ehp_fsm.runtime.errors import TransportError
from ehp_fsm.runtime.identity import hide_launch_tokens
from ehp_fsm.runtime.keys import generate_keys, load_server_keys
from ehp_fsm.runtime.transport import ControllerEndpoint
from ehp_fsm.shell.loop import Loop, Performer
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.objective import ObjectiveConfig
from ehp_fsm.training.pool import Launcher, PoolConfig, PoolFailure, TrainerPool
from ehp_fsm.training.pool_socket import LOOPBACK


def job_adam(lr: float) -> AdamConfig:
    """The run's optimizer: AdamW with torch's fused CPU kernel, chosen explicitly. On the tiny
    policy the per-parameter path (torch's default when nothing is chosen) costs ~2–6 ms a step
    in Python dispatch over 29 pieces against ~0.6 ms fused — the same update (Core and Hybrid
    lanes stay bit-identical across paddings); its temporaries are per tensor, not model-wide."""
    return AdamConfig(lr=lr, eps=1e-6, fused=True)


#: A revision's folder in the revisions folder (`RevisionStore`: `r` and eight digits).
REVISION_NAME: Final = re.compile(r"r\d{8}")


def previous_revisions(revisions: Path) -> Path:
    """Where a fresh start keeps the previous run's newest revision: a sibling of the revisions
    folder (`revisions.previous`), so on the same file system (a shared path too)."""
    return revisions.with_name(revisions.name + ".previous")


#: What a run writes at its end beside its log, of that log alone (`ending.finish`).
PREVIOUS_REPORT: Final = ("receipt.json", "summary.txt", "timeline.png", "timeline.svg")


def check_controller_port(plan: Plan) -> None:
    """The plan's controller endpoint bound once and let go (`ControllerEndpoint`: the same
    bind, refused with the same `TransportError`): a port another process holds, or an address
    this machine does not have, is refused before the start touches anything of the previous
    run. The start bound it only after `clear_run_dir` and after its log replaced the previous
    one: a mistyped `ehp-fsm run` (for `--resume`) on a busy port never began, and left nothing
    to resume. (A port taken in the milliseconds between this and the controller's own bind is
    still refused there.)"""
    bind = plan.transport.controller
    if bind.startswith("ipc://"):
        check_ipc_path(bind, bind.removeprefix("ipc://"))
    ControllerEndpoint(bind=bind, config=transport_config(plan)).close()


def check_ipc_path(bind: str, path: str) -> None:
    """No live process listens on an `ipc://` controller path. ZeroMQ binds an `ipc://`
    path by removing whatever socket file is there first: a second run (of another plan) with
    the same path took it from a live run without a word (the live run's agents, reconnecting,
    then reached the wrong controller), and the port check's own bind and close removed the
    path, so no new connection reached the live run at all. A socket file no process listens
    on (a killed run's) is left to the bind to replace; a path too long for a socket is the
    plan's to refuse (`addresses.endpoint_problem`), an abstract name (`ipc://@name`)
    ZeroMQ's."""
    if path.startswith("@"):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(path)
    except OSError:  # nothing there, no socket, or no one listening: the bind decides
        return
    finally:
        probe.close()
    raise TransportError(
        f"cannot bind the controller to {bind}",
        "another process listens on that path (another run's controller, by the same "
        "[transport] controller); binding it would take the path from that process",
        "give each run its own ipc:// path, or stop the run that holds it "
        "(`ehp-fsm stop PLAN` of that run's plan)",
    )


def clear_run_dir(
    run_dir: Path,
    revisions: Path,
    *,
    resume: bool = False,
    say: Callable[[str], None] = lambda _: None,
    log: Path | None = None,
) -> None:
    """Remove the previous run's revisions, saved states, trainer, agent and verify state;
    keep the logs (`spawn_pool` makes the trainers' folder anew, mode 0700). A resume
    keeps the revisions and the saved states it goes on from. A fresh start keeps the previous
    run's newest revision — its trained model — moved beside the revisions folder
    (`previous_revisions`: one run back, the one kept before it removed), and says so (`say`):
    a second `ehp-fsm run` of a plan removed the first one's trained model without a word. A
    fresh start's log (`log`) replaces the previous one, whose segments (`transitions.<n>.jsonl`,
    a resumed run's) go with it: they stayed beside an unrelated log, and the next resume
    numbered its own segment after them.

    The previous run's report (`PREVIOUS_REPORT`: receipt, summary, timeline) goes too, on a
    resume as well: it describes a log this run replaces, and while this run ran (or after it
    was killed) `replay LOG --receipt receipt.json` took the log for one cut short or edited."""
    for sub in CLEARED_SUBFOLDERS:  # `verify`: the last --verify's
        shutil.rmtree(run_dir / sub, ignore_errors=True)
    for name in PREVIOUS_REPORT:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (run_dir / name).unlink()
    if not resume:
        try:
            kept = sorted(p.name for p in revisions.iterdir() if REVISION_NAME.fullmatch(p.name))
        except OSError:  # none yet (or not a folder: the store refuses it, named, later)
            kept = []
        if kept:
            previous = previous_revisions(revisions)
            removed = [f"{len(kept) - 1} older"] if len(kept) > 1 else []
            if previous.exists():
                removed.append("the one kept by the run before")
            shutil.rmtree(previous, ignore_errors=True)
            previous.mkdir(mode=0o700, parents=True)  # the trained model: the user's alone
            os.replace(revisions / kept[-1], previous / kept[-1])  # one folder: a rename
            say(
                f"run: the previous run's newest revision is kept as {previous / kept[-1]}"
                + (f" ({' and '.join(removed)} removed)" if removed else "")
                + "; use --resume to go on with a stopped or killed run instead"
            )
        shutil.rmtree(revisions, ignore_errors=True)
        shutil.rmtree(run_dir / "resume", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (run_dir / SAMPLES_FILE).unlink()  # `[run] samples`: the stopped run's steps
        if log is not None:
            for segment in [log, *segments_of(log).values()]:
                if segment != log:
                    with contextlib.suppress(FileNotFoundError):
                        segment.unlink()
                for cut in segment.parent.glob(glob.escape(segment.name) + ".cut-*"):
                    with contextlib.suppress(OSError):  # what recovery cut off its tail
                        cut.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def private_folder(folder: Path) -> None:
    """Make `folder` (one of the run directory's) mode 0700: made so, or narrowed when a run of
    this user made it with more (before 2026-12-07 `resume/` and `revisions/` were 0755). What
    the run's agents and trainer workers write there — every engine's output (SGLang logs its
    `--api-key`, and the engines' key outlives the run: `keys.ensure_api_key` keeps it), the
    agents' records of their processes, the trainer pool's worker logs and Gloo rendezvous,
    the trained weights and optimizer state (`resume/`, `revisions/`, `verify/`) — is for the
    run's user alone. They were 0755 (the umask), their files 0644: any user of the machine
    read them (the trained weights and Adam state: an attacker's find). A folder of another
    user's is left as it is (the writes into it refuse what they must)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        folder.chmod(0o700)


def log_beside(run_dir: Path) -> TextIO:
    """Send the operational logs to `controller.log` beside the transition log, not to the
    screen; the open file is returned (the run keeps it open to its end)."""
    # a symbolic link there is refused (`open_own`): the run's log lines went into its target;
    # mode 0600: its lines name the run's launches (tokens are secrets, `run.owned`: each is
    # cut to a hint by `hide_launch_tokens`, but an error's text may still hold one)
    fd = open_own(run_dir / "controller.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, private=True)
    logfile = os.fdopen(fd, "a", encoding="utf-8")
    structlog.configure(
        processors=[
            hide_launch_tokens,  # secrets, in a log that is shared (bug reports)
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.WriteLoggerFactory(file=logfile),
    )
    return logfile


def pool_config(
    plan: Plan,
    model_dir: Path,
    store_root: Path,
    *,
    lenders: Sequence[str] = (),
    remote_core: Sequence[str | None] = (),
) -> PoolConfig:
    """What the trainer pool is started with: the Core ranks (those of `remote_core`'s hosts
    launched there by their agents, `placement.remote_core`) and, with EHP on, warm workers on
    this machine when a Hybrid may be borrowed on it (`max_hybrids`, at most as many as fit:
    `placement.local_warm_lanes`) plus the warm lanes of the lending hosts on other machines
    (`lenders`: launched there by their agents, `placement.remote_warm_lanes`), each training
    the plan's model under its GRPO objective on the plan's `core.backend`, every lane of
    `core.tp` processes (a Hybrid replica has the Core's TP shape)."""
    x, g = plan.ehp, plan.grpo
    local = x.enabled and (not lenders or local_lenders(plan, list(lenders)))
    backend = plan.core.backend
    return PoolConfig(
        model=str(model_dir),
        objective=ObjectiveConfig(
            clip_low=g.clip_low,
            clip_high=g.clip_high,
            kl_coef=g.kl_coef,
            aggregation=g.loss_aggregation,  # type: ignore[arg-type]
            temperature=g.temperature,  # the engines' log-probs are tempered: π_θ is too
        ),
        seed=plan.seed,
        core_dp=plan.core.dp,
        tp=plan.core.tp,
        pp=plan.core.pp,
        max_hybrids=local_warm_lanes(plan, list(lenders)) if local else 0,
        remote_warm=remote_warm_lanes(plan, list(lenders)) if x.enabled else (),
        remote_core=tuple(remote_core),
        revisions=str(store_root),
        adam=job_adam(plan.grpo.learning_rate),
        backend=backend,
        device=core_device(plan),
        # a worker may join the world as late as the run waits for its hello
        join_timeout_s=plan.run_deadlines.trainers_start,
    )


def start_pool(
    plan: Plan,
    model_dir: Path,
    store_root: Path,
    run_dir: Path,
    *,
    lenders: Sequence[str] = (),
    remote_core: Sequence[str | None] = (),
    launcher: Launcher | None = None,
) -> TrainerPool:
    """The trainer pool of `pool_config`, started (not waited for: `TrainerPool.wait_ready`),
    its processes working in `run_dir/trainers`. With lanes on other machines (Core or warm),
    Gloo's rendezvous files are kept beside the revisions (`rendezvous_dir`: a path every host
    sees)."""
    config = pool_config(plan, model_dir, store_root, lenders=lenders, remote_core=remote_core)
    private_folder(run_dir / "trainers")  # (made when a pool starts: a run that never
    # started one has none)
    if not config.remote_ranks:
        return TrainerPool(
            config, work_dir=run_dir / "trainers", **pool_channel(plan, config)
        ).launch_all()
    return TrainerPool(
        config,
        work_dir=run_dir / "trainers",
        launcher=launcher,
        rendezvous_dir=rendezvous_dir(store_root),
        **pool_channel(plan, config),
    ).launch_all()


def pool_channel(plan: Plan, config: PoolConfig) -> dict[str, Any]:
    """Where the trainer pool's control channel listens, and who may speak on it: loopback
    when every rank runs on this machine, else the controller's address (the one the agents
    reach this machine by); with the plan's CURVE keys whenever it has them (`curve = "local"`
    too: on a shared machine a plain loopback channel took any local user's frames), each rank
    bound to the key of the host whose agent launched it (`PoolConfig.home`), and the ranks the
    run launches itself to one host of its machine (`local_host`). Refused: a wildcard
    controller address when workers on other machines need one to connect to."""
    if not config.remote_ranks:
        return _pool_keys(plan, config, {"listen": LOOPBACK})
    host = plan.transport.controller.partition("://")[2].rsplit(":", 1)[0]
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        ip = None
    if is_loopback_endpoint(plan.transport.controller):
        listen = "tcp://127.0.0.1"  # "other machines" on this one (EHP_MACHINE): tests
    elif host == "*" or (ip is not None and ip.is_unspecified):
        raise EhpError(
            f"[transport] controller = {plan.transport.controller!r} is a wildcard, and "
            "trainer workers on other machines connect to the trainer pool at the controller's "
            "address",
            f"hosts {config.remote_hosts} run trainer lanes on other machines",
            "give the run's node's own address, e.g. controller = \"tcp://10.0.0.1:5555\"",
        )
    elif ip is None:  # a host name: the address it names here
        listen = f"tcp://{socket.gethostbyname(host)}"
    else:
        listen = f"tcp://{host}"
    return _pool_keys(plan, config, {"listen": listen})


def _pool_keys(plan: Plan, config: PoolConfig, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the plan's CURVE keys for the pool's channel (none: as they are)."""
    if plan.transport.curve_keys is None:
        return options
    keys = Path(plan.transport.curve_keys)
    own = local_host(plan, config)
    return {
        **options,
        "curve": load_server_keys(keys),
        "rank_hosts": {r: config.home(r) or own for r in range(config.world_size)},
        "local_client_key": keys / "agents" / f"{own}.key_secret",
    }


def local_host(plan: Plan, config: PoolConfig) -> str:
    """The host whose key the ranks the run launches itself carry: the first Core lane's host
    that is not on another machine, else the first host no lane of another machine is on (a
    lending host of this machine), else the first Core lane's host (no rank is launched here)."""
    lanes = core_lane_hosts(plan)
    for rank, host in enumerate(lanes):
        if config.home(rank) is None:
            return host
    remote = set(config.remote_hosts)
    return next((h.id for h in plan.hosts if h.id not in remote), lanes[0])


def rendezvous_dir(store_root: Path) -> Path:
    """Where the trainer pool's Gloo rendezvous files go when workers run on other
    machines: `gloo-rendezvous/` beside the revisions (the plan's `run.revisions`, which every
    host reads — a shared file system on a cluster; Gloo's file rendezvous needs file locks,
    which NFS has)."""
    return Path(store_root).parent / "gloo-rendezvous"


def local_keys(plan: Plan, run_dir: Path) -> Plan:
    """With `transport.curve = "local"`: CURVE keys for this run's own agents, one per host id
    and bound to it, made in `run_dir/keys`; the plan returned names them (`curve_keys`), so the
    controller and the agents take the authenticated path. Otherwise `plan` as it is."""
    if plan.transport.curve != "local":
        return plan
    keys = run_dir / "keys"
    generate_keys(keys, agents=[h.id for h in plan.hosts], overwrite=True)
    return dataclasses.replace(
        plan, transport=dataclasses.replace(plan.transport, curve_keys=str(keys))
    )


def agent_argv(plan: Plan, host: Host, endpoint: str, run_dir: Path) -> list[str]:
    """The command line of `host`'s agent: its plan's slots, device, heartbeat and frame limit,
    its state in `run_dir/agents/<host>`, this process as its owner (`--parent-pid`: the agent,
    and so its engines, stops when the run dies), and how its engines start: from the newest
    revision in the run's store (`revisions_dir`, `engine_launch`)."""
    t = plan.transport
    return [
        sys.executable,
        "-m",
        "ehp_fsm.cli",
        "agent",
        "--controller",
        endpoint,
        "--host-id",
        host.id,
        "--slots",
        str(len(host.gpus)),
        "--device",
        host.device,
        "--heartbeat-s",
        str(t.heartbeat_s),
        "--max-message-bytes",
        str(t.max_message_bytes),
        "--state-dir",
        str(run_dir / "agents" / host.id),
        "--parent-pid",
        str(os.getpid()),
        *engine_launch(plan, run_dir).agent_flags(),
        *(["--keys", t.curve_keys] if t.curve_keys else []),
    ]


def spawn_agent(
    plan: Plan, host: Host, endpoint: str, run_dir: Path, token: str
) -> subprocess.Popen[bytes]:
    """`host`'s agent (`agent_argv`) as a subprocess in its own session, logging to
    `agents/<host>.log`, with `token` (the run's launch token, which `run.json` records it
    with) in its environment: how `ehp-fsm stop` knows the process is the run's agent
    (`owned.Owned.refusal`). Its own launches get their own tokens (`LaunchSpec.env`)."""
    logf = run_dir / "agents" / f"{host.id}.log"
    private_folder(logf.parent)  # (its agent's state directory goes there too)
    # mode 0600, not a link (`open_own`): the agent logs the identities it reports (launch
    # tokens are secrets, `run.owned`: the agent cuts each to a hint, but an error's text may
    # still hold one)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(open_own(logf, flags, private=True), "wb") as fh:
        return subprocess.Popen(
            agent_argv(plan, host, endpoint, run_dir),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "EHP_LAUNCH_TOKEN": token},
        )


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """What the rollout shell is built with from the plan. One install call is bounded by the
    engine machine's install/update deadline (and a failing engine is retried for as long,
    then failed); one group's `/generate` by `[deadlines.run] generate`, the `/health` probe
    after one that got no answer by `[deadlines.run] health`."""

    publish: PublishConfig
    dispatch: DispatchConfig
    generate_timeout_s: float
    update_timeout_s: float

    @classmethod
    def of(cls, plan: Plan) -> RolloutSettings:
        engine = plan.deadlines["rollout_engine"]
        install_s = max(engine["installing"], engine["updating"])
        generate_s = plan.run_deadlines.generate
        return cls(
            publish=PublishConfig(install_timeout_s=install_s, give_up_after_s=install_s),
            dispatch=DispatchConfig(
                group_size=plan.grpo.group_size,
                sampling_seed=plan.seed,
                generate_timeout_s=generate_s,
                probe_timeout_s=plan.run_deadlines.health,
            ),
            generate_timeout_s=generate_s,
            update_timeout_s=install_s,
        )


def rollout_shell(
    loop: Loop,
    store: RevisionStore,
    task: DatasetTask,
    plan: Plan,
    *,
    api_key: str | None,
    first_group: int = 0,
) -> Rollout:
    """The publisher, the dispatcher and the engines' HTTP clients (each request with the run's
    `api_key`), added to `loop` in the order it polls them (`first_group`: the first group
    index, above a resumed run's earlier groups). They need no trainer: the engines are
    launched with them, before the pool."""
    s = RolloutSettings.of(plan)
    pub = Publisher(loop, store, config=s.publish, wake=loop.wake)
    disp = Dispatcher(loop, task, config=s.dispatch, first_index=first_group, wake=loop.wake)
    conns = EngineConnections(
        loop,
        pub,
        disp,
        connect=lambda url: SGLangClient(
            url,
            timeout_s=10.0,
            generate_timeout_s=s.generate_timeout_s,
            update_timeout_s=s.update_timeout_s,
            api_key=api_key,
        ),
    )
    for performer in (conns, pub, disp):
        loop.add(performer)
    return Rollout(publisher=pub, dispatcher=disp, connections=conns)


def add_performers(
    c: Cluster,
    loop: Loop,
    pool: TrainerPool,
    rollout: Rollout,
    task: DatasetTask,
    *,
    verify: bool,
) -> None:
    """The loop's performers that need the trainer pool, after the rollout's (`rollout_shell`:
    the engines' clients, the publisher, the dispatcher), in the order the loop polls them: the
    warm Hybrids, the trainer (its batch is the dispatcher's scored groups; with `verify` every
    step is recorded) and the planner's decisions."""
    disp = rollout.dispatcher
    deadlines = c.plan.deadlines["hybrid_replica"]
    c.hybrids = WarmHybrids(loop, pool, answer_s=deadlines["leaving"], load_s=deadlines["loading"])
    c.trainer = Trainer(
        loop,
        pool,
        batch_of=lambda ids: task.build_batch([g.samples for g in disp.results(ids)]),
        records=c.run_dir / "verify" / "records" if verify else None,
        timeout_s=c.plan.deadlines["training_step"]["computing"],
        wake=loop.wake,
    )
    c.decisions = Decisions(loop, drain=disp.drain_engine)
    performers: tuple[Performer, ...] = (c.hybrids, c.trainer, c.decisions)
    for performer in performers:
        loop.add(performer)


@dataclass(frozen=True)
class Rollout:
    publisher: Publisher
    dispatcher: Dispatcher
    connections: EngineConnections


def publish_initial(
    pub: Publisher,
    pool: TrainerPool,
    *,
    step: int = 0,
    checkpoint: Callable[[], None] | None = None,
) -> None:
    """Save the Core's weights as the revision of `step` (`step` + 1: revision 1 for the
    model directory's initial weights, or a resumed run's restored ones) and publish it:
    every engine installs it before it serves. `checkpoint`: `TrainerPool.publish`'s."""
    revision = step + 1
    saved = pool.publish(revision, step=step, checkpoint=checkpoint)
    if isinstance(saved, PoolFailure):
        # what to do once the disk is seen to: "check the disk under the run directory" said
        # nothing of the limit, the folder or how to go on (a resume goes on from the same
        # saved state again: its segment is set aside, nothing trained is lost)
        again = (
            "run `ehp-fsm run PLAN --resume` again: it goes on from the same saved state"
            if step
            else "start the run again with `ehp-fsm run PLAN`"
        )
        raise EhpError(
            f"revision {revision} (the weights the run starts from) could not be saved",
            str(saved),
            "free space or fix the permissions where it is written (named above; on "
            "'File too large', raise the file-size limit: `ulimit -f unlimited`), then " + again,
        )
    what = f"revision {revision} (the weights the run starts from)"
    if unseen := unseen_write(Path(saved), what, "[run] revisions", pool.config.home(0)):
        raise unseen
    pub.register_saved(revision)
    pub.publish(revision)


@dataclass
class Cluster:
    """What start-up built, filled in the order it starts; any part may be missing after a
    start-up that stopped half-way, and the end of the run stops only what exists."""

    plan: Plan
    run_dir: Path
    logfile: TextIO | None = None
    structlog_before: dict[str, Any] = field(default_factory=structlog.get_config)
    pool: TrainerPool | None = None
    ctl: Controller | None = None
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    rollout: Rollout | None = None
    hybrids: WarmHybrids | None = None
    trainer: Trainer | None = None
    decisions: Decisions | None = None
    #: entries the job adds to the receipt (a resume, the cost of the saved states)
    receipt: dict[str, Any] = field(default_factory=dict)
    #: the run has taken its run directory over (cleared it, or a resume set its log aside):
    #: before, the directory is an earlier run's, whose files a refused start leaves alone
    took_dir: bool = False
    #: the run has begun its transition log (before: the log, if any, is an earlier run's)
    log_begun: bool = False
