"""A Megatron lane's followers go with its lane rank 0 when the coordinator is gone.

Lane rank 0 of a TP × PP > 1 lane starts the lane's other ranks as its children; they watch it,
not the coordinator. When the coordinator (the run) was killed with SIGKILL, lane rank 0 saw it
gone and exited — but said nothing to its followers, then waited 10 s for them in `close()`
before killing them: the trainer processes outlived a killed run by 12–14 s. Real processes:
a coordinator process with a real TP 2 Megatron pool, killed with SIGKILL.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.procs import pids_of_a_killed_coordinator, running_after

_COORDINATOR = """
import sys, time
import psutil
from pathlib import Path
from ehp_fsm.training.pool import PoolConfig, TrainerPool
config = PoolConfig(model=sys.argv[2], backend="megatron", tp=2, max_hybrids=0)
pool = TrainerPool.spawn(config, work_dir=Path(sys.argv[1]), start_timeout_s=200)
pids = [w.identity.pid for w in pool.workers]
pids += [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]
print("PIDS", *pids, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lanes_followers_exit_soon_after_its_coordinator_dies(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    pids = pids_of_a_killed_coordinator(_COORDINATOR, str(tmp_path / "pool"), str(tiny_model_dir))
    assert len(pids) == 2  # lane rank 0 and its TP follower
    killed = time.monotonic()
    # lane rank 0 looks for its coordinator once a second (its socket poll); its follower
    # then gets SIGTERM at once. Before: 10 s more (`close()` waited for it, then killed it).
    left = running_after(pids, 20.0)
    took = time.monotonic() - killed
    assert not left, f"lane processes {left} outlived the run"
    assert took < 7.0, f"the lane's processes took {took:.1f} s to go after the coordinator"
