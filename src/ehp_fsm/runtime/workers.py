"""What an agent launches for each role: the argv of the process, and a Hybrid stand-in.

Knows: the roles the machines name in their `launch` commands (`rollout_engine`,
`hybrid_replica`, and `core_trainer` for embedding code that asks agents to start Core ranks),
how a role becomes an argv (`WorkerRegistry`), and the environment every launched process gets
(`EHP_LAUNCH_TOKEN`, `EHP_HOST_ID`, `EHP_GPUS`, `EHP_INSTANCE`, `CUDA_VISIBLE_DEVICES` on GPUs).
One more role, `pool_worker` (a trainer pool's rank that must run on this host), has no entry in
the registry: its argv is the pool's own worker command line, built by the agent from the
launch's `trainer` field (`runtime.pool_launch`), never from an argv the controller sends.

Does not know: process supervision (the agent owns that), the engine world, or training. The
`hybrid` stand-in below is a minimal *real* process — it starts, reports readiness on stdout,
and exits 0 on SIGTERM — used only until the real trainer worker exists; the embedding run
registers the real trainer argv with `WorkerRegistry.register("hybrid_replica", argv_fn)`.

Rollout engines are not started from an argv here: the agent starts them with
`ehp_fsm.rollout.launch.launch_engine` (which waits for the engine's HTTP endpoint). A registry
may replace that with an argv (`register("rollout_engine", ...)`); the Hypothesis fault test does
so to keep each example cheap, and says so.

Run the stand-in by hand:  python -m ehp_fsm.runtime.workers hybrid --instance x0
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Final

from ehp_fsm.errors import EhpError

ROLE_ENGINE: Final = "rollout_engine"
ROLE_HYBRID: Final = "hybrid_replica"
ROLE_CORE: Final = "core_trainer"
ROLES: Final = (ROLE_ENGINE, ROLE_HYBRID, ROLE_CORE)
#: A trainer pool's worker (a warm Hybrid rank) launched on this host for the run's pool. Its
#: `launch` carries a `trainer` field; the name is also the `machine` of its launch and events
#: (it is no machine of the engine world: the controller hands its news to the run's pool).
ROLE_POOL_WORKER: Final = "pool_worker"


class WorkerError(EhpError):
    """A role has no launcher, or a launch request names something this agent cannot start."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """Everything a launcher needs to build one process's argv and environment."""

    role: str
    machine: str
    instance: str
    host_id: str
    gpus: tuple[str, ...]
    token: str
    device: str = "cpu"  # "cpu" (slots) or "cuda"
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.token:
            raise WorkerError(
                f"launch of {self.machine} {self.instance!r} has no token",
                "the token is how the controller recognises its own process",
                "pass the token from the machine's `launch` command",
            )
        if self.device not in ("cpu", "cuda"):
            raise WorkerError(
                f"device {self.device!r} is invalid", "agents run cpu slots or cuda devices", ""
            )

    def env(self) -> dict[str, str]:
        """The environment additions of the launched process."""
        out = {
            "EHP_LAUNCH_TOKEN": self.token,
            "EHP_HOST_ID": self.host_id,
            "EHP_GPUS": ",".join(self.gpus),
            "EHP_INSTANCE": self.instance,
            "EHP_ROLE": self.role,
        }
        if self.device == "cuda" and (self.gpus or self.role != ROLE_POOL_WORKER):
            # `h1:g3` → CUDA device 3: the slot index is the device index on its host. A warm
            # pool worker launched on no GPU sees the host's devices: it holds none until the
            # pool activates it on the GPUs its Hybrid borrowed.
            out["CUDA_VISIBLE_DEVICES"] = ",".join(g.rsplit(":g", 1)[-1] for g in self.gpus)
        out.update(self.extra)
        return out


ArgvFn = Callable[[LaunchSpec], list[str]]


def hybrid_standin_argv(spec: LaunchSpec) -> list[str]:
    """The stand-in Hybrid replica: a real process that idles until SIGTERM."""
    return [sys.executable, "-m", "ehp_fsm.runtime.workers", "hybrid", "--instance", spec.instance]


def engine_standin_argv(spec: LaunchSpec) -> list[str]:
    """A stand-in for a rollout engine (same idle process). Only for tests that must not pay
    an engine start per example; the agent's default starts the real embedded engine."""
    return [sys.executable, "-m", "ehp_fsm.runtime.workers", "engine", "--instance", spec.instance]


class WorkerRegistry:
    """role → argv builder. `rollout_engine` is absent by default: the agent then starts the
    embedded engine through `rollout.launch`."""

    def __init__(self, launchers: Mapping[str, ArgvFn] | None = None) -> None:
        self._launchers: dict[str, ArgvFn] = {ROLE_HYBRID: hybrid_standin_argv}
        if launchers:
            self._launchers.update(launchers)

    def register(self, role: str, argv_fn: ArgvFn) -> None:
        if role == ROLE_POOL_WORKER:
            raise WorkerError(
                f"role {role!r} cannot be given an argv",
                "a pool worker runs the pool's own command line, built from its launch's "
                "`trainer` field (runtime.pool_launch)",
                "launch it with a `trainer` field instead",
            )
        if role not in ROLES:
            raise WorkerError(
                f"unknown role {role!r}", f"roles are {list(ROLES)}", "register one of those"
            )
        self._launchers[role] = argv_fn

    def has(self, role: str) -> bool:
        return role in self._launchers

    def argv(self, spec: LaunchSpec) -> list[str]:
        fn = self._launchers.get(spec.role)
        if fn is None:
            raise WorkerError(
                f"no launcher for role {spec.role!r}",
                "the agent only starts roles it has an argv for",
                f"register one with WorkerRegistry.register({spec.role!r}, argv_fn)",
            )
        return fn(spec)

    @classmethod
    def from_names(cls, names: Sequence[str]) -> WorkerRegistry:
        """Build from `role=standin` strings (the agent's `--standin ROLE` flag)."""
        reg = cls()
        for name in names:
            if name == ROLE_ENGINE:
                reg.register(ROLE_ENGINE, engine_standin_argv)
            elif name == ROLE_HYBRID:
                reg.register(ROLE_HYBRID, hybrid_standin_argv)
            else:
                raise WorkerError(
                    f"no stand-in for role {name!r}",
                    f"stand-ins exist for {[ROLE_ENGINE, ROLE_HYBRID]}",
                    "drop the flag or name one of those",
                )
        return reg


# ---- the stand-in process --------------------------------------------------------------------

_stop = False


def _on_term(signum: int, frame: FrameType | None) -> None:
    global _stop
    _stop = True


def standin_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ehp-fsm-worker")
    parser.add_argument("role", choices=("hybrid", "engine"))
    parser.add_argument("--instance", default="?")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    # not its launch token: its output goes to a log file (the token is a secret: `run.owned`)
    print(f"ready role={args.role} instance={args.instance} pid={os.getpid()}", flush=True)
    while not _stop:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(standin_main())
