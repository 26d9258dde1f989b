"""The trainer pool's shared vocabulary: its configuration, the worker command line, the
control-channel encodings of tensors, batches and delivery records, and the result values.

Both sides import it: `pool.py` (the coordinator) and `worker.py` (the trainer process).
Tensors travel as raw bytes with dtype and shape (int64, bool, float32 only), decoded with
`torch.frombuffer` after checking that the byte count matches — never pickle. Results are frozen
values; a failed pool operation is a `PoolFailure` value naming the rank, not an exception.
What it does not know: sockets, processes, torch.distributed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Final, Literal

import torch

from ehp_fsm.core.batch import Delivery, GroupPartition
from ehp_fsm.errors import EhpError
from ehp_fsm.runtime import identity as ident
from ehp_fsm.runtime.errors import IdentityError
from ehp_fsm.runtime.protocol import PROCESS_ENTRY_SCHEMA, check_fields
from ehp_fsm.training.adam import AdamConfig
from ehp_fsm.training.grpo import ON_POLICY, GroupBatch
from ehp_fsm.training.objective import ObjectiveConfig, ObjectiveMetrics
from ehp_fsm.training.policy import PolicyConfig
from ehp_fsm.training.reduction import DEFAULT_BUCKET_BYTES

BACKENDS = ("torch", "megatron")
MAX_WARM_WORKERS = 32  # one trainer process each, all in one Gloo world with the Core
#: The largest frame on the pool's channel (`PoolConfig.max_message_bytes`).
DEFAULT_MAX_MESSAGE_BYTES: Final = 16 * 2**20
_TENSOR_DTYPES = {
    "int64": torch.int64,
    "bool": torch.bool,
    "float32": torch.float32,
    "float64": torch.float64,  # a batch's rewards (`layout_batch`)
}


class PoolError(EhpError):
    """The pool was used in a way it cannot honour (a caller bug, not a worker failure)."""


class StaleStateError(PoolError):
    """A warm worker was activated with a state version other than the Core's current one."""


# -- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """What every trainer process of one pool is built from (travels as JSON in argv)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)  # the toy, when no `model`
    model: str = ""  # a Hugging Face model directory: what every lane trains
    objective: ObjectiveConfig = field(default_factory=lambda: ON_POLICY)
    seed: int = 0
    core_dp: int = 1
    max_hybrids: int = 1
    adam: AdamConfig = field(default_factory=AdamConfig)
    core_pad_multiple: int = 64
    hybrid_pad_multiple: int = 48  # deliberately not the Core's: the transfer re-pads
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    collective_timeout_s: float = 60.0
    #: how long the first member of the pool's first world waits in its rendezvous for the last
    #: (workers start one by one, remote ones through their agents, beside the engines' start);
    #: the run's `[deadlines.run] trainers_start`. A re-formed world's rendezvous and every
    #: collective have `collective_timeout_s`.
    join_timeout_s: float = 120.0
    command_timeout_s: float = 120.0
    revisions: str | None = None  # RevisionStore root; None = do not save revisions
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    respawn_warm: bool = True  # replace a warm worker that died (pool-launched workers only)
    # What every lane is built on (`training.lanes`): "torch", or "megatron" (Megatron-Core
    # through mbridge; `model` must be an HF directory). `device`: where the lanes run ("cpu":
    # a Megatron lane goes through Megatron's CPU compatibility layer).
    backend: str = "torch"
    device: str = "cpu"
    # Megatron tensor and pipeline parallelism: every lane (Core DP rank or warm Hybrid) is
    # `tp × pp` processes (`lane_size`) — the pool's worker for the lane (lane rank 0) and its
    # followers (`worker.py`); lane rank = PP stage × tp + TP rank.
    tp: int = 1
    pp: int = 1
    # Warm lanes on other machines: the host id of each, in rank order after the `max_hybrids`
    # lanes the pool launches itself. Each is launched by its host's agent (`launcher` of the
    # pool), trains only Hybrids borrowed on that host, and is known dead from its agent's word.
    remote_warm: tuple[str, ...] = ()
    # Core lanes on other machines: for each Core rank, the host id whose agent launches it
    # (`launcher` of the pool; known dead from that agent's word), or None for a lane the pool
    # launches itself; () = every Core lane is the pool's.
    remote_core: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if self.core_dp < 1:
            raise ValueError(f"core_dp={self.core_dp} must be >= 1 (the Core always trains)")
        if self.remote_core and len(self.remote_core) != self.core_dp:
            raise ValueError(
                f"remote_core names {len(self.remote_core)} Core lanes and core_dp={self.core_dp}"
                ": give one entry per Core rank (None: launched by the pool), or none"
            )
        if self.max_hybrids < 0 or self.max_hybrids + len(self.remote_warm) > MAX_WARM_WORKERS:
            raise ValueError(
                f"max_hybrids={self.max_hybrids} with {len(self.remote_warm)} remote warm lanes "
                f"must lie in [0, {MAX_WARM_WORKERS}] in all: the pool starts one warm trainer "
                "process per lane, all in one Gloo world"
            )
        if min(self.collective_timeout_s, self.command_timeout_s, self.join_timeout_s) <= 0:
            raise ValueError(
                "collective_timeout_s, command_timeout_s and join_timeout_s must be > 0"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} must be one of {list(BACKENDS)}")
        if self.backend == "megatron" and not self.model:
            raise ValueError("backend='megatron' builds its GPTModel from an HF directory (model)")
        if self.tp < 1 or (self.tp > 1 and self.backend != "megatron"):
            raise ValueError(
                f"tp={self.tp}: tensor parallelism is built on the 'megatron' backend only "
                "(the torch lanes are data-parallel); tp must be >= 1"
            )
        if self.pp < 1 or (self.pp > 1 and self.backend != "megatron"):
            raise ValueError(
                f"pp={self.pp}: pipeline parallelism is built on the 'megatron' backend only "
                "(the torch lanes are data-parallel); pp must be >= 1"
            )

    @property
    def lane_size(self) -> int:
        """Processes per lane: TP × PP (1 on the torch backend)."""
        return self.tp * self.pp

    def stage_and_tp(self, lane_rank: int) -> tuple[int, int]:
        """(PP stage, TP rank) of lane rank `lane_rank` (lane rank = stage × tp + TP rank)."""
        return divmod(lane_rank, self.tp)

    def lane_part(self, lane_rank: int) -> str:
        """Lane rank `lane_rank` as a person reads it: "TP rank K" in a lane of one pipeline
        stage, else "PP stage S, TP rank K"."""
        stage, tp_rank = self.stage_and_tp(lane_rank)
        return f"TP rank {tp_rank}" if self.pp == 1 else f"PP stage {stage}, TP rank {tp_rank}"

    @property
    def world_size(self) -> int:
        return self.core_dp + self.max_hybrids + len(self.remote_warm)

    @property
    def core_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.core_dp))

    @property
    def warm_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.core_dp, self.world_size))

    def home(self, rank: int) -> str | None:
        """The host whose agent launches rank `rank` (None: the pool launches it, on the
        coordinator's machine): a Core rank's from `remote_core`, a warm rank's from
        `remote_warm` (the first `max_hybrids` warm ranks are the pool's)."""
        if rank < self.core_dp:
            return self.remote_core[rank] if self.remote_core else None
        i = rank - self.core_dp - self.max_hybrids
        return self.remote_warm[i] if 0 <= i < len(self.remote_warm) else None

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """The ranks launched by their hosts' agents (`home` is not None)."""
        return tuple(r for r in range(self.world_size) if self.home(r) is not None)

    @property
    def remote_hosts(self) -> list[str]:
        """The hosts whose agents launch ranks of the pool (sorted)."""
        return sorted({h for r in self.remote_ranks if (h := self.home(r)) is not None})

    def core_replica(self, rank: int) -> str:
        return f"core:{rank}"

    def to_json(self) -> str:
        d = asdict(self)
        d["adam"]["betas"] = list(self.adam.betas)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PoolConfig:
        d = json.loads(text)
        adam = dict(d.pop("adam"))
        adam["betas"] = tuple(adam["betas"])
        d["remote_warm"] = tuple(d.get("remote_warm", ()))
        d["remote_core"] = tuple(d.get("remote_core", ()))
        return cls(
            policy=PolicyConfig(**d.pop("policy")),
            objective=ObjectiveConfig(**d.pop("objective")),
            adam=AdamConfig(**adam),
            **d,
        )

    @property
    def model_source(self) -> PolicyConfig | str:
        """What the lanes build: the Hugging Face directory, or the built-in toy policy."""
        return self.model or self.policy

    def with_(self, **changes: Any) -> PoolConfig:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(changes)
        return PoolConfig(**d)


#: The launch token of an identity whose token was not sent (`parse_parent`).
UNSENT: Final = "unsent"
#: A lane's rank 0 exits with this code when another rank of its lane (a follower) exited.
FOLLOWER_LOST_EXIT: Final = 5


def parent_argument(parent: ident.ProcessIdentity) -> dict[str, Any]:
    """`parent` as a worker's `--parent` carries it: host, pid and start time — what tells
    whether it still runs — without its launch token (a secret; `parse_parent`)."""
    return {k: v for k, v in parent.to_dict().items() if k != "launch_token"}


def parse_parent(text: str) -> ident.ProcessIdentity:
    """The identity a worker's `--parent` names (`parent_argument`). Its launch token was not
    sent: the worker only asks whether its parent still runs (`identity.is_alive`), which the
    token does not enter into."""
    return ident.ProcessIdentity.from_dict({**json.loads(text), "launch_token": UNSENT})


def worker_argv(
    config: PoolConfig,
    *,
    rank: int,
    control: str,
    rendezvous: str,
    parent: ident.ProcessIdentity | None = None,
    python: str = sys.executable,
    standby: bool = False,
) -> list[str]:
    """The command line that starts world rank `rank` of a pool (what a host agent launches).

    `control`: the pool's ZeroMQ endpoint (`TrainerPool.control`); `rendezvous`: the Gloo
    init method (`TrainerPool.rendezvous`); `parent`: the coordinator's identity — the worker
    exits when that process is gone (no orphans). `standby`: a replacement warm worker that
    joins the world only when the pool admits it.

    No secret is on it (`/proc/PID/cmdline` is readable by every user): the pool's launch token
    and the launch's route reach the worker in its environment (`EHP_POOL_TOKEN`,
    `EHP_POOL_ROUTE`: `TrainerPool.worker_env`), and `parent` is named by host, pid and start
    time alone.
    """
    if not 0 <= rank < config.world_size:
        raise PoolError(
            f"rank {rank} is outside the pool's world of {config.world_size}",
            "ranks 0..core_dp-1 are Core lanes, the rest warm Hybrid workers",
            f"pass a rank in [0, {config.world_size})",
        )
    argv = [
        python,
        "-m",
        "ehp_fsm.training.worker",
        "--rank",
        str(rank),
        "--control",
        control,
        "--rendezvous",
        rendezvous,
        "--config",
        config.to_json(),
    ]
    if parent is not None:
        argv += ["--parent", json.dumps(parent_argument(parent))]
    if standby:
        argv.append("--standby")
    return argv


# -- tensors and batches on the wire (raw bytes + dtype + shape; never pickle) -------------------


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TENSOR_DTYPES:
        raise PoolError(
            f"tensor dtype {t.dtype} cannot travel on the control channel",
            f"only {sorted(_TENSOR_DTYPES)} are sent",
            "convert it before sending",
        )
    return {"dtype": name, "shape": list(t.shape), "data": t.contiguous().numpy().tobytes()}


def decode_tensor(obj: Mapping[str, Any]) -> torch.Tensor:
    dtype = _TENSOR_DTYPES.get(str(obj.get("dtype")))
    shape = obj.get("shape")
    data = obj.get("data")
    if dtype is None or not isinstance(shape, list) or not isinstance(data, bytes):
        raise PoolError(
            "malformed tensor on the control channel",
            f"dtype={obj.get('dtype')!r} shape={shape!r} data={type(data).__name__}",
            "send tensors with `encode_tensor`",
        )
    numel = 1
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise PoolError("malformed tensor shape", f"{shape!r}", "send non-negative ints")
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if numel * itemsize != len(data):
        raise PoolError(
            "tensor bytes do not match its shape",
            f"{len(data)} bytes for shape {shape} of {dtype}",
            "send tensors with `encode_tensor`",
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def encode_batch(batch: GroupBatch) -> dict[str, Any]:
    out = {
        "group_ids": list(batch.group_ids),
        "group_size": batch.group_size,
        "tokens": encode_tensor(batch.tokens),
        "completion": encode_tensor(batch.completion),
        "rewards": encode_tensor(batch.rewards.to(torch.float64)),
    }
    if batch.old_logp is not None:
        out["old_logp"] = encode_tensor(batch.old_logp.to(torch.float32))
    return out


def decode_batch(obj: Mapping[str, Any]) -> GroupBatch:
    return GroupBatch(
        group_ids=tuple(int(g) for g in obj["group_ids"]),
        group_size=int(obj["group_size"]),
        tokens=decode_tensor(obj["tokens"]),
        completion=decode_tensor(obj["completion"]),
        rewards=decode_tensor(obj["rewards"]),
        old_logp=decode_tensor(obj["old_logp"]) if "old_logp" in obj else None,
    )


def delivery_to_wire(d: Delivery) -> dict[str, Any]:
    return {
        "step": d.step,
        "epoch": d.epoch,
        "replica": d.replica,
        "samples": d.samples,
        "shapes": [list(s) for s in d.shapes],
    }


def delivery_from_wire(obj: Mapping[str, Any]) -> Delivery:
    return Delivery(
        step=int(obj["step"]),
        epoch=int(obj["epoch"]),
        replica=str(obj["replica"]),
        samples=int(obj["samples"]),
        shapes=tuple(tuple(int(x) for x in s) for s in obj["shapes"]),
    )


_INT = frozenset({int})
_DELIVERY_WIRE: Mapping[str, tuple[frozenset[type] | None, bool]] = {
    "step": (_INT, True),
    "epoch": (_INT, True),
    "replica": (frozenset({str}), True),
    "samples": (_INT, True),
    "shapes": (frozenset({list}), True),
}
#: A worker's hello inventory (`worker.py` sends it), checked before the pool reads a field.
_HELLO_INVENTORY: Mapping[str, tuple[frozenset[type] | None, bool]] = {
    "rank": (_INT, True),
    "role": (frozenset({str}), True),
    "world_size": (_INT, True),
    "identity": (frozenset({dict}), True),
    "version": (_INT, True),
    "grad_shapes": (frozenset({list}), True),
    "standby": (frozenset({bool}), True),
    "threads": (frozenset({dict, type(None)}), False),
}


def _shapes_problem(shapes: list[Any], where: str) -> str | None:
    for i, s in enumerate(shapes):
        if type(s) is not list or any(type(x) is not int or x < 0 for x in s):
            return f"wrong_type: {where}[{i}] is not a list of sizes"
    return None


def delivery_wire_problem(obj: Any) -> str | None:
    """Why `obj` is not a delivery record `delivery_from_wire` can read (None: it is)."""
    if type(obj) is not dict:
        return f"wrong_type: the record is {type(obj).__name__}"
    return check_fields(obj, _DELIVERY_WIRE, "record.") or _shapes_problem(
        obj["shapes"], "record.shapes"
    )


#: The numbers of a worker's `compute` reply besides its record (`worker._compute`)
_COMPUTE_NUMBERS: Final = ("loss", "compute_s", "compute_cpu_s")
_METRICS: Final = {f.name: f.type for f in fields(ObjectiveMetrics)}


def compute_reply_problem(res: Mapping[str, Any]) -> str | None:
    """Why a worker's `compute` reply cannot be read (None: it can): its delivery record, its
    numbers (a NaN loss is a number: the reduction refuses the gradients of a diverged step)
    and its metrics. A malformed one raised in the step's thread; it is a failure of that rank."""
    if (problem := delivery_wire_problem(res.get("record"))) is not None:
        return problem
    for key in _COMPUTE_NUMBERS:
        value = res.get(key, 0.0)
        if type(value) not in (int, float):
            return f"wrong_type: {key} is {type(value).__name__}"
    metrics = res.get("metrics", {})
    if type(metrics) is not dict:
        return f"wrong_type: metrics is {type(metrics).__name__}"
    for key, value in metrics.items():
        kind = _METRICS.get(key)
        if kind is None:
            return f"unknown_field: metrics.{str(key)[:40]}"
        if type(value) not in ((int,) if kind in (int, "int") else (int, float)):
            return f"wrong_type: metrics.{key} is {type(value).__name__}"
    return None


def hello_problem(inventory: Mapping[str, Any]) -> tuple[str | None, ident.ProcessIdentity | None]:
    """(why a worker's hello inventory cannot be taken, None) or (None, the identity it names):
    a malformed hello is dropped by name, never read half-way."""
    problem = (
        check_fields(inventory, _HELLO_INVENTORY, "inventory.")
        or _shapes_problem(inventory["grad_shapes"], "inventory.grad_shapes")
        or check_fields(inventory["identity"], PROCESS_ENTRY_SCHEMA, "inventory.identity.")
    )
    if problem is not None:
        return problem, None
    threads = inventory.get("threads") or {}
    if type(threads.get("intra_op", 0)) is not int:
        return "wrong_type: inventory.threads.intra_op is not an int", None
    try:
        return None, ident.ProcessIdentity.from_dict(inventory["identity"])
    except IdentityError as exc:
        return f"bad_identity: {exc}", None


# -- results ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """One trainer process as it introduced itself at hello."""

    rank: int
    role: Literal["core", "hybrid"]
    identity: ident.ProcessIdentity
    version: int
    intra_op_threads: int = 0  # torch intra-op threads the worker runs with (1 on the CPU plan)


@dataclass(frozen=True, kw_only=True)
class RankTimings:
    compute_s: float
    reduce_s: float
    apply_s: float
    publish_s: float = 0.0
    compute_cpu_s: float = 0.0  # the compute's on-CPU time (thread time): immune to waiting


@dataclass(frozen=True, kw_only=True)
class RankReply:
    """What one live lane reported for a step."""

    rank: int
    replica: str
    delivery: Delivery
    loss: float
    version: int
    timings: RankTimings


@dataclass(frozen=True, kw_only=True)
class StepResult:
    step: int
    epoch: int
    version: int  # the Core version after the step
    loss: float  # Σ (uᵢ/U)·lossᵢ: the full-batch loss
    ranks: tuple[RankReply, ...]
    revision: int | None  # None when nothing was saved (publish=False, or publish_error)
    revision_path: str | None
    wall_s: float  # compute + ledger + commit, as the coordinator saw it
    # Hybrid replicas whose worker died after the reduction (their gradient counted, the step
    # stands): the caller fails their machines as for any other dead Hybrid.
    lost: tuple[str, ...] = ()
    lost_why: Mapping[str, str] = field(default_factory=dict)  # replica -> how it died
    # Why saving the new weights as a revision failed (a full disk, a revision number not newer
    # than the store's last): the step itself stands on every lane — only the publish did not
    # happen; the caller publishes later (`TrainerPool.publish`) or stops.
    publish_error: str | None = None
    metrics: ObjectiveMetrics = field(default_factory=ObjectiveMetrics)  # over every lane
    # (Σx, Σx²) per weight after the step on Core rank 0 (`step(fingerprint=True)`; --verify)
    fingerprint: Mapping[str, tuple[float, float]] | None = None

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(r.replica for r in self.ranks)

    def phase_s(
        self,
        name: Literal["compute_s", "compute_cpu_s", "reduce_s", "apply_s", "publish_s"],
    ) -> float:
        """The slowest lane's time in one phase."""
        return max(float(getattr(r.timings, name)) for r in self.ranks)


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    rank: int
    replica: str
    version: int  # the state version the warm worker loaded (== the Core's)
    seconds: float  # load_state called → worker reports its lane loaded (ready)


@dataclass(frozen=True, kw_only=True)
class Restored:
    """A Core state installed by `TrainerPool.restore_state`, held to its save's digests."""

    version: int  # the restored optimizer version
    # per TP shard (`tp0`, ...): tensors compared bit for bit, the digest computed from the lane
    checked: Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True, kw_only=True)
class PoolFailure:
    """A pool operation did not complete. A value, not an exception: the caller decides.

    `reason`: `dead` (a worker process is gone), `deadline` (no answer in time),
    `worker_error` (the worker raised; `detail` has its message), `ledger` (a delivery was
    rejected or missing), `broken` (an earlier failure inside a collective left the world unusable),
    `cancelled` (the caller gave a step up before its commit: nothing reduced or stepped).
    `broken_world`: True when surviving ranks may be stuck in a collective — shut the pool down.
    """

    op: str
    reason: Literal["dead", "deadline", "worker_error", "ledger", "broken", "cancelled"]
    rank: int | None
    replica: str | None
    detail: str
    broken_world: bool = False

    def __str__(self) -> str:
        who = f"rank {self.rank}" + (f" ({self.replica})" if self.replica else "")
        return f"trainer pool {self.op} failed on {who}: {self.reason}: {self.detail}"


def as_partition(
    partition: GroupPartition | Mapping[str, Sequence[int]],
    *,
    step: int,
    epoch: int,
    group_size: int,
) -> GroupPartition:
    if isinstance(partition, GroupPartition):
        if (partition.step, partition.epoch) != (step, epoch):
            raise PoolError(
                f"partition is for (step {partition.step}, epoch {partition.epoch}), "
                f"the step is ({step}, {epoch})",
                "deliveries are stamped with the step's own (step, epoch)",
                "partition the groups for this step and epoch",
            )
        return partition
    return GroupPartition(
        step=step,
        epoch=epoch,
        group_size=group_size,
        assignments=tuple((r, tuple(int(g) for g in partition[r])) for r in sorted(partition)),
    )
