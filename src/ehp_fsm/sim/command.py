"""`ehp-fsm simulate PLAN [--hosts N --steps S --seed K --ehp on|off|both --faults off|on|heavy]`.

Writes under `--out` (default `runs/<plan>-sim/`), one folder per EHP mode: `transitions.jsonl`
(what `ehp-fsm replay` verifies), `summary.txt`, `timeline.png` (GPUs per role over virtual time;
one line per GPU as well up to 64 GPUs), `receipt.json`. `--seeds M` with `--faults heavy` is
the fault hunt: M seeds, the first that breaks an invariant and the command to reproduce it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from pathlib import Path
from typing import TextIO

from ehp_fsm.errors import EhpError
from ehp_fsm.fspaths import path_problem, write_whole
from ehp_fsm.loglines import first_line, line_limit
from ehp_fsm.plan import MAX_COUNT, MAX_HYBRIDS, MAX_SEED, Plan
from ehp_fsm.sim.cluster import scale
from ehp_fsm.sim.hunt import hunt
from ehp_fsm.sim.output import PER_GPU_LIMIT, compare, draw_roles, summary, write_receipt
from ehp_fsm.sim.story import SimResult, Simulation

#: What a simulation writes beside its log at its end, of that log alone.
_REPORT = (
    "receipt.json",
    "summary.txt",
    "timeline.png",
    "timeline-gpus.png",
    "timeline-gpus.svg",
)

__all__ = ["simulate"]


def simulate(
    plan: Plan,
    *,
    plan_path: str,
    hosts: int | None,
    steps: int | None,
    seed: int | None,
    ehp: str,
    faults: str,
    seeds: int | None,
    out_dir: str | None,
    out: TextIO,
) -> int:
    if seed is None:  # (was 0 whatever the plan said: its [run] seed went unused)
        seed = plan.seed
    if not 0 <= seed <= MAX_SEED:
        raise EhpError(
            f"--seed {seed} is not a seed",
            f"seeds are whole numbers within 0..{MAX_SEED}, as a plan's [run] seed",
            f"give --seed within 0..{MAX_SEED}",
        )
    if steps is not None and not 1 <= steps <= MAX_COUNT:  # 10**20 steps ran until killed
        raise EhpError(
            f"--steps {steps} is not a number of steps",
            f"a run has 1..{MAX_COUNT} steps, as a plan's grpo.steps",
            f"give --steps within 1..{MAX_COUNT}",
        )
    if ehp != "off" and plan.ehp.max_hybrids == 0:  # (a plan of `enabled = false` may say 0)
        raise EhpError(
            f"--ehp {ehp} with [ehp] max_hybrids = 0",
            "EHP may then start no Hybrid replica: its run could never borrow a GPU (at the "
            "plan's size it was the EHP-off run again; --hosts made it 1 Hybrid a copy)",
            f"set [ehp] max_hybrids (1..{MAX_HYBRIDS}) in the plan for its {len(plan.hosts)} "
            "hosts, or give --ehp off",
        )
    if out_dir is not None:
        _check_out(out_dir)
    n_hosts = hosts if hosts is not None else len(plan.hosts)
    scaled = scale(plan, n_hosts)
    n_steps = steps if steps is not None else plan.grpo.steps

    quiet_loop_logs()

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    if n_hosts % len(plan.hosts):  # (the hint was in refusals only: the mix moved unsaid)
        share = len(plan.core.gpus) / max(1, len(plan.inventory))
        now = len(scaled.core.gpus) / max(1, len(scaled.inventory))
        say(
            f"note: --hosts {n_hosts} is not a multiple of the plan's {len(plan.hosts)} hosts: "
            f"the Core holds {now:.0%} of the GPUs where the plan's holds {share:.0%}"
        )
    if ehp != "off" and not plan.ehp.enabled:  # (asked for: a what-if of the plan with EHP)
        say(f"note: the plan has [ehp] enabled = false; --ehp {ehp} simulates it with EHP on")

    if seeds is not None:
        if out_dir is not None or ehp == "both":  # each was ignored: the hunt ran EHP on, in tmp
            # (the fix named both whichever was given: "drop --out" to a command without one)
            fixes = (["drop --out"] if out_dir is not None else []) + (
                ["give --ehp on or off with --seeds"] if ehp == "both" else []
            )
            raise EhpError(
                f"--seeds (a fault hunt) with {'--out' if out_dir is not None else '--ehp both'}",
                "a fault hunt runs one mode and keeps no output: a run's log, receipt and "
                "summary come from the command it prints for the seed that breaks",
                " and ".join(fixes),
            )
        if seeds < 1:
            raise EhpError(
                f"--seeds {seeds} is not a number of seeds",
                "a fault hunt runs one seed or more, from --seed on",
                "give --seeds 1 or more",
            )
        if seed + seeds - 1 > MAX_SEED:
            raise EhpError(
                f"--seed {seed} --seeds {seeds} runs seeds up to {seed + seeds - 1}",
                f"seeds are within 0..{MAX_SEED}",
                f"give --seeds {MAX_SEED - seed + 1} or fewer, or a smaller --seed",
            )
        found = hunt(
            scaled,
            plan_path=plan_path,
            hosts=n_hosts,
            steps=n_steps,
            seeds=range(seed, seed + seeds),
            ehp=ehp != "off",
            faults=faults,
            say=say,
        )
        if found.failing_seed is None:
            say(
                f"fault hunt: {found.seeds_run} seeds, no invariant broken ({faults} faults, "
                f"{found.faults:,} injected in all; {found.stopped} runs stopped by design)"
            )
            if faults == "off":  # more hosts or steps would inject none either
                say(
                    "fault hunt: --faults off injects no fault, so no failure was exercised: "
                    "give --faults heavy (or on)"
                )
            elif found.faults == 0:
                say(
                    "fault hunt: no fault was injected, so no failure was exercised: fault "
                    "rates are per GPU-hour and host-hour of virtual time (`[simulate]`); give "
                    "more --hosts or --steps" + ("" if faults == "heavy" else ", or --faults heavy")
                )
            return 0
        say(f"fault hunt: seed {found.failing_seed} breaks: {found.reason}")
        say(f"reproduce: {found.command}")
        return 1
    root = Path(out_dir) if out_dir else Path("runs") / f"{plan.name}-sim"
    _check_writable(root, "--out" if out_dir else "the default output folder")
    modes = {"on": [True], "off": [False], "both": [False, True]}[ehp]
    for on in modes:  # all before the first simulation starts
        folder = root / ("ehp-on" if on else "ehp-off") if ehp == "both" else root
        _check_log_is_a_simulations(folder)
        _check_reports(folder, _REPORT)
    if ehp == "both":  # its root's log and report, a single mode's, are removed below
        _check_log_is_a_simulations(root)
    _check_reports(root, ("comparison.txt",) if ehp != "both" else ("comparison.txt", *_REPORT))
    # what an earlier simulation of the other mode left at the root: another run's figures
    # beside this one's (a 1-step comparison beside a 2-step run, and the reverse)
    stale_root = ["comparison.txt"] if ehp != "both" else ["transitions.jsonl", *_REPORT]
    for name in stale_root:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (root / name).unlink()
    results: list[SimResult] = []
    for on in modes:
        folder = root / ("ehp-on" if on else "ehp-off") if ehp == "both" else root
        folder.mkdir(parents=True, exist_ok=True)
        command = (
            f"ehp-fsm simulate {shlex.quote(plan_path)} --hosts {n_hosts} --steps {n_steps} "
            f"--seed {seed} --ehp {'on' if on else 'off'} --faults {faults}"
        )
        say(f"{command}")
        sim = Simulation(
            scaled,
            seed=seed,
            faults=faults,
            ehp=on,
            steps=n_steps,
            log_path=folder / "transitions.jsonl",
            say=say,
        )
        # its log begun (and locked): an earlier simulation's report there is of another log
        # (`replay --receipt` took an interrupted one's log for an edited log)
        stale = [folder / name for name in _REPORT]
        if ehp == "both":
            stale.append(root / "comparison.txt")
        for path in stale:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                path.unlink()
        try:
            r = sim.run()
        except OSError as exc:  # the log's write (a full disk) names no file: it said only
            raise EhpError(  # "OSError: No space left on device"
                f"the simulation stopped: {exc.strerror or exc} writing its log "
                f"{folder / 'transitions.jsonl'}",
                f"{type(exc).__name__} from the disk under --out",
                "free space on that disk, or give --out a folder on another (a simulation "
                "of many hosts writes ~300 bytes a transition)",
            ) from exc
        results.append(r)
        text = summary(r)
        write_whole(folder / "summary.txt", text + "\n")
        write_receipt(r, command, folder / "receipt.json")
        title = f"{plan.name} simulated: {r.hosts} hosts, EHP {'on' if on else 'off'}, seed {seed}"
        draw_roles(r.samples, r.virtual_s, folder / "timeline.png", title)
        written = ["transitions.jsonl", "summary.txt", "timeline.png", "receipt.json"]
        if r.gpus <= PER_GPU_LIMIT:
            from ehp_fsm.report.timeline import draw_timeline, role_intervals

            draw_timeline(
                role_intervals(folder / "transitions.jsonl"), folder / "timeline-gpus", title=title
            )
            written.insert(3, "timeline-gpus.{png,svg}")  # (one line per GPU: it went unsaid)
        say(text)
        say(f"  written: {folder}/{{{','.join(written)}}}")
    if len(results) == 2:
        table = compare(results[0], results[1])
        write_whole(root / "comparison.txt", table + "\n")
        say(table)
    return 0


def _check_out(out_dir: str) -> None:
    """`--out` names a folder (made if missing): refused before anything runs when it is blank
    (it silently meant the default folder) or names something that is not a folder."""
    if (problem := path_problem(out_dir)) is not None:
        raise EhpError(f"--out {out_dir!r} is not a folder", problem, "give --out DIR")
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise EhpError(
            f"--out {out_dir} is not a folder",
            "it names a file",
            "give --out a folder (it is made if it does not exist)",
        )


def _check_writable(root: Path, flag: str) -> None:
    """The output folder, or the nearest folder above it that exists, is a folder this process
    may write in: refused before anything runs, naming `flag` (a read-only one was refused
    after the command line was printed, as "pass a log_path", an argument of the Python API;
    one under a file was "NotADirectoryError", naming no flag)."""
    here = root.absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise EhpError(
            f"{flag} {root} cannot be made",
            f"{here} is a file, not a folder",
            "give --out a folder (it is made if it does not exist)",
        )
    if not os.access(here, os.W_OK | os.X_OK):
        raise EhpError(
            f"{flag} {root} cannot be written",
            f"this user may not write in {here} (or it is on a read-only file system)",
            "give --out a folder you can write (it is made if it does not exist), or make "
            "that one writable",
        )


def _check_log_is_a_simulations(folder: Path) -> None:
    """A `transitions.jsonl` in `folder` is overwritten by the simulation only if a simulation
    wrote it: `--out runs/<plan>` emptied a real run's log (and replaced its receipt)."""
    log = folder / "transitions.jsonl"
    if not log.is_file():
        return
    if _log_says_simulation(log) is False:
        raise EhpError(
            f"--out {folder} holds a transition log that no simulation wrote ({log})",
            "a simulation empties the transitions.jsonl of its output folder: this one is a "
            "run's (or not a log at all), and would be lost",
            "give --out a folder of its own (the default is runs/<plan>-sim), or move that "
            "log away first",
        )


def _check_reports(folder: Path, names: tuple[str, ...]) -> None:
    """Each of `names` in `folder`, which the simulation writes (or removes), may be there only
    as a simulation's own file: one that is not a file (a folder named timeline.png) failed
    only after the whole simulation, and a file of the user's (a summary.txt, a receipt.json
    of their own) was replaced, unsaid. A folder whose log or receipt a simulation wrote is a
    simulation's: its files are replaced."""
    there = [folder / n for n in names if os.path.lexists(folder / n)]
    for path in there:
        if not path.is_file() or path.is_symlink():
            kind = "a folder" if path.is_dir() else "not a plain file"
            raise EhpError(
                f"the simulation's {path} is {kind}",
                "the simulation writes (or removes) that file",
                "move it away, or give --out another folder",
            )
    if there and not _simulations_folder(folder):
        raise EhpError(
            f"--out {folder} holds {', '.join(p.name for p in there)}, which no simulation wrote",
            "a simulation writes its report there, replacing them",
            "give --out a folder of its own (the default is runs/<plan>-sim), or move those "
            "files away first",
        )


def _simulations_folder(folder: Path, *, modes: bool = True) -> bool:
    """Whether a simulation wrote into `folder`: its log's header or its receipt says so, or
    (`modes`) those of its ehp-on/ehp-off folders (`--ehp both`'s, its comparison.txt)."""
    if modes and any(
        _simulations_folder(folder / sub, modes=False) for sub in ("ehp-on", "ehp-off")
    ):
        return True
    if _log_says_simulation(folder / "transitions.jsonl"):
        return True
    try:
        with (folder / "receipt.json").open("rb") as f:
            receipt = json.loads(f.read(1 << 20))
        return isinstance(receipt, dict) and str(receipt.get("command", "")).startswith(
            "ehp-fsm simulate "
        )
    except (OSError, ValueError, RecursionError):
        return False


def _log_says_simulation(log: Path) -> bool | None:
    """Whether the transition log `log`'s header says a simulation wrote it; None when the log
    is empty (nothing to lose). A missing, unreadable or malformed log (too long a line,
    [[[... nested too deep) is not a simulation's: False."""
    try:
        with log.open("rb") as f:
            first = first_line(f, line_limit())
        if not first.strip():
            return None
        meta = json.loads(first).get("meta") or {}
        return isinstance(meta, dict) and meta.get("source") == "simulate"
    except (EhpError, OSError, ValueError, AttributeError, RecursionError):
        return False


def quiet_loop_logs() -> None:
    """The loop logs each refused event at info level; a simulation shows them in its log and
    summary instead (warnings still print)."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
