"""The run's task from a user's data: prompts from a JSONL file, a reward function, a tokenizer.

`DatasetTask` is what the dispatcher asks for prompts and scores with, and what the trainer
builds batches from: group `index` is the prompt at position `index` of the dataset's stream
(shuffled per epoch from the run's seed, `data.dataset`), sampled with the plan's temperature
and response length, and each completion is decoded with the model's tokenizer and scored by the
reward, a whole group per call (`data.rewards`: a failing reward raises `RewardError` naming the
prompt and the completion, or under `on_error = "zero"` is counted and that completion scores
0). A completion earns the "full" mark (`exact`, shown beside the reward) when its reward is at
least 1; it is well formed when it ended at a stop token (`models.stops`: the engine's set, e.g.
each of the three a Llama-3 instruct config lists, not only the tokenizer's one).

Knows: prompts, tokenizer, reward, response length, sampling temperature. Does not know:
engines, HTTP, training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ehp_fsm.data.dataset import PromptDataset, PromptValue
from ehp_fsm.data.rewards import Reward
from ehp_fsm.models.stops import model_json
from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.task import (
    PLAIN_SAMPLING,
    GroupSamples,
    Scored,
    layout_batch,
    scored_group,
)

#: The sampling keys a generation_config.json may set that a run does not use (`check` names
#: them): the plan's `[grpo] temperature` and `PLAIN_SAMPLING` are what the engines sample by.
GENERATION_DEFAULTS: Final = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def unused_generation_defaults(model_dir: Path | None) -> dict[str, Any]:
    """The sampling defaults of `model_dir`'s generation_config.json (those of
    `GENERATION_DEFAULTS` it sets), which the run does not sample by; empty without one."""
    if model_dir is None:  # a model still to be generated: it has none
        return {}
    try:
        doc = model_json(model_dir / "generation_config.json")
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: doc[k] for k in GENERATION_DEFAULTS if doc.get(k) is not None}


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """Group `index`'s prompt: `text` as the engine continues it, its ids, the label."""

    index: int
    text: str
    prompt: PromptValue
    label: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    ids: tuple[int, ...] = ()
    line: int = 0

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.ids


class DatasetTask:
    """See the module docstring."""

    def __init__(
        self,
        dataset: PromptDataset,
        tokenizer: Any,
        reward: Reward,
        *,
        max_new_tokens: int,
        temperature: float,
        max_prompt_len: int,
        stop_ids: frozenset[int] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.reward = reward
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seq_len = max_prompt_len + max_new_tokens
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        # the filler after a sequence's end (masked out of the loss, never attended to by the
        # tokens before it): the tokenizer's pad id, else its eos, else 0 — the first with a
        # row in the model's embedding (`vocab_size`): a pad token added to the tokenizer and
        # not to the model (id 19 of 19) passed `check`, then every step failed, IndexError
        self.pad = next(
            int(t)
            for t in (pad, eos, 0)
            if t is not None and (vocab_size is None or 0 <= int(t) < vocab_size)
        )
        #: the ids a response ends at (`models.stops.stop_token_ids`: the engine's set; None,
        #: the tokenizer's eos alone)
        self.stop_ids = (
            frozenset(() if eos is None else (int(eos),)) if stop_ids is None else stop_ids
        )

    def question(self, index: int) -> Prompt:
        ex = self.dataset.example_at(index)
        return Prompt(
            index=index,
            text=ex.text,
            prompt=ex.prompt,
            label=ex.label,
            metadata=ex.metadata,
            ids=tuple(ex.prompt_ids),
            line=ex.line,
        )

    def sampling_params(self, seed: int) -> dict[str, object]:
        """SGLang sampling params for one sample (`sampling_seed` makes it reproducible): the
        plan's temperature over the whole vocabulary (`PLAIN_SAMPLING`)."""
        out: dict[str, object] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            **PLAIN_SAMPLING,  # the rest of the distribution, never the server's defaults
            "sampling_seed": seed,
        }
        if self.stop_ids:
            out["stop_token_ids"] = sorted(self.stop_ids)
        return out

    def score(self, prompt: Prompt, completion: Sequence[int]) -> Scored:
        """One completion (a group of one; the run scores whole groups, `score_all`)."""
        return self.score_all(prompt, (completion,))[0]

    def score_all(self, prompt: Prompt, completions: Sequence[Sequence[int]]) -> list[Scored]:
        """The completions of `prompt`'s group, decoded and scored by the reward in one call
        (one hand-over to its thread for the group, `Reward.score_group_sync`)."""
        texts = [self.tokenizer.decode(list(c), skip_special_tokens=True) for c in completions]
        values = self.reward.score_group_sync(prompt.prompt, texts, prompt.label, prompt.metadata)
        return [
            Scored(reward=v, exact=v >= 1.0, well_formed=not self.stop_ids.isdisjoint(c))
            for v, c in zip(values, completions, strict=True)
        ]

    def score_group(
        self,
        group_index: int,
        completions: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]] | None = None,
        *,
        revision: int = 0,
    ) -> GroupSamples:
        q = self.question(group_index)
        return scored_group(q, completions, lambda cs: self.score_all(q, cs), logprobs, revision)

    def build_batch(self, groups: Sequence[GroupSamples]) -> GroupBatch:
        return layout_batch(groups, seq_len=self.seq_len, pad=self.pad)
