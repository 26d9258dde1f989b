"""`ehp-fsm run PLAN --verify`: the fixed-batch proof on a real run, with bounded memory.

Three parts, for the run loop to call:

* `record_step(root, ...)` — while the EHP run trains, each step's partitioned batch is written to
  `root/step-<step:06d>.pt` (one `torch.save` of a dict of tensors and plain values: step, epoch,
  partition {replica: [group ids]}, group_ids, group_size, tokens, completion, rewards). Files are
  written to a temporary name and renamed, and read back only with `weights_only=True`.
* `replay_core_only(records, config=..., work_dir=...)` — a fresh Core-only pool (same config and
  seed, no warm workers) trains on exactly the recorded batches, the groups of each step
  re-partitioned over the Core replicas, and writes its final state.
* `compare_states(a, b, ...)` — compares two *state dirs* tensor by tensor.

A state dir (written by a trainer process, `write_state`) holds `index.json` (format, version,
Adam steps per parameter, hyperparameters, and one entry per tensor) and one `torch.save` file per
tensor: for every parameter `param/<name>` (model dtype), `master/<name>`, `exp_avg/<name>`,
`exp_avg_sq/<name>` (fp32 slices of the DP-zero world buffers). The comparison loads one tensor of
each side at a time, so its extra memory is about two of the largest parameter, never two states;
it measures and reports that peak (bytes it held at once, and the process RSS high-water above its
start) and its own time.

Tolerance (issue 3): bit-exact where the arithmetic is the same — a run where no Hybrid ever
trained repeats the Core's exact operations — else atol 2e-4 / rtol 2e-3 on parameters, master
weights and moments (a different number of replicas sums Σ (nᵢ/B)·ḡᵢ in another fp32 order).
Steps, version and hyperparameters are always compared exactly. Adam caveat (see
`tests/training/test_equivalence.py`): Adam divides by √v̂ + ε, so an element whose true gradient
is ~0 turns a rounding difference into an update of order lr; with ε = 1e-8 and lr 3e-3 a few
elements can exceed the tolerance for Adam's reason, not the transfer's — train with ε ≥ 1e-6.

What it does not know: the engine, rollout, how the run picks partitions.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.errors import EhpError
from ehp_fsm.training.dpzero import DpZeroState
from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.layout import FlatLayout

if TYPE_CHECKING:
    from ehp_fsm.training.pool_protocol import PoolConfig

STATE_FORMAT = "ehp-fsm-train-state/1"
INDEX_FILE = "index.json"
CATEGORIES = ("param", "master", "exp_avg", "exp_avg_sq")
ATOL, RTOL = 2e-4, 2e-3


class VerifyError(EhpError):
    """Recorded steps or state dirs cannot be read or do not describe the same run."""


# -- state dirs ---------------------------------------------------------------------------------


def write_state(
    path: Path,
    *,
    params: Mapping[str, torch.Tensor],
    world: DpZeroState,
    layout: FlatLayout,
) -> None:
    """Write a lane's exact state as a state dir (one file per tensor; see the module doc)."""
    path.mkdir(parents=True, exist_ok=False)
    entries: list[dict[str, Any]] = []

    def put(key: str, t: torch.Tensor) -> None:
        fname = f"t{len(entries):05d}.pt"
        torch.save(t.detach().clone(), path / fname)  # clone: a view would save its whole base
        entries.append({"key": key, "file": fname, "shape": list(t.shape), "dtype": str(t.dtype)})

    for slot in layout.params:
        put(f"param/{slot.name}", params[slot.name])
        buf = layout.buffer(slot.buffer)
        entry = world.buffers[slot.buffer][buf.dtype_key]
        for key, cat in (("param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            put(f"{cat}/{slot.name}", entry[key][slot.offset : slot.offset + slot.numel])
    index = {
        "format": STATE_FORMAT,
        "version": world.version,
        "steps": {k: float(v) for k, v in world.steps.items()},
        "hyper": [
            {
                "lr": h["lr"],
                "betas": list(h["betas"]),
                "eps": h["eps"],
                "weight_decay": h["weight_decay"],
            }
            for h in world.hyper
        ],
        "tensors": entries,
    }
    tmp = path / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, path / INDEX_FILE)  # the index last: a dir with an index is complete


def tp_part(path: Path, *, tp: int, tp_rank: int) -> Path:
    """Where TP rank `tp_rank` of a lane writes (and reads) its shard of a state dir: the dir
    itself at TP 1, else its subdir `tp-<rank>` (a complete state dir of that shard)."""
    return path if tp == 1 else path / f"tp-{tp_rank}"


def join_tp_parts(path: Path, *, tp: int) -> None:
    """The index of a TP > 1 state dir over its shards' (`tp_part`): every entry and Adam
    step count keyed with `tp<rank>/` after its category, files under `tp-<rank>/`, so
    `compare_states` and `iter_state` walk every shard as one state. The shards must agree on
    version and hyperparameters (one optimizer step on every TP rank)."""
    parts = [read_index(tp_part(path, tp=tp, tp_rank=k)) for k in range(tp)]
    for k, part in enumerate(parts):
        if part["version"] != parts[0]["version"] or part["hyper"] != parts[0]["hyper"]:
            raise VerifyError(
                f"{path}: TP rank {k}'s shard is at version {part['version']}, TP rank 0's "
                f"at {parts[0]['version']} (or their hyperparameters differ)",
                "every TP rank of a lane steps together",
                "save the state again",
            )
    index = {
        "format": STATE_FORMAT,
        "version": parts[0]["version"],
        "steps": {f"tp{k}/{n}": v for k, p in enumerate(parts) for n, v in p["steps"].items()},
        "hyper": parts[0]["hyper"],
        "tensors": [
            {**e, "key": _tp_key(e["key"], k), "file": f"tp-{k}/{e['file']}"}
            for k, p in enumerate(parts)
            for e in p["tensors"]
        ],
    }
    tmp = path / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, path / INDEX_FILE)


def _tp_key(key: str, tp_rank: int) -> str:
    """`param/<name>` of TP rank k's shard as `param/tp<k>/<name>` (the category stays first)."""
    category, _, name = key.partition("/")
    return f"{category}/tp{tp_rank}/{name}"


def read_index(path: Path) -> dict[str, Any]:
    try:
        index: dict[str, Any] = json.loads((path / INDEX_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise VerifyError(
            f"{path} is not a complete state dir",
            f"{type(exc).__name__}: {exc}",
            "pass a dir written by TrainerPool.save_state",
        ) from exc
    if index.get("format") != STATE_FORMAT:
        raise VerifyError(
            f"{path} has state format {index.get('format')!r}",
            f"this version reads {STATE_FORMAT}",
            "write both states with the same ehp-fsm version",
        )
    return index


def read_state(path: Path, layout: FlatLayout) -> DpZeroState:
    """A state dir as the world (unpadded) optimizer state of `layout`'s model: what a resumed
    run scatters into its Core (`TrainerPool.restore_state`). One tensor file is read at a
    time into the world buffers (the state dir holds each parameter's slice of them)."""
    index = read_index(path)
    files = {str(e["key"]): e for e in index["tensors"]}
    buffers: dict[int, dict[Any, dict[str, Any]]] = {}
    for b in layout.buffers:
        entry: dict[str, Any] = {
            k: torch.zeros(b.numel_unpadded, dtype=torch.float32) for k in _WORLD_KEYS.values()
        }
        entry["numel_unpadded"] = b.numel_unpadded
        buffers[b.index] = {b.dtype_key: entry}
    for slot in layout.params:
        world = buffers[slot.buffer][layout.buffer(slot.buffer).dtype_key]
        for cat, key in _WORLD_KEYS.items():
            e = files.get(f"{cat}/{slot.name}")
            if e is None:
                raise VerifyError(
                    f"{path} has no `{cat}/{slot.name}`",
                    "it was written for another model",
                    "resume with the model the run trained",
                )
            t = torch.load(path / e["file"], weights_only=True)
            if t.numel() != slot.numel:
                raise VerifyError(
                    f"{path}: `{cat}/{slot.name}` holds {t.numel()} elements, the model "
                    f"{slot.numel}",
                    "it was written for another model",
                    "resume with the model the run trained",
                )
            world[key][slot.offset : slot.offset + slot.numel].copy_(t.reshape(-1))
    hyper = tuple(
        {
            "lr": h["lr"],
            "betas": tuple(h["betas"]),
            "eps": h["eps"],
            "weight_decay": h["weight_decay"],
        }
        for h in index["hyper"]
    )
    return DpZeroState(
        buffers=buffers,
        steps={str(k): float(v) for k, v in index["steps"].items()},
        hyper=hyper,
        version=int(index["version"]),
    )


#: A state dir's category → the world buffers' key (`write_state`'s pairs).
_WORLD_KEYS = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def iter_state(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of a state dir, one tensor in memory at a time."""
    for e in read_index(path)["tensors"]:
        yield e["key"], torch.load(path / e["file"], weights_only=True)


# -- the report ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CategoryDiff:
    """The largest differences within one category (param, master, exp_avg, exp_avg_sq)."""

    tensors: int
    elements: int
    max_abs: float
    max_rel: float
    worst: str  # key of the tensor with the largest absolute difference
    bit_exact: bool
    outside: int  # elements outside the tolerance


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    passed: bool
    mode: str  # "bit-exact" or "atol 2e-4 / rtol 2e-3"
    categories: Mapping[str, CategoryDiff]
    version: tuple[int, int]
    steps_equal: bool
    max_step_diff: float
    hyper_equal: bool
    failures: tuple[str, ...]  # each names the tensor (or field) that failed and why
    peak_extra_bytes: int  # tensor bytes the comparison held at once (both sides + temporaries)
    rss_peak_delta_bytes: int  # process RSS high-water above its value at the start
    state_bytes: int  # size of one state, for scale
    seconds: float

    def lines(self) -> list[str]:
        out = [
            f"verify: {'PASS' if self.passed else 'FAIL'} ({self.mode}); "
            f"version {self.version[0]} vs {self.version[1]}; "
            f"steps {'equal' if self.steps_equal else f'differ by {self.max_step_diff}'}; "
            f"hyperparameters {'equal' if self.hyper_equal else 'differ'}"
        ]
        for name, c in self.categories.items():
            out.append(
                f"  {name:<10} max|Δ| {c.max_abs:.3e}  max rel {c.max_rel:.3e}  "
                f"{'bit-exact' if c.bit_exact else f'worst {c.worst}'}  "
                f"({c.tensors} tensors, {c.elements} elements, {c.outside} outside tolerance)"
            )
        out.append(
            f"  cost: {self.seconds:.3f} s; peak extra memory {self.peak_extra_bytes} B held "
            f"(RSS +{self.rss_peak_delta_bytes} B) for a state of {self.state_bytes} B"
        )
        out.extend(f"  failure: {f}" for f in self.failures)
        return out


def compare_states(
    a: Path, b: Path, *, exact: bool, atol: float = ATOL, rtol: float = RTOL
) -> VerifyReport:
    """Compare two state dirs tensor by tensor (streaming). `exact`: demand bit equality
    (the arithmetic was the same); else `|a−b| ≤ atol + rtol·|b|` element-wise (b = reference)."""
    t0 = time.perf_counter()
    proc = psutil.Process()
    rss0 = rss_peak = proc.memory_info().rss
    ia, ib = read_index(a), read_index(b)
    keys_a = [e["key"] for e in ia["tensors"]]
    keys_b = [e["key"] for e in ib["tensors"]]
    failures: list[str] = []
    if keys_a != keys_b:
        missing = sorted(set(keys_a) ^ set(keys_b))
        raise VerifyError(
            "the two states hold different tensors",
            f"only in one of them: {missing[:5]}",
            "compare states of the same model",
        )
    acc: dict[str, dict[str, Any]] = {
        c: {
            "tensors": 0,
            "elements": 0,
            "max_abs": 0.0,
            "max_rel": 0.0,
            "worst": "",
            "exact": True,
            "outside": 0,
        }
        for c in CATEGORIES
    }
    peak = 0
    state_bytes = 0
    for ea, eb in zip(ia["tensors"], ib["tensors"], strict=True):
        key = ea["key"]
        ta = torch.load(a / ea["file"], weights_only=True)
        tb = torch.load(b / eb["file"], weights_only=True)
        held = ta.numel() * ta.element_size() + tb.numel() * tb.element_size()
        state_bytes += ta.numel() * ta.element_size()
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            failures.append(f"{key}: {tuple(ta.shape)} {ta.dtype} vs {tuple(tb.shape)} {tb.dtype}")
            continue
        cat = acc[key.split("/", 1)[0]]
        cat["tensors"] += 1
        cat["elements"] += ta.numel()
        equal = torch.equal(ta, tb)
        if not equal:
            cat["exact"] = False
            da, db = ta.double(), tb.double()
            diff = (da - db).abs()
            held += 3 * diff.numel() * diff.element_size()
            max_abs = float(diff.max()) if diff.numel() else 0.0
            rel = diff / db.abs().clamp_min(1e-12)
            max_rel = float(rel.max()) if rel.numel() else 0.0
            outside = (
                int((diff > atol + rtol * db.abs()).sum()) if not exact else int((diff != 0).sum())
            )
            if math.isnan(max_abs):
                outside = max(outside, 1)
            if max_abs > cat["max_abs"] or math.isnan(max_abs):
                cat["max_abs"], cat["worst"] = max_abs, key
            cat["max_rel"] = max(cat["max_rel"], max_rel)
            cat["outside"] += outside
            if outside:
                failures.append(
                    f"{key}: max|Δ| {max_abs:.3e}, {outside} of {ta.numel()} elements "
                    + (
                        "differ (bit-exact required)"
                        if exact
                        else f"outside atol {atol} / rtol {rtol}"
                    )
                )
            del da, db, diff, rel
        peak = max(peak, held)
        rss_peak = max(rss_peak, proc.memory_info().rss)
        del ta, tb
    steps_a, steps_b = ia["steps"], ib["steps"]
    steps_equal = steps_a == steps_b
    max_step = max(
        (
            abs(steps_a.get(k, math.nan) - steps_b.get(k, math.nan))
            for k in set(steps_a) | set(steps_b)
        ),
        default=0.0,
    )
    if not steps_equal:
        failures.append(f"Adam steps differ (max {max_step}): {steps_a} vs {steps_b}")
    if ia["version"] != ib["version"]:
        failures.append(f"version {ia['version']} vs {ib['version']}")
    hyper_equal = ia["hyper"] == ib["hyper"]
    if not hyper_equal:
        failures.append(f"hyperparameters differ: {ia['hyper']} vs {ib['hyper']}")
    cats = {
        c: CategoryDiff(
            tensors=v["tensors"],
            elements=v["elements"],
            max_abs=v["max_abs"],
            max_rel=v["max_rel"],
            worst=v["worst"],
            bit_exact=v["exact"],
            outside=v["outside"],
        )
        for c, v in acc.items()
    }
    return VerifyReport(
        passed=not failures,
        mode="bit-exact" if exact else f"atol {atol:g} / rtol {rtol:g}",
        categories=cats,
        version=(int(ia["version"]), int(ib["version"])),
        steps_equal=steps_equal,
        max_step_diff=float(max_step),
        hyper_equal=hyper_equal,
        failures=tuple(failures),
        peak_extra_bytes=peak,
        rss_peak_delta_bytes=max(0, rss_peak - rss0),
        state_bytes=state_bytes,
        seconds=time.perf_counter() - t0,
    )


# -- recording and replay -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RecordedStep:
    step: int
    epoch: int
    partition: Mapping[str, tuple[int, ...]]
    batch: GroupBatch

    @property
    def hybrids(self) -> tuple[str, ...]:
        """Non-Core replicas that computed groups in this step."""
        return tuple(r for r, g in self.partition.items() if g and not r.startswith("core:"))


def record_step(
    root: Path,
    *,
    step: int,
    epoch: int,
    partition: Mapping[str, Sequence[int]],
    batch: GroupBatch,
) -> Path:
    """Write one step's batch and partition (see the module doc); returns the file."""
    root.mkdir(parents=True, exist_ok=True)
    covered = sorted(g for gs in partition.values() for g in gs)
    if covered != sorted(batch.group_ids):
        raise VerifyError(
            f"step {step}: the partition covers groups {covered}",
            f"the batch holds {sorted(batch.group_ids)}",
            "record the batch the step actually trained on with its partition",
        )
    out = root / f"step-{step:06d}.pt"
    tmp = root / f".step-{step:06d}.pt.tmp"
    torch.save(
        {
            "step": step,
            "epoch": epoch,
            "partition": {r: [int(g) for g in gs] for r, gs in partition.items()},
            "group_ids": [int(g) for g in batch.group_ids],
            "group_size": batch.group_size,
            "tokens": batch.tokens,
            "completion": batch.completion,
            "rewards": batch.rewards,
            **({} if batch.old_logp is None else {"old_logp": batch.old_logp}),
        },
        tmp,
    )
    os.replace(tmp, out)
    return out


def load_records(root: Path) -> list[RecordedStep]:
    files = sorted(root.glob("step-*.pt"))
    if not files:
        raise VerifyError(f"no recorded steps under {root}", "", "run with recording enabled")
    out = []
    for f in files:
        d = torch.load(f, weights_only=True)
        out.append(
            RecordedStep(
                step=int(d["step"]),
                epoch=int(d["epoch"]),
                partition={str(r): tuple(g) for r, g in d["partition"].items()},
                batch=GroupBatch(
                    group_ids=tuple(d["group_ids"]),
                    group_size=int(d["group_size"]),
                    tokens=d["tokens"],
                    completion=d["completion"],
                    rewards=d["rewards"],
                    old_logp=d.get("old_logp"),
                ),
            )
        )
    steps = [r.step for r in out]
    if steps != sorted(set(steps)):
        raise VerifyError(f"recorded steps {steps} repeat", "", "record each step once")
    return out


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    state: Path
    steps: int
    hybrid_steps: int  # recorded steps in which a Hybrid computed groups
    seconds: float
    losses: tuple[float, ...] = field(default=())


def replay_core_only(
    records: Path, *, config: PoolConfig, work_dir: Path, start_timeout_s: float = 120.0
) -> ReplayResult:
    """Train a fresh Core-only pool (`config` with max_hybrids=0, no revisions) on the recorded
    batches and write its final state to `work_dir/core-only-state`. `config` is the run's
    `PoolConfig` (same policy, seed, Core DP, Adam)."""
    from ehp_fsm.training.pool import PoolFailure, TrainerPool  # pool's workers import verify

    t0 = time.perf_counter()
    steps = load_records(records)
    cfg = config.with_(max_hybrids=0, revisions=None)
    core = {cfg.core_replica(r): 1 for r in cfg.core_ranks}
    losses = []
    with TrainerPool.spawn(
        cfg, work_dir=work_dir / "core-only", start_timeout_s=start_timeout_s
    ) as pool:
        for rec in steps:
            part = partition_groups(
                groups=rec.batch.group_ids,
                live=core,
                group_size=rec.batch.group_size,
                step=rec.step,
                epoch=0,
            )
            res = pool.step(step=rec.step, epoch=0, partition=part, batch=rec.batch, publish=False)
            if isinstance(res, PoolFailure):
                raise VerifyError(
                    f"Core-only replay failed at step {rec.step}", str(res), "see the worker logs"
                )
            losses.append(res.loss)
        out = work_dir / "core-only-state"
        saved = pool.save_state(out)
        if isinstance(saved, PoolFailure):
            raise VerifyError(
                "Core-only replay could not save its state", str(saved), "see the worker logs"
            )
    return ReplayResult(
        state=out,
        steps=len(steps),
        hybrid_steps=sum(1 for r in steps if r.hybrids),
        seconds=time.perf_counter() - t0,
        losses=tuple(losses),
    )


def verify_run(
    records: Path, ehp_state: Path, *, config: PoolConfig, work_dir: Path
) -> tuple[ReplayResult, VerifyReport]:
    """Replay Core-only and compare with the EHP run's final Core state: bit-exact if no Hybrid
    ever computed groups, else within atol/rtol."""
    replay = replay_core_only(records, config=config, work_dir=work_dir)
    report = compare_states(ehp_state, replay.state, exact=replay.hybrid_steps == 0)
    return replay, report
