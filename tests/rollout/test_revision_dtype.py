"""A bf16 model trained in fp32 publishes its revisions in bf16, the dtype its config names:
half the bytes written, hashed and read per install, and the same bits served. The embedded
engine builds its module in the config's dtype and casts what it installs into it, and
`from_pretrained` does the same cast (torch's fp32 → bf16, round to nearest even), so a revision
written in fp32 (as every one was) and the same weights written in bf16 serve identical
parameters. A model whose config names float32 (the default run's tiny model) publishes the same
bytes as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from ehp_fsm.models.revision_dir import distinct_tensors, write_revision
from ehp_fsm.models.tiny import init_model
from ehp_fsm.rollout import RevisionStore
from ehp_fsm.rollout.engine import EngineCore

from .hf import revision_state


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 whose config says bfloat16, as every Qwen3/Llama checkpoint on the Hub."""
    return init_model(tmp_path_factory.mktemp("bf16") / "tiny", seed=3, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory, bf16_model: Path) -> tuple[Path, Path]:
    """The same fp32 trainer weights (base weights plus noise bf16 cannot hold), published the
    old way (`write_revision` as it was called: fp32 as held) and by the store (now: bf16)."""
    state = revision_state(bf16_model, 1)  # the base loaded in float32, as the trainers hold it
    assert all(t.dtype == torch.float32 for t in state.values())
    # values bf16 cannot hold: the fp32 → bf16 cast rounds them (the comparison means something)
    assert all(not torch.equal(t, t.bfloat16().float()) for t in state.values())
    root = tmp_path_factory.mktemp("published")
    old = root / "fp32"
    write_revision(old, distinct_tensors(state), revision=1, parent=None, base=bf16_model, step=1)
    store = RevisionStore(root / "store")
    store.save(revision=1, step=1, state_dict=state, base=bf16_model)
    return old, store.path(1)


def _dtypes(revision: Path) -> dict[str, torch.dtype]:
    with safe_open(revision / "model.safetensors", framework="pt") as fh:
        return {name: fh.get_tensor(name).dtype for name in fh.keys()}  # noqa: SIM118


def test_a_bf16_model_trained_in_fp32_publishes_bf16_weights(
    published: tuple[Path, Path], bf16_model: Path
) -> None:
    old, new = published
    assert set(_dtypes(old).values()) == {torch.float32}
    assert set(_dtypes(new).values()) == {torch.bfloat16}, "floating tensors are written in bf16"
    # the same layout as the base model the config came with, and half the old weight bytes
    base = (bf16_model / "model.safetensors").stat().st_size
    assert (new / "model.safetensors").stat().st_size == base
    assert (old / "model.safetensors").stat().st_size > 1.9 * base


def _served(revision: Path) -> dict[str, torch.Tensor]:
    core = EngineCore()
    try:
        ok, message, _ = core.update_weights_from_disk(str(revision))
        assert ok, message
        model = core._model
        assert model is not None
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        core.shutdown()


def _assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def test_the_embedded_engine_serves_the_same_bits_from_either_revision(
    published: tuple[Path, Path],
) -> None:
    old, new = published
    from_old, from_new = _served(old), _served(new)
    assert {t.dtype for t in from_new.values()} == {torch.bfloat16}
    _assert_same_bits(from_old, from_new)


def test_the_embedded_engine_swapping_between_them_keeps_the_same_bits(
    published: tuple[Path, Path],
) -> None:
    """An install that reuses the module (same config) casts the fp32 revision the same way."""
    old, new = published
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(new))[0]
        model = core._model
        from_new = {k: v.clone() for k, v in model.state_dict().items()}
        assert core.update_weights_from_disk(str(old))[0]
        assert core._model is model  # the module is reused, its tensors replaced
        _assert_same_bits({k: v.clone() for k, v in model.state_dict().items()}, from_new)
    finally:
        core.shutdown()


def test_from_pretrained_gives_the_bf16_model_the_fp32_revision_gives_in_bf16(
    published: tuple[Path, Path],
) -> None:
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    old, new = published
    as_published = auto.from_pretrained(new, dtype="auto", local_files_only=True)
    cast = auto.from_pretrained(old, dtype=torch.bfloat16, local_files_only=True)
    assert {p.dtype for p in as_published.parameters()} == {torch.bfloat16}
    _assert_same_bits(as_published.state_dict(), cast.state_dict())


def test_a_float32_model_publishes_the_same_bytes_as_before(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The default run's tiny model names float32: its revisions are unchanged byte for byte."""
    state = revision_state(tiny_model, 2)
    old = tmp_path / "old"
    before = write_revision(old, distinct_tensors(state), revision=2, parent=None, base=tiny_model)
    store = RevisionStore(tmp_path / "store")
    now = store.save(revision=2, step=0, state_dict=state, base=tiny_model)
    assert now.sha256 == before.sha256
    assert (old / "model.safetensors").read_bytes() == (
        store.path(2) / "model.safetensors"
    ).read_bytes()
