"""The planner's step-time prediction: what a move would make of the next step — pure.

Why: a planner that only reacts to the last step's train/rollout ratio overshoots whenever one
move carries the ratio across both hysteresis thresholds. On a balanced plan (gpu-4x8 at 1,024
hosts) borrowing `max_hybrids` halved training, rollout on the remaining engines became the
bottleneck, the ratio fell under the release threshold, everything went back, and again: 2,560
borrows and 1,280 returns in 10 steps, slower than no EHP (benchmarks/simulate-2026-12-02.md).
Predicting the step a move leads to lets the planner size the move instead.

What it knows: how the last step's measured times scale with the two things a move changes.
* Training: the fixed global batch of G groups is split over the training replicas by
  `core.batch.partition_groups` (capacity 1 each, Core and Hybrid alike: every replica gets
  floor or ceil of G/N groups), and the step waits for the replica with the most. So training
  time scales with ceil(G/N); with G unknown (0) with 1/N.
* Rollout: with the physical GPUs of the engines that serve (the measured throughput per GPU).
* The step: with rollout overlapping training (max_staleness >= 1) the longer of the two,
  otherwise their sum.
Predictions are relative to the measured step (`StepModel`'s basis), so a model that is exact
for a cluster predicts the same times from every basis: a move it takes is one it would not
undo with the same workload (see tests/property/test_planner_thrash.py).

What it does not know: the cluster, actions, clocks; fixed per-step costs (reduction,
optimizer, save) are counted as if they scaled with training too.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from ehp_fsm.core.planner_model import ClusterView

__all__ = ["KEPT_UP", "Prediction", "RolloutPace", "StepModel", "StepTimes", "shape_of"]


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted times of the next step with `replicas` training replicas and `gpus` serving
    rollout GPUs."""

    replicas: int
    gpus: float  # an estimate may be fractional (an average cost per replica)
    train_s: float
    rollout_s: float
    step_s: float

    def describe(self) -> str:
        return (
            f"{self.step_s:.4g} s (train {self.train_s:.4g} s on {self.replicas} replicas, "
            f"rollout {self.rollout_s:.4g} s on {self.gpus:.4g} GPUs)"
        )


@dataclass(frozen=True, slots=True)
class StepModel:
    """The measured step and what it ran on: the basis every prediction scales from.

    `train_replicas`: replicas that trained in the measured step (Core plus active Hybrids).
    `rollout_gpus`: physical GPUs of the engines that served its rollout. `groups`: G, the
    groups of one step (0: unknown). `overlapped`: rollout runs during training.
    """

    train_s: float
    rollout_s: float
    train_replicas: int
    rollout_gpus: int
    groups: int
    overlapped: bool

    def load(self, replicas: int) -> float:
        """The largest share of the batch one of `replicas` replicas trains (in groups)."""
        n = max(replicas, 1)
        if self.groups <= 0:
            return 1.0 / n
        return float(math.ceil(self.groups / n))

    def predict(self, replicas: int, gpus: float) -> Prediction:
        train = self.train_s * self.load(replicas) / self.load(self.train_replicas)
        rollout = self._rollout(gpus)
        step = max(train, rollout) if self.overlapped else train + rollout
        return Prediction(replicas, gpus, train, rollout, step)

    def _rollout(self, gpus: float) -> float:
        """Rollout time scales with 1/serving GPUs. With no GPU after a move that had some
        before, rollout never ends (inf); with none measured, the measured time is per GPU."""
        base = self.rollout_gpus
        if gpus == base:
            return self.rollout_s
        if gpus <= 0:
            return math.inf if base > 0 else self.rollout_s
        return self.rollout_s * max(base, 1) / gpus


def shape_of(view: ClusterView) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a step's times depend on that a move changes: the active Hybrids and the engines
    that serve (or briefly update to a new revision)."""
    return (
        tuple(h.hybrid_id for h in view.hybrids if h.state == "active"),
        tuple(e.engine_id for e in view.engines if e.state in ("serving", "updating")),
    )


class StepTimes:
    """The times the planner decides from: the median of the last `window` steps measured with
    the cluster's current shape (`shape_of`); a change of shape starts afresh.

    Why: one step's times are noisy — an install, a slow engine, a busy machine — and the
    prediction scales them to size a move, so one outlier could trigger a return whose engine
    restart costs far more than it saves (in a default run on a loaded machine: a return on a
    step whose rollout wait was twice its neighbours', an engine restart of 24 s, and the same
    borrow again right after). Times from another shape are not mixed in: the prediction's basis
    is one shape. A decision is never delayed: the first step of a shape counts alone, the
    second with it (their mean), and from the third on one outlier among the last three is
    outvoted.
    """

    def __init__(self, window: int = 3) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._shape: object = None
        self._train: deque[float] = deque(maxlen=window)
        self._rollout: deque[float] = deque(maxlen=window)

    def add(self, shape: object, train_s: float, rollout_s: float) -> tuple[float, float]:
        """Record one step measured with `shape`; return the (train, rollout) seconds to decide
        from."""
        if shape != self._shape:
            self._shape = shape
            self._train.clear()
            self._rollout.clear()
        self._train.append(train_s)
        self._rollout.append(rollout_s)
        return statistics.median(self._train), statistics.median(self._rollout)


#: A wait for groups at most this share of the step's training says rollout kept up: it tells
#: nothing of how much time rollout had to spare (`RolloutPace`).
KEPT_UP = 0.05


class RolloutPace:
    """The rollout time the planner predicts from: the step's wait for its groups — unless
    rollout kept up (a wait of at most `KEPT_UP` of the step's training), then the time the
    serving engines take to generate one step's G groups at the pace they generated since the
    last decision.

    Why not the wait alone: with rollout overlapping training (max_staleness >= 1) a step's
    groups are mostly made while the previous step trains, so while rollout keeps up the wait
    is near 0 (2e-5 to 4e-5 s measured on the CPU demo) and `StepModel` — step = max(train,
    rollout) — predicted every borrow free: on the CPU demo, whose engines needed about twice
    training's time a step, a borrow was made and held that left two engines doing three
    engines' work. Why not the pace always: where a step waits on its longest responses (a
    long-tailed length distribution, `ehp-fsm simulate`'s default), a few long responses hold
    the engines' slots, and the wait — which grew as predicted when a borrow took GPUs away —
    decided better there: the pace in place of a material wait stopped borrows that paid
    (`ehp-fsm simulate`, same seeds, 2026-12-07: gpu-4x8 at 0.4 s of training per sample, 40
    steps, 1.078× → 1.000× with the pace alone or the longer of the two; train-heavy 1.313× →
    1.251× with the pace alone, 1.201× with the longer of the two).

    The pace: the engines' busy GPU-seconds (each group in flight counts its share of its
    engine's slots, `rollout.dispatch.Occupancy`) per group made since the last decision,
    times G, over the GPUs that serve now. Without a group made or a GPU serving in the
    window, the wait stands.
    """

    def __init__(self) -> None:
        self._gpu_s = 0.0
        self._completed = 0

    def add(
        self,
        *,
        busy_gpu_s: float,
        completed: int,
        groups: int,
        serving_gpus: int,
        waited_s: float,
        train_s: float,
    ) -> float:
        """Record the counters now (cumulative busy GPU-seconds and groups made); return the
        rollout seconds to predict one step of `groups` on `serving_gpus` from."""
        d_busy, d_done = busy_gpu_s - self._gpu_s, completed - self._completed
        self._gpu_s, self._completed = busy_gpu_s, completed
        if waited_s > KEPT_UP * train_s:
            return waited_s
        if d_done <= 0 or d_busy <= 0 or serving_gpus <= 0 or groups <= 0:
            return waited_s
        return max(waited_s, groups * d_busy / d_done / serving_gpus)
