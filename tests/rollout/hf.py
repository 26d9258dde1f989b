"""A tiny Hugging Face model for the rollout tests, and revisions made from it.

`init_model` writes a real architecture's config (Qwen3, a few small layers), seeded weights and
the arithmetic character tokenizer — ids agree with the arithmetic task's prompts. A revision's
weights are the model's tensors (tied duplicates dropped, as a trainer's publisher writes them)
plus noise seeded by the revision number, so revisions differ and each is reproducible.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ehp_fsm.models.load import load_model
from ehp_fsm.models.revision_dir import revision_tensors
from ehp_fsm.models.tiny import init_model


def make_model(dest: Path) -> Path:
    """The tiny model every rollout test serves (≈ 0.1 M parameters, 64-token context)."""
    return init_model(dest, seed=0)


@functools.lru_cache(maxsize=4)
def _base_tensors(base: str) -> dict[str, torch.Tensor]:
    return revision_tensors(load_model(base).model)


def revision_state(base: Path, revision: int) -> dict[str, torch.Tensor]:
    """`base`'s tensors perturbed by noise drawn with seed `revision` (new tensors each call)."""
    g = torch.Generator().manual_seed(revision)
    return {
        k: (v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)).detach()
        for k, v in _base_tensors(str(base)).items()
    }
