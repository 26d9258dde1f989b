"""One training lane: a model, its FP32 master weights and Adam state, laid out DP-zero style.

A lane is either one Core data-parallel rank (`dp_size` > 1: it owns one padded shard of every
flat buffer, runs Adam on the pieces of parameters inside that shard, then all-gathers the updated
master shards over its DP group into the model), or a DP1 Hybrid lane (`dp_size` = 1: it owns
whole buffers, with its own padding). The model may hold fp32 or bf16 parameters; the master
weights are always fp32.

What it knows: the lane's layout, its optimizer pieces, capture/restore of its exact state
(`LaneState`), loading shards from DP-zero world tensors. What it does not know: who computes
which groups, gradient reduction, the delivery ledger, how state travels between processes
(`dpzero.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ehp_fsm.errors import EhpError
from ehp_fsm.training.adam import AdamConfig, build_adam
from ehp_fsm.training.layout import FlatLayout, Piece
from ehp_fsm.training.reduction import require_finite

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


class TrainingStateError(EhpError):
    """A captured training state does not fit the lane it is restored into."""


@dataclass(frozen=True, kw_only=True)
class LaneSpec:
    role: Literal["core", "hybrid"]
    replica: str
    dp_rank: int = 0
    dp_size: int = 1
    pad_multiple: int = 64
    param_dtype: torch.dtype = torch.float32
    adam: AdamConfig = field(default_factory=AdamConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} must lie in [0, dp_size={self.dp_size})")
        if self.role == "hybrid" and self.dp_size != 1:
            raise ValueError(f"a Hybrid lane is DP1, got dp_size={self.dp_size}")
        if self.param_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"param_dtype={self.param_dtype} must be torch.float32 or bfloat16")
        if self.pad_multiple < 1:
            raise ValueError(f"pad_multiple={self.pad_multiple} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class LaneState:
    """An owned copy of a lane's whole training state.

    `params`: model parameters in the model dtype (fp32 or bf16), full tensors. `master`,
    `exp_avg`, `exp_avg_sq`: this lane's flat fp32 shard per buffer index, padding included
    (padding is zero). `steps`: Adam's step per parameter piece in this shard, one *independent*
    tensor each. `param_groups`: optimizer hyperparameters without `params`.
    """

    version: int
    layout: FlatLayout
    dp_rank: int
    params: Mapping[str, torch.Tensor]
    master: Mapping[int, torch.Tensor]
    exp_avg: Mapping[int, torch.Tensor]
    exp_avg_sq: Mapping[int, torch.Tensor]
    steps: Mapping[str, torch.Tensor]
    param_groups: tuple[dict[str, Any], ...]


class TrainingLane:
    def __init__(
        self, model: nn.Module, spec: LaneSpec, *, dp_group: dist.ProcessGroup | None = None
    ) -> None:
        if spec.dp_size > 1 and dp_group is None:
            raise ValueError(f"a lane with dp_size={spec.dp_size} needs its DP process group")
        self.spec = spec
        self.model = model.to(spec.param_dtype)
        self.dp_group = dp_group
        self.version = 0
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.layout = FlatLayout.build(
            [(n, tuple(p.shape)) for n, p in self.named],
            dp_size=spec.dp_size,
            pad_multiple=spec.pad_multiple,
            param_dtype=spec.param_dtype,
        )
        self.pieces: tuple[Piece, ...] = self.layout.pieces(spec.dp_rank)
        self._param = dict(self.named)
        self.master: dict[int, torch.Tensor] = {
            b.index: torch.zeros(b.shard_numel, dtype=torch.float32) for b in self.layout.buffers
        }
        with torch.no_grad():
            for pc in self.pieces:
                src = self._param[pc.name].detach().reshape(-1)[pc.param_start : pc.param_end]
                self._piece_view(self.master, pc).copy_(src)
        # Optimizer parameters are views into the flat master shards, and Adam's moments are
        # views into flat moment shards: the optimizer updates them in place, as a DP-zero
        # distributed optimizer does, so a shard is one contiguous tensor per key.
        self.exp_avg = {b: torch.zeros_like(t) for b, t in self.master.items()}
        self.exp_avg_sq = {b: torch.zeros_like(t) for b, t in self.master.items()}
        self.piece_params = [self._piece_view(self.master, pc) for pc in self.pieces]
        self.optimizer = build_adam(self.piece_params, spec.adam)
        self._install_steps(dict.fromkeys(self.param_names, 0.0))

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def _piece_view(flat: Mapping[int, torch.Tensor], pc: Piece) -> torch.Tensor:
        return flat[pc.buffer][pc.shard_start : pc.shard_start + pc.numel]

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.named)

    def grad_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(p.shape) for _, p in self.named)

    def step_tensors(self) -> list[torch.Tensor]:
        """Adam's per-piece step tensors (for checks that they are independent)."""
        return [self.optimizer.state[p]["step"] for p in self.piece_params]

    # -- training --------------------------------------------------------------------------
    def apply(self, reduced: Sequence[torch.Tensor]) -> int:
        """One optimizer step with the reduced (full-batch mean) fp32 gradients, in parameter
        order; then the model parameters are refreshed from the master weights. Returns the new
        version (optimizer steps taken)."""
        if len(reduced) != len(self.named):
            raise ValueError(f"{len(reduced)} gradients for {len(self.named)} parameters")
        require_finite(reduced, self.param_names)
        index = {n: i for i, n in enumerate(self.param_names)}
        for pc, p in zip(self.pieces, self.piece_params, strict=True):
            g = reduced[index[pc.name]].reshape(-1)[pc.param_start : pc.param_end]
            p.grad = g.to(torch.float32)
        self.optimizer.step()
        for p in self.piece_params:
            p.grad = None
        self.sync_params()
        self.version += 1
        return self.version

    def sync_params(self) -> None:
        """Write the master weights into the model parameters (all-gathering the DP shards)."""
        with torch.no_grad():
            for b in self.layout.buffers:
                shard = self.master[b.index]
                if self.layout.dp_size > 1:
                    parts = [torch.empty_like(shard) for _ in range(self.layout.dp_size)]
                    dist.all_gather(parts, shard, group=self.dp_group)
                    world = torch.cat(parts)
                else:
                    world = shard
                for slot in self.layout.params:
                    if slot.buffer == b.index:
                        seg = world[slot.offset : slot.offset + slot.numel]
                        self._param[slot.name].copy_(seg.view(slot.shape))

    # -- shard tensors (DP-zero) ------------------------------------------------------------
    def shard_tensors(self, *, copy: bool = True) -> dict[int, dict[str, torch.Tensor]]:
        """This lane's flat fp32 shards {buffer: {param, exp_avg, exp_avg_sq}}: owned copies, or
        with `copy=False` the live shards themselves (read-only use, e.g. sending them)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for b in self.master:
            trio = {
                "param": self.master[b],
                "exp_avg": self.exp_avg[b],
                "exp_avg_sq": self.exp_avg_sq[b],
            }
            out[b] = {k: t.clone() for k, t in trio.items()} if copy else trio
        return out

    def live_shards(self) -> dict[int, dict[str, torch.Tensor]]:
        """The live flat shards, to be written in place (e.g. by a scatter); call
        `install_loaded` afterwards."""
        return self.shard_tensors(copy=False)

    def piece_steps(self) -> dict[str, float]:
        """Adam's step per parameter that has a piece in this shard."""
        return {
            pc.name: float(self.optimizer.state[p]["step"])
            for pc, p in zip(self.pieces, self.piece_params, strict=True)
        }

    def hyperparameters(self) -> tuple[dict[str, Any], ...]:
        return tuple(
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        )

    def load_shards(
        self,
        shards: Mapping[int, Mapping[str, torch.Tensor]],
        *,
        steps: Mapping[str, float],
        hyper: Sequence[Mapping[str, Any]],
        version: int,
    ) -> None:
        """Install this lane's shards (fp32 master, Adam moments), a fresh step tensor per piece,
        and hyperparameters; then refresh the model parameters from the master weights (a DP
        collective when dp_size > 1: every rank of the group must call it)."""
        for b in self.layout.buffers:
            got = shards[b.index]
            for key in STATE_KEYS:
                if got[key].shape != (b.shard_numel,):
                    raise TrainingStateError(
                        f"buffer {b.index} `{key}` shard has shape {tuple(got[key].shape)}",
                        f"this lane's shard holds {b.shard_numel} elements",
                        "scatter world tensors with this lane's layout (dp_size, pad_multiple)",
                    )
        with torch.no_grad():
            for b in self.layout.buffers:
                self.master[b.index].copy_(shards[b.index]["param"])
                self.exp_avg[b.index].copy_(shards[b.index]["exp_avg"])
                self.exp_avg_sq[b.index].copy_(shards[b.index]["exp_avg_sq"])
        self.install_loaded(steps=steps, hyper=hyper, version=version)

    def install_loaded(
        self, *, steps: Mapping[str, float], hyper: Sequence[Mapping[str, Any]], version: int
    ) -> None:
        """After the flat shards were written: fresh step tensors, hyperparameters, version, and
        the model parameters refreshed from the master weights (a DP collective)."""
        self._install_steps(steps)
        self._set_hyper(hyper)
        self.version = version
        self.sync_params()

    def _install_steps(self, steps: Mapping[str, float] | Mapping[str, torch.Tensor]) -> None:
        scalar = torch.tensor(0.0).dtype  # torch Adam keeps `step` as a float32 scalar on CPU
        for pc, p in zip(self.pieces, self.piece_params, strict=True):
            if pc.name not in steps:
                raise TrainingStateError(
                    f"no Adam step for parameter {pc.name!r}",
                    "every piece carries its own step",
                    "capture state from a lane of the same model",
                )
            s = steps[pc.name]
            self.optimizer.state[p] = {
                "exp_avg": self._piece_view(self.exp_avg, pc),
                "exp_avg_sq": self._piece_view(self.exp_avg_sq, pc),
                # A fresh tensor per piece: a shared one would be advanced once per parameter.
                "step": (
                    s.detach().clone().to(scalar)
                    if isinstance(s, torch.Tensor)
                    else torch.tensor(float(s), dtype=scalar)
                ),
            }

    def _set_hyper(self, hyper: Sequence[Mapping[str, Any]]) -> None:
        if len(hyper) != len(self.optimizer.param_groups):
            raise TrainingStateError(
                f"{len(hyper)} param groups captured, lane has {len(self.optimizer.param_groups)}",
                "hyperparameters restore group by group",
                "build both lanes the same way",
            )
        for group, h in zip(self.optimizer.param_groups, hyper, strict=True):
            for k, v in h.items():
                if k != "params":
                    group[k] = v

    # -- capture / restore -----------------------------------------------------------------
    def capture(self) -> LaneState:
        shards = self.shard_tensors()
        return LaneState(
            version=self.version,
            layout=self.layout,
            dp_rank=self.spec.dp_rank,
            params={n: p.detach().clone() for n, p in self.named},
            master={b: s["param"] for b, s in shards.items()},
            exp_avg={b: s["exp_avg"] for b, s in shards.items()},
            exp_avg_sq={b: s["exp_avg_sq"] for b, s in shards.items()},
            steps={
                pc.name: self.optimizer.state[p]["step"].detach().clone()
                for pc, p in zip(self.pieces, self.piece_params, strict=True)
            },
            param_groups=self.hyperparameters(),
        )

    def restore(self, state: LaneState) -> None:
        """Install a captured state exactly: params (model dtype), fp32 master, moments, an
        independent step tensor per piece, hyperparameters and version. Local, no collective."""
        if state.layout != self.layout or state.dp_rank != self.spec.dp_rank:
            raise TrainingStateError(
                "captured state has another layout or DP rank",
                "capture/restore copies shards as they are; padding and DP size must match",
                "use the DP-zero gather/scatter (ehp_fsm.training.dpzero) to change layout",
            )
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(state.params[n])
            for b in self.master:
                self.master[b].copy_(state.master[b])
                self.exp_avg[b].copy_(state.exp_avg[b])
                self.exp_avg_sq[b].copy_(state.exp_avg_sq[b])
        self._install_steps(state.steps)
        self._set_hyper(state.param_groups)
        self.version = state.version
