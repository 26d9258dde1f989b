"""`ehp-fsm run PLAN --resume`: go on with a run that was killed (kill -9, a lost machine) or
stopped (`ehp-fsm stop PLAN`, Ctrl-C). Its messages say "the run being resumed": either one.

What a run leaves for this: after a step the Core's exact training state (parameters, FP32
master weights, Adam moments and steps) is saved beside the revisions, in
`resume/state-<step>` with `resume/latest.json` naming the newest complete one (the one before
is removed once the new one is complete, so the disk holds one state, two while one is written).
Its cost is bounded by time: after the first step, a state is saved only when the run has gone
on for `1 / STATE_SAVE_SHARE` times as long as the last save took since it ended, so saving
takes at most that share (2 %) of the run's time whatever the model's size (plus one save after
the last step, and one after the last step of a run stopped by a signal); a resume of a
killed run goes back at most that far (on the tiny model a save takes 0.03–0.2 s:
at most one every 1.5–10 s; at 10 % the saves were ~5 % of the default run's wall time);
`run.json` names every process the run owned (`owned`); the transition log is the run's
write-ahead log.

What a resume does, before anything starts:
1. Refuses a plan whose model is not the killed run's (`check_resumed_model`: its config or
   tokenizer files against those the run's revisions carry), or that changed how the run
   trains (`check_resumed_plan`: seed, data, reward — its name and its code —, GRPO settings,
   Core layout, model settings; against `resume/plan.json`, the plan the run started or last
   resumed with; other changes, such as hosts, engines, the EHP policy or deadlines, are listed
   and taken), and refuses while the run is still alive (`ehp-fsm stop PLAN` stops it); stops
   what is left of it — agents, engines, Hybrids, trainer workers — by identity (pid and start
   time). Nothing is adopted: the resumed run starts its own pieces, and an engine of the
   killed run would serve weights the resumed run did not publish.
2. Repairs the log's tail (`runtime.recovery.recover_log`: a torn last line, an incomplete last
   event) and replays it, then moves it aside as a *segment* (`transitions.1.jsonl`, `.2`, ...).
   The resumed run writes a new log at the plan's path whose header names the segment it resumes
   and that segment's chain head (lines, last `chain`): `ehp-fsm replay` verifies each segment
   and that each one ends exactly where its successor says (a segment edited or cut after the
   resume breaks that link).
3. The resumed run restores the Core from the newest saved state (its optimizer version is the
   step count) and holds every Core rank and TP shard to it bit for bit: the save recorded each
   tensor's SHA-256 as the lane held it, the restored lane's tensors are hashed again and any
   that differs is refused (`verify.check_restored`; the receipt's `resumed.restored`). It
   publishes those weights as the revision that step had published (step + 1), and
   trains the remaining steps on new groups (group ids go on after the last one the killed run
   created: none is trained twice). Groups the killed run created but did not train (queued,
   generating, completed or claimed by the step it died in) are not carried over, and their
   prompts are skipped: the new log's header and the receipt list them (`abandoned_groups`).
   Neither are the steps after the saved state: they are trained again on new groups, and their
   revision numbers name the new weights (the killed run's revisions from the restored one on
   are removed from the store).

Knows: the layout of `resume/`, the segment names and the header's `resumes` entry. Does not
know: how the pieces start (`startup`), the step loop (`job`), how processes are stopped
(`owned`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from ehp_fsm.data.rewards import reward_code
from ehp_fsm.errors import EhpError
from ehp_fsm.finished import IdSet
from ehp_fsm.fspaths import write_whole
from ehp_fsm.models import revision_dir
from ehp_fsm.plan import MAX_COUNT, Plan
from ehp_fsm.replay import ReplayResult
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.run.owned import read_run_state, read_state_json, run_process, stop_owned
from ehp_fsm.run.placement import unseen_write
from ehp_fsm.runtime.recovery import recover_log
from ehp_fsm.training.pool import PoolFailure, TrainerPool
from ehp_fsm.training.verify import INDEX_FILE, combine_digests

RESUME_DIR: Final = "resume"
PLAN_RECORD: Final = "plan.json"  # in RESUME_DIR: the plan its saved states were trained by
#: what a resumed run must train as the killed run did (plan settings, `plan_settings` keys,
#: and everything below them): a change is refused ...
TRAINED_AS: Final = (
    "run.seed",
    "run.revisions",
    "model",
    "data",
    "reward.function",
    "reward.code",
    "grpo",
    "core",
)
#: ... except these: the steps to train to, where the Core runs, where the model's files lie
#: (their contents are `check_resumed_model`'s)
FREE: Final = ("grpo.steps", "core.gpus", "model.path")
#: the prompts file's contents (`plan_settings`), under `data` as its path is: groups, the
#: shuffle and the prompts a resume skips are prompt indexes, which name other prompts in a file
#: rewritten in place (held by its path alone, such a resume went on without a word)
DATA_CONTENTS: Final = "data.train_contents"
#: the reward's code (`plan_settings`: `rewards.reward_code`, its source files' digests): the
#: function edited in its module under the same name scored the resumed steps otherwise, and a
#: resume held to `reward.function` alone went on without a word
REWARD_CODE: Final = "reward.code"
#: what `REWARD_CODE` holds (`plan_settings`): "imports", the reward's modules and the user's
#: modules they import. A record without it is an older ehp-fsm's, which held the reward's own
#: module alone: only that record resumes with files added (`_held_as_before`) — for a record of
#: this one, a file added is code the killed run did not run (`try: from my_overrides import
#: SCALE` / `except ImportError`, with `my_overrides.py` written since, resumed without a word)
REWARD_CODE_SCOPE: Final = "reward.code_scope"
#: the initial weights, when `grpo.kl_coef > 0` (`plan_settings`: `_weights_digest`): the KL
#: reference is the model folder's weights, loaded anew by a resume (the policy is the saved
#: state's). A checkpoint put in the folder since — other weights, the same config and
#: tokenizer — was resumed without a word, the KL term then measured against it (ref KL 79.8
#: where the run had 0.04; an ML user's find)
MODEL_WEIGHTS: Final = "model.weights"
#: The module of the built-in rewards, which `rewards.builtin_code` names "<module>:<name>".
BUILTIN_MODULE: Final = reward_code.__module__
_ABSENT: Final = "(not set)"
STATE_SAVE_SHARE: Final = 0.02  # the share of a run's time its state saves may take, at most
LATEST: Final = "latest.json"
#: A saved state's folder in `RESUME_DIR`: `state-<step>`, the step zero-padded to 6 digits
#: (`save_state` names it so; `latest_state` reads the step back from a name of any width).
STATE_NAME: Final = "state-{:06d}"
_STATE_STEP: Final = re.compile(r"state-(\d+)")


class ResumeError(EhpError):
    """The run cannot be resumed: nothing to resume, the run still runs, its log is damaged."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run goes on from: the last step whose state was saved (0: none, the run
    starts from the model's weights), that state, the first group index it may use, the
    segment the killed run's log became (and its chain head), what was stopped."""

    step: int
    state: Path | None
    next_group: int
    segment: Path
    chain: tuple[int, str] | None
    stopped: tuple[str, ...]
    repair: str
    abandoned: tuple[str, ...]  # groups the killed run created and never trained
    repaired: bool = False  # its log's tail was cut or mended (`repair` says how)

    def header(self) -> dict[str, Any]:
        """The new log's header entry `resumes` (see `replay`): the segment and its chain
        head, the step the Core goes on from, the killed run's processes this resume stopped
        (its segment ends with them alive) and the groups it leaves untrained."""
        count, head = self.chain if self.chain is not None else (None, None)
        return {
            "log": self.segment.name,
            "count": count,
            "hash": head,
            "step": self.step,
            "stopped": list(self.stopped),
            "abandoned_groups": list(self.abandoned),
        }

    def receipt(self) -> dict[str, Any]:
        return {
            "from_step": self.step,
            "state": str(self.state) if self.state is not None else None,
            "previous_log": str(self.segment),
            "stopped": list(self.stopped),
            "abandoned_groups": list(self.abandoned),
            "log_repair": self.repair,
        }


def resumable_run(plan_name: str, log: Path, *, relative: str | None = None) -> dict[str, Any]:
    """The run state of the run of `plan_name` whose log is `log`, refused when there is none
    to resume (no run state, or no log): asked first, before the plan's inputs are read (a
    `--resume` with nothing to resume wrote the plan's model first). `relative`: the plan's
    `[run] log` when it is relative (taken from the current directory): the refusal says so,
    since a resume from another directory than the run's looks in another folder (it advised
    a fresh start, which trains from the beginning)."""
    doc = read_run_state(log.parent, plan_name)
    if doc is None or not (log.exists() or newest_segment(log) is not None):
        raise ResumeError(
            f"there is no run of plan {plan_name!r} to resume in {log.parent}",
            "its run state (run.json) or transition log is missing"
            + (
                f" ([run] log = {relative!r} is relative, taken from the directory the command "
                f"runs in: {Path.cwd()})"
                if relative is not None
                else ""
            ),
            "run the resume from the directory the run was started in"
            if relative is not None
            else "start the run anew with --fresh (it removes the saved state in "
            f"{log.parent / RESUME_DIR})"
            if unfinished_state(log.parent) is not None
            else "start the run without --resume",
        )
    return doc


def prepare_resume(
    plan_name: str,
    log: Path,
    say: Any,
    *,
    steps: int,
    checkpoint: Callable[[], None] | None = None,
) -> ResumePoint:
    """Steps 1 and 2 of the module docstring; the point to resume from. A run whose newest
    saved state is already at `steps` (the steps this resume would train to) is refused once
    its leftovers are stopped, before its log is touched: there is nothing to resume.
    `checkpoint`: called as the log is replayed (`replay`'s); what it raises ends the resume
    with the log where and as it was."""
    run_dir = log.parent
    doc = resumable_run(plan_name, log)
    last = newest_segment(log)
    run = run_process(doc, run_dir)
    if run.process() is not None:
        raise ResumeError(
            f"the run of plan {plan_name!r} is still running (pid {run.pid})",
            "a resume takes over a run that is gone",
            f"stop it first (ehp-fsm stop {plan_name}'s plan file), or let it finish",
        )
    report = stop_owned(run_dir, doc, say=say)
    for line in report.stopped:
        say(f"resume: stopped {line}")
    if report.left:
        raise ResumeError(
            "processes of the run being resumed could not be stopped",
            ", ".join(report.left),
            "stop them by hand (they ignore SIGKILL only in uninterruptible sleep), then resume",
        )
    saved, _ = latest_state(run_dir)
    if saved >= steps:
        why, replayed = "a resume goes on from the newest saved state", ""
        if log.exists() and not (run_dir / "receipt.json").exists():
            # killed at its end (its last step saved, then kill -9 during the Hybrids' return
            # or its write-up): the refusal named only --steps and a fresh start, which
            # removes the log; the log of those steps is whole and replays
            why += (
                f"; the run being resumed saved its state after step {saved} and was stopped "
                "after that, before it wrote its receipt (killed at its end)"
            )
            replayed = (
                f"nothing of those steps is lost: `ehp-fsm replay {shlex.quote(str(log))}` "
                "verifies their log (there is no receipt to check it against); "
            )
        raise ResumeError(
            f"the run of plan {plan_name!r} has nothing left to resume: its newest saved "
            f"state is after step {saved}, and this resume would train to step {steps}",
            why,
            f"{replayed}give --steps N with N > {saved} to train further from there, or start "
            "the run anew with --fresh",
        )
    if log.exists():
        segment = next_segment(log)
        result, repaired = recover_log(log, forget_finished=True, checkpoint=checkpoint)
        _hold_state_to_log(saved, result.world.globals.get("core_version", 0), log)
        _hold_plan_record(run_dir, result.world.globals.get("core_version", 0))
        os.replace(log, segment)
        kept = repaired.kept
        if kept is not None:  # the cut bytes follow their segment's name (never over another)
            moved = segment.with_name(segment.name + kept.name[len(log.name) :])
            with contextlib.suppress(OSError):
                os.link(kept, moved)  # (fails where `moved` exists: then kept where it is)
                kept.unlink()
                kept = moved
        # what was repaired is that segment now
        repaired = replace(repaired, path=segment, kept=kept)
    else:  # a resume killed after it set the log aside, before it wrote its own
        assert last is not None
        segment = last
        result, repaired = recover_log(segment, forget_finished=True, checkpoint=checkpoint)
        _hold_state_to_log(saved, result.world.globals.get("core_version", 0), segment)
        _hold_plan_record(run_dir, result.world.globals.get("core_version", 0))
    step, state = latest_state(run_dir)
    return ResumePoint(
        step=step,
        state=state,
        next_group=next_group_index(result.world.of("request"), _consumed(result)),
        segment=segment,
        chain=result.chain,
        stopped=report.stopped,
        repair=repaired.describe(),
        repaired=bool(repaired.truncated_bytes or repaired.notes),
        abandoned=tuple(
            sorted(g for g, r in result.world.of("request").items() if r.state != "consumed")
        ),
    )


def _hold_plan_record(run_dir: Path, logged: Any) -> None:
    """Refuse a run that trained steps and has no record of its plan: every start writes it
    (`record_plan`, in `resume/` beside the saved states) before it trains, so it, or the whole
    `resume/` folder, was removed since. A resume then took any edit of the plan without a word
    (a new seed and group count: `plan_changes: []`), and with `resume/` gone it went on from
    the initial weights, "resumed after step 0", dropping every step the log holds."""
    path = run_dir / RESUME_DIR / PLAN_RECORD
    if isinstance(logged, int) and logged >= 1 and not path.exists():
        gone = path.parent if not path.parent.exists() else path
        raise ResumeError(
            f"the run being resumed trained {logged} step(s), and {gone} is gone",
            "every start records its plan there before it trains (and the saved states go "
            "beside it): without it a resume can hold neither the plan to the one the steps "
            "were trained by nor the weights to their last saved state",
            f"put back {gone} as the run left it, or start the run anew with --fresh",
        )


def _hold_state_to_log(saved: int, logged: Any, log: Path) -> None:
    """Refuse a saved state of a step the log does not reach: a run saves a step's state only
    after that step's transitions are logged, so the log was cut since (its last lines deleted,
    or an older copy put back), and the groups of the steps between are in the weights but
    not in the log (a resume went on, and trained them again)."""
    if isinstance(logged, int) and saved > logged:
        raise ResumeError(
            f"the newest saved state is after step {saved}, but the transition log {log} ends "
            f"with the Core after step {logged}",
            "a run saves a step's state only once the log holds that step, so the log lost its "
            f"last lines since (cut, or an older copy put back): the groups of steps "
            f"{logged + 1}..{saved} are in the saved weights and not in the log, and a resume "
            "would train on them again",
            "put back the log as the run left it, or start the run anew with --fresh",
        )


def check_resumed_model(revisions: Path, model_dir: Path, model_key: str) -> None:
    """Refuse a resume whose plan names another model than the killed run trained: its config
    or tokenizer files differ from those the run's newest revision carries (the saved state is
    restored into the plan's model, and its tokenizer encodes the prompts). A plan edited
    between the kill and the resume was taken as it was: a model of other shapes failed only
    at the restore, after every engine and trainer had started, advising to delete the saved
    state; another tokenizer of the same size went unnoticed. Nothing to compare when the
    store (`revisions`, not made here) holds no revision."""
    if not revisions.is_dir():
        return
    store = RevisionStore(revisions)
    held = store.revisions()
    if not held:
        return
    newest = store.path(max(held))
    try:
        problem = revision_dir.base_files_problem(model_dir, newest)
    except (OSError, EhpError):  # a damaged revision: its install will say so
        return
    if problem is not None:
        raise ResumeError(
            f"the plan's model {model_dir} ({model_key}) is not the model the run being "
            "resumed trained",
            f"{problem} ({newest})",
            f"put back {model_key} (and the model's files) as the run had them, or start the "
            "run anew with --fresh",
        )


def plan_settings(
    plan: Plan, *, steps: int | None = None, checkpoint: Callable[[], None] | None = None
) -> dict[str, Any]:
    """What runs, as the parsed plan holds it (defaults included), flattened to dotted keys
    with JSON values; the `[run]` keys under `run.`. `steps`: the steps the run trains to when
    `run --steps N` overrides the plan's `grpo.steps` (held as `grpo.steps`). `checkpoint`:
    called as the data file and the initial weights are hashed (`_file_digest`)."""
    doc = json.loads(json.dumps(plan.to_dict(), default=str))
    doc.pop("simulate")  # `ehp-fsm simulate`'s cost model: nothing a run reads
    doc["run"] = {k: doc.pop(k) for k in ("name", "seed", "log", "revisions", "samples")}
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", doc)
    if steps is not None:
        out["grpo.steps"] = steps
    if plan.data is not None:
        out[DATA_CONTENTS] = _file_digest(plan.data.train, checkpoint)
    folder = Path(plan.source).resolve().parent if plan.source else None  # as `inputs.prepare`
    out[REWARD_CODE] = reward_code(plan.reward.function, folder=folder)
    out[REWARD_CODE_SCOPE] = "imports"
    if plan.grpo.kl_coef > 0 and plan.model is not None:
        out[MODEL_WEIGHTS] = _weights_digest(Path(plan.model.path), checkpoint)  # (as `prepare`)
    return out


def _weights_digest(model_dir: Path, checkpoint: Callable[[], None] | None = None) -> str | None:
    """The model folder's weights as one `sha256:<hex>` over the files `from_pretrained`
    reads — its safetensors (and their index), else its PyTorch `.bin` files — each file's
    name and bytes; None when it holds none (a model `generate` writes later)."""
    try:
        names = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    except OSError:
        return None
    weights = [n for n in names if n.endswith((".safetensors", ".safetensors.index.json"))]
    weights = weights or [n for n in names if n.endswith(".bin")]
    if not weights:
        return None
    try:  # hashed once a process while the files stay as they were (a resume asks twice)
        seen = tuple((n, (s := (model_dir / n).stat()).st_size, s.st_mtime_ns) for n in weights)
    except OSError:
        return None
    if (known := _WEIGHTS_SEEN.get((str(model_dir), seen))) is not None:
        return known
    total = hashlib.sha256()
    for name in weights:
        digest = _file_digest(model_dir / name, checkpoint)
        if digest is None:
            return None
        total.update(f"{name}\0{digest}\0".encode())
    _WEIGHTS_SEEN[(str(model_dir), seen)] = out = "sha256:" + total.hexdigest()
    return out


_WEIGHTS_SEEN: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


#: Bytes hashed between two calls of `_file_digest`'s `checkpoint`.
HASH_CHUNK: Final = 1 << 24


def _file_digest(path: Path, checkpoint: Callable[[], None] | None = None) -> str | None:
    """The file's bytes as `sha256:<hex>` (None when it cannot be read: the run's own reading
    of it names why). `checkpoint` is called after every `HASH_CHUNK` bytes; what it raises
    ends the hashing (a stop while the run hashes a model's weights: 15 GB of a 7B model in
    bf16 is tens of seconds)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb", buffering=0) as fh:
            # No bigger than the file: a data file of a few KiB takes no 16 MiB buffer.
            chunk = bytearray(max(1, min(HASH_CHUNK, os.fstat(fh.fileno()).st_size)))
            view = memoryview(chunk)
            while n := fh.readinto(chunk):
                digest.update(view[:n])
                if checkpoint is not None:
                    checkpoint()
    except OSError:
        return None
    return "sha256:" + digest.hexdigest()


def record_plan(
    run_dir: Path,
    plan: Plan,
    *,
    steps: int | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> None:
    """Keep the plan the run trains by in `resume/` (a resume compares its own with it), with
    the steps it trains to (`steps`: `run --steps N`'s, else the plan's). `checkpoint`:
    `plan_settings`'s."""
    path = run_dir / RESUME_DIR / PLAN_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = plan_settings(plan, steps=steps, checkpoint=checkpoint)
    write_whole(path, json.dumps(settings, indent=1, sort_keys=True))


def check_resumed_plan(
    run_dir: Path,
    plan: Plan,
    *,
    steps: int | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> list[str]:
    """Refuse a resume whose plan changed how the run trains since the killed run started (or
    last resumed): a key of `TRAINED_AS` (but not `FREE`) whose value differs. The resumed run
    goes on from a state those settings trained, and a change (another learning rate, seed,
    data file or group size) was taken without a word: the run went on as neither plan would
    have trained it. The other changes are returned, one "key: old -> new" each, for the
    resume to say. The data is compared by its contents too (`DATA_CONTENTS`). Nothing to
    compare when the run recorded no plan (refused once its log holds a trained step:
    `_hold_plan_record`). `steps`: the steps this resume
    trains to (`run --steps N`'s, else the plan's): a resume with `--steps` for a longer run
    than the killed one said nothing of it, where every other change taken was named.
    `checkpoint`: `plan_settings`'s."""
    path = run_dir / RESUME_DIR / PLAN_RECORD
    try:
        before = read_state_json(path)
        if not isinstance(before, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise ResumeError(
            f"{path} (the plan the run being resumed trained by) cannot be read",
            f"{type(exc).__name__}: {exc}",
            f"put back {path} as the run left it, or start the run anew with --fresh",
        ) from None
    now = plan_settings(plan, steps=steps, checkpoint=checkpoint)
    # recorded by an ehp-fsm that held the data by its path, the reward by its name, or the
    # reward by its own module alone
    for held_by_name in (DATA_CONTENTS, REWARD_CODE, REWARD_CODE_SCOPE, MODEL_WEIGHTS):
        if held_by_name not in before:
            now.pop(held_by_name, None)
    if "run.samples" not in before and not now.get("run.samples"):  # (recorded before it was
        now.pop("run.samples", None)  # a key, and off: no change to say)
    if MODEL_WEIGHTS not in now:  # kl_coef now 0: the change refused is `grpo.kl_coef`'s
        before.pop(MODEL_WEIGHTS, None)
    if REWARD_CODE_SCOPE not in before and _held_as_before(
        before.get(REWARD_CODE), now.get(REWARD_CODE)
    ):
        now[REWARD_CODE] = before[REWARD_CODE]
    changed = [
        (k, before.get(k, _ABSENT), now.get(k, _ABSENT))
        for k in sorted(before.keys() | now.keys())
        if before.get(k, _ABSENT) != now.get(k, _ABSENT)
    ]

    lines = [
        _code_change(old, new)
        if k == REWARD_CODE
        else _weights_change(old, new)
        if k == MODEL_WEIGHTS
        else f"{k}: {json.dumps(old)} -> {json.dumps(new)}"
        for k, old, new in changed
    ]
    refused = [
        line
        for line, (k, _, _) in zip(lines, changed, strict=True)
        if _under(k, TRAINED_AS) and not _under(k, FREE)
    ]
    if refused:
        data = any(_under(k, (DATA_CONTENTS,)) for k, _, _ in changed)
        weights = any(k == MODEL_WEIGHTS for k, _, _ in changed)
        code = [(o, _changed_files(o, n)) for k, o, n in changed if k == REWARD_CODE]
        restore = _code_fix(*code[0], new_files=REWARD_CODE_SCOPE in before) if code else ""
        raise ResumeError(
            "the plan changed how the run trains since the run being resumed started: "
            + "; ".join(refused),
            "a resume goes on from the state the settings of the run being resumed trained "
            "(seed, data, reward and its code, GRPO, Core layout and model settings must stay)",
            "put those keys back as the run had them (its plan is in "
            f"{path}{'; put back the data file the run trained on' if data else ''}"
            f"{'; put back the weights the run started from in [model] path' if weights else ''}"
            f"{restore}), or start "
            "the run anew with --fresh",
        )
    return lines


def _weights_change(old: Any, new: Any) -> str:
    """A change of `MODEL_WEIGHTS` as a line (the first 12 hex digits of each digest)."""

    def short(digest: Any) -> str:
        return str(digest).removeprefix("sha256:")[:12] if digest else "(none)"

    return (
        f"{MODEL_WEIGHTS}: the weights in [model] path are not those the run started from, "
        f"the KL reference (grpo.kl_coef > 0) (sha256 {short(old)} -> {short(new)})"
    )


def _held_as_before(old: Any, new: Any) -> bool:
    """The reward's code now is what an older ehp-fsm recorded (a record without
    `REWARD_CODE_SCOPE`), held otherwise since:
    - the recorded files, unchanged, and more: a record from before the modules of the user's
      own the reward imports were held too (its resume was refused: "helper.py sha256 (none)
      -> ..."). A file added by an edit is never only added: a new import is an edit of a file
      already held, whose digest then differs;
    - a built-in held by its function's source (`rewards.builtin_code`) where the record held
      the whole of ehp-fsm's `data/rewards.py`, which any upgrade changes (the built-in's
      name, `reward.function`, is compared on its own)."""
    was, now = _code_files(old), _code_files(new)
    if not was:
        return False
    if len(now) > len(was) and all(now.get(f) == d for f, d in was.items()):
        return True
    return (
        len(now) == 1
        and next(iter(now)).startswith(f"{BUILTIN_MODULE}:")
        and all(Path(f).parts[-3:] == ("ehp_fsm", "data", "rewards.py") for f in was)
    )


def _code_change(old: Any, new: Any) -> str:
    """A change of `REWARD_CODE` as a line: each source file whose digest changed, with the
    first 12 hex digits of both ("(none)": no such file recorded, or none now)."""

    def short(digest: str | None) -> str:
        return digest.removeprefix("sha256:")[:12] if digest else "(none)"

    was, now = _code_files(old), _code_files(new)
    changed = _changed_files(old, new)
    parts = [
        f"{name[:_SHOWN]} sha256 {short(was.get(name))} -> {short(now.get(name))}"
        for name in changed[:_FILES_SHOWN]
    ]
    if len(changed) > _FILES_SHOWN:
        parts.append(f"and {len(changed) - _FILES_SHOWN:,} more")
    if not parts:  # (the reward could not be resolved: its run says why)
        parts = [f"{json.dumps(old)[:_SHOWN]} -> {json.dumps(new)[:_SHOWN]}"]
    return f"{REWARD_CODE} (the reward's source files): " + ", ".join(parts)


#: What a refusal shows of an edited `resume/plan.json`'s `reward.code`: a few files, each name
#: (or value) clipped. A record edited to hold 200,000 files made an 8 MB message.
_FILES_SHOWN = 5
_SHOWN = 300


def _under(key: str, roots: tuple[str, ...]) -> bool:
    return any(key == r or key.startswith(r + ".") for r in roots)


def next_group_index(requests: Any, forgotten: Iterable[IdSet] = ()) -> int:
    """One past the highest group index the killed run created (ids `g<index>`): of the live
    groups `requests` and the forgotten ones (`forgotten`: their ids, whose data is gone)."""
    top = -1
    for gid, inst in requests.items():
        index = inst.get("index")
        if not isinstance(index, int):
            m = _GROUP_ID.fullmatch(str(gid))
            index = int(m.group(1)) if m else -1
        top = max(top, index)
    for ids in forgotten:
        runs, others = ids.runs()
        for prefix, _, last in runs:
            if _GROUP_ID.fullmatch(f"{prefix}{last}"):
                top = max(top, last)
        for gid in others:
            m = _GROUP_ID.fullmatch(gid)
            top = max(top, int(m.group(1)) if m else -1)
    return top + 1


_GROUP_ID = re.compile(r"[a-z]*(\d+)")


def _consumed(result: ReplayResult) -> list[IdSet]:
    """The ids of the groups the recovered world forgot (consumed ones)."""
    finished = result.forgetter.finished.get("request") if result.forgetter else None
    return list(finished.by_state.values()) if finished is not None else []


def segments_of(log: Path) -> dict[int, Path]:
    """The segments beside `log` (`transitions.<n>.jsonl` for `transitions.jsonl`) by number."""
    pattern = re.compile(re.escape(log.stem) + r"\.(\d+)" + re.escape(log.suffix))
    paths = list(log.parent.iterdir()) if log.parent.is_dir() else []
    return {int(m.group(1)): p for p in paths if (m := pattern.fullmatch(p.name))}


def next_segment(log: Path) -> Path:
    """`transitions.<n>.jsonl` beside `log`, n one above every segment there."""
    return log.with_name(f"{log.stem}.{max(segments_of(log), default=0) + 1}{log.suffix}")


def newest_segment(log: Path) -> Path | None:
    """The segment with the highest number beside `log`; None when there is none."""
    n = int(next_segment(log).name[len(log.stem) + 1 : -len(log.suffix) or None])
    return log.with_name(f"{log.stem}.{n - 1}{log.suffix}") if n > 1 else None


def unfinished_state(run_dir: Path) -> str | None:
    """Why a fresh start in `run_dir` would remove training a resume could go on from, as the
    start of `run`'s refusal (`Job.claim`); None when it would not: no state saved, or the
    state of a run that finished. Read from `resume/` alone — the run being another host's,
    or of a plan renamed since, its `run.json` does not say (a Slurm job's next allocation on
    another node, the run directory on shared storage, went on and removed it); the plan is
    named from its record. A saved state that cannot be read counts too: a resume of it is
    refused, naming why, and its files are the user's to look at before anything removes
    them."""
    folder = run_dir / RESUME_DIR
    try:
        step, _ = latest_state(run_dir)
    except EhpError as exc:
        return f"the saved state in {folder} cannot be read ({exc.what})"
    if step < 1:
        return None
    try:
        record = read_state_json(folder / PLAN_RECORD)
    except (OSError, ValueError):
        record = None
    steps = record.get("grpo.steps") if isinstance(record, dict) else None
    name = record.get("run.name") if isinstance(record, dict) else None
    if isinstance(steps, int) and step >= steps:
        return None
    of = f" of {steps}" if isinstance(steps, int) else ""
    plan = f"of plan {name!r} " if isinstance(name, str) else ""
    return f"the last run {plan}in {run_dir} stopped after step {step}{of}"


def latest_state(run_dir: Path) -> tuple[int, Path | None]:
    """(step, state dir) of the newest complete saved state; (0, None) when none was saved
    (no `latest.json`: the run was killed before its first save). A `latest.json` that cannot
    be read, or that names no complete state (it is written only once its state is), is
    refused: the run did save, and a resume from the initial weights would drop its steps
    (it did, saying only "resumed after step 0"). Without a `latest.json` (lost, deleted, or
    the run killed between a save and its naming), the newest complete `state-<step>` there
    is the newest save (a complete one has its index, written last): with it deleted, a
    resume went on from the initial weights, dropping every step the state held."""
    latest = run_dir / RESUME_DIR / LATEST
    fix = (
        f"put back {latest.parent} as the run left it, or start the run anew with --fresh "
        "(from the initial weights)"
    )
    if not latest.exists():
        complete: list[tuple[int, Path | None]] = [(0, None)]
        with contextlib.suppress(OSError):  # no resume folder: nothing was saved
            for path in latest.parent.iterdir():
                m = _STATE_STEP.fullmatch(path.name)
                # the run makes each state a folder, of a step within a plan's: a link there
                # (to a folder elsewhere) was restored from, and `state-0…0999…9` (past any
                # run's steps) refused the resume as having "nothing left to resume"
                if (
                    m
                    and 1 <= int(m.group(1)) <= MAX_COUNT
                    and not path.is_symlink()
                    and (path / INDEX_FILE).is_file()
                ):
                    complete.append((int(m.group(1)), path))
        return max(complete, key=lambda c: c[0])
    if not latest.is_file() or latest.is_symlink():  # a FIFO there: its read waited for ever
        raise ResumeError(
            f"{latest} is not a file", "a run writes latest.json as a file of its own", fix
        )
    try:
        doc = read_state_json(latest)
        step, path = int(doc["step"]), run_dir / RESUME_DIR / str(doc["state"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"{latest} cannot be read", f"{type(exc).__name__}: {exc}", fix) from None
    if path.parent != latest.parent or path.name in ("", ".", ".."):  # "/x", "../x", "a/b"
        raise ResumeError(
            f"{latest} names the state {str(doc['state'])[:200]!r}, not a folder of "
            f"{latest.parent}",
            "a run saves its states there and names them by their folder",
            fix,
        )
    if path.is_symlink():  # (the run makes folders; restored from, it read the link's target)
        raise ResumeError(
            f"{latest} names the state {path}, which is a symbolic link (to "
            f"{os.readlink(path)}), not a folder the run saved",
            "a run saves its states as folders of their own there",
            fix,
        )
    if step < 1 or not (path / INDEX_FILE).is_file():
        raise ResumeError(
            f"{latest} names the state of step {step} in {path}, which is not a complete "
            "saved state",
            f"{path / INDEX_FILE} is missing (or the step is below 1)",
            fix,
        )
    return step, path


def drop_revisions_after(store: RevisionStore, revision: int) -> None:
    """Remove the killed run's revisions from `revision` on: the resumed run publishes its
    restored weights as `revision` and trains the later ones anew. A symbolic link in a
    revision's place is removed, never what it points to; one that is left is refused, naming
    it (it was left silently, and the resume failed at its first publication, "revision 12
    already exists ... save revision 13 or higher", after every engine had started from it)."""
    for r in store.revisions():
        if r < revision:
            continue
        path = store.path(r)
        failed = _remove(path)
        if path.exists() or path.is_symlink():
            raise ResumeError(
                f"revision {r} ({path}) could not be removed" + (f" ({failed})" if failed else ""),
                f"the resumed run publishes its restored weights as revision {revision}, and "
                f"revisions only increase: those the run being resumed made from {revision} on "
                "are removed",
                f"remove {path} by hand, then resume",
            )


def _remove(path: Path) -> str | None:
    """Remove `path` (a link itself, never what it points to); the OS's words for the first
    thing left ("...: Permission denied"), or None. The refusal said only "could not be
    removed", and the cause was a read-only revisions folder."""
    failed: list[str] = []

    def note(
        _fn: object, where: str, info: tuple[type[BaseException], BaseException, object]
    ) -> None:
        exc = info[1]
        failed.append(f"{where}: {getattr(exc, 'strerror', None) or exc}")

    if path.is_symlink():
        try:
            path.unlink()
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
    else:
        shutil.rmtree(path, onerror=note)  # (3.11: `onexc` is 3.12's)
    return failed[0] if failed else None


def restore(
    pool: TrainerPool, point: ResumePoint, *, checkpoint: Callable[[], None] | None = None
) -> dict[str, Any] | None:
    """Install the saved Core state (nothing to do when no step had been saved) and hold it to
    the save: the receipt's `resumed.restored` — every TP shard's lane compared bit for bit with
    the digests recorded when the state was saved (`verify.check_restored`; a lane that differs
    is refused), the tensors compared and the state's digest computed from the lanes.
    `checkpoint`: called while the restore is awaited; what it raises ends it (the pool is
    then unusable: `TrainerPool.restore_state`)."""
    if point.state is None:
        return None
    got = pool.restore_state(point.state, checkpoint=checkpoint)
    if isinstance(got, PoolFailure):
        # a damaged state's reason carries its own fix (`verify`): one "Fix:", not two
        why, named, fix = str(got).partition(". Fix: ")
        raise ResumeError(
            f"the Core state of step {point.step} could not be restored",
            why,
            f"{fix} (a start with --fresh clears {point.state.parent})"
            if named
            else "resume again (a worker that died or ran out of time): the saved state is "
            f"unchanged; if it fails again, start the run anew with --fresh (it clears "
            f"{point.state.parent})",
        )
    if got.version != point.step:
        raise ResumeError(
            f"the saved state of step {point.step} holds optimizer version {got.version}",
            "the state and the step it was saved after disagree",
            f"remove {point.state.parent} and start the run again with --fresh",
        )
    shards = {k: str(v["digest"]) for k, v in got.checked.items()}
    return {
        "bit_exact": True,
        "tensors": sum(int(v["tensors"]) for v in got.checked.values()),
        "shards": sorted(shards),
        "digest": combine_digests(shards),
    }


@dataclass
class StateSaves:
    """The cost of saving the Core's state after every step (the receipt's `state_saves`)."""

    saves: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0
    bytes: int = 0
    last_seconds: float = 0.0
    last_end: float | None = None  # time.monotonic() when the last save ended
    step: int = 0  # the step whose state was saved last (a resume's: the one it restored)
    failed: int = 0  # saves that failed (the run went on; a resume starts from an older one)
    last_failure: str = ""

    def due(self, now: float) -> bool:
        """Whether a save now keeps the saves within `STATE_SAVE_SHARE` of the time."""
        if self.last_end is None:
            return True
        return now - self.last_end >= self.last_seconds / STATE_SAVE_SHARE

    def as_dict(self) -> dict[str, Any]:
        return {
            "saves": self.saves,
            "seconds": round(self.seconds, 4),
            "max_seconds": round(self.max_seconds, 4),
            "bytes": self.bytes,
            "failed": self.failed,
            "last_failure": self.last_failure,
        }


def save_step_state(
    pool: TrainerPool, run_dir: Path, step: int, saves: StateSaves, *, last: bool = False
) -> None:
    """Save the Core's state after `step` when one is due (`StateSaves.due`; always after the
    `last` step: a finished run resumes with nothing to redo; and once a stop was asked for: a
    resume goes on from the step the run stopped after), name it in `latest.json`, remove the
    one before. A save that fails is not fatal (the run goes on; a resume starts from the
    previous one); one this machine does not see (Core rank 0 on another machine, the log's
    folder not shared) is: no resume could find it (`placement.unseen_write`)."""
    if not last and not saves.due(time.monotonic()):
        return
    root = run_dir / RESUME_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = STATE_NAME.format(step)
    shutil.rmtree(root / name, ignore_errors=True)  # a half-written one from a killed run
    t0 = time.perf_counter()
    got = pool.save_state(root / name)
    if isinstance(got, PoolFailure):
        # what it wrote goes (a full disk kept the partial files until the next save); the
        # receipt's `state_saves` counts it: a resume starts from the save named in latest.json
        shutil.rmtree(root / name, ignore_errors=True)
        saves.failed += 1
        saves.last_failure = f"after step {step}: {got}"[:2000]
        return
    what = f"the Core's state after step {step} (resume/ beside the log)"
    if (unseen := unseen_write(root / name, what, "[run] log", pool.config.home(0))) is not None:
        raise unseen  # a resume could not find it: not a save that merely failed
    write_whole(root / LATEST, json.dumps({"step": step, "state": name}))
    seconds = time.perf_counter() - t0
    saves.saves += 1
    saves.seconds += seconds
    saves.max_seconds = max(saves.max_seconds, seconds)
    saves.last_seconds, saves.last_end = seconds, time.monotonic()
    saves.step = step
    # every file, a TP > 1 state's shard folders (`tp-<K>/`) included
    saves.bytes = sum(f.stat().st_size for f in (root / name).rglob("*") if f.is_file())
    for old in root.glob("state-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def _code_files(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _code_fix(old: Any, changed: list[str], *, new_files: bool) -> str:
    """What a refusal of the reward's code says to do: restore the changed files as the run had
    them — and, with `new_files` (the record held the modules the reward imports: a file it
    lacks is one the killed run did not have), remove those it did not have (it said "restore
    my_overrides.py as the run had it" of a file written since the kill)."""
    was = _code_files(old)
    added = [
        f for f in changed if new_files and f not in was and not f.startswith(f"{BUILTIN_MODULE}:")
    ]
    parts = []
    for verb, files, suffix in (
        ("restore", [f for f in changed if f not in added], " as the run had it"),
        ("remove", added, f": the run being resumed had no such file{'s' * (len(added) > 1)}"),
    ):
        if files:
            named = " and ".join(f[:_SHOWN] for f in files[:_FILES_SHOWN])
            if len(files) > _FILES_SHOWN:
                named += f" (and {len(files) - _FILES_SHOWN:,} more)"
            parts.append(f"{verb} {named}{suffix}")
    return "; " + "; ".join(parts or ["restore the reward as the run had it"])


def _changed_files(old: Any, new: Any) -> list[str]:
    """The source files whose digests differ between two `REWARD_CODE` values."""
    was, now = _code_files(old), _code_files(new)
    return [n for n in sorted(was.keys() | now.keys()) if was.get(n) != now.get(n)]
