"""Run a benchmark's two-rank body in two spawned processes and collect rank 0's figures.

`target(rank, tmp, *args, queue)` runs in each process (a fresh interpreter: spawn), with a
shared scratch folder `tmp` (a rendezvous file, staged data); rank 0 puts its result on `queue`.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
from collections.abc import Callable
from typing import Any


def run_two_ranks(target: Callable[..., None], *args: Any, prefix: str) -> Any:
    """Rank 0's result; the processes are joined and the scratch folder removed."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=target, args=(r, tmp, *args, q)) for r in range(2)]
        for p in procs:
            p.start()
        res = q.get(timeout=600)
        for p in procs:
            p.join(60)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
