"""The fault matrix's checks on a run that ended (or was killed): what every row must show.

`assert_run_sound(log, ...)` reads only what the run left — its transition log (and the segments
a resumed log chains to), its receipt, its `run.json` — and the live process table:

- the log replays clean (every segment, each ending where its successor says), and ends where
  the receipt's `log_chain` says;
- no GPU was ever owned twice: the engine's invariants hold after *every* event of the log (it
  is fed again, event by event, to an orchestrator that checks them), and at the end every GPU
  is free or the Core's — or its host is in the receipt's `unconfirmed_hosts`;
- no group was lost or trained twice: each group a done step names is consumed, by exactly one
  done step; no group is left claimed; a resumed log's header lists every group the segment
  before it left untrained (`abandoned_groups`) and none of them is reused; a step that
  stepped but whose revision was not published (it could not be saved) ends `failed` with
  its groups consumed by it: the segment's last step, the Core's version, in a run that
  ended with an error;
- no orphan: no process the run recorded (`run.json`: the run, its agents and trainers) nor any
  engine or Hybrid the log names is running — each checked by pid *and* start time — and no
  process carries the test's run id (`EHP_TEST_RUN`);
- the receipt tells the truth: its last step (the last whose revision was published),
  revision and Core version are the log's, its
  `interrupted` and `error` are what the test expected, a resumed run names the step it resumed
  from as its log's header does.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil

from ehp_fsm.core.world import Event
from ehp_fsm.embedded import Orchestrator
from ehp_fsm.replay import ReplayResult, check_receipt, replay
from ehp_fsm.runtime.identity import START_TIME_TOLERANCE_S, start_time_of

#: GPU states that mean "not held by anyone but the Core" at the end of a run
_FREE = frozenset({"free"})


def assert_run_sound(
    log: Path,
    *,
    run_id: str | None,
    interrupted: bool = False,
    error: bool = False,
    identities: Iterable[tuple[str, int, float]] = (),
) -> dict[str, Any]:
    """Every check of the module docstring; the receipt. `identities`: more (what, pid, start
    time) the test recorded while the run lived (e.g. from each killed segment's run.json)."""
    receipt = json.loads((log.parent / "receipt.json").read_text())
    result = replay(log)
    check_receipt(result, receipt)
    for seg, path in _segments(log, result):
        assert_invariants_at_every_event(path)
        assert_groups_accounted(seg, stepped_steps(path))
    assert_gpus_end_free(result, receipt)
    assert_resume_chain(result)
    assert (receipt["error"] is not None) is error, receipt["error"]
    assert receipt["interrupted"] is interrupted, receipt
    w = result.world
    done = [_step_of(s.id) for s in w.of("training_step").values() if s.state == "done"]
    unpublished = [_step_of(s) for s in _unpublished(result, stepped_steps(log))]
    assert not unpublished or error, f"steps {unpublished} failed unpublished with no error"
    start = w.config.get("core_version", 0)  # a resumed run's Core starts at its saved step
    assert receipt["last_step"] == max(done, default=start), (receipt["last_step"], done)
    assert w.globals["core_version"] == max(done + unpublished, default=start)
    assert receipt["last_revision"] == w.globals["revision"]
    resumes = (result.header.get("meta") or {}).get("resumes")
    if resumes is not None:
        assert receipt["resumed"]["from_step"] == resumes["step"]
    assert_no_orphans(log, result, run_id, identities, wait_s=5.0)
    return dict(receipt)


def _step_of(instance: str) -> int:
    """The step number of a training_step instance (`step-3`, or `step-3.1` for a retry)."""
    return int(instance.split("-", 1)[1].split(".", 1)[0])


def _segments(log: Path, result: ReplayResult) -> Iterator[tuple[ReplayResult, Path]]:
    path: Path = log
    seg: ReplayResult | None = result
    while seg is not None:
        yield seg, path
        resumes = (seg.header.get("meta") or {}).get("resumes")
        path = log.parent / resumes["log"] if resumes else path
        seg = seg.previous


def assert_invariants_at_every_event(log: Path) -> None:
    """Feed every root event of `log` to an orchestrator that checks the invariants (one owner
    per GPU, ...) after each one: `InvariantViolation` names the first event that broke one."""
    lines = log.read_bytes().splitlines()
    header = json.loads(lines[0])
    orch = Orchestrator(header["config"], check=True)
    for raw in lines[1:]:
        rec = json.loads(raw)
        if "seq" not in rec or rec.get("cause") is not None:
            continue  # a checkpoint, or a record an event cascaded
        orch.handle(
            Event(
                rec["machine"],
                rec["instance"],
                rec["event"],
                rec["time"],
                rec["payload"],
                rec["correlation"],
            )
        )


def assert_gpus_end_free(result: ReplayResult, receipt: dict[str, Any]) -> None:
    """At the end every GPU is free or the Core's, or its host is one the receipt names as
    not confirmed stopped."""
    unconfirmed = set(receipt.get("unconfirmed_hosts") or ())
    for g in result.world.of("gpu").values():
        if g.state in _FREE or g.get("owner") == "core":
            continue
        assert g.get("host") in unconfirmed, (g.id, g.state, g.data, receipt)


def stepped_steps(log: Path) -> set[str]:
    """The training_step instances whose `stepped` (the optimizer stepped) `log` accepted."""
    out = set()
    for raw in log.read_bytes().splitlines()[1:]:
        rec = json.loads(raw)
        step = rec.get("machine") == "training_step" and rec.get("event") == "stepped"
        if step and rec.get("accepted"):
            out.add(str(rec["instance"]))
    return out


def _unpublished(seg: ReplayResult, stepped: set[str]) -> list[str]:
    """The steps that stepped (`stepped_steps`) and then failed: their revision was not
    published (it could not be saved), the run stopped. Or that stepped and are still
    `publishing` where the log ends: the log itself could not be written on (past the
    file-size limit, a full disk), so the step's failure could not be recorded (the resume goes
    on from the Core state saved at that step: `Job.save_after_error`)."""
    return [
        s.id
        for s in seg.world.of("training_step").values()
        if s.state in ("failed", "publishing") and s.id in stepped
    ]


def assert_groups_accounted(seg: ReplayResult, stepped: set[str] | None = None) -> None:
    """Each group a done step names was consumed, by that step alone; none is left claimed. A
    step that stepped (`stepped`: its ids) and failed — its revision was not published — keeps
    its groups consumed: at most one, the segment's last (its number the Core's version)."""
    w = seg.world
    unpublished = _unpublished(seg, stepped or set())
    assert len(unpublished) <= 1, f"steps that stepped and failed: {unpublished}"
    for sid in unpublished:
        n = _step_of(sid)
        assert w.globals["core_version"] == n, (sid, w.globals["core_version"])
        later = [s for s in w.of("training_step") if _step_of(s) > n]
        assert not later, f"steps after {sid}, which stepped and failed: {later}"
    named = Counter(
        str(x)
        for s in w.of("training_step").values()
        if s.state == "done" or s.id in unpublished
        for x in s.get("groups")
    )
    twice = [g for g, n in named.items() if n > 1]
    assert not twice, f"groups trained twice: {twice}"
    for gid in named:
        r = w.get("request", gid)
        assert r is not None and r.state == "consumed", (gid, r)
        step = w.get("training_step", str(r.get("consumed_by")))
        finished = step is not None and (step.state == "done" or step.id in unpublished)
        assert finished and gid in step.get("groups"), gid
    consumed = {g for g, r in w.of("request").items() if r.state == "consumed"}
    assert consumed == set(named), consumed ^ set(named)
    claimed = [g for g, r in w.of("request").items() if r.state == "claimed"]
    spec = w.specs["training_step"]
    open_steps = [s.id for s in w.of("training_step").values() if s.state not in spec.terminal]
    assert not claimed or open_steps, f"groups claimed by no open step: {claimed}"


def assert_resume_chain(result: ReplayResult) -> None:
    """A resumed segment lists what the one before left untrained, and reuses no group id."""
    seg: ReplayResult | None = result
    while seg is not None and seg.previous is not None:
        resumes = seg.header["meta"]["resumes"]
        before = seg.previous.world.of("request")
        untrained = sorted(g for g, r in before.items() if r.state != "consumed")
        assert resumes["abandoned_groups"] == untrained
        assert not set(seg.world.of("request")) & set(before), "a group id was reused"
        assert seg.world.config.get("core_version", 0) == resumes["step"]
        # never from a step the Core of the segment before did not reach
        assert resumes["step"] <= seg.previous.world.globals["core_version"], resumes
        # a step the log before left `publishing` stepped on its groups (consumed there): the
        # resume goes on from that step's Core, else their training was lost
        for s in seg.previous.world.of("training_step").values():
            if s.state == "publishing":
                assert resumes["step"] == _step_of(s.id), (s.id, resumes)
        seg = seg.previous


def recorded_identities(run_dir: Path) -> list[tuple[str, int, float]]:
    """(what, pid, start time) of every process `run.json` and the agents' state files name."""
    out = []
    doc = json.loads((run_dir / "run.json").read_text())
    out.append(("run", int(doc["run"]["pid"]), float(doc["run"]["start_time"])))
    for kind in ("agents", "trainers"):
        for k, i in doc[kind].items():
            out.append((f"{kind} {k}", int(i["pid"]), float(i["start_time"])))
    for f in (run_dir / "agents").glob("*/processes.json"):
        for e in json.loads(f.read_text()):
            if "pid" in e:
                out.append((str(e.get("instance")), int(e["pid"]), float(e["start_time"])))
    return out


def _logged_identities(result: ReplayResult) -> list[tuple[str, int, float]]:
    out = []
    seg: ReplayResult | None = result
    while seg is not None:
        for m in ("rollout_engine", "hybrid_replica"):
            for inst in seg.world.of(m).values():
                ident = inst.get("identity")
                if ident:
                    what = f"{m} {inst.id}"
                    out.append((what, int(ident["pid"]), float(ident["start_time"])))
        seg = seg.previous
    return out


def running(pid: int, start_time: float) -> bool:
    """Whether `pid` still names the process that started at `start_time` (not a zombie)."""
    try:
        p = psutil.Process(pid)
        same = abs(start_time_of(pid) - start_time) <= START_TIME_TOLERANCE_S
        return same and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def processes_of_test(run_id: str) -> list[psutil.Process]:
    """Live processes carrying this test's run id."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("EHP_TEST_RUN") == run_id and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def assert_no_orphans(
    log: Path,
    result: ReplayResult,
    run_id: str | None,
    identities: Iterable[tuple[str, int, float]] = (),
    *,
    wait_s: float = 0.0,
) -> None:
    """No process the run recorded or the log names runs (by pid and start time); none
    carries the test's run id. `wait_s`: how long stops may still take."""
    every = [*recorded_identities(log.parent), *_logged_identities(result), *identities]
    every = [x for x in every if x[1] != os.getpid()]  # a run in this process (`job.run`)
    end = time.monotonic() + wait_s
    while True:
        alive = [x for x in every if running(x[1], x[2])]
        strays = processes_of_test(run_id) if run_id is not None else []
        if not alive and not strays:
            return
        assert time.monotonic() < end, (alive, [p.cmdline() for p in strays])
        time.sleep(0.2)
