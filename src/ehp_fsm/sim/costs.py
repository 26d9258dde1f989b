"""The cost model's draws: how long each simulated thing takes, and when faults strike.

Knows: the plan's `[simulate]` numbers (`plan.SimulateSpec`), the run's seed and fault level.
Every draw comes from `random.Random` streams seeded from (seed, purpose, index), so a group's
response lengths are the same whether EHP is on or off, and a run is the same on every machine.
Does not know the machines or the clock.
"""

from __future__ import annotations

import _random
import math
import random
from collections.abc import Callable
from typing import Final

from ehp_fsm.plan import SimulateSpec

__all__ = ["FAULT_LEVELS", "Costs"]

#: Fault rate multipliers of `--faults`: `heavy` makes a run of a few virtual hours see
#: hundreds of engine and Hybrid deaths and silent agents on a 1,024-host cluster.
FAULT_LEVELS: Final = {"off": 0.0, "on": 1.0, "heavy": 5000.0}
_GROUP_STREAM: Final = 1_000_003


#: The generator's own seeding (C), which `random.Random(n)` ends in for an int `n`: one
#: generator re-seeded per group instead of a new one built through two Python layers.
_seed: Final = _random.Random.seed
_NV_MAGICCONST: Final = 4 * math.exp(-0.5) / math.sqrt(2.0)


def _lognormvariate(random: Callable[[], float], mu: float, sigma: float) -> float:
    """`random.Random.lognormvariate(mu, sigma)` of the generator whose `random` this is, step
    for step (CPython's Kinderman-Monahan `normalvariate`, then `exp`): the same draws, without
    two method calls per draw. `tests/sim/test_lean.py` checks it against the library's."""
    log = math.log
    while True:
        u1 = random()
        u2 = 1.0 - random()
        z = _NV_MAGICCONST * (u1 - 0.5) / u2
        if z * z / 4.0 <= -log(u2):
            return math.exp(mu + z * sigma)


class Costs:
    """Durations in virtual seconds; fault arrival times."""

    def __init__(self, spec: SimulateSpec, *, seed: int, faults: str, group_size: int) -> None:
        self.spec = spec
        self.seed = seed
        self.fault_scale = FAULT_LEVELS[faults]
        self.group_size = group_size
        self.faults = random.Random(seed * 7 + 1)  # noqa: S311  # draws, not secrets
        self._mu = math.log(spec.response_median_tokens)
        self._group_rng = random.Random()  # noqa: S311  # re-seeded per group

    # -- rollout -------------------------------------------------------------------------------
    def response_lengths(self, group_index: int) -> list[int]:
        """The n response lengths of a group (its own stream: the same in every mode)."""
        s = self.spec
        rng = self._group_rng
        _seed(rng, self.seed * _GROUP_STREAM + group_index)  # as `random.Random(that)` starts
        if s.response_lengths:
            return [rng.choice(s.response_lengths) for _ in range(self.group_size)]
        cap, mu, sigma = s.response_max_tokens, self._mu, s.response_sigma
        # `_lognormvariate`, inlined: n draws without a call each (the same operations in the
        # same order, so the same numbers; `tests/sim/test_lean.py` checks against the library)
        draw, log, exp = rng.random, math.log, math.exp
        out = []
        for _ in range(self.group_size):
            while True:
                u1 = draw()
                u2 = 1.0 - draw()
                z = _NV_MAGICCONST * (u1 - 0.5) / u2
                if z * z / 4.0 <= -log(u2):
                    break
            n = round(exp(mu + z * sigma))  # `max(1, min(cap, n))`, without two calls
            out.append(n if 1 <= n <= cap else 1 if n < 1 else cap)
        return out

    def group_seconds(self, lengths: list[int], tp: int, slow: float) -> tuple[float, float]:
        """One group on one engine: (its share of the engine's decode throughput, the time
        of its longest sample at one sequence's speed)."""
        s = self.spec
        throughput = s.engine_tokens_per_s * tp**s.tp_exponent
        return slow * sum(lengths) / throughput, slow * max(lengths) / s.sequence_tokens_per_s

    # -- training ------------------------------------------------------------------------------
    def compute_seconds(self, samples: int, slow: float) -> float:
        return slow * samples * self.spec.train_s_per_sample

    def reduce_seconds(self, replicas: int) -> float:
        if replicas <= 1:
            return 0.0
        s = self.spec
        return 2.0 * s.model_gb * (replicas - 1) / replicas / s.reduce_gb_per_s

    def save_seconds(self) -> float:
        return self.spec.model_gb / self.spec.save_gb_per_s

    def install_seconds(self, slow: float) -> float:
        return slow * self.spec.model_gb / self.spec.install_gb_per_s

    def state_load_seconds(self) -> float:
        s = self.spec
        return s.model_gb * s.state_bytes_factor / s.state_gb_per_s

    # -- faults --------------------------------------------------------------------------------
    def time_to_gpu_fault(self, gpus: int) -> float | None:
        """Seconds until a process on `gpus` GPUs dies (None: never, faults off)."""
        rate = self.spec.gpu_fault_per_hour * self.fault_scale * gpus / 3600.0
        return self.faults.expovariate(rate) if rate > 0 else None

    def time_to_silence(self, hosts: int) -> float | None:
        rate = self.spec.agent_silence_per_hour * self.fault_scale * hosts / 3600.0
        return self.faults.expovariate(rate) if rate > 0 else None

    def slow_hosts(self, hosts: list[str]) -> dict[str, float]:
        """Hosts that run slow all run long, and by how much (none with faults off, and none
        at `slow_node_factor = 1`: a host at full speed was counted as a fault injected)."""
        s = self.spec
        if self.fault_scale == 0 or s.slow_node_factor == 1.0:
            return {}
        rng = random.Random(self.seed * 13 + 5)  # noqa: S311
        return {h: s.slow_node_factor for h in hosts if rng.random() < s.slow_node_fraction}
