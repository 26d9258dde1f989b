"""Scenarios whose transition logs are committed as golden logs beside the tests.

Run `python -m tests.golden.scenarios` (with `EHP_LOG_KEY` unset: golden logs are unkeyed) to
regenerate the files after an intended spec change
(and review the diff: a golden log changing is a behaviour change).

`borrow_and_return.unversioned.jsonl` is the same log in the format written before the header
recorded the ehp-fsm version (`ehp_fsm_version`, since 0.1.1): the golden log as that code wrote
it (byte for byte what `logedit.without_version` derives from today's, which is how it is
regenerated with the others), kept so that logs without the field are known to replay.
"""

from __future__ import annotations

from pathlib import Path

from tests.core.scenario import Scenario, identity

HERE = Path(__file__).resolve().parent


def train_step(s: Scenario, step: int, groups: list[str], replicas: list[str]) -> None:
    sid = f"step-{step}"
    s.ok("training_step", sid, "begin", step=step)
    part = {r: groups[i :: len(replicas)] for i, r in enumerate(replicas)}
    s.ok("training_step", sid, "partition", groups=groups, partition=part)
    s.ok("training_step", sid, "delivered", replicas=replicas)
    s.ok("training_step", sid, "reduced")
    s.ok("training_step", sid, "stepped", version=step)
    rev = step + 1
    s.ok("revision", f"r{rev}", "save", revision=rev, step=step)
    s.ok("revision", f"r{rev}", "saved", checksum=f"sum{rev}", path=f"/revisions/{rev}")
    s.ok("revision", f"r{rev}", "publish")
    s.ok("training_step", sid, "published", revision=rev)


def borrow_and_return(
    log: Path, *, checkpoint_every: int | None = None, forget_finished: bool = True
) -> Scenario:
    """Three engines serve; step 1 Core-only; e1 is drained and its GPU borrowed by Hybrid x0
    for step 2; x0 leaves and e1's GPU comes back as a new engine e3 that installs the newest
    revision before serving. Includes refused events (a recycled pid, a premature activation).
    `forget_finished`: the orchestrator's (`Scenario`)."""
    s = Scenario(log_path=log, checkpoint_every=checkpoint_every, forget_finished=forget_finished)
    s.serving_engine("e0", "h1:g0")
    s.serving_engine("e1", "h1:g1")
    s.serving_engine("e2", "h2:g0", host="h2")
    train_step(s, 1, s.completed_groups(8, "e0", "a"), ["core:0", "core:1"])
    for e in ("e0", "e1", "e2"):
        s.ok("rollout_engine", e, "installed", revision=2)
    # borrow e1's GPU
    s.ok("request", "b0", "enqueue", prompt="2+2=")
    s.ok("request", "b0", "dispatch", engine="e1")
    s.ok("rollout_engine", "e1", "drain")
    s.ok("rollout_engine", "e1", "drained")
    s.no("rollout_engine", "e1", "exited", identity=identity("h1", "t-e1", start=77.0))
    s.ok("rollout_engine", "e1", "exited", identity=identity("h1", "t-e1"))
    s.confirm_free("h1:g1", "engine:e1")
    s.ok("hybrid_replica", "x0", "request")
    s.ok("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g1"])
    s.ok("hybrid_replica", "x0", "launch", token="t-x0")
    s.ok("hybrid_replica", "x0", "launched", identity=identity("h1", "t-x0", pid=300))
    s.ok("hybrid_replica", "x0", "loaded", version=1)
    s.ok("hybrid_replica", "x0", "activate")
    groups = [*s.completed_groups(7, "e0", "c"), "b0"]
    s.ok("request", "b0", "dispatch", engine="e2")
    s.ok("request", "b0", "complete", engine="e2", revision=2)
    train_step(s, 2, groups, ["core:0", "core:1", "hybrid:x0"])
    # return
    s.ok("hybrid_replica", "x0", "leave")
    s.ok("hybrid_replica", "x0", "exited", identity=identity("h1", "t-x0", pid=300))
    s.confirm_free("h1:g1", "hybrid:x0")
    s.ok("rollout_engine", "e3", "launch", host="h1", gpus=["h1:g1"], tp=1, token="t-e3")
    s.ok("rollout_engine", "e3", "healthy", identity=identity("h1", "t-e3", pid=400))
    s.no("rollout_engine", "e3", "installed", revision=2)
    s.ok("rollout_engine", "e3", "installed", revision=3)
    s.engine.close()
    return s


GOLDEN = {"borrow_and_return.jsonl": borrow_and_return}
#: Golden logs in the format before the header recorded the version: (file, derived from)
UNVERSIONED = {"borrow_and_return.unversioned.jsonl": "borrow_and_return.jsonl"}

if __name__ == "__main__":
    from tests.core.logedit import without_version

    for name, make in GOLDEN.items():
        make(HERE / name)
        print(f"wrote {HERE / name}")
    for name, source in UNVERSIONED.items():
        lines = (HERE / source).read_text().splitlines(keepends=True)
        (HERE / name).write_text("".join(without_version(lines)))
        print(f"wrote {HERE / name}")
