"""What a run owns, written where `ehp-fsm stop` and `ehp-fsm run --resume` find it.

`run.json` in the run directory (beside the transition log) names the plan and the identity —
pid, process start time, launch token — of the run process, of each host agent it started and
of each trainer worker (Core ranks and warm Hybrid workers); each agent keeps its engines' and
launches' identities in `agents/<host>/processes.json` (`agent_processes.STATE_FILE`). The run
rewrites `run.json` as it starts its pieces and after every step (a replaced trainer worker has
a new identity), each time by an atomic rename.

A recorded process is ours only while its pid names a process with the recorded start time: a
pid the system gave to another process since is never signalled (psutil checks the start time
again when it signals). Nor is a process that does not prove it is the run's (`Owned.refusal`):
the files are only as trustworthy as the folder — anyone who can write it (a shared or
world-writable runs/) could name any process of the user by its pid and start time, both in
`ps` — so the run's own process must hold the run directory's lock (the kernel says who does),
and every other one must carry its recorded launch token in its own environment
(`EHP_LAUNCH_TOKEN`: the run gives its agents its own token, the pool its trainer workers the
pool's, an agent each launch its launch's; `/proc/PID/environ` is readable by the user alone).
The tokens are secrets: every file that holds one (this one, `processes.json`, the transition
log, the run's and agents' logs) is made mode 0600 (`fspaths.PRIVATE`), and no command line
carries one (`/proc/PID/cmdline` is world-readable) — else anyone who reads another run's files
could copy its pids, start times and tokens into a run folder of their own, and `stop` it.

`stop_owned` stops what is left of a run, in the order that lets each owner clean up after
itself: the run (SIGTERM: it stops its own pieces and writes its receipt), then the agents
(their SIGTERM stops their engines), then every recorded engine, Hybrid, launch and trainer
worker, each with the processes it started; SIGTERM, then SIGKILL after a grace. Idempotent: a
second call finds nothing alive and says so.

Knows: the file's keys, the agents' state file, how to find and signal a process by identity.
Does not know: what the processes do, the engine world or the transition log.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import signal
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final

import psutil

from ehp_fsm.errors import EhpError
from ehp_fsm.fspaths import open_own, read_own_json, read_own_text, write_whole
from ehp_fsm.runtime.agent_processes import SHUTDOWN_BOUND_S, STATE_FILE, launch_token_of
from ehp_fsm.runtime.identity import (
    START_TIME_TOLERANCE_S,
    ProcessIdentity,
    start_time_of,
    this_host,
)

RUN_STATE: Final = "run.json"
#: Held locked (`flock`) by the run of its directory while it runs (`lock_run_dir`).
RUN_LOCK: Final = "run.lock"
RUN_STATE_FORMAT: Final = "ehp-fsm-run-state/1"
#: The least grace an agent gets: its own stop of its engines is bounded by
#: `agent_processes.SHUTDOWN_BOUND_S` (it SIGKILLs them itself by then), plus room for its
#: interpreter to exit on a loaded machine — an agent is never killed while it still stops its
#: engines (stop's 10 s once equalled the agent's own engine grace, and agents stuck on a hung
#: engine were SIGKILLed).
AGENT_GRACE_S: Final = SHUTDOWN_BOUND_S + 3.0
#: How long a process that does not prove it is the run's is watched before it is named as
#: such (`Owned.refusal`): one that is ending reads as one without the run's token.
EXITING_S: Final = 2.0


class RunStateError(EhpError):
    """A run directory's `run.json` is unreadable or belongs to another plan or host."""


@dataclass(frozen=True)
class Owned:
    """One process a run owned: what it was (`what`: "run", "agent h1", "engine e0", ...), its
    identity on this host, and what proves a live process with that identity is the run's —
    `token`, the launch token it carries in its environment, or `lock`, the run directory's
    lock file it holds (the run's own process). Neither: nothing proves it, it is never
    signalled."""

    what: str
    pid: int
    start_time: float
    token: str = ""
    lock: Path | None = None

    def process(self) -> psutil.Process | None:
        """The live process this identity names, when it proves it is the run's; None when the
        pid is gone, names another process (another start time), a zombie, or a process that
        does not prove it (`refusal`)."""
        p = self._live()
        return p if p is not None and self._unproven() is None else None

    def refusal(self) -> str | None:
        """Why the live process this identity names is not the run's, for a message (None: it
        is, or no such process lives). A process that is ending as it is looked at (an agent
        of a killed run stops by itself) has its environment gone before it is a zombie: its
        token unreadable, it was refused as not the run's and `stop` exited 1. So a refusal
        stands only for a process still there `EXITING_S` later."""
        if self._live() is None:
            return None
        why = self._unproven()
        deadline = time.monotonic() + EXITING_S
        while why is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            if self._live() is None:
                return None  # it ended: nothing of the run's is left there
            why = self._unproven()
        return why

    def _live(self) -> psutil.Process | None:
        try:
            p = psutil.Process(self.pid)
            if abs(start_time_of(self.pid) - self.start_time) > START_TIME_TOLERANCE_S:
                return None
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
        except psutil.Error:
            return None
        return p

    def _unproven(self) -> str | None:
        if self.lock is not None:
            if self.pid in _lock_holders(self.lock):
                return None
            return (
                f"pid {self.pid} does not hold this run's lock ({self.lock}): not signalled "
                f"(run.json names it as the {self.what}, but a run holds its lock from its "
                "start to its end: a process that is not this run's, or a run that has just "
                "ended)"
            )
        if self.token and launch_token_of(self.pid) == self.token:
            return None
        return (
            f"pid {self.pid} does not carry this run's launch token: not signalled (the run "
            f"directory names it as {self.what}, but its environment lacks the recorded "
            f"EHP_LAUNCH_TOKEN; check it with `ps -p {self.pid} -o args` and stop it by hand "
            "if it is the run's)"
        )


def owned_of(what: str, identity: ProcessIdentity) -> Owned:
    return Owned(what, identity.pid, identity.start_time, token=identity.launch_token)


def write_run_state(
    run_dir: Path,
    *,
    plan: str,
    run: ProcessIdentity,
    agents: Mapping[str, ProcessIdentity],
    trainers: Mapping[int, ProcessIdentity],
) -> None:
    """Write (atomically, readable by this user alone) what the run owns now."""
    doc = {
        "format": RUN_STATE_FORMAT,
        "plan": plan,
        "host": run.host,
        "run": run.to_dict(),
        "agents": {h: i.to_dict() for h, i in sorted(agents.items())},
        "trainers": {str(r): i.to_dict() for r, i in sorted(trainers.items())},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    # mode 0600: the launch tokens are what proves a process is the run's (`Owned.refusal`)
    write_whole(run_dir / RUN_STATE, json.dumps(doc, indent=1), private=True)


#: The largest of the run's own JSON files read back (run.json, an agent's state file,
#: resume/latest.json and plan.json): a few KiB, some 20 MB for 100,000 trainer ranks.
STATE_JSON_MAX: Final = 64 << 20


def read_state_json(path: Path) -> Any:
    """The JSON of one of the run's own files at `path`, within `STATE_JSON_MAX` bytes
    (`fspaths.read_own_json`: not a FIFO, not nested too deep)."""
    return read_own_json(path, STATE_JSON_MAX)


def read_run_state(run_dir: Path, plan: str) -> dict[str, Any] | None:
    """The run directory's `run.json` (None when there is none: nothing was started there);
    refused when it is unreadable, another plan's or another host's."""
    path = run_dir / RUN_STATE
    if not path.exists():
        return None
    try:
        doc: dict[str, Any] = read_state_json(path)
        ok = isinstance(doc, dict) and doc.get("format") == RUN_STATE_FORMAT
    except (OSError, ValueError) as exc:
        raise RunStateError(f"{path} is unreadable", str(exc), f"remove {path} by hand") from None
    if not ok:
        raise RunStateError(
            f"{path} is not a run state this ehp-fsm wrote", "", f"remove {path} by hand"
        )
    if doc.get("plan") != plan:
        raise RunStateError(
            f"{path} belongs to plan {doc.get('plan')!r}, not {plan!r}",
            "two plans share a run directory (their `log` is in the same folder), or this "
            "plan's `[run] name` was changed since that run started",
            f"give each plan its own log folder; if this plan's name was changed, put `[run] "
            f"name = {json.dumps(doc.get('plan'))}` back to stop or resume that run "
            f"(`ehp-fsm stop {run_dir}` stops what that run left running, whatever its plan "
            "now says)",
        )
    if doc.get("host") != this_host():
        raise RunStateError(
            f"the run in {run_dir} ran on host {doc.get('host')!r}, this is {this_host()!r}",
            "processes can be checked and signalled only on their own host",
            f"run the command on {doc.get('host')}",
        )
    # the identities `stop` and `--resume` read: an edited file was a KeyError/AttributeError
    if (problem := _identities_problem(doc)) is not None:
        raise RunStateError(
            f"{path} is not a run state this ehp-fsm wrote",
            problem,
            f"remove {path} by hand (after checking that nothing of that run still runs)",
        )
    return doc


def recorded_plan(run_dir: Path) -> str | None:
    """The name of the plan whose run `run_dir` holds — its `run.json`'s, else the one its
    `run.lock` names (a run still starting) — or None: `ehp-fsm stop RUN_DIR` needs no plan,
    which may have been edited (renamed, broken) since its run started."""
    try:
        doc = read_state_json(run_dir / RUN_STATE)
        if isinstance(doc, dict) and isinstance(doc.get("plan"), str):
            return str(doc["plan"])
    except (OSError, ValueError):
        pass
    return locked_plan(run_dir / RUN_LOCK)


def unreadable_run_state(run_dir: Path) -> str | None:
    """Why `run_dir`'s `run.json`, which is there, names no plan (`recorded_plan` cannot read
    it); None when there is none, or it names one. `ehp-fsm stop RUN_DIR` said "no run state:
    nothing to stop" (exit 0) for a run.json it could not read — empty, `[]`, `{}`, not
    JSON — while what that run recorded may still run."""
    path = run_dir / RUN_STATE
    if not os.path.lexists(path):
        return None
    try:
        doc = read_state_json(path)
    except json.JSONDecodeError as exc:
        return "it is empty" if not exc.doc.strip() else f"it is not JSON ({exc})"
    except (OSError, ValueError) as exc:
        return exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)
    if not isinstance(doc, dict) or doc.get("format") != RUN_STATE_FORMAT:
        return f"it holds {str(doc)[:80]!r}, not a run state this ehp-fsm wrote"
    if not isinstance(doc.get("plan"), str):
        return f"it names no plan (its `plan` is {str(doc.get('plan'))[:80]!r})"
    return None


def locked_plan(lock: Path) -> str | None:
    """The plan name the lock file `lock` (`lock_run_dir`'s) names: the last run's that took
    it, live or not; None when it names none."""
    try:
        lines = read_own_text(lock, 1 << 16).split("\n")
    except (OSError, ValueError):
        return None
    name = lines[1].strip() if len(lines) > 1 else ""
    return name or None


def _identities_problem(doc: Mapping[str, Any]) -> str | None:
    """Why the process identities of run state `doc` cannot be read (None: they can)."""
    entries: dict[str, object] = {"run": doc.get("run")}
    for role in ("agents", "trainers"):
        table = doc.get(role, {})
        if not isinstance(table, dict):
            return f"its `{role}` is {str(table)[:80]!r}, not a table of process identities"
        entries |= {f"{role} {k}": v for k, v in table.items()}
    for what, entry in entries.items():
        if entry is None:
            return f"its entry for {what} is missing"
        if not isinstance(entry, dict):
            return f"its entry for {what} is {str(entry)[:80]!r}, not {{pid, start_time}}"
        try:
            _owned(what, entry)
        except RunStateError:
            return f"its entry for {what} is {str(entry)[:80]!r}, not {{pid, start_time}}"
    return None


def live_foreign_run(run_dir: Path, plan: str) -> tuple[str, int] | None:
    """(plan, pid) of a live run of *another* plan recorded in `run_dir` on this host: two plans
    whose logs share a folder share a run directory, and a start would clear the live one's
    (its engines failed, its trainer died). Another host's run cannot be checked from here."""
    try:
        doc = read_state_json(run_dir / RUN_STATE)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != RUN_STATE_FORMAT:
        return None
    if doc.get("plan") == plan or doc.get("host") != this_host():
        return None
    try:
        run = run_process(doc, run_dir)
        alive = run.process() is not None
    except (KeyError, TypeError, ValueError):  # a run state written by hand: nothing to check
        return None
    return (str(doc.get("plan")), run.pid) if alive else None


def lock_run_dir(run_dir: Path, *, lock: Path | None = None, plan: str = "") -> BinaryIO | None:
    """`run_dir`'s `run.lock`, locked (`flock`, exclusive) for as long as the returned file is
    open and naming this process; None when another process holds it — a run of this
    directory is starting or running. One run at a time takes a run directory over: `run.json`
    names a run only once it has cleared the directory (seconds for large revisions), and a
    second run started meanwhile found no live run there, cleared the first one's revisions
    and keys, and at its end stopped every process `run.json` named — the first run's agents,
    engines and trainers. The lock goes with its process: a killed run's holds nothing.
    `lock`: another lock file (a run's revisions directory is locked beside it: a start
    clears that directory too, and two runs would write the same revision numbers there).
    The file holds the pid, then `plan` (the run's plan name: `starting_run`)."""
    path = run_dir / RUN_LOCK if lock is None else lock
    path.parent.mkdir(parents=True, exist_ok=True)
    # a symbolic link there is refused (`open_own`): `name_lock` emptied its target. Private
    # (0600, another user's refused): any user could open a 0644 lock read-only and hold its
    # `flock`, and every `ehp-fsm run` of the directory was refused as "starting" elsewhere
    fh = os.fdopen(open_own(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, private=True), "a+b")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    name_lock(fh, plan)
    return fh


def name_lock(fh: BinaryIO, plan: str) -> None:
    """Make the held lock file `fh` name this process and plan `plan`."""
    fh.truncate(0)
    fh.write(f"{os.getpid()}\n{plan}\n".encode())
    fh.flush()


def run_dir_holder(run_dir: Path, *, lock: Path | None = None) -> str:
    """Who holds `run_dir`'s lock (or `lock`), for a message: "pid N", or "" when it does
    not say."""
    try:
        text = read_own_text(run_dir / RUN_LOCK if lock is None else lock, 1 << 16)
    except (OSError, ValueError):
        return ""
    pid = text.split("\n", 1)[0].strip()
    return f"pid {pid}" if pid.isdigit() else ""


def starting_run(run_dir: Path, plan: str) -> Owned | None:
    """The process holding `run_dir`'s lock (a run of that directory, from its first step:
    `Job.claim`), when it is alive and runs plan `plan`; None when no process holds the lock.
    Probed with a shared lock taken and dropped at once: the holder's exclusive lock refuses
    it."""
    try:
        fh = (run_dir / RUN_LOCK).open("rb")
    except OSError:
        return None
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, rest = fh.read(4096).decode("utf-8", "replace").partition("\n")
        else:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            return None
    # not yet written (it has just locked), or another plan's run sharing the folder
    if not pid.strip().isdigit() or rest.strip() != plan:
        return None
    if int(pid) not in _lock_holders(run_dir / RUN_LOCK):  # the file names a process that
        return None  # does not hold the lock: not signalled on the word of a file alone
    try:
        return Owned("run", int(pid), start_time_of(int(pid)), lock=run_dir / RUN_LOCK)
    except psutil.Error:
        return None


def _lock_holders(path: Path) -> set[int]:
    """The pids holding a `flock` on lock file `path` (`_flock_holders`), when `path` is a
    lock a run of this user made: a regular file of this user, with one name — not a link (or
    hard link) planted to a lock file some other process of the user holds. Empty otherwise,
    and when `/proc/locks` cannot be read: nothing is proven then."""
    try:
        st = os.lstat(path)
    except OSError:
        return set()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        return set()
    return _flock_holders(path) or set()


def _flock_holders(path: Path) -> set[int] | None:
    """The pids the kernel names as holding a `flock` on `path` (`/proc/locks`: "N: FLOCK
    ADVISORY WRITE PID MAJ:MIN:INODE ..."; a waiter's line has "->" after "N:"); None when it
    cannot be read."""
    try:
        st = path.lstat()
        text = Path("/proc/locks").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    held = set()
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == where and f[4].isdigit():
            held.add(int(f[4]))
    return held


def runs_elsewhere(plan: str, but: Path) -> list[tuple[Owned, Path]]:
    """Live runs of plan `plan` (each with the run directory whose lock it holds) in other
    run directories than `but`. A plan's relative `[run] log` is taken from the directory a
    run starts in, so `ehp-fsm stop` from another directory found no run state and said
    "nothing to stop" (exit 0) while the run went on. Found through the `flock`s the kernel
    lists (`/proc/locks`), each holder's open `run.lock` checked as `starting_run` checks it;
    a process this user cannot inspect is not seen."""
    try:
        text = Path("/proc/locks").read_text(encoding="ascii", errors="replace")
    except OSError:
        return []
    pids = set()
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[4].isdigit():
            pids.add(int(f[4]))
    found: dict[Path, Owned] = {}
    for pid in sorted(pids - {os.getpid()}):
        try:
            files = psutil.Process(pid).open_files()
        except psutil.Error:
            continue
        for f in files:
            where = Path(f.path).parent
            if Path(f.path).name != RUN_LOCK or where == but or where in found:
                continue
            if (run := starting_run(where, plan)) is not None:
                found[where] = run
    return [(run, where) for where, run in sorted(found.items())]


#: How far `runs_near` looks from a folder that holds no run state: its parents up to this
#: many levels (`runs/short/agents/h1` is two below its run directory), and its folders down
#: to this depth (`.` is two above `runs/short`), reading at most `NEAR_FOLDERS` entries.
NEAR_LEVELS: Final = 3
NEAR_FOLDERS: Final = 5000


def runs_near(folder: Path) -> list[tuple[Path, list[Owned]]]:
    """Run directories in the folders above `folder` (`NEAR_LEVELS` of them) or below it (to
    that depth) where something a run recorded runs (or a run is starting: it holds the lock),
    each with its live processes. `ehp-fsm stop runs` or `stop runs/short/agents` — a folder
    above or below a live run's directory — found no run state there and said "nothing to
    stop" (exit 0) while the run went on. Links are not followed down; a folder that cannot be
    listed is passed over."""
    found: list[Path] = [p for p in list(folder.parents)[:NEAR_LEVELS] if _holds_run(p)]
    level, seen = [folder], 0
    for _ in range(NEAR_LEVELS):
        below: list[Path] = []
        for here in level:
            if seen >= NEAR_FOLDERS:
                break
            try:
                with os.scandir(here) as entries:
                    subs = []
                    for e in entries:  # (a folder of a million files is not read whole)
                        seen += 1
                        if seen > NEAR_FOLDERS:
                            break
                        if e.is_dir(follow_symlinks=False):
                            subs.append(Path(e.path))
            except OSError:
                continue
            for sub in sorted(subs):
                if _holds_run(sub):
                    found.append(sub)
                below.append(sub)
        level = below
    out = []
    for run_dir in found:
        if live := _live_of(run_dir):
            out.append((run_dir, live))
    return out


def _holds_run(folder: Path) -> bool:
    return any(os.path.lexists(folder / name) for name in (RUN_STATE, RUN_LOCK))


def _live_of(run_dir: Path) -> list[Owned]:
    """What still runs of the run of `run_dir` (a run starting there: its process alone);
    empty when nothing does, or its run state cannot be read or is another host's."""
    plan = locked_plan(run_dir / RUN_LOCK)
    if plan is not None and (starting := starting_run(run_dir, plan)) is not None:
        return [starting]
    name = recorded_plan(run_dir)
    if name is None:
        return []
    try:
        doc = read_run_state(run_dir, name)
        if doc is None:
            return []
        owned = [run_process(doc, run_dir), *owned_processes(run_dir, doc)]
    except RunStateError:
        return []
    return [o for o in owned if o.process() is not None]


def stop_starting(run: Owned, *, grace_s: float = 60.0) -> list[str]:
    """SIGTERM the run `run` (its own pieces are its to stop; it ends cleanly from any point
    of its start-up), SIGKILL after `grace_s`; the line that says so (none: it was gone)."""
    return _stop([run], grace_s=grace_s, children=False)


def revisions_lock(revisions: Path) -> Path:
    """The lock file of a revisions directory: beside it (a start removes the directory)."""
    return revisions.with_name(revisions.name + ".lock")


def run_process(doc: Mapping[str, Any], run_dir: Path) -> Owned:
    """The run process of run state `doc` of `run_dir`: proven by holding `run_dir`'s lock
    (`lock_run_dir`; it never leaves its process's environment, which a token put there at its
    start would)."""
    return _owned("run", doc["run"], lock=run_dir / RUN_LOCK)


def owned_processes(run_dir: Path, doc: Mapping[str, Any]) -> list[Owned]:
    """Every process the run recorded besides itself: agents, their engines and Hybrids (from
    the agents' state files), trainer workers; plus any process still carrying the launch
    token of a launch an agent recorded before its process existed."""
    out = [_owned(f"agent {h}", i) for h, i in sorted(doc.get("agents", {}).items())]
    tokens: set[str] = set()
    for f in sorted((run_dir / "agents").glob(f"*/{STATE_FILE}")):
        try:
            entries = read_state_json(f)
        except (OSError, ValueError):
            continue
        for e in entries if isinstance(entries, list) else ():
            if not isinstance(e, dict):
                continue
            if e.get("launching") is True:
                tokens.add(str(e.get("token", "")))
            elif "pid" in e and "start_time" in e:
                try:
                    out.append(_owned(f"{_engine_word(e)} {e.get('instance')}", e))
                except RunStateError as exc:  # (it named neither the file nor a fix)
                    raise RunStateError(
                        f"{f} is not an agent state file this ehp-fsm wrote",
                        f"{exc.what}: {exc.why}",
                        f"remove {f} by hand (after checking that nothing of that run still runs)",
                    ) from None
    out += [_owned(f"trainer {r}", i) for r, i in sorted(doc.get("trainers", {}).items())]
    if tokens - {""}:
        out += _carrying(tokens - {""})
    return out


def _engine_word(entry: Mapping[str, Any]) -> str:
    return "engine" if entry.get("machine") == "rollout_engine" else str(entry.get("machine"))


def _owned(what: str, data: Mapping[str, Any], *, lock: Path | None = None) -> Owned:
    """`data`'s identity (run state: `launch_token`; an agent's state file: `token`)."""
    token = data.get("launch_token", data.get("token"))
    try:
        pid, start_time = int(data["pid"]), float(data["start_time"])
        # a pid is positive (psutil raised ValueError for -1: a traceback from `stop`), and a
        # NaN start time is no time a process started at
        if pid < 1 or not math.isfinite(start_time):
            raise ValueError(pid, start_time)
        return Owned(
            what, pid, start_time, token=token if isinstance(token, str) else "", lock=lock
        )
    except (KeyError, TypeError, ValueError, OverflowError):
        raise RunStateError(
            f"the run state's entry for {what} is not an identity", repr(data)[:200], ""
        ) from None


def _carrying(tokens: set[str]) -> list[Owned]:
    out = []
    for p in psutil.process_iter():
        try:
            token = launch_token_of(p.pid)
            if token in tokens:
                out.append(Owned(f"launch {token[:8]}", p.pid, start_time_of(p.pid), token=token))
        except psutil.Error:
            continue
    return out


@dataclass(frozen=True)
class StopReport:
    """What `stop_owned` found and did: each line says what was stopped and how; `left`: what
    is still alive (empty when everything stopped); `refused`: one line per live process the
    run directory names that did not prove it is the run's (`Owned.refusal`), not signalled."""

    stopped: tuple[str, ...]
    left: tuple[str, ...]
    recorded: int
    refused: tuple[str, ...] = ()


def stop_owned(
    run_dir: Path,
    doc: Mapping[str, Any],
    *,
    run_grace_s: float = 60.0,
    grace_s: float = 10.0,
    say: Callable[[str], None] = lambda _: None,
    leftovers_only: bool = False,
) -> StopReport:
    """Stop everything `doc` (a run state of `run_dir`) names that still runs; see the module
    docstring. `leftovers_only`: the run itself calls it at its end, for what its agents could
    not stop (an engine whose agent was killed): the run process is left alone. A live process
    that does not prove it is the run's is not signalled, and `say`s why."""
    stopped: list[str] = []
    refused: list[str] = []

    def refuse(line: str) -> None:
        if line not in refused:
            refused.append(line)
            say(line)

    run = run_process(doc, run_dir)
    if not leftovers_only and run.process() is not None:
        say(f"the run (pid {run.pid}) is running: asking it to stop (SIGTERM)")
        # the run alone: it stops its own pieces and says so in its receipt; signalled with
        # it, its Core trainer died mid-step and the run ended "training step N failed" (exit
        # 2, --resume advised). What it leaves is stopped below, by what it recorded.
        stopped += _stop([run], grace_s=run_grace_s, children=False)
    elif not leftovers_only and (why := run.refusal()) is not None:
        refuse(why)
    rest = owned_processes(run_dir, doc)
    agents = [o for o in rest if o.what.startswith("agent ")]
    stopped += _stop(agents, grace_s=max(grace_s, AGENT_GRACE_S), refuse=refuse)
    others = owned_processes(run_dir, doc)  # the agents' files may have changed meanwhile
    stopped += _stop(
        [o for o in others if not o.what.startswith("agent ")], grace_s=grace_s, refuse=refuse
    )
    everything = others if leftovers_only else [run, *others]
    left = [f"{o.what} (pid {o.pid})" for o in everything if o.process() is not None]
    return StopReport(tuple(stopped), tuple(left), len(everything), tuple(refused))


def _stop(
    owned: Iterable[Owned],
    *,
    grace_s: float,
    children: bool = True,
    refuse: Callable[[str], None] = lambda _: None,
) -> list[str]:
    """SIGTERM each live process of `owned` and (`children`) the processes it started,
    SIGKILL what is left after `grace_s`; one line per process of `owned` that was running.
    One that does not prove it is the run's (`Owned.refusal`) is not signalled: `refuse` gets
    why."""
    procs: dict[int, tuple[str, psutil.Process]] = {}
    for o in owned:
        p = o.process()
        if p is None:
            if (why := o.refusal()) is not None:
                refuse(why)
            continue
        procs[p.pid] = (f"{o.what} (pid {o.pid})", p)
        try:
            kids = p.children(recursive=True) if children else []
        except psutil.Error:
            kids = []
        for k in kids:
            procs.setdefault(k.pid, (f"a process of {o.what} (pid {k.pid})", k))
    for _, p in procs.values():
        _signal(p, signal.SIGTERM)
    alive = _wait_gone([p for _, p in procs.values()], grace_s)
    for p in alive:
        _signal(p, signal.SIGKILL)
    still = _wait_gone(alive, 5.0)
    killed = {p.pid for p in alive}
    lines = []
    for pid, (what, _) in procs.items():
        if what.startswith("a process of"):
            continue
        how = f"SIGKILL after {grace_s:g} s" if pid in killed else "SIGTERM"
        if any(p.pid == pid for p in still):
            how += ", still alive"
        lines.append(f"{what}: {how}")
    return lines


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes of `procs` still running after up to `timeout_s`. One that exited is gone
    even while its parent has not reaped it yet (a zombie): it runs nothing and holds nothing
    but its pid, and the reaper of an orphan (pid 1, for the agents and trainers of a killed
    run) may take seconds — 1.6–2.6 s here. `psutil.wait_procs` counted such a zombie alive,
    and `stop` waited its whole grace for an agent that had exited at once and reported it
    SIGKILLed."""
    end = time.monotonic() + timeout_s
    alive = list(procs)
    while True:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() >= end:
            return alive
        time.sleep(0.05)


def _running(p: psutil.Process) -> bool:
    """`p` runs: its pid names it still (psutil checks the start time) and it is no zombie."""
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    """`sig` to `p`; psutil refuses (NoSuchProcess) when the pid names another process now.
    SIGTERM is followed by SIGCONT: a stopped process (SIGSTOP, Ctrl-Z) acts on it only once
    continued, and was SIGKILLed after the whole grace instead of ending cleanly."""
    with contextlib.suppress(psutil.Error):
        p.send_signal(sig)
        if sig == signal.SIGTERM:
            p.resume()
