"""`ehp-fsm run PLAN --verify`: the fixed-batch proof on a real run, with bounded memory.

The parts, for the run loop to call:

* `record_step(root, ...)` — while the EHP run trains, each step's partitioned batch is written to
  `root/step-<step:06d>.pt` (one `torch.save` of a dict of tensors and plain values: step, epoch,
  partition {replica: [group ids]}, group_ids, group_size, tokens, completion, rewards). Files are
  written to a temporary name and renamed, and read back only with `weights_only=True`. Once the
  step stood, `record_result` writes the fingerprint of the Core's weights after it
  (`result-<step:06d>.json`).
* `replay_core_only(records, config=..., work_dir=...)` — a fresh Core-only pool (same config and
  seed, no warm workers) trains on exactly the recorded batches, the groups of each step
  re-partitioned over the Core replicas, and writes its final state.
* `replay_partitions(records, config=...)` — the run's own partitions replayed in this process
  (torch lanes), or `replay_partitions_on_pool` on the run's lanes (see "What passes").
* `compare_states(a, b, ...)` — compares two *state dirs* tensor by tensor.

A state dir (written by a trainer process, `write_state`) holds `index.json` (format, version,
Adam steps per parameter, hyperparameters, and one entry per tensor) and one `torch.save` file per
tensor: for every parameter `param/<name>` (model dtype), `master/<name>`, `exp_avg/<name>`,
`exp_avg_sq/<name>` (fp32 slices of the DP-zero world buffers). The comparison loads one tensor of
each side at a time, so its extra memory is about two of the largest parameter, never two states;
it measures and reports that peak (bytes it held at once, and the process RSS high-water above its
start) and its own time.

What passes (`verify_run`). Bit-exact where the arithmetic is the same — a run where no Hybrid
ever trained repeats the Core's exact operations. Once a Hybrid computes, the Core-only replay
sums Σ (nᵢ/B)·ḡᵢ in another fp32 order, and over a long GRPO run that rounding does not stay
small: it grows step by step until a token's ratio lies on the other side of a clip bound, its
gradient switches on or off (a discrete change of about Âρ/T), and the two trajectories part —
measured on the default plan: the same 100 recorded steps replayed in one process with random
two-way splits (no processes, no transfer) ended 7.9e-3 apart from the Core-only order in three
of four splits, after one token at ratio 0.8002 vs 0.7998 flipped at step 80. So the final
Core-only state cannot judge a Hybrid run; what is judged instead (torch lanes):

* the run's final state equals its *recorded partitions replayed* (`replay_partitions`, one
  lane in this process computing each replica's groups as its lane did, summed with the same
  fp32 weights) bit for bit — a sum of two lanes is the same in either order; once a step
  summed more (Core DP > 1 with a Hybrid), the bit-exact replay is on a fresh pool of the run's
  lanes with each Hybrid on the rank it had (`replay_partitions_on_pool`: the same Gloo sums)
  — and the run's per-step fingerprint of its weights
  (`record_result`) matches the replay's after every step, so a group trained twice or not at
  all, a wrong weight or a Hybrid holding stale state is named at the step it happened;
* every step's split gives the whole batch's gradient at the same weights within `SPLIT_RTOL`
  (the fixed-batch invariant itself, checked where rounding has not accumulated);
* no group is recorded twice (`repeats`; in any run, Hybrid or not): a replay repeats a recorded
  batch as it is, so a group handed to training twice is seen only here.

Megatron lanes cannot be built in this process: their partitions are replayed on a fresh pool
of the run's own lanes (`replay_partitions_on_pool`: each recorded Hybrid loaded from the Core
before its step), judged bit-exact and by fingerprint the same way, without the whole-batch
check. The Core-only replay's final state and its per-step drift from the run are still
reported. Steps, version and hyperparameters are always compared exactly. Adam caveat (see
`tests/training/test_equivalence.py`): Adam divides by √v̂ + ε, so an element whose true
gradient is ~0 turns a rounding difference into an update of order lr — train with ε ≥ 1e-6.

What it does not know: the engine, rollout, how the run picks partitions.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.errors import EhpError
from ehp_fsm.training.dpzero import DpZeroState
from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.layout import FlatLayout
from ehp_fsm.training.reduction import sample_weight

if TYPE_CHECKING:
    from ehp_fsm.training.backend import TorchBackend
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
    """Write a lane's exact state as a state dir (one file per tensor; see the module doc).
    Each entry carries the `tensor_digest` of the tensor as the lane held it: what
    `check_restored` holds a restored lane to."""
    path.mkdir(parents=True, exist_ok=False)
    entries: list[dict[str, Any]] = []
    for key, t in state_tensors(params, world, layout):
        fname = f"t{len(entries):05d}.pt"
        torch.save(t.detach().clone(), path / fname)  # clone: a view would save its whole base
        entries.append(
            {
                "key": key,
                "file": fname,
                "shape": list(t.shape),
                "dtype": str(t.dtype),
                "sha256": tensor_digest(t),
            }
        )
    steps = {k: float(v) for k, v in world.steps.items()}
    hyper = _hyper_json(world.hyper)
    index = {
        "format": STATE_FORMAT,
        "version": world.version,
        "steps": steps,
        "hyper": hyper,
        "tensors": entries,
        # over what the tensors' digests do not cover (version, Adam steps, hyperparameters)
        # and those digests: `read_state` refuses an index changed since
        "digest": _shard_digest(world.version, steps, hyper, _entry_digests(entries)),
    }
    tmp = path / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, path / INDEX_FILE)  # the index last: a dir with an index is complete


def state_tensors(
    params: Mapping[str, torch.Tensor], world: DpZeroState | None, layout: FlatLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of a lane's state in the state dir's order: per parameter its `param`,
    then (given the world state) its `master`, `exp_avg` and `exp_avg_sq` slices."""
    for slot in layout.params:
        yield f"param/{slot.name}", params[slot.name]
        if world is None:
            continue
        b = layout.buffer(slot.buffer)
        entry = world.buffers[b.world_key][b.dtype_key]
        start = b.world_offset + slot.offset
        for key, cat in (("param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            yield f"{cat}/{slot.name}", entry[key][start : start + slot.numel]


def _hyper_json(hyper: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "lr": h["lr"],
            "betas": list(h["betas"]),
            "eps": h["eps"],
            "weight_decay": h["weight_decay"],
        }
        for h in hyper
    ]


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes: two tensors with one digest are the same
    bit for bit (a copy to the CPU first; a state save or restore hashes each tensor once)."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def _shard_digest(
    version: int, steps: Mapping[str, float], hyper: Any, tensors: Iterable[tuple[str, str]]
) -> str:
    doc = {"version": version, "steps": dict(steps), "hyper": hyper, "tensors": list(tensors)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _entry_digests(entries: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(key, sha256) of each tensor entry of an index, in its order."""
    return [(str(e["key"]), str(e.get("sha256"))) for e in entries]


def combine_digests(shards: Mapping[str, str]) -> str:
    """One digest of a state from its TP shards' (`tp0`, `tp1`, ... → digest)."""
    order = sorted(shards, key=lambda k: int(k[2:]))
    return hashlib.sha256(" ".join(f"{k}:{shards[k]}" for k in order).encode()).hexdigest()


def state_digest(path: Path) -> str:
    """The digest of the state dir `path` from its index (every TP shard's): what
    `check_restored` reports for a lane that holds this state bit for bit."""
    parts = sorted(path.glob("tp-*"), key=lambda p: int(p.name[3:])) or [path]
    shards = {}
    for k, part in enumerate(parts):
        index = read_index(part)
        tensors = _entry_digests(index["tensors"])
        shards[f"tp{k}"] = _shard_digest(index["version"], index["steps"], index["hyper"], tensors)
    return combine_digests(shards)


def check_restored(
    path: Path,
    *,
    params: Mapping[str, torch.Tensor],
    world: DpZeroState | None,
    layout: FlatLayout,
) -> tuple[int, str | None]:
    """Hold a lane's state after a restore from the state dir `path` (this TP rank's shard) to
    the digests `write_state` recorded when it was saved: every parameter, and given the world
    state (the rank that gathered it) every FP32 master and Adam moment slice, the Adam steps,
    version and hyperparameters. Raises `VerifyError` naming what differs; else (tensors
    compared, the shard's digest computed from the lane — None without the world state)."""
    index = read_index(path)
    saved = {str(e["key"]): e.get("sha256") for e in index["tensors"]}
    if None in saved.values():
        raise VerifyError(
            f"{path} records no digests of its tensors",
            "it was saved by an ehp-fsm that did not record them, so the restore cannot be "
            "checked bit for bit",
            "start the run again with --fresh",
        )
    got = [(k, tensor_digest(t)) for k, t in state_tensors(params, world, layout)]
    differ = [k for k, d in got if saved.get(k) != d]
    if world is None:
        if differ:
            raise _differs(path, differ)
        return len(got), None
    steps = {k: float(v) for k, v in world.steps.items()}
    hyper = _hyper_json(world.hyper)
    if world.version != index["version"]:
        differ.append(f"version {world.version} (saved {index['version']})")
    if steps != index["steps"]:
        differ.append("the Adam steps")
    if hyper != index["hyper"]:
        differ.append("the hyperparameters")
    if len(got) != len(saved):
        differ.append(f"{len(got)} tensors (saved {len(saved)})")
    if differ:
        raise _differs(path, differ)
    return len(got), _shard_digest(world.version, steps, hyper, got)


def _differs(path: Path, what: Sequence[str]) -> VerifyError:
    shown = ", ".join(what[:4]) + (f" and {len(what) - 4} more" if len(what) > 4 else "")
    return VerifyError(
        f"the state restored from {path} is not the saved one: {shown} differ",
        "the lane after the restore holds other values than the save hashed (a damaged "
        "state file, or a restore that installed something else)",
        "start the run again with --fresh (or from an intact copy of the state)",
    )


def tp_part(path: Path, *, tp: int, tp_rank: int) -> Path:
    """Where process `tp_rank` of a lane writes (and reads) its shard of a state dir: the dir
    itself for a lane of one process, else its subdir `tp-<rank>` (a complete state dir of that
    shard). `tp` is the lane's size and `tp_rank` its lane rank: TP × PP and PP stage × TP +
    TP rank under pipeline parallelism (the shard names keep TP's)."""
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
    if not isinstance(index, dict):
        raise VerifyError(
            f"{path / INDEX_FILE} is not a JSON object",
            f"it holds a {type(index).__name__}",
            "pass a dir written by TrainerPool.save_state",
        )
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
    time into the world buffers (the state dir holds each parameter's slice of them). An index
    or a file that cannot be read, or an index changed since the save (its `digest`), is
    refused naming it, before anything is installed."""
    index = read_index(path)
    try:
        files = {str(e["key"]): str(e["file"]) for e in index["tensors"]}
        hyper = tuple(
            {
                "lr": h["lr"],
                "betas": tuple(h["betas"]),
                "eps": h["eps"],
                "weight_decay": h["weight_decay"],
            }
            for h in index["hyper"]
        )
        steps = {str(k): float(v) for k, v in index["steps"].items()}
        version = int(index["version"])
        digest = _shard_digest(
            index["version"], index["steps"], index["hyper"], _entry_digests(index["tensors"])
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise VerifyError(
            f"{path / INDEX_FILE} is damaged: its version, steps, hyper or tensors cannot be read",
            f"{type(exc).__name__}: {exc}",
            _DAMAGED_FIX,
        ) from None
    if "digest" in index and index["digest"] != digest:  # (an older save recorded none)
        raise VerifyError(
            f"{path / INDEX_FILE} changed since the save",
            "its version, Adam steps, hyperparameters or tensor digests are not those the save "
            "recorded (a damaged disk, or an edit): installed, they would go on as optimizer "
            "state the run never had",
            _DAMAGED_FIX,
        )
    buffers: dict[int, dict[Any, dict[str, Any]]] = {}
    sizes: dict[int, int] = {}  # world tensor → its length (the buckets placed in it, unpadded)
    for b in layout.buffers:
        sizes[b.world_key] = max(sizes.get(b.world_key, 0), b.world_offset + b.numel_unpadded)
    for b in layout.buffers:
        if b.world_key in buffers:
            continue
        n = sizes[b.world_key]
        entry: dict[str, Any] = {
            k: torch.zeros(n, dtype=torch.float32) for k in _WORLD_KEYS.values()
        }
        entry["numel_unpadded"] = n
        buffers[b.world_key] = {b.dtype_key: entry}
    for slot in layout.params:
        b = layout.buffer(slot.buffer)
        world = buffers[b.world_key][b.dtype_key]
        start = b.world_offset + slot.offset
        for cat, key in _WORLD_KEYS.items():
            e = files.get(f"{cat}/{slot.name}")
            if e is None:
                raise VerifyError(
                    f"{path} has no `{cat}/{slot.name}`",
                    "it was written for another model",
                    "resume with the model the run trained",
                )
            t = _load_tensor(path, e, f"{cat}/{slot.name}")
            if t.numel() != slot.numel:
                raise VerifyError(
                    f"{path}: `{cat}/{slot.name}` holds {t.numel()} elements, the model "
                    f"{slot.numel}",
                    "it was written for another model",
                    "resume with the model the run trained",
                )
            world[key][start : start + slot.numel].copy_(t.reshape(-1))
    return DpZeroState(buffers=buffers, steps=steps, hyper=hyper, version=version)


_DAMAGED_FIX = "start the run again with --fresh (or from an intact copy of the state)"


def _load_tensor(path: Path, name: str, key: str) -> torch.Tensor:
    """The tensor `key` of the state dir `path` from its file `name` (the index's), refused
    naming the file when it is not a plain file of the dir (a FIFO's open waits forever) or
    does not hold a tensor: torch's own error named neither (an empty file: `EOFError: `)."""
    if Path(name).name != name or name in ("", ".", ".."):
        raise VerifyError(
            f"{path / INDEX_FILE} names the file {name[:200]!r} for `{key}`",
            "it is not a file of the state dir",
            _DAMAGED_FIX,
        )
    f = path / name
    if not f.is_file():
        why = "it is missing" if not f.exists() else "it is not a regular file"
    else:
        try:
            t = torch.load(f, weights_only=True)
        except Exception as exc:  # torch raises what its reader met: zip, pickle, EOF errors
            said = str(exc)[:200] or ("it ends early" if isinstance(exc, EOFError) else "")
            why = f"{type(exc).__name__}: {said}"
        else:
            if isinstance(t, torch.Tensor):
                return t
            why = f"it holds a {type(t).__name__}, not a tensor"
    raise VerifyError(f"{f} (`{key}` of the saved state) cannot be read", why, _DAMAGED_FIX)


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
    notes: tuple[str, ...] = ()  # the other checks of `verify_run`, one line each
    # the first step after which the run's weights differ from its partitions replayed
    first_departure: int | None = None
    # what the category lines compare, printed above them when they are not what the verdict
    # judges (the Core-only replay once a Hybrid trained: right under "PASS ... bit-exact", its
    # max|Δ| read as the verdict's own)
    table: str = ""

    def lines(self) -> list[str]:
        out = [
            f"verify: {'PASS' if self.passed else 'FAIL'} ({self.mode}); "
            f"version {self.version[0]} vs {self.version[1]}; "
            f"steps {'equal' if self.steps_equal else f'differ by {self.max_step_diff}'}; "
            f"hyperparameters {'equal' if self.hyper_equal else 'differ'}"
        ]
        if self.table:
            out.append(f"  {self.table}")
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
        out.extend(self.notes)
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


#: Per parameter (Σx, Σx²) of the model weights after a step, in float64.
Fingerprint = Mapping[str, tuple[float, float]]


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
    """(Σx, Σx²) in float64 of each weight: what the run records after each step and the replay
    of its partitions recomputes, so a departure is found at the step it happened, not 100
    steps later in the final state. Cheap (one pass over the weights) and small (two numbers a
    tensor, whatever the model's size); equal weights give equal fingerprints bit for bit (the
    same sum, in the same order, on one thread)."""
    out = {}
    with torch.no_grad():
        for name, p in named:
            x = p.detach().reshape(-1).double()
            out[name] = (float(x.sum()), float(x.dot(x)))
    return out


@dataclass(frozen=True, kw_only=True)
class RecordedStep:
    step: int
    epoch: int
    partition: Mapping[str, tuple[int, ...]]
    batch: GroupBatch
    fingerprint: Fingerprint | None = None  # the run's weights after the step (if recorded)
    #: replica -> the pool rank that computed it in the run (a replay on a pool puts each
    #: Hybrid on the same rank: the Gloo sum's order follows the ranks)
    ranks: Mapping[str, int] = field(default_factory=dict)

    @property
    def lanes(self) -> int:
        """How many replicas computed groups in this step (the terms of its Gloo sum)."""
        return sum(1 for g in self.partition.values() if g)

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
    ranks: Mapping[str, int] | None = None,
) -> Path:
    """Write one step's batch and partition (see the module doc), and the pool rank of each
    replica (`ranks`, when given); returns the file."""
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
            "ranks": {r: int(k) for r, k in (ranks or {}).items()},
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


def record_result(root: Path, *, step: int, weights: Fingerprint) -> Path:
    """Write the fingerprint of the Core's weights after step `step` stood (`fingerprint`)
    beside its batch, as `result-<step:06d>.json` (a retried step writes it once, when it
    stood)."""
    out = root / f"result-{step:06d}.json"
    tmp = root / f".result-{step:06d}.json.tmp"
    tmp.write_text(
        json.dumps({"step": step, "fingerprint": {k: list(v) for k, v in weights.items()}})
    )
    os.replace(tmp, out)
    return out


def _load_fingerprint(root: Path, step: int) -> Fingerprint | None:
    f = root / f"result-{step:06d}.json"
    if not f.exists():
        return None
    doc = json.loads(f.read_text())
    return {str(k): (float(v[0]), float(v[1])) for k, v in doc["fingerprint"].items()}


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
                fingerprint=_load_fingerprint(root, int(d["step"])),
                ranks={str(r): int(k) for r, k in d.get("ranks", {}).items()},
            )
        )
    steps = [r.step for r in out]
    if steps != sorted(set(steps)):
        raise VerifyError(f"recorded steps {steps} repeat", "", "record each step once")
    return out


def repeats(steps: Sequence[RecordedStep]) -> tuple[str, ...]:
    """Groups the run trained twice, one line each: a group id twice in one step's batch, or in
    two steps (each group is consumed by exactly one step). Both replays repeat a recorded
    batch as it is, so this is the check that sees a group handed to training twice."""
    seen: dict[int, int] = {}
    out = []
    for rec in steps:
        for g in rec.batch.group_ids:
            if g in seen:
                where = "twice in step" if seen[g] == rec.step else f"in step {seen[g]} and step"
                out.append(f"group {g} was trained {where} {rec.step}")
            seen.setdefault(g, rec.step)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    state: Path
    steps: int
    hybrid_steps: int  # recorded steps in which a Hybrid computed groups
    seconds: float
    losses: tuple[float, ...] = field(default=())
    # per fingerprinted step: the largest relative difference of a weight's (Σx, Σx²) between
    # the replay and the run after that step (0.0: the same weights)
    drift: tuple[tuple[int, float], ...] = field(default=())
    repeated: tuple[str, ...] = field(default=())  # groups the records hold twice (`repeats`)

    def drift_lines(self) -> list[str]:
        """Where the Core-only replay's weights part from the run's: the first step they differ
        and the step of the largest one-step jump (a discrete change, e.g. a token's clip flip)."""
        first = next(((s, d) for s, d in self.drift if d > 0), None)
        if first is None:
            n = len(self.drift)
            return [
                f"  Core-only replay vs the run, per step: the same weights ({n} steps)"
            ] * bool(n)
        jump, prev = None, 0.0
        for s, d in self.drift:
            if prev > 0 and d > 0 and (jump is None or d / prev > jump[1]):
                jump = (s, d / prev, d)
            prev = d
        out = (
            "  Core-only replay vs the run, per step: weights first differ after step "
            f"{first[0]} (rel {first[1]:.1e})"
        )
        if jump is not None:
            out += (
                f"; largest one-step growth ×{jump[1]:.1f} at step {jump[0]} (to rel {jump[2]:.1e})"
            )
        return [out + f"; after the last step rel {self.drift[-1][1]:.1e}"]


def replay_core_only(
    records: Path,
    *,
    config: PoolConfig,
    work_dir: Path,
    start_timeout_s: float = 120.0,
    checkpoint: Callable[[], None] | None = None,
) -> ReplayResult:
    """Train a fresh Core-only pool (`config` with max_hybrids=0, no revisions) on the recorded
    batches and write its final state to `work_dir/core-only-state`. `config` is the run's
    `PoolConfig` (same policy, seed, Core DP, Adam). `checkpoint`: called while its pool starts
    and before each step; what it raises ends the replay (its pool shut down)."""
    from ehp_fsm.training.pool import PoolFailure, TrainerPool  # pool's workers import verify

    t0 = time.perf_counter()
    steps = load_records(records)
    cfg = config.with_(max_hybrids=0, remote_warm=(), remote_core=(), revisions=None)
    core = {cfg.core_replica(r): 1 for r in cfg.core_ranks}
    losses = []
    drift: list[tuple[int, float]] = []
    with TrainerPool.spawn(
        cfg,
        work_dir=work_dir / "core-only",
        start_timeout_s=start_timeout_s,
        checkpoint=checkpoint,
    ) as pool:
        for rec in steps:
            if checkpoint is not None:
                checkpoint()
            part = partition_groups(
                groups=rec.batch.group_ids,
                live=core,
                group_size=rec.batch.group_size,
                step=rec.step,
                epoch=0,
            )
            res = pool.step(
                step=rec.step,
                epoch=0,
                partition=part,
                batch=rec.batch,
                publish=False,
                fingerprint=rec.fingerprint is not None,
            )
            if isinstance(res, PoolFailure):
                raise VerifyError(
                    f"Core-only replay failed at step {rec.step}", str(res), "see the worker logs"
                )
            losses.append(res.loss)
            if rec.fingerprint is not None and res.fingerprint is not None:
                drift.append((rec.step, _fingerprint_rel(rec.fingerprint, res.fingerprint)))
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
        drift=tuple(drift),
        repeated=repeats(steps),
    )


#: One step's split (Core + Hybrids) against the whole batch on one lane: max |Δg| of a
#: parameter's reduced gradient within this fraction of that gradient's max |g|. Rounding of
#: the fp32 sums leaves ~1e-6 of it; a group counted twice or left out, or a wrong weight,
#: moves it by about a group's share (≥ 1/G of the batch).
SPLIT_RTOL = 1e-4


@dataclass(frozen=True, kw_only=True)
class Departure:
    """The first step after which the run's weights differ from its recorded partitions
    replayed: the parameters whose fingerprints differ (the worst first) and that step's
    partition (replica → group ids)."""

    step: int
    tensors: tuple[str, ...]
    max_rel: float  # the largest fingerprint difference relative to the weight's norm
    partition: Mapping[str, tuple[int, ...]]

    def line(self) -> str:
        part = "; ".join(f"{r} {list(g)}" for r, g in self.partition.items() if g)
        shown = ", ".join(self.tensors[:4]) + (" …" if len(self.tensors) > 4 else "")
        return (
            f"the run's weights depart from its recorded partitions replayed at step "
            f"{self.step} ({len(self.tensors)} tensors, max rel {self.max_rel:.2e}: {shown}); "
            f"that step's groups: {part}"
        )


@dataclass(frozen=True, kw_only=True)
class SplitCheck:
    """The largest difference, over the steps, between a step's split reduced gradient and the
    whole batch's gradient on one lane at the same weights (the fixed-batch invariant)."""

    step: int
    tensor: str
    max_abs: float
    scale: float  # max |g| of that parameter's whole-batch gradient

    @property
    def rel(self) -> float:
        return (
            self.max_abs / self.scale if self.scale > 0 else (0.0 if not self.max_abs else math.inf)
        )


@dataclass(frozen=True, kw_only=True)
class PartitionReplay:
    state: Path
    steps: int
    fingerprinted: int  # steps whose run fingerprint was compared (recorded, and sums still exact)
    exact: bool  # ≤ 2 lanes had groups in every step: the run's sums are reproduced bit for bit
    departure: Departure | None
    worst_split: SplitCheck | None
    split_failures: tuple[str, ...]
    seconds: float


def replay_partitions(
    records: Path,
    *,
    config: PoolConfig,
    work_dir: Path,
    checkpoint: Callable[[], None] | None = None,
) -> PartitionReplay:
    """The run's arithmetic, replayed in this process on one torch lane (one thread, as a
    trainer worker): for every recorded step, each replica's groups are computed at the same
    weights exactly as its lane did (the same sub-batch, the same local normaliser), scaled by
    its weight uᵢ/U in fp32 and summed — what the pool's Gloo reduction does, bit for bit when
    at most two lanes carry groups (a sum of two is the same in either order) — and the Adam
    step applied. Per step it also computes the whole batch on the lane and checks that the
    split's reduced gradient is that gradient within `SPLIT_RTOL` (the fixed-batch invariant,
    at the run's own weights, so rounding does not accumulate over steps), and compares the
    weights after the step with the run's fingerprint (`record_result`): the first step that
    differs is the `Departure`. Writes the final state to `work_dir/partitions-state`.
    `checkpoint`: as `replay_core_only`'s."""
    from ehp_fsm.training.backend import TorchBackend
    from ehp_fsm.training.lane import LaneSpec

    t0 = time.perf_counter()
    steps = load_records(records)
    be = TorchBackend(config.model_source, seed=config.seed, objective=config.objective)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a trainer worker's arithmetic (`worker.main`)
    try:
        be.build(
            LaneSpec(
                role="core",
                replica=config.core_replica(0),
                pad_multiple=config.core_pad_multiple,
                adam=config.adam,
            )
        )
        exact, departure, worst, failures, fingerprinted = True, None, None, [], 0
        for rec in steps:
            if checkpoint is not None:
                checkpoint()
            shares = [(r, g) for r, g in rec.partition.items() if g]
            exact = exact and len(shares) <= 2
            reduced = _split_gradient(be, rec, shares)
            whole = _whole_gradient(be, rec)
            for name, g, w in zip(be.lane.param_names, reduced, whole, strict=True):
                check = SplitCheck(
                    step=rec.step,
                    tensor=name,
                    max_abs=float((g - w).abs().max()) if g.numel() else 0.0,
                    scale=float(w.abs().max()) if w.numel() else 0.0,
                )
                if worst is None or check.rel > worst.rel:
                    worst = check
                if check.rel > SPLIT_RTOL:
                    failures.append(
                        f"step {rec.step}: the split's reduced gradient of {name} differs from "
                        f"the whole batch's by {check.max_abs:.3e} (max |g| {check.scale:.3e})"
                    )
            be.apply(reduced)
            # the run's weights are reproduced bit for bit only while every sum was of ≤ 2 lanes
            if rec.fingerprint is not None and exact:
                fingerprinted += 1
                if departure is None:
                    departure = _departure(rec, fingerprint(be.named_parameters()))
        out = work_dir / "partitions-state"
        work_dir.mkdir(parents=True, exist_ok=True)
        write_state(
            out, params=dict(be.named_parameters()), world=be.local_state(), layout=be.layout
        )
    finally:
        be.close()
        torch.set_num_threads(threads)
    return PartitionReplay(
        state=out,
        steps=len(steps),
        fingerprinted=fingerprinted,
        exact=exact,
        departure=departure,
        worst_split=worst,
        split_failures=tuple(failures),
        seconds=time.perf_counter() - t0,
    )


def replay_partitions_on_pool(
    records: Path,
    *,
    config: PoolConfig,
    work_dir: Path,
    start_timeout_s: float = 120.0,
    checkpoint: Callable[[], None] | None = None,
) -> PartitionReplay:
    """The run's partitions replayed on a fresh pool of the run's own lanes (any backend; what
    Megatron lanes use, which cannot be built in this process): before every step each recorded
    Hybrid replica is loaded from the Core's current state into a warm worker and activated,
    the step runs over exactly the recorded partition (the same lanes, the same Gloo sum), and
    the Hybrids leave again — a Hybrid that trained many steps in the run holds after each of
    them what a fresh load gives (a load is bit-exact), so the replay's weights must equal the
    run's after every step (fingerprints) and at the end. No whole-batch check here (that needs
    a lane in this process): `worst_split` is None. Final state: `work_dir/partitions-state`.
    `checkpoint`: as `replay_core_only`'s."""
    from ehp_fsm.training.pool import PoolFailure, TrainerPool  # pool's workers import verify

    t0 = time.perf_counter()
    steps = load_records(records)
    # the run's warm lanes of other machines are replayed here, on the same ranks
    warm = config.max_hybrids + len(config.remote_warm)
    cfg = config.with_(revisions=None, max_hybrids=warm, remote_warm=(), remote_core=())
    departure, fingerprinted = None, 0

    def must(x: Any, what: str, step: int) -> Any:
        if isinstance(x, PoolFailure):
            raise VerifyError(f"the partition replay failed at step {step} ({what})", str(x), "")
        return x

    with TrainerPool.spawn(
        cfg, work_dir=work_dir / "pool", start_timeout_s=start_timeout_s, checkpoint=checkpoint
    ) as pool:
        for rec in steps:
            if checkpoint is not None:
                checkpoint()
            hybrids = [r for r in rec.partition if not r.startswith("core:")]
            for replica, rank in _warm_ranks(rec, hybrids, pool.idle_warm_ranks()).items():
                must(pool.load_state(rank, replica=replica), f"loading {replica}", rec.step)
                pool.activate(replica)
            res = must(
                pool.step(
                    step=rec.step,
                    epoch=0,
                    partition=rec.partition,
                    batch=rec.batch,
                    publish=False,
                    fingerprint=True,
                ),
                "the step",
                rec.step,
            )
            for replica in hybrids:
                pool.deactivate(replica)
            if rec.fingerprint is not None and res.fingerprint is not None:
                fingerprinted += 1
                if departure is None:
                    departure = _departure(rec, res.fingerprint)
        out = work_dir / "partitions-state"
        must(pool.save_state(out), "saving its state", steps[-1].step)
    return PartitionReplay(
        state=out,
        steps=len(steps),
        fingerprinted=fingerprinted,
        exact=True,
        departure=departure,
        worst_split=None,
        split_failures=(),
        seconds=time.perf_counter() - t0,
    )


def _warm_ranks(rec: RecordedStep, hybrids: Sequence[str], idle: Sequence[int]) -> dict[str, int]:
    """The warm rank each of the step's Hybrids is replayed on: the rank it computed on in the
    run (recorded), so the Gloo sum adds the same terms in the same order; a Hybrid recorded
    without one takes the lowest idle rank left."""
    if len(hybrids) > len(idle):
        raise VerifyError(
            f"step {rec.step} was split over {len(hybrids)} Hybrids",
            f"the replay pool has {len(idle)} warm workers",
            "verify with the run's own plan (its max_hybrids)",
        )
    out = {h: rec.ranks[h] for h in hybrids if rec.ranks.get(h) in idle}
    left = [r for r in idle if r not in out.values()]
    for h in hybrids:
        if h not in out:
            out[h] = left.pop(0)
    return out


def _split_gradient(
    be: TorchBackend, rec: RecordedStep, shares: Sequence[tuple[str, Sequence[int]]]
) -> list[torch.Tensor]:
    """Σ (uᵢ/U)·ḡᵢ over the step's shares, as `weighted_allreduce_` forms it: each lane's
    gradient times its fp32 weight, then summed (in share order)."""
    deliveries = [be.compute(rec.batch.select(list(g)), step=rec.step, epoch=0) for _, g in shares]
    total = sum(d.record.samples for d in deliveries)
    out: list[torch.Tensor] | None = None
    for d in deliveries:
        w = torch.tensor(sample_weight(d.record.samples, total), dtype=torch.float32)
        scaled = [g.mul(w) for g in d.grads]
        out = scaled if out is None else [a.add_(b) for a, b in zip(out, scaled, strict=True)]
    assert out is not None
    return out


def _whole_gradient(be: TorchBackend, rec: RecordedStep) -> tuple[torch.Tensor, ...]:
    """The step's whole batch on the lane: ḡ over every group (what a Core alone computes)."""
    return tuple(be.compute(rec.batch, step=rec.step, epoch=0).grads)


def _weight_rel(a: tuple[float, float], b: tuple[float, float]) -> float:
    """How far fingerprint `a` is from `b` (the reference), relative to the weight's norm ‖x‖
    rather than to its sum (which may be near 0): max(|ΔΣx| / ‖x‖, |ΔΣx²| / ‖x‖²)."""
    if a == b:
        return 0.0
    norm2 = max(abs(b[1]), 1e-30)
    return max(abs(a[0] - b[0]) / math.sqrt(norm2), abs(a[1] - b[1]) / norm2)


def _fingerprint_rel(a: Fingerprint, b: Fingerprint) -> float:
    """The largest `_weight_rel` over the weights (inf: a weight missing on one side)."""
    if set(a) != set(b):
        return math.inf
    return max((_weight_rel(a[n], b[n]) for n in a), default=0.0)


def _departure(rec: RecordedStep, mine: Fingerprint) -> Departure | None:
    assert rec.fingerprint is not None
    theirs = rec.fingerprint
    differ: list[tuple[float, str]] = []
    for name in sorted(set(mine) | set(theirs)):
        a, b = theirs.get(name), mine.get(name)
        if a is None or b is None:
            differ.append((math.inf, name))
        elif a != b:
            differ.append((_weight_rel(a, b), name))
    if not differ:
        return None
    differ.sort(reverse=True)
    return Departure(
        step=rec.step,
        tensors=tuple(n for _, n in differ),
        max_rel=differ[0][0],
        partition=rec.partition,
    )


def _partition_replays(
    records: Path,
    *,
    config: PoolConfig,
    work_dir: Path,
    checkpoint: Callable[[], None] | None = None,
) -> tuple[PartitionReplay, PartitionReplay]:
    """(the replay that checks each split against the whole batch, the one that must equal the
    run bit for bit) — one and the same on torch lanes while no step summed more than two
    lanes (`replay_partitions` in this process); once one did (Core DP > 1 with a Hybrid), or on
    Megatron lanes, the exact one is `replay_partitions_on_pool`: the run's lanes, each Hybrid on
    its recorded rank, so every Gloo sum adds the same terms in the same order."""
    if config.backend != "torch":
        on_pool = replay_partitions_on_pool(
            records, config=config, work_dir=work_dir, checkpoint=checkpoint
        )
        return on_pool, on_pool
    split = replay_partitions(records, config=config, work_dir=work_dir, checkpoint=checkpoint)
    if split.exact:
        return split, split
    pool_dir = work_dir / "pool-replay"
    return split, replay_partitions_on_pool(
        records, config=config, work_dir=pool_dir, checkpoint=checkpoint
    )


def _pool_replay_dir(
    steps: Sequence[RecordedStep], config: PoolConfig, work_dir: Path
) -> Path | None:
    """Where `_partition_replays` replays the run's partitions on a pool, None: it does not
    (no Hybrid computed; or torch lanes and no step summed more than two, `replay_partitions`
    then being exact)."""
    if not any(r.hybrids for r in steps):
        return None
    if config.backend != "torch":
        return work_dir
    return work_dir / "pool-replay" if any(r.lanes > 2 for r in steps) else None


def _outcome(
    future: Future[PartitionReplay] | None,
) -> PartitionReplay | BaseException | None:
    """What the replay `future` ended with (its result or its exception), once it ended."""
    if future is None:
        return None
    try:
        return future.result()
    except BaseException as exc:
        return exc


def verify_run(
    records: Path,
    ehp_state: Path,
    *,
    config: PoolConfig,
    work_dir: Path,
    checkpoint: Callable[[], None] | None = None,
) -> tuple[ReplayResult, VerifyReport]:
    """Check the EHP run's final Core state (see the module doc, "What passes").

    No Hybrid ever computed groups: the Core-only replay repeats the run's exact operations and
    must match bit for bit. Otherwise the run must equal its recorded partitions replayed
    (bit-exact, and its fingerprints step by step, so the first step that departs is named) —
    in this process on torch lanes (`replay_partitions`, which also checks every step's split
    against the whole batch within `SPLIT_RTOL`), on a fresh pool of the run's lanes and ranks
    when that cannot be exact (`_partition_replays`: Megatron, or a step of more than two
    lanes). The Core-only replay's final state and per-step drift are reported beside it, not
    judged: a different split rounds differently, and over
    many steps that difference grows until a token at a clip bound flips and the trajectories
    part (not a transfer fault).

    The two replays on pools (the Core-only one, and the partition replay where it needs a
    pool) start together, each on its own pool: a pool's start-up (its processes' imports, the
    lanes' build) took most of either's time, one after the other ~40 s of a Megatron TP 2
    `--verify` on two loaded cores.

    `checkpoint`: called before each step of every replay (on both threads); what it raises
    ends them within a step and is raised as it is (a stop: the replays take about as long as
    the run's steps did)."""
    on_pool = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-partitions") as beside:
        if (where := _pool_replay_dir(load_records(records), config, work_dir)) is not None:
            on_pool = beside.submit(
                replay_partitions_on_pool,
                records,
                config=config,
                work_dir=where,
                checkpoint=checkpoint,
            )
        try:
            replay = replay_core_only(
                records, config=config, work_dir=work_dir, checkpoint=checkpoint
            )
        finally:  # its failure is the one shown; the other replay's is seen only alone
            partitions = _outcome(on_pool)
    if replay.hybrid_steps == 0:
        report = compare_states(ehp_state, replay.state, exact=True)
        alone = (*replay.repeated, *report.failures)
        return replay, replace(
            report,
            passed=not alone,
            failures=alone,
            notes=tuple(replay.drift_lines()),
        )
    drift = compare_states(ehp_state, replay.state, exact=False)
    if isinstance(partitions, BaseException):
        raise partitions
    if partitions is None:  # torch lanes, no step of more than two: this process, exact
        split, exact = _partition_replays(
            records, config=config, work_dir=work_dir, checkpoint=checkpoint
        )
    elif config.backend == "torch":  # the whole-batch check of each split needs a lane here
        split = replay_partitions(records, config=config, work_dir=work_dir, checkpoint=checkpoint)
        exact = partitions
    else:
        split = exact = partitions
    same = compare_states(ehp_state, exact.state, exact=exact.exact)
    failures = list(replay.repeated)
    failures += [] if exact.departure is None else [exact.departure.line()]
    failures += [f"the run vs its partitions replayed: {f}" for f in same.failures]
    failures += list(split.split_failures[:10])
    if len(split.split_failures) > 10:
        failures.append(f"… and {len(split.split_failures) - 10} more split differences")
    kind = "bit-exact" if exact.exact else f"within atol {ATOL:g} / rtol {RTOL:g}"
    worst = split.worst_split
    notes = [
        f"  the run vs its recorded partitions replayed ({kind} required): "
        + (
            "bit-exact"
            if all(c.bit_exact for c in same.categories.values())
            else f"param max|Δ| {same.categories['param'].max_abs:.3e}"
        )
        + f"; {exact.fingerprinted} of {exact.steps} steps compared by fingerprint: "
        + ("none departs" if exact.departure is None else f"departs at step {exact.departure.step}")
        + ("" if exact is split else " (replayed on a pool of the run's lanes and ranks)"),
        (
            "  each step's split vs the whole batch at the same weights: worst max|Δg| "
            f"{worst.rel:.1e} of max|g| (step {worst.step}, {worst.tensor}); "
            f"tolerance {SPLIT_RTOL:g}"
            if worst is not None
            else f"  (each step's split vs the whole batch: not checked on {config.backend} "
            "lanes, which are replayed on a pool)"
        ),
        *replay.drift_lines(),
        "  cost of the partition replay: "
        + (
            f"{split.seconds:.1f} s"
            if exact is split
            else f"{split.seconds:.1f} s in this process + {exact.seconds:.1f} s on a pool"
        ),
    ]
    mode = f"run == its partitions replayed, {kind}" + (
        f"; each split == whole batch within {SPLIT_RTOL:g}" if worst is not None else ""
    )
    return replay, replace(
        drift,
        passed=not failures,
        mode=mode,
        failures=tuple(failures),
        notes=tuple(notes),
        first_departure=None if exact.departure is None else exact.departure.step,
        table="the Core-only replay's final state vs the run's (reported, not judged: its "
        "trajectory drifts from the run's once a Hybrid computes):",
    )
