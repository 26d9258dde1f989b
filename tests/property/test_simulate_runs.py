"""Any simulated run — any seed, fault level, EHP on or off, cluster size, length — keeps every
invariant at every event (the simulation raises at the first break) and writes a log that replays
to the same transitions. Few examples: each is a whole run (the far edge is simulated; the
controller is the real one)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ehp_fsm.plan import load_plan
from ehp_fsm.replay import replay
from ehp_fsm.sim.cluster import scale
from ehp_fsm.sim.story import RunStopped, Simulation

HEAVY = Path(__file__).parents[1] / "sim" / "train_heavy.toml"


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    faults=st.sampled_from(["off", "on", "heavy"]),
    ehp=st.booleans(),
    hosts=st.sampled_from([4, 8]),
    steps=st.integers(2, 8),
)
def test_any_run_keeps_the_invariants_and_replays(
    seed: int, faults: str, ehp: bool, hosts: int, steps: int
) -> None:
    plan = scale(load_plan(HEAVY), hosts)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "t.jsonl"
        sim = Simulation(plan, seed=seed, faults=faults, ehp=ehp, steps=steps, log_path=log)
        try:
            r = sim.run()
        except RunStopped:
            return  # the run's designed stop (a step failed on every attempt): no break
        assert len(r.figures) == steps
        assert replay(log).transitions == r.transitions
