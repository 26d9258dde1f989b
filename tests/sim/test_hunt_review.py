"""Findings of a fault hunt over `ehp-fsm simulate` (plans under corners the examples do not
reach), each a whole simulated run: the real controller, planner and dispatcher in virtual time;
only the far edge (agents, engine processes, trainer ranks) is simulated, as in every test of
`tests/sim/`."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.plan import load_plan
from ehp_fsm.replay import replay
from ehp_fsm.sim.cluster import scale
from ehp_fsm.sim.story import Simulation

GPU_PLAN = Path(__file__).parents[2] / "examples" / "gpu-4x8.toml"


def _one_group_per_core_replica(tmp_path: Path) -> Path:
    """examples/gpu-4x8.toml with G = Core DP = 4: one group per Core replica a step."""
    text = GPU_PLAN.read_text(encoding="utf-8")
    assert "prompts_per_step = 64\n" in text
    plan = tmp_path / "g4.toml"
    plan.write_text(text.replace("prompts_per_step = 64\n", "prompts_per_step = 4\n"), "utf-8")
    return plan


def test_hosts_that_repeat_the_core_host_keep_a_group_per_core_replica(tmp_path: Path) -> None:
    """`--hosts 5` of a 4-host plan repeats the Core's host n0 (DP 4 → 8) but scaled the
    batch by 5/4 (4 → 5 groups): a plan that runs at its own size failed its first step with
    "5 groups cannot give work to 8 live replicas" (`ehp-fsm simulate PLAN --hosts 5 --ehp
    off`)."""
    big = scale(load_plan(_one_group_per_core_replica(tmp_path)), 5)
    assert big.core.dp == 8
    assert big.grpo.prompts_per_step >= big.core.dp
    log = tmp_path / "out" / "transitions.jsonl"
    r = Simulation(big, seed=0, ehp=False, steps=1, log_path=log).run()
    assert len(r.figures) == 1 and r.hosts == 5
    assert replay(log).transitions == r.transitions


def test_hosts_at_a_multiple_of_the_plan_scale_the_batch_as_before() -> None:
    """The floor only lifts a batch below the Core's DP: at a multiple of the plan's hosts (and
    for the examples at any size) G is the plan's times the factor, as before."""
    plan = load_plan(GPU_PLAN)
    assert scale(plan, 8).grpo.prompts_per_step == 128
    assert scale(plan, 5).grpo.prompts_per_step == 80


#: Corners no other plan of `tests/sim/` reaches at once: engines of TP 1, 2, 4 and 8 mixed
#: (one TP 8 alone on its host, a TP 4 beside the Core), a Core of TP 2 × DP 2, rollout reserve
#: 0, `max_hybrids` at its bound (32), staleness bound 0 (rollout does not overlap training).
MIXED = """
[run]
name = "mixtp"
seed = 0
log = "runs/mixtp/transitions.jsonl"
[[hosts]]
id = "h0"
gpus = 8
[[hosts]]
id = "h1"
gpus = 8
[[hosts]]
id = "h2"
gpus = 8
[core]
backend = "megatron"
tp = 2
dp = 2
gpus = ["h0:g0", "h0:g1", "h0:g2", "h0:g3"]
[[engines]]
id = "e0"
host = "h0"
tp = 4
[[engines]]
id = "e1"
host = "h1"
tp = 8
[[engines]]
id = "e2"
host = "h2"
tp = 1
[[engines]]
id = "e3"
host = "h2"
tp = 1
[[engines]]
id = "e4"
host = "h2"
tp = 2
[[engines]]
id = "e5"
host = "h2"
tp = 4
[rollout]
reserve = 0
allowed_tp = [1, 2, 4, 8]
[grpo]
prompts_per_step = 40
group_size = 4
steps = 8
max_staleness = 0
[ehp]
max_hybrids = 32
cooldown_s = 0.0
[simulate]
train_s_per_sample = 3.0
"""


@pytest.mark.parametrize("seed", [0, 6])
def test_mixed_tp_reserve_0_max_hybrids_staleness_0_under_heavy_faults(
    tmp_path: Path, seed: int
) -> None:
    """Seeds 0 and 6 borrow and lose Hybrids (and seed 6 an engine) under heavy faults: every
    invariant holds at every event, the log replays, and the GPU time by role covers every
    GPU for the whole run."""
    path = tmp_path / "mixtp.toml"
    path.write_text(MIXED, encoding="utf-8")
    log = tmp_path / "t.jsonl"
    r = Simulation(load_plan(path), seed=seed, faults="heavy", steps=8, log_path=log).run()
    assert len(r.figures) == 8
    assert r.borrows and r.faults_seen.get("hybrid_death", 0) >= 1, (r.borrows, r.faults_seen)
    assert replay(log).transitions == r.transitions
    assert sum(r.gpu_s.values()) == pytest.approx(r.gpus * r.virtual_s, rel=1e-9)


def _short_with(tmp_path: Path, simulate: str) -> Path:
    """examples/short.toml (3 TP 1 engines, one Core GPU) with `simulate` as its [simulate]."""
    text = (GPU_PLAN.parent / "short.toml").read_text(encoding="utf-8")
    plan = tmp_path / "short.toml"
    plan.write_text(f"{text}\n[simulate]\n{simulate}\n", encoding="utf-8")
    return plan


def test_a_hunt_counts_a_run_whose_engines_all_died_of_faults_at_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every engine killed by a simulated GPU fault before it served is a run `ehp-fsm run`
    stops too (it trains only once every engine serves), as a run whose engines all die later
    is: the hunt counted the later one and said "seed 0 breaks: no engine came up" of this
    one, a finding in the controller that was none."""
    plan = _short_with(tmp_path, "gpu_fault_per_hour = 1e6\nengine_start_s = 60.0")
    argv = ["simulate", str(plan), "--steps", "1", "--faults", "heavy", "--seeds", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "breaks" not in out, out
    assert "fault hunt: 2 seeds, no invariant broken" in out and "2 runs stopped by design" in out
    assert "seed 0: the run stopped as `ehp-fsm run` would: no engine came up" in out, out


def test_engines_that_outlive_their_deadlines_are_still_the_hunts_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Engines failed by their install deadline (no fault) are the cost model's: the hunt
    still reports the seed, with what to change."""
    plan = _short_with(tmp_path, "model_gb = 1e6\ngpu_fault_per_hour = 0.0")
    argv = ["simulate", str(plan), "--steps", "1", "--faults", "heavy", "--seeds", "2"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "fault hunt: seed 0 breaks: no engine came up" in out, out
    assert "model_gb / install_gb_per_s" in out, out
