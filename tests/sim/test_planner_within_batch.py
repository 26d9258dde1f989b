"""The planner borrows no more Hybrids than the fixed batch has groups for beyond the Core:
with G = 2 groups, Core DP 1 and max_hybrids 2 it borrowed 2 (3 replicas for 2 groups: equal
predicted times picked the most replicas) and the next step's partition raised PartitionError —
in `ehp-fsm run` too (`run.step._attempt`). Found by the fault-hunt review (h-hunt)."""

from __future__ import annotations

from pathlib import Path

from ehp_fsm.plan import load_plan
from ehp_fsm.sim.story import Simulation

PLAN = """
[run]
name = "over"
seed = 0
log = "runs/over/transitions.jsonl"
[[hosts]]
id = "h0"
gpus = 1
[[hosts]]
id = "h1"
gpus = 3
[core]
dp = 1
gpus = ["h0:g0"]
[[engines]]
id = "e0"
host = "h1"
tp = 1
[[engines]]
id = "e1"
host = "h1"
tp = 1
[[engines]]
id = "e2"
host = "h1"
tp = 1
[rollout]
reserve = 0
[grpo]
prompts_per_step = 2
group_size = 8
steps = 4
[ehp]
borrow_threshold = 0.01
release_threshold = 0.001
max_hybrids = 2
[simulate]
train_s_per_sample = 1.0
response_max_tokens = 64
"""


def test_the_planner_borrows_no_more_hybrids_than_the_batch_has_groups(tmp_path: Path) -> None:
    path = tmp_path / "over.toml"
    path.write_text(PLAN, encoding="utf-8")
    r = Simulation(load_plan(path), seed=0, steps=4, log_path=tmp_path / "t.jsonl").run()
    assert len(r.figures) == 4
    assert all(1 + f.hybrids <= 2 for f in r.figures), [f.hybrids for f in r.figures]
    assert r.borrows, "the step is training-bound: it should still borrow one Hybrid"
