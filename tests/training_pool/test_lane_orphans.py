"""A Megatron lane's followers go with its lane rank 0 when the coordinator is gone.

Lane rank 0 of a TP × PP > 1 lane starts the lane's other ranks as its children; they watch it,
not the coordinator. When the coordinator (the run) was killed with SIGKILL, lane rank 0 saw it
gone and exited — but said nothing to its followers, then waited 10 s for them in `close()`
before killing them: the trainer processes outlived a killed run by 12–14 s. Real processes:
a coordinator process with a real TP 2 Megatron pool, killed with SIGKILL.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.procs import still_running

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
    coord = subprocess.Popen(
        [sys.executable, "-c", _COORDINATOR, str(tmp_path / "pool"), str(tiny_model_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        assert coord.stdout is not None
        line = ""
        while not line.startswith("PIDS"):  # skip the pool's log lines
            line = coord.stdout.readline()
            assert line, "the coordinator exited before its pool started"
        pids = [int(x) for x in line.split()[1:]]
        assert len(pids) == 2  # lane rank 0 and its TP follower
    finally:
        coord.kill()
        coord.wait(10)
        if coord.stdout is not None:
            coord.stdout.close()
    killed = time.monotonic()
    # lane rank 0 looks for its coordinator once a second (its socket poll); its follower
    # then gets SIGTERM at once. Before: 10 s more (`close()` waited for it, then killed it).
    while time.monotonic() < killed + 20 and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    took = time.monotonic() - killed
    assert not still_running(pids), f"lane processes {still_running(pids)} outlived the run"
    assert took < 7.0, f"the lane's processes took {took:.1f} s to go after the coordinator"
