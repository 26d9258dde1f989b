"""What `mbridge` (0.15.1) builds of a Hugging Face config, and what it silently builds
otherwise: asked by `check` (`run.inputs`) and by the Megatron lane itself
(`backends.megatron.hf`) without importing Megatron."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

#: The activations mbridge 0.15.1 builds: it sets Megatron's `activation_func` to SiLU (gated)
#: for every architecture, whatever the config's `hidden_act` (HF's "swish" is SiLU too).
BRIDGED_ACTIVATIONS: Final = ("silu", "swish")


def bridge_refusal(config: Mapping[str, Any]) -> tuple[str, str] | None:
    """What of a Hugging Face config (`PretrainedConfig.to_dict()`) mbridge 0.15.1 does not
    build as the model has it: (what the model uses, why it cannot be built), or None. Each of
    these passed `check`, and the lane computed another function than the model the engines
    sample (the run trained off-policy, ratio ≠ 1 at step 1, exit 0), or exported fewer
    tensors than the model has (every engine then refused the revision)."""
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list | tuple):  # transformers 5: which layers slide, per layer
        sliding = sorted({str(t) for t in layer_types if t != "full_attention"})
        if sliding:
            return (
                f"uses {', '.join(sliding)} layers (layer_types; sliding_window "
                f"{config.get('sliding_window')})",
                "mbridge 0.15.1 builds full attention on every layer",
            )
    elif config.get("use_sliding_window"):
        return (
            f"uses sliding-window attention (sliding_window {config.get('sliding_window')})",
            "mbridge 0.15.1 builds full attention on every layer",
        )
    act = config.get("hidden_act")
    if act is not None and act not in BRIDGED_ACTIVATIONS:
        return (
            f"uses hidden_act {act!r}",
            "mbridge 0.15.1 builds every MLP with SiLU",
        )
    for key, what in (("attention_bias", "attention"), ("mlp_bias", "MLP")):
        if config.get(key):
            return (
                f"has {what} biases ({key} = true)",
                "mbridge 0.15.1 builds the output projections and MLP without biases (only "
                "Qwen2's fixed q/k/v biases and Llama's q/k/v), so the lane would drop them",
            )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, Mapping):
        kinds = {str(rope.get("rope_type", rope.get("type", "default")))}
        if not any(k in rope for k in ("rope_type", "type", "rope_theta")):  # per layer type
            kinds = {
                str(v.get("rope_type", v.get("type", "default")))
                for v in rope.values()
                if isinstance(v, Mapping)
            } or kinds
        if kinds - {"default"}:
            return (
                f"uses rope_type {', '.join(repr(k) for k in sorted(kinds - {'default'}))}",
                "mbridge 0.15.1 builds Megatron's plain rotary embedding from rope_theta only",
            )
    return None
