"""Launch real multi-process Gloo worlds for the Megatron tests, with hard deadlines.

Each world is a set of processes (forked from a server that has imported torch:
`tests.training.harness.forked_from_preloaded_server`) with its own rendezvous on 127.0.0.1 (a
free port).
Workers apply the CPU compatibility layer, run one scenario function, and report through files
(`torch.save` / `torch.load(weights_only=True)`); nothing is pickled over a socket. Separate
worlds talk through `FileExchange`, a directory — the far edge we fake, standing in for whatever
channel (object store, socket) moves state between a Core job and a Hybrid job.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.training.harness import forked_from_preloaded_server

Scenario = Callable[["WorkerContext"], None]


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    world: str
    rank: int
    world_size: int
    out: Path

    @property
    def exchange(self) -> FileExchange:
        return FileExchange(self.out / "exchange")

    def save(self, key: str, obj: Any) -> None:
        self.exchange.put(f"{self.world}.{key}", obj)


class FileExchange:
    """Atomic put / polling get of tensor payloads in a directory (with a deadline)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, obj: Any) -> None:
        final = self.root / f"{key}.pt"
        tmp = self.root / f".{key}.{os.getpid()}.tmp"
        torch.save(obj, tmp)
        os.replace(tmp, final)

    def get(self, key: str, timeout: float = 150.0) -> Any:
        path = self.root / f"{key}.pt"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no `{key}` in {self.root} after {timeout}s")
            time.sleep(0.02)
        return torch.load(path, weights_only=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(scenario: Scenario, world: str, rank: int, size: int, port: int, out: str) -> None:
    import warnings

    # Megatron warns that Apex/TE are missing and about deprecated collectives; not our subject.
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from ehp_fsm.backends.megatron import cpu

    cpu.apply()
    ctx = WorkerContext(world=world, rank=rank, world_size=size, out=Path(out))
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=size)
        scenario(ctx)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        (Path(out) / f"error-{world}-{rank}.txt").write_text(traceback.format_exc())
        raise


def run_worlds(worlds: Sequence[tuple[str, int, Scenario]], out: Path, *, timeout: float) -> None:
    """Run every (name, size, scenario) world concurrently; fail on error or deadline."""
    ctx = forked_from_preloaded_server()
    procs = []
    for name, size, scenario in worlds:
        port = _free_port()
        for rank in range(size):
            p = ctx.Process(target=_entry, args=(scenario, name, rank, size, port, str(out)))
            p.start()
            procs.append(p)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(5)
    errors = "\n".join(f.read_text() for f in sorted(out.glob("error-*.txt")))
    if alive:
        raise AssertionError(f"{len(alive)} worker(s) still running after {timeout}s\n{errors}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"worker exit codes {bad}\n{errors}")


def load(out: Path, key: str) -> Any:
    return FileExchange(out / "exchange").get(key, timeout=0.0)
