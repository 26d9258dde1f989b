"""`ehp-fsm run PLAN`: a real GRPO job with live borrowing and return.

The story, in the order it happens:
1. Start: the controller (a loop whose transition log is the run's write-ahead log, and its
   agent link), one agent per host, the rollout's performers (engine clients, publisher,
   dispatcher), the engines and, while they start, the trainer pool (Core ranks + warm Hybrid
   workers, one Gloo world) and the performers that need it (warm Hybrids, trainer, planner
   decisions). Revision 1 is published; every engine installs it before it serves (an engine
   launched before it existed started from the model directory).
2. Each step: rollout collects G complete groups; ready Hybrids join at the boundary; one step
   through the training_step machine (`step.run_step`) trains and publishes a revision.
3. Between steps the planner decides from the measured times; its decision goes through the
   loop (`decisions.Decisions`): drain → stop → finalizer → Hybrid on a warm worker → load →
   join at a boundary; and back.
4. The end: a "return all" decision takes the same path; then everything the run owns stops and
   the summary, timeline and receipt are written (`ending.finish`), whatever happened before.

Along the way the run writes what `ehp-fsm stop` and `--resume` need: the identities of every
process it owns (`owned`, `run.json`) and, after each step, the Core's exact state (`resume`).
With `resume`, start-up first takes over the killed run (`resume.prepare_resume`), the Core
starts from its last saved state and the step loop from the step after it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import BinaryIO, Final, TextIO, cast

from ehp_fsm import stacks
from ehp_fsm.core.execution import cluster_view
from ehp_fsm.core.planner import return_all
from ehp_fsm.core.planner_model import Decision, PlannerState
from ehp_fsm.core.planner_predict import RolloutPace, StepTimes
from ehp_fsm.core.world import World
from ehp_fsm.data.rewards import Reward, RewardInterrupted
from ehp_fsm.errors import EhpError, PlanError, printable
from ehp_fsm.plan import MAX_COUNT, Plan
from ehp_fsm.report.progress import GuardedOutput, Progress, RunFigures
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.run import ending
from ehp_fsm.run.decisions import (
    BORROW_ON_THE_WAY,
    borrows_on_the_way,
    idle,
    idle_once_settled,
    planner_turn,
)
from ehp_fsm.run.engines import engine_key_file, revisions_dir
from ehp_fsm.run.inputs import check_log_folder, prepare, refuse_unsupported
from ehp_fsm.run.owned import (
    RunStateError,
    live_foreign_run,
    lock_run_dir,
    locked_plan,
    name_lock,
    read_run_state,
    revisions_lock,
    run_dir_holder,
    run_process,
    write_run_state,
)
from ehp_fsm.run.placement import remote_core, remote_lenders, unshared
from ehp_fsm.run.remote_lanes import RemoteLanes
from ehp_fsm.run.resume import (
    RESUME_DIR,
    ResumePoint,
    StateSaves,
    check_resumed_model,
    check_resumed_plan,
    drop_revisions_after,
    latest_state,
    newest_segment,
    prepare_resume,
    record_plan,
    restore,
    resumable_run,
    save_step_state,
    segments_of,
    unfinished_state,
)
from ehp_fsm.run.samples import prepare_samples, samples_file, write_samples
from ehp_fsm.run.startup import (
    REVISION_NAME,
    Cluster,
    add_performers,
    check_controller_port,
    clear_run_dir,
    local_keys,
    log_beside,
    private_folder,
    publish_initial,
    rollout_shell,
    spawn_agent,
    start_pool,
)
from ehp_fsm.run.step import RESUME_FIX, run_step
from ehp_fsm.run.watch import FailureWatch, MoveTracker, record_step, step_status
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.errors import IdentityError
from ehp_fsm.runtime.identity import ProcessIdentity, capture, new_launch_token, this_host
from ehp_fsm.runtime.keys import ensure_api_key
from ehp_fsm.training.pool import PoolFailure, TrainerPool

__all__ = ["Job", "RunError", "run"]

AGENTS = ("local", "external")  # who starts the host agents: this run, or the cluster (srun)


@dataclass(frozen=True)
class Waits:
    """How long the run waits, from the plan's deadlines: an engine from its launch to serving
    (`starting` + `installing`), a publication's installs (`installing`/`updating`), the
    end-of-run return (the Hybrid's `leaving`, then its engine's start)."""

    serve_s: float
    install_s: float
    return_s: float


def waits(plan: Plan) -> Waits:
    engine = plan.deadlines["rollout_engine"]
    serve = engine["starting"] + engine["installing"]
    return Waits(
        serve_s=serve,
        install_s=max(engine["installing"], engine["updating"]),
        return_s=plan.deadlines["hybrid_replica"]["leaving"] + serve,
    )


class RunError(EhpError):
    """The job could not go on (a Core trainer died, no engine came up, ...)."""


def _go_on(job: Job) -> str:
    """How to go on after an error that stopped the run: `--resume`, or a new start when it
    stopped at its own start (and what a resume trains again)."""
    step = job.figures.last_step
    saved = 0  # a resume goes on from the last saved state, not from `step` (2% of the time)
    with contextlib.suppress(EhpError, OSError):
        saved, _ = latest_state(job.cluster.run_dir)
    again = (
        f": it goes on from the state saved after step {saved} (steps {saved + 1}..{step} are "
        "trained again)"
        if 0 < saved < step
        else ""
    )
    if step == 0 and not job.resume:
        # a fresh start: `--resume` is refused ("no run ... to resume") once its start cleared
        # the previous run, which it does before it writes anything of its own
        kept = (
            f" (or go on with the previous run by `ehp-fsm run PLAN --resume`: its state "
            f"saved after step {saved} is still there)"
            if saved > 0
            else ""
        )
        # (over a run stopped before its end, a start needs --fresh: `Job.claim`)
        fresh = " --fresh" if unfinished_state(job.cluster.run_dir) is not None else ""
        go_on = f"start the run again with `ehp-fsm run PLAN{fresh}`{kept}"
    else:
        anew = " (or start anew: `ehp-fsm run PLAN --fresh`)" if step == 0 else ""
        go_on = f"go on with `ehp-fsm run PLAN --resume`{anew}"
    return go_on + again


def _log_write(exc: OSError, job: Job) -> Path | None:
    """The transition log, when `exc` (which names no file: a write's error) was raised
    writing it: the error named the run directory ("File too large (/runs/x)"), not the file
    that reached the limit."""
    tb = exc.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).match("ehp_fsm/translog.py"):
            return Path(job.plan.log).resolve()
        tb = tb.tb_next
    return None


def _os_error(exc: OSError, job: Job) -> RunError:
    """An OSError that stopped the run, as the run's error: where it happened (the file, else
    the run directory, where the run writes) and how to go on."""
    where = exc.filename or _log_write(exc, job) or job.cluster.run_dir
    fix = "free space on that disk (or fix its permissions)"
    if exc.errno == errno.EFBIG:  # not a full disk: a file past the file-size limit
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        fix = (
            "raise the file-size limit of the shell or batch job that runs it (`ulimit -f "
            "unlimited`; it is "
            + ("unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes")
            + " now: else the file system's own largest file was reached)"
        )
    error = RunError(
        f"the run stopped after step {job.figures.last_step}: {exc.strerror or exc} ({where})",
        f"{type(exc).__name__} while writing or reading what the run keeps there",
        f"{fix}, then {_go_on(job)}",
    )
    error.__cause__ = exc
    return error


def _log_removed(job: Job) -> RunError | None:
    """`Job.check_log`'s error when the run's log is gone (its run directory deleted): a write
    into the deleted folder (a revision's config.json) can fail before the step boundary's
    check, and its "No such file or directory (config.json) ... free space" hid the cause."""
    try:
        job.check_log()
    except RunError as exc:
        return exc
    return None


def check_run_dir_text(run_dir: Path) -> None:
    """The run directory's path is UTF-8 text: a folder in it named with other bytes (a
    Latin-1 name; the current directory, where a relative `[run] log` starts) made the
    trainer pool fail at its start with torch's `TypeError: __init__(): incompatible
    constructor arguments` for its rendezvous file, and the fix to start fewer warm workers.
    Refused before anything starts or is written."""
    try:
        str(run_dir).encode("utf-8")
    except UnicodeEncodeError:
        raise RunError(
            f"the run directory {printable(str(run_dir))} is not UTF-8 text",
            "a folder name in its path holds bytes that are not UTF-8 (a relative [run] log "
            "starts at the current directory), and the trainers' rendezvous file (torch) and "
            "the run's JSON files name their paths as text",
            "rename that folder, or give [run] log an absolute path whose folders are named "
            "in UTF-8",
        ) from None


#: The open files `run` lets itself and what it starts have (its soft limit raised to at most
#: this, within the hard limit): each agent connection, engine client, trainer socket and log
#: holds some, and a cluster's run holds one or more per host.
OPEN_FILES: Final = 65536
#: How long a step's rollout may see only failed dispatches before the run says so.
ROLLOUT_QUIET_S: Final = 10.0
#: A step still training this long (or 3 × the longest step so far, if more) is said, and
#: again every `2 ×` this: a trainer hung mid-step (a Core rank stopped by SIGSTOP) left the
#: run without a word until the step's `computing` deadline, 300 s by default (an operator's
#: find), and a stopped rank is named with how to resume it.
SLOW_STEP_S: Final = 30.0


def open_files_needed(plan: Plan) -> int:
    """The fewest open files a run of `plan` is let start with: 48, and 2 for each host and
    each engine (the controller holds a connection to each agent and clients to each engine).
    The short plan's run (3 hosts, 3 engines) used 38 in its own process and ran at 64; at 32
    and 20 it failed, and libzmq then could abort the process (`Too many open files
    (src/epoll.cpp:38)`, SIGABRT: no receipt, no word of the limit)."""
    return 48 + 2 * (len(plan.hosts) + len(plan.engines))


def raise_open_files(plan: Plan) -> None:
    """Raise this process's soft limit of open files (`ulimit -n`) towards its hard limit, at
    most to `OPEN_FILES` (what the run starts inherits it), and refuse a limit below
    `open_files_needed` before anything starts. A soft limit of 32 stopped the short plan's run
    at its start (the error blamed a damaged revision), and 20 with a traceback
    (`zmq.error.ZMQError: Too many open files`), where the hard limit allowed thousands."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = open_files_needed(plan)
    if soft != resource.RLIM_INFINITY and soft < need:
        raise RunError(
            f"the run may hold {soft} open files (`ulimit -n`; hard limit "
            f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}), and this plan's run "
            f"needs at least {need}",
            f"its sockets, logs and files (48, and 2 for each of its {len(plan.hosts)} hosts "
            f"and {len(plan.engines)} engines) would run out: the run would stop part-way, or "
            "be aborted by libzmq with no receipt",
            f"raise the limit (`ulimit -n {max(need, 1024)}` in the shell that runs it; past "
            "the hard limit, ask the machine's administrator), then run the same command again",
        )


# The least address space (`ulimit -v`) each process of a run may map. Measured on the default
# plan's tiny model on a 2-core machine: the run's own process mapped 1.9 GB at its peak (21
# threads: each maps a stack and may map a 64 MiB malloc arena, so more cores map more), a
# trainer worker 1.2 GB, an engine 1.0 GB. Under 1 GB the run was aborted by libzmq ("FATAL
# ERROR: OUT OF MEMORY", no receipt); under 1.5 GB it died now and then, as a traceback, when a
# thread could not start.
ADDRESS_SPACE_NEEDED: Final = 4 << 30


def refuse_low_address_space() -> None:
    """Refuse, before anything starts, a soft memory limit (`ulimit -v`, `prlimit --as`) under
    `ADDRESS_SPACE_NEEDED`: every process the run starts inherits it, and under it a process of
    the run dies wherever it is (libzmq aborts the run's own process, with no receipt)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft >= ADDRESS_SPACE_NEEDED:
        return
    past = (
        ""
        if hard == resource.RLIM_INFINITY or hard >= ADDRESS_SPACE_NEEDED
        else f"; the hard limit is {hard:,} bytes: ask the machine's administrator to raise it"
    )
    raise RunError(
        f"this run's processes may map at most {soft:,} bytes of memory each (`ulimit -v`), "
        f"under the {ADDRESS_SPACE_NEEDED:,} a run needs",
        "the run's own process maps ~1.9 GB and each trainer worker ~1.2 GB even with the "
        "default plan's tiny model (more on a machine with more cores, more with a larger "
        "model); under the limit a process dies wherever it is (libzmq aborts the run with no "
        "receipt, a thread cannot start, a worker's import fails)",
        f"raise it (`ulimit -v unlimited` in the shell that runs it){past}, then run the same "
        "command again",
    )


def _in_chain(exc: BaseException, match: Callable[[BaseException], bool]) -> BaseException | None:
    """The first of `exc` and the errors it was raised from or during (`__cause__`, else
    `__context__`) that `match`es; None when none does."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if match(cause):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _out_of_memory(exc: BaseException, job: Job) -> RunError | None:
    """`exc` (or an error it was raised from) is a `MemoryError` or a thread that could not
    start ("can't start new thread"): as the run's error, naming the process limits that cause
    it and how to go on; None for any other error."""
    cause = _in_chain(
        exc, lambda c: isinstance(c, MemoryError) or "can't start new thread" in str(c)
    )
    if cause is None:
        return None
    mapped = resource.getrlimit(resource.RLIMIT_AS)[0]
    threads = resource.getrlimit(resource.RLIMIT_NPROC)[0]

    def shown(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else f"{n:,}"

    error = RunError(
        f"the run stopped after step {job.figures.last_step}: "
        + (
            f"out of memory ({type(cause).__name__}: {cause})"
            if isinstance(cause, MemoryError)
            else f"a thread could not start ({cause})"
        ),
        f"its processes may map {shown(mapped)} bytes of memory each (`ulimit -v`) and start "
        f"{shown(threads)} processes and threads (`ulimit -u`), or the machine (or its "
        "container's memory or pids limit) has no more to give",
        "raise the limit or free the machine's memory (`free -g`), then " + _go_on(job),
    )
    error.__cause__ = exc
    return error


#: Sockets past this many times what a plan's run needs (`open_files_needed`) are not the
#: run's own: an EMFILE then names a connection flood, not the limit alone.
FLOOD_SOCKETS_PER_NEED: Final = 8


def _descriptors() -> tuple[int, int]:
    """(sockets, all) open in this process, from /proc/self/fd ((0, 0) where it cannot be
    read). Read entry by entry, descriptor number by number up to the soft limit: listing
    the folder needs a descriptor of its own, and at the limit — a flood takes every one that
    frees up — it failed, and the flood went unnamed (a reviewer's find)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = (1 << 20) if soft == resource.RLIM_INFINITY else min(soft, 1 << 20)
    sockets = held = 0
    for fd in range(top):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # not open (or /proc not there: nothing counted)
        held += 1
        sockets += target.startswith("socket:")
    return sockets, held


def _out_of_files(exc: BaseException, job: Job) -> RunError | None:
    """`exc` (or an error it was raised from, or one it quotes: a trainer worker's, an
    agent's) is "Too many open files" (EMFILE, or ENFILE: the whole system's table): as the
    run's error, naming the limit and how to raise it; None for any other error."""
    cause = _in_chain(
        exc,
        lambda c: (
            getattr(c, "errno", None) in (errno.EMFILE, errno.ENFILE)
            or "Too many open files" in str(c)
        ),
    )
    if cause is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def shown(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else str(n)

    # the OS's own words and the file, not the message that quotes them (a revision's "never
    # install a damaged one" hid the cause)
    said = re.search(r"\[Errno \d+\] Too many open files[^'\n]*('[^'\n]*')?", str(cause))
    why = (
        f"a process of the run may hold {shown(soft)} open files (`ulimit -n`; hard limit "
        f"{shown(hard)}), fewer than its sockets, logs and files need (each host's agent, "
        "engine and trainer holds some), or the system's table of open files is full"
    )
    fix = (
        "raise the limit (`ulimit -n 65536` in the shell that runs it; past the hard limit, "
        f"ask the machine's administrator), then {_go_on(job)}"
    )
    sockets, held = _descriptors()
    if sockets > FLOOD_SOCKETS_PER_NEED * open_files_needed(job.plan):
        # (the run blamed the limit alone where another local user had opened 20,000 idle
        # connections to its ports: an attacker's find)
        why = (
            f"{sockets} of the {held} files the run's process holds open are sockets, far more "
            f"than a run of this plan opens (~{open_files_needed(job.plan)}): another process "
            "may be holding connections to its ports (its controller's, its trainer pool's; "
            "they refuse to speak to a peer without the run's keys, but every connection "
            "holds a file)"
        )
        fix = (
            f"find what is connected to the ports the run listens on (`ss -tlnp` shows them "
            f"for pid {os.getpid()}; `ss -tnp` each connection's process) and stop it; on a "
            "machine whose other users you do not trust, run on hosts of your own (README: "
            f"'On a shared machine'), then {_go_on(job)}"
        )
    error = RunError(
        f"the run stopped after step {job.figures.last_step}: "
        + (said.group(0) if said else "Too many open files"),
        why,
        fix,
    )
    error.__cause__ = exc
    return error


def ended_engines(world: World) -> dict[str, str]:
    """Engines in a terminal state (failed: a launch that failed, a process that died) and
    why: at start-up none of them will ever serve (the run used to wait out the engines'
    start deadline, 180 s by default, and then named none of them)."""
    spec = world.specs["rollout_engine"]
    return {
        eid: str(e.get("reason") or e.state)
        for eid, e in world.of("rollout_engine").items()
        if e.state in spec.terminal
    }


class Interrupted(Exception):
    """A signal asked the run to stop while it waited (start-up): not an error, the run ends
    cleanly with 128 + the signal's number and a receipt that says `interrupted`."""


class Job:
    def __init__(
        self,
        plan: Plan,
        out: TextIO,
        *,
        live: bool | None,
        verify: bool,
        steps: int | None,
        resume: bool = False,
        agents: str = "local",
        fresh: bool = False,
    ) -> None:
        self.plan, self.out, self.verify = plan, out, verify
        self.resume, self.agents, self.fresh = resume, agents, fresh
        self.steps = steps if steps is not None else plan.grpo.steps
        self.cluster = Cluster(plan=plan, run_dir=Path(plan.log).resolve().parent)
        self.figures = RunFigures(kl_reference=plan.grpo.kl_coef > 0)
        if not plan.ehp.enabled:
            self.figures.unmoved = "[ehp] enabled = false: the planner never ran"
        self.progress = Progress(out, live=live)
        self.memory = PlannerState()
        self.step_times = StepTimes()  # what the planner decides from: recent medians
        self.pace = RolloutPace()  # the rollout phase's length, from the engines' busy time
        #: `[run] samples`: how a completion is decoded for `samples.jsonl` (None: not written)
        self.decode: Callable[[Sequence[int]], str] | None = None
        self.samples_to: Path | None = None
        self.resumes = 0  # how many times the run had been resumed (its log's segments)
        self.moves = MoveTracker(self.figures, self.progress)
        self.failures = FailureWatch(self.progress)
        self.started = time.monotonic()
        self.stop_requested = False
        self.deferred: Exception | None = None  # see `during_step`
        self.stepping = 0  # the step the trainer's thread is on (`during_step`'s notes)
        self.longest_step_s = 0.0
        self.lagging_said: set[str] = set()  # engines named once as left behind (installs)
        self.reward: Reward | None = None  # the run's reward, once its inputs are read
        self.me = capture(os.getpid(), launch_token=new_launch_token())
        self.resumed: ResumePoint | None = None
        self.saves = StateSaves()
        # the run directory belongs to another run of this plan that is alive: nothing of this
        # one may be written there (its receipt, summary, timeline are the other run's)
        self.dir_taken = False
        self.notes: list[str] = []  # lines noted by the signal handler, printed by `say`
        self.dir_lock: BinaryIO | None = None  # the run directory's, held to the end (`owned`)
        self.revisions_lock: BinaryIO | None = None  # [run] revisions', the same
        self.log_id: tuple[int, int] | None = None  # the log's (device, inode) once begun
        self.log_gone = False  # see `check_log`

    # -- 1. start ------------------------------------------------------------------------------
    def start(self) -> None:
        c, plan = self.cluster, self.plan
        self.claim()  # first: from here on `ehp-fsm stop` finds this run (its lock's holder)
        # what can be refused cheaply, before the previous run's log, saved states and
        # revisions are touched (a busy port lost the state a mistyped --resume needed): a
        # plan the run does not honour first (a port refusal hid it: gpu-4x8's controller
        # address), with nothing written for a run that cannot be (it left a receipt)
        try:
            refuse_unsupported(plan)
        except PlanError:
            self.dir_taken = True
            raise
        check_controller_port(plan)
        inputs = prepare(  # model, prompts, reward: or refused (a stop ends their reading)
            plan,
            create=True,
            say=self.say,
            checkpoint=lambda: self.interrupted("reading the plan's inputs"),
        )
        self.reward = inputs.task.reward
        self.samples_to = samples_file(plan)
        if self.samples_to is not None:  # `[run] samples`: decoded as the reward saw them
            tokenizer = inputs.task.tokenizer
            self.decode = lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))
        self.interrupted("reading the plan's inputs")  # before the run directory is cleared
        self.take_over(inputs.model_dir)
        self.interrupted("taking the run directory over")
        point = self.resumed
        revisions = revisions_dir(plan, c.run_dir)
        c.took_dir = True
        clear_run_dir(
            c.run_dir,
            revisions,
            resume=point is not None,
            say=self.say,
            log=c.run_dir / Path(plan.log).name,
        )
        if self.samples_to is not None:  # (after the fresh start removed the last run's)
            prepare_samples(self.samples_to)
            self.resumes = len(segments_of(c.run_dir / Path(plan.log).name))
        # the trained weights and optimizer state are the run's user's alone (they were 0755
        # folders of 0644 files); a `[run] revisions` folder elsewhere is left as it is when
        # it exists (the plan's to share), made 0700 when the run makes it (`RevisionStore`)
        mine = [
            RESUME_DIR,
            *(["verify"] if self.verify else []),
            *([] if plan.revisions else ["revisions"]),
        ]
        for folder in mine:
            private_folder(c.run_dir / folder)
        # what a resume holds its plan to (`check_resumed_plan`), with the steps it trains to
        record_plan(c.run_dir, plan, steps=self.steps, checkpoint=self.hashing)
        self.record_owned()
        plan = c.plan = self.plan = local_keys(plan, c.run_dir)
        # every engine request carries it: an engine on a node's address is not open to anyone
        # who can reach the port (loading weights, pausing, aborting)
        engine_key = ensure_api_key(engine_key_file(plan, c.run_dir))
        c.logfile = log_beside(c.run_dir)
        store = RevisionStore(revisions)
        meta = {"resumes": point.header()} if point is not None else None
        c.log_begun = True
        ctl = c.ctl = Controller.start(
            plan,
            log_path=plan.log,
            log_meta=meta,
            core_version=point.step if point is not None else 0,
        )
        with contextlib.suppress(OSError):  # (not there: `check_log` says so at step 1)
            st = os.stat(plan.log)
            self.log_id = (st.st_dev, st.st_ino)
        hosts = {h.id for h in plan.hosts}
        wait_s = plan.run_deadlines.agents_connect
        if self.agents == "local":
            c.agents = [
                spawn_agent(plan, h, ctl.endpoint.endpoint, c.run_dir, self.me.launch_token)
                for h in plan.hosts
            ]
            self.record_owned()
            where = f"see {c.run_dir / 'agents'}/*.log"
            engine_logs = (
                f"see {c.run_dir / 'agents'}/<host>/logs/ (each engine's output) and "
                f"{c.run_dir / 'agents'}/<host>.log (its agent's)"
            )
        else:
            self.say(
                f"waiting up to {wait_s:g} s for the host agents {', '.join(sorted(hosts))} "
                f"(started outside: `ehp-fsm agent --controller {ctl.endpoint.endpoint}`)"
            )
            where = "see each node's agent output (the srun step's log)"
            engine_logs = where
        # why an agent that never said hello did not (the error said "because see each node's
        # agent output" and nothing to do): the run started them, or the cluster did
        keys = plan.transport.curve_keys
        unheard = (
            "their agents exited or never reached the controller"
            if self.agents == "local"
            else "no hello came from them: an agent not started (or not yet), started with "
            "another host id or --controller, unable to reach the controller's port from its "
            "node, or whose CURVE handshake failed"
        )
        start_them = (
            where
            if self.agents == "local"
            else f"start `ehp-fsm agent --controller {ctl.endpoint.endpoint} --plan PLAN"
            + (f" --keys {keys}" if keys else "")
            + "` on each of those nodes (its host id: --host-id, or under Slurm the node name "
            "$SLURMD_NODENAME); an agent the run does not answer says why in its output "
            "(`controller_unanswered`); raise [deadlines.run] agents_connect if they start late"
        )
        if not self.until(
            lambda: hosts <= {a for a, i in ctl.agents.items() if i.reconciled}, wait_s
        ):
            self.interrupted("waiting for the host agents")
            missing = sorted(hosts - {a for a, i in ctl.agents.items() if i.reconciled})
            # an agent started with a host id the plan lacks (a node name that is not a
            # [[hosts]] id) is refused at its hello: the error named only the missing hosts
            strays = sorted({p for p, what, _ in ctl.link.refused if what == "hello"} - hosts)
            # an agent speaking with another host's key is dropped before its hello is read:
            # the error said "no hello came from them" though the controller knew why
            wrong_key = {h: ctl.link.key_drops[h] for h in missing if h in ctl.link.key_drops}
            if wrong_key and not strays:
                raise RunError(
                    f"the host agents {missing} did not connect within {wait_s:g} s "
                    "([deadlines.run] agents_connect)",
                    "the controller dropped what came from "
                    + "; ".join(f"{h}: {why}" for h, why in sorted(wrong_key.items())),
                    "start each agent with its own host's key (`--key-name` defaults to the "
                    "host id: drop one that names another host; `ehp-fsm keys DIR --agent HOST` "
                    "writes a host's), " + where,
                )
            raise RunError(
                f"the host agents {missing} did not connect within {wait_s:g} s "
                "([deadlines.run] agents_connect)",
                f"agents of hosts the plan does not have connected and were refused: {strays}"
                if strays
                else unheard,
                f"start each agent with a [[hosts]] id of the plan ({sorted(hosts)}) as its "
                "--host-id (under Slurm, its node name $SLURMD_NODENAME is the default); " + where
                if strays
                else start_them,
            )
        self.check_inventories()
        lenders, core = self.check_placement()
        if point is not None:  # before any engine starts from the store's newest revision
            drop_revisions_after(store, point.step + 1)
        # The engines start while the trainers do (each side takes minutes on a GPU cluster):
        # from the store's newest revision, or the model directory when it holds none; none
        # serves before it has installed the revision published below (the engine machine).
        first_group = point.next_group if point is not None else 0
        rollout = c.rollout = rollout_shell(
            ctl.loop, store, inputs.task, plan, api_key=engine_key, first_group=first_group
        )
        ctl.launch_engines(lambda _eid: new_launch_token())
        pool = c.pool = self.start_pool(inputs.model_dir, store.root, lenders, core)
        if point is not None:
            restored = restore(
                pool,
                point,
                checkpoint=lambda: self.interrupted(
                    f"restoring the Core state saved after step {point.step}"
                ),
            )
            if restored is not None:
                c.receipt["resumed"]["restored"] = restored
                self.say(
                    f"resume: the Core holds the state saved after step {point.step}, bit for "
                    f"bit ({restored['tensors']} tensors of {', '.join(restored['shards'])})"
                )
        add_performers(c, ctl.loop, pool, rollout, inputs.task, verify=self.verify)
        done = point.step if point is not None else 0
        publish_initial(
            rollout.publisher,
            pool,
            step=done,
            checkpoint=lambda: self.interrupted(
                f"saving revision {done + 1}, the weights the run starts from"
            ),
        )
        # (a stop while the engines start said "final revision 0", its receipt revision 1)
        self.figures.final_revision = done + 1
        serve_s = self.serve_s()
        ready = self.until(
            lambda: self.serving() == len(plan.engines) or bool(self.engines_ended()), serve_s
        )
        if ended := self.engines_ended():  # none of them will serve: not a wait to its end
            self.interrupted("waiting for the rollout engines to serve")
            raise engines_not_serving(ended, None, engine_logs, resume=point is not None)
        if not ready:
            self.interrupted("waiting for the rollout engines to serve")
            raise engines_not_serving({}, serve_s, engine_logs, resume=point is not None)
        self.failures.starting = False  # an engine that fails now: the run goes on without it
        self.figures.last_step = done
        self.saves.step = done  # a resume's restored state is saved already
        going_on = f"resumed after step {done} of " if point is not None else "training "
        self.say(
            f"ehp-fsm run {plan.name}: {len(plan.engines)} engines "
            f"serving revision {done + 1}; {going_on}{self.steps} steps"
        )
        if point is not None and point.repaired:  # (said in the receipt alone before)
            self.say(f"resume: the killed run's log was repaired: {point.repair}")

    def check_inventories(self) -> None:
        """Refuse a host whose agent reports fewer of the plan's devices than the plan gives it
        (an agent started with `--slots 1` for a host of 2, a node with fewer GPUs visible):
        the run went on placing the Core, engines and Hybrids on devices the agent does not
        have — a Core rank on the missing device trained anyway, the only word a warning in
        controller.log (a user's find)."""
        c = self.cluster
        assert c.ctl is not None
        for h in self.plan.hosts:
            info = c.ctl.agents.get(h.id)
            reported = list((info.inventory.get("gpus") or ()) if info is not None else ())
            missing = [g for g in h.gpus if g not in reported]
            if missing:
                raise RunError(
                    f"the agent of host {h.id} reports the devices {reported}, and the plan "
                    f"gives it {list(h.gpus)}: {missing} missing",
                    "the run would place the Core, engines or Hybrids on devices that host does "
                    "not have",
                    f"start {h.id}'s agent where it has {len(h.gpus)} devices (on CPU: "
                    f"`--slots {len(h.gpus)}`; on CUDA: the GPUs it sees, CUDA_VISIBLE_DEVICES), "
                    f"or give that [[hosts]] entry gpus = {len(reported)} (and place nothing on "
                    "the others)",
                )

    def check_placement(self) -> tuple[list[str], tuple[str | None, ...]]:
        """Who launches each trainer lane (`placement`), from the machines the agents reported:
        the hosts a Hybrid may be borrowed on whose agent is on another machine (their warm
        workers are launched there, by that agent) and, per Core lane, its host when its agent
        is on another machine (that agent launches the lane; () when the run launches every
        one). Refused: lanes on other machines while the revisions stay in the run directory
        (`placement.unshared`)."""
        ctl = self.cluster.ctl
        assert ctl is not None
        machines = {h: info.inventory.get("hostname") for h, info in ctl.agents.items()}
        here = this_host()
        lenders = remote_lenders(self.plan, machines, here)
        core = remote_core(self.plan, machines, here)
        if (why := unshared(self.plan, core, lenders)) is not None:
            raise RunError(
                "the run cannot train where the plan says",
                why,
                "set [run] revisions to a path every node sees (a shared file system), as "
                "examples/slurm/README.md shows",
            )
        elsewhere = [f"core:{r} on {h} ({machines[h]})" for r, h in enumerate(core) if h]
        if elsewhere:
            self.say(
                "Core lanes launched by their hosts' agents on other machines: "
                + ", ".join(elsewhere)
            )
        return lenders, core

    def start_pool(
        self,
        model_dir: Path,
        store_root: Path,
        lenders: list[str],
        core: tuple[str | None, ...] = (),
    ) -> TrainerPool:
        """The trainer pool: Core ranks and the warm lanes of lending hosts on this machine
        launched here, those on other machines (`core`: the Core lanes' hosts, `lenders`) by
        their hosts' agents (`RemoteLanes`); the loop turns while the workers start (the agents
        are connected)."""
        c = self.cluster
        assert c.ctl is not None
        launcher = RemoteLanes(c.ctl) if lenders or core else None
        if launcher is not None:
            c.ctl.loop.add(launcher)
        pool = c.pool = start_pool(
            self.plan,
            model_dir,
            store_root,
            c.run_dir,
            lenders=lenders,
            remote_core=core,
            launcher=launcher,
        )
        if launcher is not None:
            launcher.bind(pool)
        failure: PoolFailure | None = None

        def started() -> bool:
            nonlocal failure
            got = pool.wait_ready(timeout_s=0.05)
            if got is not None and got.reason != "deadline":
                failure = got
            return got is None or failure is not None

        wait_s = self.plan.run_deadlines.trainers_start
        ready = self.until(started, wait_s)
        self.record_owned()
        self.interrupted("starting the trainer pool")
        if failure is not None or not ready:
            why = (
                str(failure)
                if failure is not None
                else f"not every worker said hello within {wait_s:g} s "
                "([deadlines.run] trainers_start)"
            )
            # a memory limit (`ulimit -v`, `prlimit --as`): a worker died importing torch or
            # transformers ("SystemError: error return without exception set", exit 3) and
            # nothing said that memory was the cause
            mapped = resource.getrlimit(resource.RLIMIT_AS)[0]
            limited = (
                f"; this run's processes may map at most {mapped:,} bytes of memory "
                "(`ulimit -v`): a worker that cannot load torch and the model under it dies "
                "(MemoryError, or a SystemError in an import), so raise it (`ulimit -v "
                "unlimited`)"
                if mapped != resource.RLIM_INFINITY
                else ""
            )
            killed = "was killed by" in why  # (an operator, the OOM killer: not the load)
            raise RunError(
                f"the trainer pool did not start: {why}",
                f"the workers' logs say more: {pool.work_dir}/worker-*.log (a worker on "
                "another machine logs in its agent's state directory, "
                "logs/pool-r<rank>-*.log)",
                "see what killed it (`dmesg` names the OOM killer) and start the run again"
                if killed
                else "check the worker logs; on a loaded machine start fewer warm workers "
                f"([ehp] max_hybrids){limited}",
            )
        return pool

    def claim(self) -> None:
        """Before anything, its inputs included: a live run of another plan in the same run
        directory is refused; without `resume`, so is a run of this plan that is still alive
        (it would lose its run directory); and so is a start while another run of this run
        directory is starting (`owned.lock_run_dir`). The lock is held from here to the end,
        and names this process: `ehp-fsm stop` stops a run that has not yet written its
        `run.json` through it (it said "nothing to stop" while a run read its inputs)."""
        c = self.cluster
        if (foreign := live_foreign_run(c.run_dir, self.plan.name)) is not None:
            self.dir_taken = True
            raise RunError(
                f"the run directory {c.run_dir} is in use by a live run of plan "
                f"{foreign[0]!r} (pid {foreign[1]})",
                "the two plans' logs share a folder, and a start clears its run directory",
                f"give this plan its own log folder, or stop that run (ehp-fsm stop on plan "
                f"{foreign[0]!r})",
            )
        if self.resume:  # nothing to resume: refused before the inputs are read (or made)
            try:
                log = self.plan.log
                resumable_run(
                    self.plan.name,
                    Path(log).resolve(),
                    relative=None if Path(log).is_absolute() else log,
                )
            except EhpError:
                # no run there: nothing is written for it either (a receipt and summary of a
                # run that never began were left in a run directory it made)
                self.dir_taken = True
                raise
        else:  # (a resume refuses a live run of its plan itself)
            try:
                doc = read_run_state(c.run_dir, self.plan.name)
            except RunStateError:  # another plan's that ended, another host's: cleared
                doc = None
            if doc is not None and (run := run_process(doc, c.run_dir)).process() is not None:
                self.dir_taken = True
                raise RunError(
                    f"a run of plan {self.plan.name!r} is still running (pid {run.pid})",
                    "a second run would clear its run directory",
                    "wait for it, or stop it: ehp-fsm stop PLAN",
                )
            if not self.fresh and (left := unfinished_state(c.run_dir)) is not None:
                self.dir_taken = True
                logged = Path(self.plan.log).resolve()
                raise RunError(
                    left,
                    "a fresh start removes its saved state (the Core's weights and optimizer "
                    "state) and its transition log; only its newest revision is kept",
                    "go on with it: ehp-fsm run PLAN --resume; or start anew, removing it: "
                    "ehp-fsm run PLAN --fresh"
                    if logged.exists() or newest_segment(logged) is not None
                    else "its transition log is gone, so it cannot be resumed: start anew, "
                    "removing it, with ehp-fsm run PLAN --fresh",
                )
        # a run of this directory still starting is recorded nowhere yet: its lock says so
        self.dir_lock = lock_run_dir(c.run_dir, plan=self.plan.name)
        if self.dir_lock is None:
            self.dir_taken = True
            holder = run_dir_holder(c.run_dir)
            raise RunError(
                f"another ehp-fsm run{f' ({holder})' if holder else ''} is starting or running "
                f"in the run directory {c.run_dir}",
                "one run at a time takes a run directory over (a start clears it)",
                "wait for that run, or stop it (ehp-fsm stop PLAN); a second run of the same "
                "plan needs its own [run] log folder",
            )

    def take_over(self, model_dir: Path) -> None:
        """Once the inputs are read: the revisions directory locked (`claim` for the run
        directory's); with `resume`, the killed run's leftovers stopped and its log set aside
        (`resume.prepare_resume`)."""
        c = self.cluster
        if self.plan.revisions:  # a folder of its own, which the start clears too
            revisions = revisions_dir(self.plan, c.run_dir)
            lock = revisions_lock(revisions)
            last = locked_plan(lock)  # the plan of the last run that used it (kept named
            self.revisions_lock = lock_run_dir(c.run_dir, lock=lock, plan=last or "")  # there
            if self.revisions_lock is None:
                self.dir_taken = True
                holder = run_dir_holder(c.run_dir, lock=lock)
                raise RunError(
                    f"another ehp-fsm run{f' ({holder})' if holder else ''} uses the revisions "
                    f"directory {revisions} ([run] revisions)",
                    "a start clears it, and two runs would write the same revision numbers",
                    "give each run its own [run] revisions, or wait for that run (ehp-fsm stop)",
                )
            if last is not None and last != self.plan.name and _holds_revisions(revisions):
                self.shared_revisions(revisions, last)  # a refused resume leaves it named
            name_lock(self.revisions_lock, self.plan.name)
        if self.resume:  # the plan's model and settings: the killed run's (before anything moves)
            check_resumed_model(revisions_dir(self.plan, c.run_dir), model_dir, "[model] path")
            changes = check_resumed_plan(
                c.run_dir, self.plan, steps=self.steps, checkpoint=self.hashing
            )
            self.resumed = prepare_resume(
                self.plan.name,
                Path(self.plan.log).resolve(),
                self.say,
                steps=self.steps,
                checkpoint=lambda: self.interrupted("replaying the log of the run it resumes"),
            )
            c.receipt["resumed"] = {**self.resumed.receipt(), "plan_changes": changes}
            # where the run stands until it trains a step: a stop before the engines serve
            # said "last step 0, final revision 0" (and the receipt `last_step: 0`) of a run
            # resumed after step 9. Its state is saved already (`saves.step`): a stop saves
            # nothing it did not train, and the next resume goes on from the same step.
            done = self.resumed.step
            self.figures.last_step, self.figures.final_revision = done, (done + 1 if done else 0)
            self.figures.resumed_after = self.saves.step = done
            for line in changes:
                self.say(f"resume: the plan changed since the run being resumed started: {line}")
            c.took_dir = True  # its log is set aside: the directory is this run's

    def shared_revisions(self, revisions: Path, last: str) -> None:
        """`[run] revisions` holds plan `last`'s revisions: its last run was another plan's.
        A resume is refused — it retires every revision it did not write, so plan `last`'s
        trained model went without a word, and its own were removed by that run's start; a
        fresh start says whose newest revision it keeps."""
        if self.resume:
            raise RunError(
                f"[run] revisions {revisions} holds the revisions of plan {last!r}, whose run "
                f"used it after this plan's",
                "a resume retires the revisions it did not write: the trained model of plan "
                f"{last!r} would be removed (and this plan's were, when that run started)",
                f"give each plan its own [run] revisions; to resume anyway, move {revisions} "
                "aside first (the resume starts again from its saved state)",
            )
        self.say(
            f"run: [run] revisions {revisions} holds the revisions of plan {last!r} (its run "
            "used it last): two plans share that folder; give each its own [run] revisions"
        )

    def record_owned(self) -> None:
        """Write `run.json`: this process, its agents and trainer workers, by identity."""
        c = self.cluster
        agents: dict[str, ProcessIdentity] = {}
        for host, a in zip(self.plan.hosts, c.agents, strict=False):
            with contextlib.suppress(IdentityError):  # it died at once: nothing to stop
                agents[host.id] = capture(a.pid, launch_token=self.me.launch_token)
        here = this_host()
        trainers = (  # remote warm workers are their agents' to stop
            {w.rank: w.identity for w in c.pool.workers if w.identity.host == here}
            if c.pool is not None
            else {}
        )
        write_run_state(
            c.run_dir, plan=self.plan.name, run=self.me, agents=agents, trainers=trainers
        )

    # -- 2. the step loop ----------------------------------------------------------------------
    def train(self) -> None:
        """The steps; a stop asked for between two (or while one's groups are rolled out) saves
        the last step's state first (`save_before_stop`), and so does an error that stops
        them (`save_after_error`)."""
        try:
            self.train_steps()
        except (Interrupted, RewardInterrupted):
            self.save_before_stop()
            raise
        except Exception:
            self.save_after_error()
            raise
        if self.stop_requested:
            self.save_before_stop()

    def train_steps(self) -> None:
        c, g = self.cluster, self.plan.grpo
        assert c.ctl and c.rollout and c.hybrids and c.trainer  # started
        disp = c.rollout.dispatcher
        for step in range(self.figures.last_step + 1, self.steps + 1):
            if self.stop_requested:
                break
            self.check_log()
            t0 = time.monotonic()
            disp.fill(2 * g.prompts_per_step)  # nothing to add after the planner's top-up
            rollout_s = self.plan.run_deadlines.rollout
            if not self.until(self.rollout_done(step, t0), rollout_s):
                if self.stop_requested:
                    break
                failure = disp.last_failure
                raise RunError(
                    f"rollout did not produce {g.prompts_per_step} groups in {rollout_s:g} s "
                    "([deadlines.run] rollout)",
                    # what the engines said, else nothing to go on ("no groups" in 300 s)
                    f"{disp.stats.aborted} dispatches failed; the last, {failure[:600]}"
                    if failure
                    else "",
                    "fix what the engines refuse (above), or raise [deadlines.run] rollout "
                    "if generation is just slow"
                    if failure
                    else "",
                )
            rollout_s = time.monotonic() - t0
            # again before a borrow joins: a group formed in a deleted run directory (its
            # rendezvous file gone) waits out the store's minute before the run stops (the
            # directory removed during the rollout wait is named here, at once)
            self.check_log()
            self.wait_for_borrows()
            for hid in c.hybrids.join_ready():
                self.moves.moved("borrow", hid, step)
            ids = disp.completed_groups(g.prompts_per_step)
            samples = [r.samples for r in disp.results(ids)]
            self.stepping = step
            try:
                done = run_step(
                    c.ctl.loop,
                    c.trainer,
                    c.rollout.publisher,
                    step=step,
                    groups=ids,
                    group_size=g.group_size,
                    say=self.say,
                    wait=self.during_step,
                )
            except Exception:
                if self.deferred is not None:  # the first cause, held while the step ended
                    raise self.deferred from None
                raise
            record_step(self.figures, step, done, samples, rollout_s)
            if self.samples_to is not None and self.decode is not None:
                write_samples(
                    self.samples_to, step, ids, samples, self.decode, resumes=self.resumes
                )
            self.longest_step_s = max(self.longest_step_s, done.result.wall_s)
            self.check_log()  # (before its state is saved where no resume will find it)
            # after the last step, and after a step a stop waited for: a resume goes on from it
            last = step == self.steps or self.stop_requested
            save_step_state(c.trainer.pool, c.run_dir, step, self.saves, last=last)
            c.receipt["state_saves"] = self.saves.as_dict()
            self.record_owned()  # a warm worker replaced during the step has a new identity
            if self.reward is not None:
                failed = self.reward.failures
                self.figures.reward_failures = failed.count
                self.figures.reward_failure_kinds = dict(failed.by_kind)
                self.figures.reward_failure_last = failed.last
            # a failure or stop held while the step ended (`during_step`): the step stands, is
            # counted and gets its line (it had none: a step that ended as a Ctrl-C landed
            # was missing from the output), then it is raised; no planning after it, nor after
            # a stop asked for by then (it planned on engines still installing, whose wait a
            # stop cuts short: "shortfall ... after failures" with none), and a stop landing
            # in the planner's loop turn (its reward interrupted) waits for the step's line
            stopped: Exception | None = None
            if (
                self.deferred is None
                and not self.stop_requested
                and self.plan.ehp.enabled
                and step < self.steps
            ):
                # the next step's groups go out before the planner waits for every install
                # (`settle_installs`), as they do without EHP: else the engines that installed
                # first sat idle until the last one had (EHP on that borrowed nothing was
                # slower than EHP off); an engine a borrow then drains has them requeued
                disp.fill(2 * g.prompts_per_step)
                try:
                    self.plan_next(step, done.result.wall_s, rollout_s)
                except (Interrupted, RewardInterrupted) as exc:
                    stopped = exc
            self.progress.update(
                step_status(
                    c.ctl.world,
                    self.figures,
                    step=step,
                    steps=self.steps,
                    loss=done.result.loss,
                    core=self.plan.core.dp,
                )
            )
            self.figures.steps_s += time.monotonic() - t0
            if self.deferred is not None:
                raise self.deferred
            if stopped is not None:
                raise stopped

    def save_before_stop(self) -> None:
        """A stop asked for between steps (a signal, a lost output): the last step's state, if
        the saves' rule (`resume.StateSaves.due`) skipped it, so a resume goes on from there (a
        resume after a SIGTERM went back 16 steps, to the save before). A stop during a step
        saves after that step (`train`)."""
        c = self.cluster
        if c.trainer is None or self.saves.step >= self.figures.last_step:
            return
        step = self.figures.last_step
        save_step_state(c.trainer.pool, c.run_dir, step, self.saves, last=True)
        c.receipt["state_saves"] = self.saves.as_dict()

    def save_after_error(self) -> None:
        """An error that stops the steps (a revision that could not be saved, a rollout
        deadline): the Core's state, as a stop by a signal saves it, so a resume does not train
        again what the Core holds (it trained again the step whose revision could not be saved,
        and the steps since the last due save). Saved as the step of the Core's version, and
        only when the log's Core version is the same (a pool that stepped after the log gave
        the step up holds a step the log does not: such a state would be refused by the
        resume, and its save removes the one before) and no step is in flight (it could commit
        during the save). Its revision need not exist: a resume publishes the restored weights
        as that step's revision again (`startup.publish_initial`). A save that fails leaves
        the state before it; it never hides the run's error."""
        c = self.cluster
        if c.pool is None or c.ctl is None or c.trainer is None or c.trainer.busy():
            return
        if self.log_gone:  # no resume goes on without the log: a state saved for none
            return
        step = int(c.ctl.world.globals.get("core_version") or 0)
        if self.saves.step >= step or c.pool.core_version != step:
            return
        try:
            save_step_state(c.pool, c.run_dir, step, self.saves, last=True)
        except Exception as exc:
            self.say(f"the Core's state after step {step} was not saved for a resume: {exc}")
            return
        c.receipt["state_saves"] = self.saves.as_dict()

    def check_log(self) -> None:
        """The run's transition log is still the file the run writes, at its path. Removed
        (its run directory deleted, say) or replaced, the run wrote on into a file no one can
        read: it trained step after step recorded nowhere (one minute on, a borrow's trainer
        world, whose rendezvous was in the deleted directory, failed with "DistStoreError: No
        such file or directory" and the error said to `--resume`, which found no run). One
        `stat` a step."""
        if self.log_id is None:
            return
        log = Path(self.plan.log).resolve()
        try:
            st = os.stat(log)
        except FileNotFoundError:
            now = "removed"
        except OSError:  # (a permission, say: what the run writes next says so)
            return
        else:
            if (st.st_dev, st.st_ino) == self.log_id:
                return
            now = "replaced by another file"
        self.log_gone = True
        gone = (
            ""
            if self.cluster.run_dir.is_dir()
            else f" (its run directory {self.cluster.run_dir} is gone)"
        )
        raise RunError(
            f"the run's transition log {log} was {now} while the run ran{gone}",
            "the log records every step: the steps after it went would be recorded nowhere, and "
            "`--resume` and `ehp-fsm replay` go on from it",
            "start the run anew with `ehp-fsm run PLAN --fresh` (without its log no resume "
            "can go on from the saved states; a removed run directory took them with it); to "
            "keep a run's files, copy them once it has ended",
        )

    def rollout_done(self, step: int, t0: float) -> Callable[[], bool]:
        """Whether the step's groups are in; said once, `ROLLOUT_QUIET_S` into a wait in which
        no group completed and dispatches failed, what the engines answer. A model whose
        weights held a NaN had every sample aborted: the run said nothing for the 300 s of
        `[deadlines.run] rollout`, and only then why."""
        c, need = self.cluster, self.plan.grpo.prompts_per_step
        assert c.rollout is not None
        disp = c.rollout.dispatcher
        completed, aborted, said = disp.stats.completed, disp.stats.aborted, False

        def done() -> bool:
            nonlocal said
            if len(disp.completed_groups()) >= need:
                return True
            failed = disp.stats.aborted - aborted
            if (
                not said
                and failed
                and disp.stats.completed == completed
                and time.monotonic() - t0 >= ROLLOUT_QUIET_S
            ):
                said = True
                self.say(
                    f"step {step}: no group completed in {ROLLOUT_QUIET_S:g} s; {failed} "
                    f"dispatches failed, the last: {disp.last_failure[:300]} (the run waits "
                    f"up to [deadlines.run] rollout = {self.plan.run_deadlines.rollout:g} s)"
                )
            return False

        return done

    # -- 3. the planner between steps ----------------------------------------------------------
    def plan_next(self, step: int, train_s: float, rollout_s: float) -> None:
        c = self.cluster
        assert c.ctl and c.rollout
        world = c.ctl.world
        view = cluster_view(world)
        ctl = c.ctl
        decide_on = planner_turn(
            view,
            pace=self.pace,
            step_times=self.step_times,
            dispatched=c.rollout.dispatcher.pace(),
            groups=self.plan.grpo.prompts_per_step,
            train_s=train_s,
            rollout_s=rollout_s,
            steps_left=self.steps - step,
            policy=self.plan.planner_policy(),
            state=self.memory,
            now=ctl.now,
        )
        d = decide_on(view)
        self.name_lagging()  # (said by the wait below too; an idle decision waits for none)
        if not c.rollout.publisher.settled() and not idle_once_settled(d, world, view, decide_on):
            # A move is decided from a settled world: right after a publication every engine
            # is `updating` (out of routing) for a moment, none of them one to drain and their
            # GPUs not the reserve's. An engine that does not answer (a frozen process, a hung
            # weight update) is not waited for past `Publisher.settle_s`: its own deadline
            # fails it, and training goes on at the pace of the engines that serve (it waited
            # for that deadline, 60 s, every time). Nothing to do is known without the wait,
            # which the steps paid at every boundary, EHP on only, while training waited
            # (`tests/sim/test_idle_planner.py`).
            self.settle_installs()
            d = decide_on(cluster_view(world))
        if idle(d, world):
            self.memory = d.next_state  # nothing to do, nothing to clear: no record
            # (the summary's answer to "why did it never borrow?")
            self.figures.unmoved = f"the planner's last decision, after step {step}: {d.reason}"
            return
        if self.carry_out(d, step) and d.actions:
            self.say(f"step {step}: planner {d.summary()}")
        if not d.actions:  # a shortfall alone (a floor or a count that does not fit)
            self.figures.unmoved = f"the planner's last decision, after step {step}: {d.reason}"

    def carry_out(self, d: Decision, step: int) -> bool:
        """Post the decision through the loop; track its borrows and returns as moves."""
        assert self.cluster.decisions is not None
        done = self.cluster.decisions.carry_out(d)
        if done is None:
            return False  # stale: the next step recomputes from the current world
        self.memory = d.next_state
        self.moves.track(done, step)
        return True

    # -- 4. the end ----------------------------------------------------------------------------
    def return_all(self) -> None:
        """Every Hybrid returns at this step boundary, by a decision like any other, and its
        GPUs stay free: the run is about to stop every engine, so none is started for them
        (that was the whole start of an engine — 3–4 s here, a minute or more for SGLang —
        for nothing). The run then waits for this return (the Hybrids gone, their GPUs
        confirmed free), for earlier returns still in flight to serve again, and for every
        engine to install the newest revision."""
        c = self.cluster
        assert c.ctl is not None and c.rollout is not None
        world = c.ctl.world
        spec = world.specs["hybrid_replica"]
        if any(h.state not in spec.terminal for h in world.of("hybrid_replica").values()):
            d = return_all(
                view=cluster_view(world),
                policy=self.plan.planner_policy(),
                state=self.memory,
                now=c.ctl.now(),
                restart_engines=False,
            )
            if not self.carry_out(d, self.figures.last_step):  # nothing moved in between
                raise RunError("the end-of-run return was refused as stale")
        t0, returns = time.monotonic(), self.moves.returns()
        return_s = waits(self.plan).return_s
        if not self.until(lambda: not any(p in self.moves.pending for p in returns), return_s):
            why = "a stop was requested" if self.stop_requested else f"not within {return_s:g} s"
            self.moves.unfinished(returns, self.figures.last_step, t0, why)
        self.settle_installs()

    def settle_installs(self) -> None:
        """Turn the loop until every install worth waiting for is done (`Publisher.settled`;
        at most the install deadline); an engine left behind is named once. The time goes to
        the summary's `waiting for installs`."""
        c = self.cluster
        assert c.rollout is not None
        pub = c.rollout.publisher
        t0 = time.monotonic()
        self.until(pub.settled, self.install_s())
        self.figures.install_wait_s += time.monotonic() - t0
        self.name_lagging()

    def name_lagging(self) -> None:
        """Name, once, each engine whose install is far slower than every one so far
        (`Publisher.lagging`): the run goes on without it (a frozen process, a hung update)."""
        c = self.cluster
        assert c.rollout is not None
        pub = c.rollout.publisher
        for eid in pub.lagging():
            if eid not in self.lagging_said:
                self.lagging_said.add(eid)
                self.say(
                    f"rollout_engine {eid} has not finished installing in "
                    f"{pub.settle_s():.1f} s (not answering?); going on without it until it "
                    "does or its install deadline fails it"
                )

    # -- the loop's turns ----------------------------------------------------------------------
    def until(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        """Turn the loop until `pred()` holds (True), the time is up or a stop is requested."""
        ctl = self.cluster.ctl
        assert ctl is not None
        end = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > end or self.stop_requested:
                return False
            ctl.tick(0.02)
            self.failures.watch(ctl.world)
            self.failures.watch_agents(ctl.agents)
            self.failures.watch_stalls(ctl.link.long_stalls)
            self.moves.watch_returns(ctl.world)
        return True

    def during_step(self, done: Callable[[], bool]) -> None:
        """Turn the loop while the trainer's thread steps, until `done()`: a stop request
        waits for the step (it cannot be cut in the middle), and the pool's own deadlines
        (each phase within `[deadlines.training_step] computing`) bound it. Whatever stops
        the loop meanwhile (a signal's `RewardInterrupted`, a failure the watch raises) is
        held until the step is in the log to its end (`deferred`, raised by `train`); the
        trainer alone is turned until then."""
        c = self.cluster
        assert c.ctl is not None and c.trainer is not None
        limit = 4 * self.plan.deadlines["training_step"]["computing"] + 60.0
        started = time.monotonic()
        end = started + limit
        note_at = started + max(SLOW_STEP_S, 3 * self.longest_step_s)
        while not done():
            if (now := time.monotonic()) >= note_at and self.deferred is None:
                note_at = now + 2 * SLOW_STEP_S
                self.say(self.slow_step(now - started))
            if time.monotonic() > end:
                raise RunError(
                    f"the trainer pool did not end a step in {limit:g} s",
                    "its own deadlines should have ended it: see trainers/ beside the log",
                    RESUME_FIX,
                )
            if self.deferred is not None:
                if not c.trainer.busy():
                    return  # the trainer has nothing more to say (it raised, or refused)
                c.trainer.poll(0.0)
                time.sleep(0.02)
                continue
            try:
                c.ctl.tick(0.02)
                self.failures.watch(c.ctl.world)
                self.failures.watch_agents(c.ctl.agents)
                self.failures.watch_stalls(c.ctl.link.long_stalls)
                self.moves.watch_returns(c.ctl.world)
            except Exception as exc:
                self.deferred = exc

    def slow_step(self, elapsed: float) -> str:
        """`during_step`'s note on a step still training after `elapsed` s."""
        pool = self.cluster.pool
        stopped = pool.stopped_ranks() if pool is not None else []
        why = "; ".join(
            f"trainer rank {r}'s process {pid} is stopped (SIGSTOP or Ctrl-Z; `kill -CONT {pid}` "
            "resumes it)"
            for r, pid in stopped
        )
        computing = self.plan.deadlines["training_step"]["computing"]
        return (
            f"step {self.stepping}: still training after {elapsed:.0f} s"
            + (
                f" (the longest step so far took {self.longest_step_s:.1f} s)"
                if self.longest_step_s
                else ""
            )
            + f"; [deadlines.training_step] computing = {computing:g} s gives it up"
            + (f": {why}" if why else "")
        )

    def interrupted(self, during: str) -> None:
        """A wait of start-up that ended early because a stop was requested: not a time-out."""
        if self.stop_requested:
            raise Interrupted(f"stopped by a signal while {during}")

    def hashing(self) -> None:
        """The checkpoint of hashing what a resume is held to (`resume.plan_settings`)."""
        self.interrupted("hashing the plan's data file and initial weights")

    def wait_for_borrows(self) -> None:
        """At a step boundary: let the borrows on their way become ready (or fail), so they
        join now (`decisions.BORROW_ON_THE_WAY`); at most their Hybrid deadlines together."""
        ctl = self.cluster.ctl
        assert ctl is not None
        on_the_way = borrows_on_the_way(ctl.world)
        if on_the_way:
            d = self.plan.deadlines["hybrid_replica"]
            limit = sum(d[s] for s in BORROW_ON_THE_WAY)
            self.until(lambda: not borrows_on_the_way(ctl.world, on_the_way), limit)

    def serve_s(self) -> float:
        return waits(self.plan).serve_s

    def install_s(self) -> float:
        return waits(self.plan).install_s

    def engines_ended(self) -> dict[str, str]:
        assert self.cluster.ctl is not None
        return ended_engines(self.cluster.ctl.world)

    def serving(self) -> int:
        assert self.cluster.ctl is not None
        engines = self.cluster.ctl.world.of("rollout_engine").values()
        return sum(1 for e in engines if e.state == "serving")

    def say(self, text: str) -> None:
        self.flush_notes()
        self.progress.message(text)

    def flush_notes(self) -> None:
        """Print what the signal handler noted (it must not write itself)."""
        while self.notes:
            self.progress.message(self.notes.pop(0))


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a run cleanly: Ctrl-C, SIGTERM and SIGHUP — a closed terminal or a
    dropped ssh session — unless SIGHUP is ignored (`nohup`: the caller asked that a hang-up
    not stop it). SIGHUP's default ended the run at once, like kill -9: no receipt, no summary
    or timeline, and `run.json` left for `stop` and `--resume`."""
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hangup)


def check_flags(*, steps: int | None, resume: bool, fresh: bool, verify: bool, agents: str) -> None:
    """Refuse `ehp-fsm run`'s flags that contradict each other or are out of range, before
    anything else is looked at (a run to resume, the plan's run directory)."""
    if steps is not None and not 1 <= steps <= MAX_COUNT:  # 10**20 steps started a run
        raise RunError(
            f"--steps {steps} is not a number of steps",
            f"a run has 1..{MAX_COUNT} steps, as a plan's grpo.steps",
            f"give --steps within 1..{MAX_COUNT}",
        )
    if resume and fresh:
        raise RunError(
            "--resume and --fresh contradict each other",
            "--resume goes on with the stopped run; --fresh removes it and starts anew",
            "give one of them",
        )
    if resume and verify:  # refused before anything starts or is written
        raise RunError(
            "--verify cannot check a resumed run",
            "it checks a whole run from its initial weights, and a resume goes on from a "
            "saved state: --verify's records of the run being resumed (if it had them) are "
            "not carried into the resumed run",
            "drop --verify, or start the run anew with --fresh instead of --resume",
        )
    if agents not in AGENTS:
        raise RunError(f"--agents {agents!r} is not one of {AGENTS}", fix="give local or external")


def run(
    plan: Plan,
    *,
    out: TextIO | None = None,
    live: bool | None = None,
    verify: bool = False,
    steps: int | None = None,
    resume: bool = False,
    agents: str = "local",
    fresh: bool = False,
) -> int:
    """Run `plan`; the exit status: 0 when every step ran and everything stopped cleanly, 1 on
    a failure (or an unclean stop, or `verify` not passing), 128 + the signal's number when a
    signal stopped the run early, at any moment from start-up to the end (the receipt says
    `interrupted`, how far it got, and in `clean_controller` whether every process was
    confirmed stopped) — never 0, so a pipeline does not take an interrupted run for a
    finished one. `resume`: go on with a stopped or killed run of this plan (see `resume`).
    `fresh`: start anew over a run of this plan that stopped before its last step, removing
    its saved state and log (refused without it: `Job.claim`).

    `agents`: "local" starts one host agent per host of the plan as a subprocess of this run;
    "external" starts none and waits for agents the cluster started (`srun ... ehp-fsm agent`,
    see examples/slurm), which need the plan's controller endpoint to have a fixed port."""
    check_flags(steps=steps, resume=resume, fresh=fresh, verify=verify, agents=agents)
    if agents == "external" and plan.transport.controller.endswith(":*"):
        raise RunError(
            f"--agents external: the controller endpoint {plan.transport.controller} has no "
            "fixed port, so agents started outside cannot find it",
            fix='set [transport] controller = "tcp://HOST:PORT" with a port, as the agents\' '
            "--controller says",
        )
    if agents == "external" and plan.transport.curve == "local":
        raise PlanError(
            "transport.curve",
            "'local' makes CURVE keys at the run's start for the agents the run starts itself; "
            "agents started by the cluster (--agents external) cannot have them (a plan "
            "without curve_keys is 'local' unless it says curve = \"off\")",
            "make keys with `ehp-fsm keys DIR --agent HOST ...`, set [transport] curve_keys = "
            'DIR and give each agent --plan PLAN (or --keys DIR); or set curve = "off" for '
            "a loopback control plane that trusts this machine's other users",
        )
    # A run directory that cannot be made or written: refused by its key before anything (the
    # lock, a summary of a run that never began, a receipt it cannot write) — a plan error.
    try:
        check_log_folder(plan)
    except PlanError as exc:
        run_dir = Path(plan.log).resolve().parent
        if not resume or exc.key != "run.log" or not run_dir.is_dir():
            raise
        # "point it at a path in a folder you can write": the resume then found no run there
        # (and a fresh start elsewhere left the killed run's saved state behind)
        raise PlanError(
            exc.key,
            exc.why,
            f"a resume goes on from what the run left in {run_dir}: make its file system "
            "writable again (check the disk: an error can remount it read-only), or copy "
            f"{run_dir} to a folder you can write, point [run] log there and resume the copy",
            path=exc.path,
        ) from None
    check_run_dir_text(Path(plan.log).resolve().parent)
    raise_open_files(plan)
    refuse_low_address_space()
    stopped_by: list[int] = []

    def stop(signum: int, note: str) -> None:
        # Flags and list appends only: a handler may run again inside itself (signals close
        # together) or while the main thread writes to `out`, and a write here would then be
        # a reentrant call into the stream. The note is printed by the main thread (`say`).
        job.stop_requested = True
        stopped_by.append(signum)
        job.notes.append(note)
        if job.reward is not None:
            job.reward.interrupt()  # a reward still running is not waited for

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop(signum, f"signal {signal.Signals(signum).name}: stopping cleanly")

    def on_output_lost(exc: OSError) -> None:
        # as SIGPIPE would (128 + 13), but cleanly: the receipt and the rest are still written
        with contextlib.suppress(OSError, ValueError):
            print(
                f"ehp-fsm run: its output is gone ({exc.strerror or exc}): stopping cleanly; "
                f"the summary and receipt are written to {job.cluster.run_dir}",
                file=sys.stderr,
                flush=True,
            )
        stop(signal.SIGPIPE, "the output is gone: stopping cleanly")

    # today's stdout: a caller may have redirected it
    out = cast(TextIO, GuardedOutput(out if out is not None else sys.stdout, on_output_lost))
    job = Job(
        plan, out, live=live, verify=verify, steps=steps, resume=resume, agents=agents, fresh=fresh
    )

    old = {s: signal.signal(s, on_signal) for s in stop_signals()}
    # `kill -USR1 PID`: every thread's stack to stderr, where a run that seems stuck waits
    # (`ehp_fsm.stacks`) — not when stderr is no file (a caller that captures it, e.g. a test
    # running the job in process): the run goes on without it
    with contextlib.suppress(OSError, ValueError, AttributeError):
        old[signal.SIGUSR1] = stacks.install(sys.stderr.fileno())
    error: BaseException | None = None
    try:
        job.start()
        job.train()
        if not job.stop_requested:
            job.return_all()
    except (Interrupted, RewardInterrupted) as exc:  # a stop asked for while waiting
        job.say(str(exc))
    except OSError as exc:  # a full disk, a permission: say where the run was and what next
        error = _out_of_files(exc, job) or _log_removed(job) or _os_error(exc, job)
    except BaseException as exc:  # the receipt and summary are written whatever happened
        # a run directory deleted mid-run is the cause of what failed in it next (a borrow's
        # trainer world, whose rendezvous file was there: "DistStoreError", and `--resume`)
        removed = _log_removed(job) if isinstance(exc, Exception) else None
        if removed is not None:
            removed.__cause__ = exc
        error = _out_of_files(exc, job) or _out_of_memory(exc, job) or removed or exc
    finally:
        job.flush_notes()
        try:
            receipt = ending.finish(
                job.cluster,
                job.figures,
                error=error,
                interrupted=lambda: job.stop_requested,
                verify=verify,
                out=out,
                say=job.say,
                started=job.started,
                write=not job.dir_taken,
            )
        finally:
            # a signal during the shutdown itself (it counts: the receipt says interrupted)
            # was noted and never said — the run exited 130 after a complete summary
            with contextlib.suppress(OSError, ValueError):
                while job.notes:  # (one at a time: a signal may add one meanwhile)
                    job.progress.message(f"{job.notes.pop(0)} (it came during the run's shutdown)")
            for s, h in old.items():
                if h is not None:  # None: a handler not set from Python, not ours to restore
                    signal.signal(s, h)
            for held in (job.revisions_lock, job.dir_lock):  # free for the next run
                if held is not None:
                    held.close()
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if error is not None:
        raise error
    if stopped_by:  # interrupted, whenever it came: never 0, never taken for a failure
        return 128 + stopped_by[0]
    if verify and not (receipt.get("verify") or {}).get("passed", False):
        return 1
    if not receipt.get("clean_controller", False):  # exit 1 after a whole summary: say why
        with contextlib.suppress(OSError, ValueError):
            print(
                ending.unclean_end(
                    plan.name, job.cluster.run_dir, receipt, external=agents == "external"
                ),
                file=sys.stderr,
                flush=True,
            )
        return 1
    return 0


def engines_not_serving(
    ended: dict[str, str], serve_s: float | None, where: str, *, resume: bool
) -> RunError:
    """The start-up's error when the engines do not all serve: those that failed (`ended`,
    with their reasons), else the wait (`serve_s`) that ran out; `where`: the logs to read. It
    said "failed before serving: e2 (... in state serving)", "because see .../*.log", and no
    fix."""
    if ended:
        what = "a rollout engine failed while the run started, before every engine served: " + (
            "; ".join(f"{e} ({why})" for e, why in ended.items())
        )
    else:
        what = (
            f"rollout engines did not all start serving within {serve_s:g} s "
            "([deadlines.rollout_engine] starting + installing)"
        )
    again = "`ehp-fsm run PLAN --resume` again" if resume else "the run again"
    return RunError(
        what,
        "the run trains only once every engine of the plan serves; no step was trained",
        f"{where} for the cause, fix it, then start {again}",
    )


def _holds_revisions(revisions: Path) -> bool:
    """`revisions` holds at least one revision folder."""
    try:
        return any(REVISION_NAME.fullmatch(p.name) for p in revisions.iterdir())
    except OSError:  # none yet, or not a folder (refused, named, later)
        return False
