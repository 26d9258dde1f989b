"""Seeded, reproducible kill points drawn from the transitions of a borrow and of a return.

A kill point is "the first tick after transition T of this phase is in the controller's log"
(or `start`: the phase's first tick). T is drawn, per victim, from the transitions of the phase
at which that victim can still be killed (a clean borrow/return on the slot `h1:g0` logs them in
this order; see `BORROW` and `RETURN`). A victim that has no process yet at T is killed at the
first tick after T at which it has one.

Draws: `EHP_KILL_SEED` (default 0) seeds a `random.Random` per (victim, phase), from which
`EHP_KILL_POINTS` (default 2) distinct points are drawn (all of them when the set is smaller).
CI runs the defaults; `EHP_KILL_POINTS=99` runs every point, another seed other draws. Each
test id and failure note names the seed and the point, so a failure replays with

    EHP_KILL_SEED=<seed> pytest tests/runtime_system/test_faults.py -k '<victim>-<phase>-<point>'

Knows: the transition names of the two phases and which victim is alive at which of them; how
to read new records from a transition log (`LogTail`). Does not know: how to kill anything.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Final

START: Final = "start"
SLOT: Final = "h1:g0"

#: The transitions of a borrow of `h1:g0` in log order (`activate`, which ends it, excluded).
BORROW: Final = (
    "rollout_engine:drain",
    "rollout_engine:drained",
    "rollout_engine:exited",
    "gpu:release",
    "gpu:confirm_free",
    "hybrid_replica:request",
    "hybrid_replica:allocate",
    "gpu:assign",
    "hybrid_replica:launch",
    "hybrid_replica:launched",
    "hybrid_replica:loaded",
)
#: The transitions of a return in log order (`healthy` → `installed`, which end it, excluded:
#: the driver installs within the tick that saw `healthy`).
RETURN: Final = (
    "hybrid_replica:leave",
    "hybrid_replica:exited",
    "gpu:release",
    "gpu:confirm_free",
    "rollout_engine:launch",
    "gpu:assign",
)
PHASES: Final = {"borrow": BORROW, "return": RETURN}

#: Points at which each victim has (or is about to have) a process to kill.
ELIGIBLE: Final[dict[tuple[str, str], tuple[str, ...]]] = {
    ("agent", "borrow"): (START, *BORROW),
    ("agent", "return"): (START, *RETURN),
    ("controller", "borrow"): (START, *BORROW),
    ("controller", "return"): (START, *RETURN),
    # the serving engine until it has exited
    ("engine", "borrow"): (START, "rollout_engine:drain", "rollout_engine:drained"),
    # the relaunched engine while it starts (before it answers)
    ("engine", "return"): ("rollout_engine:launch", "gpu:assign"),
    # the new Hybrid from its launch until it is activated
    ("hybrid", "borrow"): (
        "hybrid_replica:launch",
        "hybrid_replica:launched",
        "hybrid_replica:loaded",
    ),
    # the active Hybrid until it has exited
    ("hybrid", "return"): (START, "hybrid_replica:leave"),
}


@dataclass(frozen=True, kw_only=True)
class KillPoint:
    victim: str
    phase: str
    point: str
    seed: int

    def __post_init__(self) -> None:
        if self.point not in ELIGIBLE[(self.victim, self.phase)]:
            raise ValueError(
                f"{self.point!r} is not a kill point of {self.victim} in a {self.phase}"
            )

    @property
    def id(self) -> str:
        return f"{self.victim}-{self.phase}-{self.point.replace(':', '.')}"

    def describe(self) -> str:
        return (
            f"kill point: {self.victim} killed at the first tick after {self.point!r} of the "
            f"{self.phase} (EHP_KILL_SEED={self.seed}; replay: EHP_KILL_SEED={self.seed} pytest "
            f"tests/runtime_system/test_faults.py -k '{self.id}')"
        )


def draw(
    victim: str, phase: str, *, seed: int | None = None, n: int | None = None
) -> list[KillPoint]:
    """`n` distinct kill points of `victim` in `phase`, drawn with `seed` (env defaults)."""
    seed = int(os.environ.get("EHP_KILL_SEED", "0")) if seed is None else seed
    n = int(os.environ.get("EHP_KILL_POINTS", "2")) if n is None else n
    eligible = ELIGIBLE[(victim, phase)]
    rng = random.Random(f"{seed}:{victim}:{phase}")
    points = rng.sample(eligible, min(n, len(eligible)))
    return [KillPoint(victim=victim, phase=phase, point=p, seed=seed) for p in points]


class LogTail:
    """New accepted transitions of a transition log, as `machine:event` names, since `start()`."""

    def __init__(self, path: Path, *, slot: str = SLOT) -> None:
        self.path, self.slot = path, slot
        self.offset = 0
        self.seen: list[str] = []

    def start(self) -> None:
        self.offset = self.path.stat().st_size
        self.seen = []

    def poll(self) -> list[str]:
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a record is complete once its newline is written
        self.offset += end
        new = []
        for line in data[:end].splitlines():
            rec = json.loads(line)
            if not rec.get("accepted") or rec.get("machine") == "request":
                continue
            if rec.get("machine") == "gpu" and rec.get("instance") != self.slot:
                continue
            new.append(f"{rec['machine']}:{rec['event']}")
        self.seen += new
        return new


class Trigger:
    """Armed once the point's transition has been logged in this phase (at once for `start`)."""

    def __init__(self, kp: KillPoint, log_path: Path) -> None:
        self.kp = kp
        self.tail = LogTail(log_path)
        self.armed = False

    def begin(self) -> None:
        self.tail.start()
        self.armed = self.kp.point == START

    def poll(self) -> bool:
        if not self.armed and self.kp.point in self.tail.poll():
            self.armed = True
        return self.armed
