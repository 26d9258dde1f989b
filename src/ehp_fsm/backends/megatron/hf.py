"""Megatron-Core GPTModels from Hugging Face directories, and back, through `mbridge`.

What it knows: how to ask `mbridge` (0.15.1) for the three conversions a Megatron lane of
`ehp-fsm run` needs — the HF config → Megatron `TransformerConfig`, the HF safetensors → the
GPTModel's weights, the GPTModel's weights → HF tensors (what each revision saves) — and the two
things mbridge 0.15.1 assumes that do not hold everywhere:

- Transformer Engine. mbridge builds the GPTModel with Megatron's Transformer Engine layer spec,
  whose fused modules name the pre-attention and pre-MLP norms `linear_qkv.layer_norm_*` and
  `linear_fc1.layer_norm_*`. Without Transformer Engine (any CPU machine) the lane is built with
  Megatron's local layer spec, and the local names are translated to the TE names with the
  `sharded_state_dict_keys_map` that Megatron's own local spec declares for exactly this
  purpose (its checkpoints are TE-compatible); mbridge's mapping then applies unchanged. No
  weight mapping is written here.
- transformers ≥ 5 keeps `rope_theta` inside `rope_parameters`; mbridge reads
  `config.rope_theta`. The default rope is passed through.
- What mbridge 0.15.1 silently builds otherwise is refused (`bridge_refusal`, which `check`
  asks too): a rope type with scaling (it builds the unscaled rope), sliding-window layers
  (full attention), a `hidden_act` other than SiLU (SiLU), attention or MLP biases beyond
  q/k/v (dropped).
- Tied word embeddings under PP. The last stage holds Megatron's copy of the embedding as its
  output layer; mbridge maps that copy to the HF embedding for Qwen2/Qwen3 only (Llama's
  bridge asks a tied checkpoint for an `lm_head.weight` it does not hold). Every bridge here
  maps it to the embedding; the export, which then yields the embedding from both stages,
  refuses two copies that differ. mbridge's Qwen2/Qwen3 bridge writes that mapping into its
  class, for every later bridge of the process: each bridge here writes into its own copy.

Under PP each rank builds and loads its own stage (`build_gpt`), and the export is collective
over the pipeline group: every stage gets the whole HF state dict.

What it does not know: optimizers, DDP, process groups (the caller initialises Megatron's
parallel state before building: mbridge reads TP/PP/CP from it), revisions on disk.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from ehp_fsm.backends.megatron.errors import MegatronBackendError
from ehp_fsm.models.bridged import bridge_refusal

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def _local_keys_map() -> dict[str, str]:
    """Megatron's local spec's own map from its module names to the TE spec's names."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec: Any = get_gpt_layer_local_spec()
    return dict(spec.submodules.sharded_state_dict_keys_map)


class _TiedOutputBridge:
    """Mixed in front of every architecture's mbridge class: with tied word embeddings, the
    last pipeline stage's output layer (Megatron's copy of the embedding under PP > 1; at PP 1
    the output layer has no weight of its own) is the HF embedding tensor. mbridge 0.15.1 maps
    it so for Qwen2/Qwen3 only; Llama's bridge asks for an `lm_head.weight` a tied checkpoint
    does not hold."""

    def _adjust_mapping_for_shared_weights(self) -> None:
        """mbridge 0.15.1's Qwen2 bridge (Qwen3's too) points `output_layer.weight` at the
        embedding for a tied model by writing into its class's `_DIRECT_MAPPING`: every
        bridge built after it in the process, untied ones included, then loaded and exported
        the output layer as the embedding. The instance gets its own copy to write into."""
        mapping: Any = getattr(self, "_DIRECT_MAPPING", None)
        if isinstance(mapping, dict):
            self._DIRECT_MAPPING = dict(mapping)
        parent: Any = super()
        parent._adjust_mapping_for_shared_weights()

    def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
        parent: Any = super()
        hf_config: Any = self.hf_config  # type: ignore[attr-defined]  # set by mbridge's Bridge
        if name == "output_layer.weight" and getattr(hf_config, "tie_word_embeddings", False):
            name = "embedding.word_embeddings.weight"
        names: list[str] = parent._weight_name_mapping_mcore_to_hf(name)
        return names


class _LocalSpecBridge:
    """Mixed in front of the architecture's mbridge class when Transformer Engine is missing:
    the local layer spec, and its names translated to the TE names mbridge maps from."""

    _keys_map: dict[str, str]

    def _get_transformer_layer_spec(self, vp_stage: int | None = None) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        config: Any = self.config  # type: ignore[attr-defined]  # set by mbridge's Bridge
        self.has_vp_stage = True
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)

    def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
        for local, te in self._keys_map.items():
            name = name.replace(f".{local}", f".{te}")
        parent: Any = super()
        names: list[str] = parent._weight_name_mapping_mcore_to_hf(name)
        return names


def _hf_config(model_dir: str) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError) as exc:
        raise MegatronBackendError(
            f"the config of {model_dir} cannot be loaded",
            f"transformers said: {exc}",
            "point [model] path at a Hugging Face directory (config.json)",
        ) from exc
    refusal = bridge_refusal(config.to_dict())
    if refusal is not None:
        raise MegatronBackendError(
            f"{model_dir} {refusal[0]}",
            refusal[1],
            "use a model without it, or core.backend = 'torch' (transformers builds it whole)",
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "rope_theta", None) is None and "rope_theta" in rope:
        config.rope_theta = rope["rope_theta"]
    return config


def bridge_for(model_dir: str | Path, *, dtype: torch.dtype) -> Any:
    """The mbridge bridge of the model in `model_dir` (its `model_type` picks the class), for
    parameters of `dtype`. Megatron's parallel state must be initialised (TP/PP/CP come from it).
    `bridge.config` is the Megatron `TransformerConfig`."""
    from mbridge import AutoBridge
    from mbridge.core.bridge import _MODEL_REGISTRY

    config = _hf_config(str(model_dir))
    kind = getattr(config, "model_type", None)
    if kind not in _MODEL_REGISTRY:
        raise MegatronBackendError(
            f"mbridge has no bridge for model_type {kind!r}",
            f"mbridge 0.15.1 knows {sorted(AutoBridge.list_supported_models())}",
            "use a supported architecture (e.g. qwen3, llama), or core.backend = 'torch'",
        )
    cls = _MODEL_REGISTRY[kind]
    if not HAVE_TE:
        cls = type(
            f"Local{cls.__name__}", (_LocalSpecBridge, cls), {"_keys_map": _local_keys_map()}
        )
    cls = type(f"Tied{cls.__name__}", (_TiedOutputBridge, cls), {})
    # Megatron splits the vocabulary over TP: mbridge pads it (zero rows, cut off again on
    # export) when the model's own does not divide; the lane cuts the padded logits off.
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    bridge = cls(config, dtype=dtype, make_vocab_size_divisible_by=tp if tp > 1 else None)
    # Initialise on CPU from the seed (then overwritten by the HF weights and moved to this
    # rank's device); no dropout (a delivery must be a function of its groups); Megatron's
    # fused softmax kernel exists on CUDA only.
    bridge.set_extra_args(
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=torch.cuda.is_available(),
        # mbridge turns sequence parallelism on with TP; it needs reduce-scatter, which Gloo
        # (CPU) lacks, and Megatron's torch norms refuse it. TP runs without it.
        sequence_parallel=False,
    )
    return bridge


def build_gpt(bridge: Any) -> torch.nn.Module:
    """The GPTModel of the bridge's configuration: this rank's pipeline stage (the whole model
    at PP 1; under PP the first stage holds the embedding, the last the final norm and output
    layer — with tied embeddings a copy of the embedding, which Megatron initialises from the
    first stage's over its embedding group)."""
    from megatron.core import parallel_state

    provider = bridge._model_provider([])
    model: torch.nn.Module = provider(
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    return model


def load_hf_weights(bridge: Any, model: torch.nn.Module, model_dir: str | Path) -> None:
    """Copy the HF safetensors of `model_dir` into `model` (mbridge's mapping and TP split)."""
    with torch.no_grad():
        bridge.load_weights([model], str(model_dir))


def hf_state_dict(bridge: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as an HF state dict (mbridge's export: merged TP shards, split
    fused QKV and gate/up projections, every pipeline stage's tensors broadcast over PP), owned
    CPU copies, the same on every rank. Collective over Megatron's TP and PP groups (every rank
    of them calls it). Under PP with tied embeddings the first stage's embedding and the last
    stage's output layer both export as the HF embedding; they must be equal."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in bridge.export_weights([model]):
            value = tensor.detach().to("cpu", copy=True).contiguous()
            if name in out and not torch.equal(out[name], value):
                raise MegatronBackendError(
                    f"the two pipeline copies of the tied {name} differ",
                    "the first stage's embedding and the last stage's output layer are one "
                    "tied weight; their gradients must be summed over Megatron's embedding "
                    "group before every step",
                    "step the lane only with deliveries of MegatronBackend.compute",
                )
            out[name] = value
    return out
