"""Run a function on N real processes joined by a torch.distributed Gloo group (file rendezvous).

Each rank's return value (tensors, numbers, strings, in dicts/lists) is saved with torch.save and
loaded with `weights_only=True` (no pickle of arbitrary objects); a rank that raises or hangs
fails the test with its exit code.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _entry(
    fn: Callable[..., Any], rank: int, world: int, tmp: str, args: tuple[Any, ...], dump_s: float
) -> None:
    torch.set_num_threads(1)
    # A rank still running near the deadline prints every thread's stack and exits: a hang
    # (e.g. a collective one rank never reached) is then named by where each rank waited.
    faulthandler.dump_traceback_later(dump_s, exit=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        os._exit(3)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is saved and every rank passed the barrier: leave without the interpreter's
    # finalization, where Gloo's C++ threads can abort the process (SIGABRT, "terminate called
    # without an active exception"; pytorch/pytorch#179291) — once in ~12 CI runs, after the
    # rank's work had passed. What the ranks did is this harness's subject, not torch's exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def forked_from_preloaded_server() -> Any:
    """The multiprocessing context the harnesses start their ranks with: `forkserver`, whose
    server (a fresh, single-threaded process of its own, started once per test process) has
    imported torch; each rank is forked from it. A `spawn` context re-imported torch in every
    rank (~1.5 s of CPU each); what a rank imports after that, and in which order (the Megatron
    harness applies the CPU compatibility layer before Megatron is imported, as a trainer
    worker does), is unchanged. Nothing of the test process is inherited, as with `spawn`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def run_ranks(
    fn: Callable[..., Any], world: int, tmp: Path, *args: Any, timeout: float = 80.0
) -> list[Any]:
    ctx = forked_from_preloaded_server()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, str(tmp), args, max(1.0, timeout - 5)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        end = time.monotonic() + timeout  # one deadline for all ranks, not `timeout` each
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        codes = [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not hung, f"ranks {hung} still running after {timeout} s"
    assert codes == [0] * world, f"rank exit codes {codes} (tracebacks are in stderr above)"
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(world)]
