"""The verifiable task GRPO trains on: small arithmetic questions with an exactly checked answer.

What it knows: how to make the prompt of question `index` ("7+5=") deterministically from
`(seed, index)` alone (a SplitMix64 hash — no global randomness, no state), how to check a
completion exactly, how to score it, and how to lay whole GRPO groups out as a `GroupBatch` for
the losses in `ehp_fsm.training.grpo`. What it does not know: engines, HTTP, dispatch, training.

The reward (documented here because the run's curve is read against it):

* `1.0` — the completion is exactly the answer's decimal digits followed by EOS ("7<eos>").
* `format_credit + closeness_credit · max(0, 1 − |x − answer| / closeness_scale)` — a
  well-formed integer `x` (optional "-", no leading zero) followed by EOS, but not the answer.
  `format_credit + closeness_credit < 1` is enforced, so the exact answer is always strictly best.
* `0.0` — anything else (no EOS within `max_new_tokens`, stray characters, empty answer).

Defaults, and why (measured 2026-11-29 with an in-process GRPO loop on this 2-core machine: 8
prompts × 8 samples per step, Adam lr 1e-3, the default `PolicyConfig`, temperature 1):
questions `a+b=` with a, b in [0, 4] (25 questions, one-digit answers) and **no shaping**
(`format_credit = closeness_credit = 0`, so reward = exact). A random policy ends on EOS after
one digit often enough (≈ 1/9 of well-formed answers are right) that the exact reward alone is
dense: the exact rate went 0 → 0.3–0.6 within 200–300 steps (≈ 40 s) for policy seeds 0 and 1.
Every shaped variant we tried (format credit 0.02 or 0.1, closeness credit 0.3 over scales 3
and 10) collapsed the policy within ~30 steps onto one prompt-independent answer ("5", "11"):
a credit that any number earns rewards whichever number is already most likely, and the group
normalisation then sees flat groups and stops learning. Operands up to 9 collapsed likewise.
GRPO from scratch is still seed-sensitive (policy seed 2 collapsed onto "4" even unshaped), so
`Scored.exact` (and `exact_rate`) is always reported beside the reward: it is the figure that
says the task is being learnt; the shaping knobs stay for experiments.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import torch

from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.policy import BOS, EOS, PAD, PolicyConfig, decode, encode

#: What every request sets besides its temperature: the whole distribution, which the GRPO loss
#: takes π_θ to be (the softmax of the logits at the temperature, over the whole vocabulary).
#: Left unset, the server chose: SGLang merges `--preferred-sampling-params` under a request's
#: own keys (and its OpenAI routes take a model's generation_config.json defaults, Qwen3's
#: top_p 0.95 and top_k 20), the embedded engine took none of them.
PLAIN_SAMPLING: Final[dict[str, float | int]] = {
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}

OPS = "+-*"
_INT_RE = re.compile(r"^-?(0|[1-9][0-9]*)$")
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One SplitMix64 output for state `x` (a fixed, portable integer hash)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True, kw_only=True)
class Question:
    """One prompt: `text` is what the policy sees ("7+5="); `answer` is the exact result."""

    index: int
    a: int
    op: str
    b: int
    answer: int
    text: str

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """Token ids fed to the engine: BOS + characters (what the embedded engine does for
        `text`, so ids and text prompts agree)."""
        return (BOS, *encode(self.text))


@dataclass(frozen=True, kw_only=True)
class Scored:
    """How one completion scored: the shaped `reward`, and the two exact facts behind it."""

    reward: float
    exact: bool
    well_formed: bool


class Prompted(Protocol):
    """What a group's prompt offers: its index, text and the token ids the engine was given."""

    @property
    def index(self) -> int: ...

    @property
    def text(self) -> str: ...

    @property
    def prompt_ids(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, kw_only=True)
class GroupSamples:
    """The n completions of one GRPO group as an engine returned them, with their scores.

    `completions[i]` are the sampled token ids (EOS included when the sample stopped on it);
    `logprobs[i]` the engine's log-prob of each of them (the behaviour policy π_old), when it
    returned them; `revision` the weight version that generated the group."""

    group_index: int
    question: Prompted
    completions: tuple[tuple[int, ...], ...]
    scores: tuple[Scored, ...]
    logprobs: tuple[tuple[float, ...], ...] | None = None
    revision: int = 0

    def __post_init__(self) -> None:
        if len(self.completions) != len(self.scores):
            raise ValueError(
                f"group {self.group_index} has {len(self.completions)} completions but "
                f"{len(self.scores)} scores; score every completion once"
            )
        if not self.completions:
            raise ValueError(f"group {self.group_index} has no completions; a group needs n ≥ 1")
        if self.logprobs is not None and [len(x) for x in self.logprobs] != [
            len(c) for c in self.completions
        ]:
            raise ValueError(
                f"group {self.group_index}: the engine's log-probs do not match its tokens "
                "one for one"
            )

    @property
    def rewards(self) -> tuple[float, ...]:
        return tuple(s.reward for s in self.scores)

    @property
    def exact_count(self) -> int:
        return sum(s.exact for s in self.scores)


@dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """Questions `a op b =` with operands in `[0, max_operand]` and `op` drawn from `ops`."""

    seed: int = 0
    max_operand: int = 4
    ops: str = "+"
    max_new_tokens: int = 3
    format_credit: float = 0.0
    closeness_credit: float = 0.0
    closeness_scale: float = 3.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be ≥ 0, got {self.seed}")
        if not 0 <= self.max_operand <= 99:
            raise ValueError(
                f"max_operand must be in [0, 99], got {self.max_operand}; "
                "the tiny policy's context is 32 tokens"
            )
        if not self.ops or any(o not in OPS for o in self.ops):
            raise ValueError(f"ops must be a non-empty string of {OPS!r}, got {self.ops!r}")
        widest = max(len(str(x)) for x in _extremes(self.ops, self.max_operand))
        if self.max_new_tokens < widest + 1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} cannot hold the widest answer "
                f"({widest} characters) plus EOS; use at least {widest + 1}"
            )
        if self.format_credit < 0 or self.closeness_credit < 0 or self.closeness_scale <= 0:
            raise ValueError("format_credit and closeness_credit must be ≥ 0, closeness_scale > 0")
        if self.format_credit + self.closeness_credit >= 1.0:
            raise ValueError(
                f"format_credit + closeness_credit = "
                f"{self.format_credit + self.closeness_credit} must stay below 1.0, "
                "or a wrong answer could score as well as the exact one"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for GRPO sampling, got {self.temperature}")

    # -- prompts ---------------------------------------------------------------------------
    def question(self, index: int) -> Question:
        """Question `index` of this task; the same (seed, index) always gives the same one."""
        if index < 0:
            raise ValueError(f"question index must be ≥ 0, got {index}")
        h = _splitmix64((self.seed << 40) ^ index)
        span = self.max_operand + 1
        a, b = h % span, (h >> 16) % span
        op = self.ops[(h >> 32) % len(self.ops)]
        return Question(index=index, a=a, op=op, b=b, answer=_apply(op, a, b), text=f"{a}{op}{b}=")

    @property
    def seq_len(self) -> int:
        """Row length of every `GroupBatch` this task builds: BOS + longest prompt + completion."""
        m = str(self.max_operand)
        return 1 + len(f"{m}+{m}=") + self.max_new_tokens

    def check_config(self, config: PolicyConfig) -> None:
        """Raise ValueError if the policy cannot hold a prompt plus a full completion."""
        if self.seq_len > config.max_len:
            raise ValueError(
                f"the task needs rows of {self.seq_len} tokens, the policy's max_len is "
                f"{config.max_len}; lower max_operand/max_new_tokens or raise max_len"
            )

    def sampling_params(self, seed: int) -> dict[str, object]:
        """SGLang sampling params for one sample (`sampling_seed` makes it reproducible)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            **PLAIN_SAMPLING,  # the whole distribution, as the loss takes π_θ
            "sampling_seed": seed,
        }

    # -- scoring ---------------------------------------------------------------------------
    def score(self, question: Question, completion: Sequence[int]) -> Scored:
        """Exact check and shaped reward of one completion (see the module docstring)."""
        ids = list(completion)
        if EOS not in ids:
            return Scored(reward=0.0, exact=False, well_formed=False)
        body = ids[: ids.index(EOS)]
        if any(t <= EOS for t in body):  # PAD/BOS inside an answer is malformed
            return Scored(reward=0.0, exact=False, well_formed=False)
        text = decode(body)
        if not _INT_RE.match(text):
            return Scored(reward=0.0, exact=False, well_formed=False)
        value = int(text)
        if value == question.answer:
            return Scored(reward=1.0, exact=True, well_formed=True)
        close = max(0.0, 1.0 - abs(value - question.answer) / self.closeness_scale)
        return Scored(
            reward=self.format_credit + self.closeness_credit * close,
            exact=False,
            well_formed=True,
        )

    def score_group(
        self,
        group_index: int,
        completions: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]] | None = None,
        *,
        revision: int = 0,
    ) -> GroupSamples:
        q = self.question(group_index)
        return scored_group(
            q, completions, lambda cs: [self.score(q, c) for c in cs], logprobs, revision
        )

    # -- batches ---------------------------------------------------------------------------
    def build_batch(self, groups: Sequence[GroupSamples]) -> GroupBatch:
        """Whole groups as one `GroupBatch`, rows `seq_len` long (see `layout_batch`)."""
        return layout_batch(groups, seq_len=self.seq_len, pad=PAD)


def scored_group(
    question: Prompted,
    completions: Sequence[Sequence[int]],
    score: Callable[[tuple[tuple[int, ...], ...]], Sequence[Scored]],
    logprobs: Sequence[Sequence[float]] | None,
    revision: int,
) -> GroupSamples:
    """The group of `question` with its completions scored by `score` (any task's scoring),
    given the whole group at once: a user's reward scores a group in one hand-over to its
    thread (`data.rewards.Reward.score_group_sync`), not one per completion."""
    comps = tuple(tuple(int(t) for t in c) for c in completions)
    return GroupSamples(
        group_index=question.index,
        question=question,
        completions=comps,
        scores=tuple(score(comps)),
        logprobs=None if logprobs is None else tuple(tuple(map(float, x)) for x in logprobs),
        revision=revision,
    )


def layout_batch(groups: Sequence[GroupSamples], *, seq_len: int, pad: int) -> GroupBatch:
    """Whole groups as one `GroupBatch` (rows `seq_len` long, groups in the given order).

    Row = prompt completion PAD…; `completion[t]` is set where the logits at `t` predict a
    completion token (the EOS included), and `old_logp[t]` is the engine's log-prob of that
    token when every group carries log-probs (else the batch is on-policy)."""
    if not groups:
        raise ValueError("a batch needs at least one group")
    n = len(groups[0].completions)
    t = seq_len
    with_logp = all(g.logprobs is not None for g in groups)
    rows: list[list[int]] = []
    masks: list[list[bool]] = []
    olds: list[list[float]] = []
    rewards: list[float] = []
    for g in groups:
        if len(g.completions) != n:
            raise ValueError(
                f"group {g.group_index} has {len(g.completions)} samples, group 0 has {n}; "
                "every group of a batch has the same size"
            )
        prompt = list(g.question.prompt_ids)
        for i, (comp, s) in enumerate(zip(g.completions, g.scores, strict=True)):
            seq = (prompt + list(comp))[:t]
            rows.append(seq + [pad] * (t - len(seq)))
            masks.append([len(prompt) - 1 <= p < len(seq) - 1 for p in range(t)])
            rewards.append(s.reward)
            if with_logp:
                assert g.logprobs is not None
                lp = g.logprobs[i]
                row = [0.0] * t
                for k in range(len(seq) - len(prompt)):
                    row[len(prompt) - 1 + k] = lp[k]
                olds.append(row)
    return GroupBatch(
        group_ids=tuple(g.group_index for g in groups),
        group_size=n,
        tokens=torch.tensor(rows, dtype=torch.long),
        completion=torch.tensor(masks, dtype=torch.bool),
        # float64, as the rewards are and `group_advantages` computes: float32 rounded rewards
        # of 1e8, 1e8 + 1, 1e8 + 2, 1e8 + 3 all to 1e8, and the group's advantages to 0
        rewards=torch.tensor(rewards, dtype=torch.float64),
        old_logp=torch.tensor(olds, dtype=torch.float32) if with_logp else None,
    )


def exact_rate(groups: Sequence[GroupSamples]) -> float:
    """Fraction of all samples that are exactly right (0.0 for no samples)."""
    total = sum(len(g.scores) for g in groups)
    return sum(g.exact_count for g in groups) / total if total else 0.0


def mean_reward(groups: Sequence[GroupSamples]) -> float:
    """Mean shaped reward over all samples (0.0 for no samples)."""
    total = sum(len(g.scores) for g in groups)
    return sum(sum(g.rewards) for g in groups) / total if total else 0.0


def _extremes(ops: str, m: int) -> list[int]:
    """The answers of widest text for operands in [0, m]."""
    out = [0]
    if "+" in ops:
        out.append(m + m)
    if "-" in ops:
        out.append(-m)
    if "*" in ops:
        out.append(m * m)
    return out


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b
