"""The end of a run: everything this run owns stops, and the run is written up.

(The Hybrids' return to rollout before this is a planner decision like any other: `job`.)
`finish` runs whatever happened before it — a clean end, an error, Ctrl-C/SIGTERM, or
a start-up that never completed — and stops what exists: the dispatcher and publisher, the
Hybrids (on the run's warm workers, not behind an agent), the controller, the trainer pool and
the agents; then whatever the run recorded that is still running (an engine whose agent was
killed) is stopped by identity, and the receipt says so (`stopped_at_end`). With `--verify` it
saves the final state first (while every lane runs: the controller's shutdown stops those its
agents launched on other machines) and, once all is stopped, checks it against the recorded
batches (`verify.verify_run`: the run's own partitions replayed, step by step, and the
Core-only replay). It then writes the summary, the GPU timeline and `receipt.json` beside the log.

Knows: what start-up built (`startup.Cluster`; any part may be missing after a failed start-up),
the receipt's keys, where the summary, timeline and verify records go. Does not know: the step loop,
the planner, or how the pieces were started (`job`, `startup`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

import structlog

from ehp_fsm.core.world import World
from ehp_fsm.errors import EhpError, printable
from ehp_fsm.fspaths import write_whole
from ehp_fsm.replay import replay
from ehp_fsm.report.progress import RunFigures, render_summary
from ehp_fsm.report.timeline import draw_timeline, role_intervals
from ehp_fsm.rollout.client import SGLangClient
from ehp_fsm.run.owned import RUN_LOCK, RunStateError, read_run_state, stop_owned
from ehp_fsm.run.placement import unseen_write
from ehp_fsm.run.startup import Cluster
from ehp_fsm.training.pool import PoolConfig, PoolFailure
from ehp_fsm.training.verify import verify_run
from ehp_fsm.translog import log_key, receipt_log_chain


def finish(
    c: Cluster,
    figures: RunFigures,
    *,
    error: BaseException | None,
    interrupted: Callable[[], bool],
    verify: bool,
    out: TextIO,
    say: Callable[[str], None],
    started: float,
    write: bool = True,
) -> dict[str, Any]:
    """Stop everything the run owns, write the summary, timeline and receipt; return the
    receipt. Safe after a start-up that stopped half-way: only what exists is stopped.
    `interrupted()` is asked again as the receipt is written: a signal during the shutdown
    itself counts. `write=False` (the run directory is another live run's): nothing was
    started, and nothing is written or stopped there. Nor is anything when the run stopped
    before it took its run directory over (a refused input, a refused resume) and the
    directory holds an earlier run's files: its receipt, summary and timeline stay that
    run's."""
    figures.wall_s = time.monotonic() - started
    receipt: dict[str, Any] = {
        "plan": c.plan.name,
        "error": repr(error) if error else None,
        "interrupted": interrupted(),
    }
    if not write or not (c.took_dir or _empty(c.run_dir)):
        return receipt
    # Whatever fails to close, the rest is still stopped; the receipt says what failed.
    errors: list[str] = []
    receipt["shutdown_errors"] = errors
    final_state = c.run_dir / "verify" / "ehp-state"
    # a stop requested skips the check: its replays take about as long as the run's steps did,
    # and a stop is meant now (a scheduler's SIGKILL follows its SIGTERM after a grace period)
    verified = verify and error is None and figures.last_step > 0
    stopped_saving = False
    if c.pool is not None and verified and not interrupted():
        # before the controller's shutdown, which stops the lanes its agents launched
        try:
            saved = c.pool.save_state(final_state, checkpoint=_stop_check(interrupted))
        except _VerifyStopped:  # the pool is abandoned: its shutdown ends the workers
            stopped_saving = True
        else:
            unseen = None
            if not isinstance(saved, PoolFailure):
                host = c.pool.config.home(0)
                unseen = unseen_write(saved, "the final Core state", "[run] log", host)
            receipt["verify_state"] = str(unseen or saved)
    # (also before the controller started: a resume stopped that early stands at its step)
    receipt["last_step"] = figures.last_step
    if c.ctl is not None:
        ctl = c.ctl
        figures.stalled_s = ctl.link.long_stalls.seconds
        receipt["last_revision"] = ctl.world.globals.get("revision")
        receipt["asked_to_stop"] = [f"{m}:{i}" for m, i, _ in ctl.owned_processes()]
        clients = c.rollout.connections.clients if c.rollout is not None else {}
        receipt["engine_revisions"] = engine_revisions(clients, ctl.world)
        # The rollout performers stop first (nothing more is dispatched or installed); the
        # Hybrids end on the run's warm workers (their GPUs' finalizers confirmed at once);
        # then the controller stops every engine by identity through its agent.
        if c.rollout is not None:
            r = c.rollout
            errors += ctl.loop.close([r.dispatcher, r.publisher])
        if c.hybrids is not None:
            errors += ctl.loop.close([c.hybrids])
        try:
            receipt["clean_controller"] = ctl.shutdown(timeout_s=30.0)
        except Exception as exc:
            receipt["clean_controller"] = False
            errors.append(f"controller: {exc!r}")
        # hosts where some process was not confirmed stopped (its GPU still releasing)
        receipt["unconfirmed_hosts"] = ctl.unconfirmed_hosts()
        # the log's final line count and hash: `ehp-fsm replay LOG --receipt` finds a cut log
        if (chain := ctl.loop.orchestrator.log_chain) is not None:
            receipt["log_chain"] = chain
    if c.pool is not None:
        receipt["killed_trainers"] = c.pool.shutdown(timeout_s=10.0)
    for a in c.agents:
        with contextlib.suppress(ProcessLookupError):
            a.send_signal(signal.SIGTERM)
    receipt["agents_exit"] = [wait_exit(a) for a in c.agents]
    receipt["stopped_at_end"], receipt["left_running"] = stop_leftovers(c)
    if verify and receipt.get("verify_state") == str(final_state) and c.pool is not None:
        receipt["verify"] = verify_final(c, c.pool.config, final_state, say, interrupted)
    elif verified and interrupted():
        receipt["verify"] = not_verified(
            c.run_dir,
            "it was stopped while it saved the final state"
            if stopped_saving
            else "the run was stopped",
            say,
        )
    figures.wall_s = time.monotonic() - started  # the end's shutdown counted too
    summary = render_summary(figures)
    out.write(summary)
    # a run that failed before it made its directory (a refused --resume) still gets its files
    try:
        c.run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # the run directory cannot exist: say why the run ended, not this
        errors.append(f"run directory: {exc!r}")
        close_logs(c)
        return receipt
    try:
        write_whole(c.run_dir / "summary.txt", summary)
    except OSError as exc:  # a full disk: the summary was printed; the run's error comes first
        errors.append(f"summary.txt: {exc!r}")
    logged = c.log_begun and Path(c.plan.log).is_file()
    if logged:
        try:  # a picture that cannot be drawn never hides how the run ended
            paths = draw_timeline(
                role_intervals(c.plan.log),
                c.run_dir / "timeline",
                title=f"ehp-fsm run {c.plan.name}: GPU roles",
            )
            receipt["timeline"] = [str(p) for p in paths]
        except Exception as exc:
            errors.append(f"timeline: {exc!r}")
            for suffix in (".png", ".svg"):  # a full disk: no empty or cut picture left
                with contextlib.suppress(OSError):
                    (c.run_dir / "timeline").with_suffix(suffix).unlink()
    receipt["moves"] = [
        {"kind": m.kind, "step": m.step, "latency_s": m.latency_s, "detail": m.detail}
        for m in figures.moves
    ]
    receipt["rewards"] = figures.rewards
    receipt["exact"] = figures.exact
    receipt["reward_failures"] = figures.reward_failures
    # by kind, and the last one's message: the count alone said nothing of why (a resumed
    # run's are its segment's, as every figure here: `resumed.from_step` says from where)
    receipt["reward_failure_kinds"] = dict(figures.reward_failure_kinds)
    receipt["reward_failure_last"] = figures.reward_failure_last
    receipt["objective"] = figures.step_metrics  # per step: clip fraction, ratio, approx KL
    receipt["staleness"] = [{str(k): n for k, n in h.items()} for h in figures.staleness]
    receipt["reward_by_revision"] = {
        str(r): total / max(1, n) for r, (total, n) in sorted(figures.by_revision.items())
    }
    receipt["time_s"] = {
        "rollout": figures.rollout_s,
        "training": figures.training_s,
        "steps": figures.steps_s,  # the step loop, rollout and training included
        "install_waits": figures.install_wait_s,
        "wall": figures.wall_s,
        "own_stalls": figures.stalled_s,  # of the wall: the run's process stopped or blocked
    }
    if logged and "log_chain" not in receipt:  # a log begun by no controller (a port taken)
        with contextlib.suppress(EhpError, OSError):
            if (end := replay(c.plan.log).chain) is not None:  # its header: a few lines
                receipt["log_chain"] = receipt_log_chain(*end, key=log_key())
    receipt["log"] = str(Path(c.plan.log).resolve()) if logged else None
    receipt.update(c.receipt)  # a resume: from which step; the saved states' cost
    receipt["interrupted"] = interrupted()
    path = c.run_dir / "receipt.json"
    try:
        write_whole(path, json.dumps(receipt, indent=2, default=str))
        where = str(path)
    except OSError as exc:  # a full disk: say so, and let the run's own error be the one shown
        errors.append(f"receipt.json: {exc!r}")
        where = f"not written ({exc.strerror or exc}: {path})"
    if logged:
        log = receipt["log"]
    elif c.log_begun and c.ctl is not None:  # begun, then removed (its run directory deleted)
        log = f"gone ({Path(c.plan.log).resolve()} was removed while the run ran)"
    else:
        log = "not written (the run stopped before it began one)"
    out.write(f"log: {log}\nreceipt: {where}\n")
    out.flush()
    close_logs(c)
    return receipt


def unclean_end(
    plan_name: str, run_dir: Path, receipt: dict[str, Any], *, external: bool = False
) -> str:
    """Why a run whose steps all ran exits 1 (`clean_controller` false): the hosts whose
    processes their agent did not confirm stopped, what the run stopped or could not stop
    itself, and what to do. It ended with its summary alone, as a finished run does.
    `external`: the agents were the cluster's (`--agents external`): what a dead one launched
    is on its node, in its --state-dir, out of the run's reach."""
    parts = [f"ehp-fsm run {plan_name}: the steps ran, but the run did not end cleanly"]
    if hosts := receipt.get("unconfirmed_hosts"):
        parts.append(
            f"host(s) {', '.join(map(str, hosts))}: their agent did not confirm that their "
            "processes stopped and their GPUs are free (it died or went silent during the run)"
        )
    if stopped := receipt.get("stopped_at_end"):
        parts.append(f"stopped by the run at its end, by identity: {'; '.join(stopped)}")
    if errors := receipt.get("shutdown_errors"):
        parts.append(f"failed to close: {'; '.join(map(str, errors))}")
    left = receipt.get("left_running")
    if left:
        parts.append(f"still running: {'; '.join(map(str, left))}")
        fix = f"stop them with `ehp-fsm stop {run_dir}`"
    elif hosts and external:
        # the run said "nothing the run recorded is left running" while the dead agent's
        # engines ran on: the run records no process an external agent launched
        named = ", ".join(map(str, hosts))
        fix = (
            f"what the agent of {named} launched may still run there (the run cannot stop it): "
            "restart that agent with the same --state-dir — it finds those processes, and "
            "`ehp-fsm run PLAN --resume` (or, with no run, its --orphan-after-s lease) stops "
            f"them — or end its job step; then check the GPUs of {named}"
        )
    else:
        fix = "nothing the run recorded is left running" + (
            f"; check the GPUs of {', '.join(map(str, hosts))} by hand" if hosts else ""
        )
    where = f"{run_dir / 'receipt.json'} (clean_controller, unconfirmed_hosts) and controller.log"
    # one line, printed as it is: what the run's files said (a run.json edited during the run
    # names its host in the reason it could not be read) reached the terminal raw
    return printable(f"{'; '.join(parts)}. Fix: {fix}; see {where}")


def _empty(run_dir: Path) -> bool:
    """`run_dir` holds nothing (or does not exist): no earlier run's files to keep (its lock
    file is no run's file)."""
    try:
        return all(p.name == RUN_LOCK for p in run_dir.iterdir())
    except FileNotFoundError:
        return True
    except OSError:  # not a directory, not readable: nothing is written there
        return False


def stop_leftovers(c: Cluster) -> tuple[list[str], list[str]]:
    """What the run recorded (`run.json`, the agents' state files) and is still running after
    its agents exited — an engine whose agent was killed, which nobody else will stop — is
    stopped by identity (`owned.stop_owned`); (what was stopped, what is still running)."""
    try:
        doc = read_run_state(c.run_dir, c.plan.name)
    except RunStateError as exc:
        return [], [f"run.json: {exc}"]
    if doc is None:
        return [], []
    report = stop_owned(c.run_dir, doc, grace_s=5.0, leftovers_only=True)
    return list(report.stopped), list(report.left)


def close_logs(c: Cluster) -> None:
    """Close `controller.log` and give structlog back the configuration it had before the
    run (a scheduler that embeds `run` keeps its own logging)."""
    if c.logfile is not None:
        structlog.configure(**c.structlog_before)
        # a full disk: its last lines are lost (the file is closed all the same); raising here
        # replaced the run's own error (its step, the path, `--resume`) by a bare OSError
        with contextlib.suppress(OSError):
            c.logfile.close()
        c.logfile = None


class _VerifyStopped(Exception):
    """A stop requested while the check of a `--verify` run saves the final state or replays
    the run's steps."""


def _stop_check(interrupted: Callable[[], bool]) -> Callable[[], None]:
    """A checkpoint that raises `_VerifyStopped` once a stop is requested."""

    def checkpoint() -> None:
        if interrupted():
            raise _VerifyStopped

    return checkpoint


def verify_final(
    c: Cluster,
    config: PoolConfig,
    final_state: Path,
    say: Callable[[str], None],
    interrupted: Callable[[], bool],
) -> dict[str, Any]:
    """Check the final state against the recorded batches (`verify.verify_run`). A stop
    requested meanwhile (`interrupted()`) ends the replays within a step: not judged."""
    say(
        "verify: replaying the recorded steps (Core-only, then the run's own partitions; "
        "Ctrl-C or SIGTERM ends it)"
    )
    try:
        replayed, report = verify_run(
            c.run_dir / "verify" / "records",
            final_state,
            config=config,
            work_dir=c.run_dir / "verify" / "replay",
            checkpoint=_stop_check(interrupted),
        )
    except _VerifyStopped:
        return not_verified(c.run_dir, "it was stopped while it replayed the steps", say)
    for line in report.lines():
        say(line)
    return {
        "passed": report.passed,
        "mode": report.mode,
        "lines": report.lines(),
        "replay_seconds": replayed.seconds,
        "hybrid_steps": replayed.hybrid_steps,
        "first_departure": report.first_departure,  # the step to look at, when it failed
    }


def not_verified(run_dir: Path, why: str, say: Callable[[str], None]) -> dict[str, Any]:
    """The receipt's `verify` of a `--verify` run whose check did not run to its end (`why`):
    neither passed nor failed (its exit status is the signal's)."""
    line = (
        f"verify: not judged: {why} (the run's records stay in "
        f"{run_dir / 'verify'}; a run started anew with --verify checks a whole run)"
    )
    say(line)
    return {"passed": None, "not_judged": why, "lines": [line]}


_SERVES = frozenset({"installing", "serving", "updating"})
#: How long the run's end waits for an engine's weight version (a small GET a live engine
#: answers at once). The clients' own timeout (10 s) let one frozen engine — still `serving`:
#: nothing judged it yet — hold the end that long for a line of the receipt.
REVISION_QUERY_S = 3.0


def engine_revisions(
    clients: dict[str, SGLangClient], world: World, *, timeout_s: float = REVISION_QUERY_S
) -> dict[str, str | None]:
    """The weight version each serving engine reports (or why it could not be asked, within
    `timeout_s`); an engine that is leaving or gone (draining or stopping for a borrow,
    stopped, failed — one the dispatcher found not answering is failed) will serve nothing
    more and is not listed."""
    asked = {}
    for eid, client in clients.items():
        inst = world.get("rollout_engine", eid)
        if inst is not None and inst.state in _SERVES:
            asked[eid] = client

    def ask(client: SGLangClient) -> str | None:
        try:
            return client.weight_version(timeout_s=timeout_s)
        except Exception as exc:
            return f"unreachable: {exc}"

    if not asked:
        return {}
    # all at once: an engine that does not answer (a frozen process) costs one client
    # timeout, not one for each such engine before the run's end goes on
    try:
        with ThreadPoolExecutor(min(len(asked), 16), thread_name_prefix="ehp-end") as pool:
            return dict(zip(asked, pool.map(ask, asked.values()), strict=True))
    except RuntimeError:
        # no thread could start (the memory limit reached, a thread limit): one at a time
        # here. It raised out of the run's end, before the engines were stopped: no summary,
        # no receipt, a traceback for a run whose every step had run
        return {eid: ask(client) for eid, client in asked.items()}


def wait_exit(p: subprocess.Popen[bytes]) -> int | None:
    """The exit code of `p`, killing it if it has not ended within 15 s of being asked."""
    try:
        return p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait(5)
