"""`ehp-fsm replay` of simulated runs forgets finished instances: with heavy faults and EHP on
(engines fail and are replaced, Hybrids come and go, groups are requeued and expire), the
forgetting replay gives the verdict of the replay that keeps everything, and the world it holds
stays the live world's size while the log grows. Only the far edge is simulated (see
`test_simulate`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.replay import replay
from ehp_fsm.sim.story import Simulation
from tests.core.test_replay_forget import retained, same_verdict

HEAVY = Path(__file__).parent / "train_heavy.toml"


@pytest.mark.parametrize("seed", [3, 4])
def test_replay_of_a_longer_simulation_holds_no_more(tmp_path: Path, seed: int) -> None:
    held, kept = [], []
    for steps in (6, 30):
        log = tmp_path / f"{steps}" / "transitions.jsonl"
        Simulation(
            load_plan(HEAVY), seed=seed, faults="heavy", ehp=True, steps=steps, log_path=log
        ).run()
        held.append(retained(same_verdict(log)))
        kept.append(retained(replay(log)))
    assert kept[1] > 3 * kept[0]  # keeping every instance grows with the log ...
    assert held[1] <= held[0] + 8  # ... forgetting holds the live world (engines vary a little)
