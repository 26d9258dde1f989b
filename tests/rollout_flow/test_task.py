"""The arithmetic task: deterministic questions, the exact check, the reward and the batch
layout the GRPO loss reads (pure; no processes)."""

from __future__ import annotations

import pytest
import torch

from ehp_fsm.training.grpo import ON_POLICY, group_advantages, replica_loss
from ehp_fsm.training.policy import EOS, PAD, PolicyConfig, build_policy, encode
from ehp_fsm.training.task import ArithmeticTask, exact_rate, mean_reward


def test_questions_depend_only_on_seed_and_index() -> None:
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert [a.question(i) for i in range(50)] == [b.question(i) for i in range(50)]
    assert [q.text for q in map(ArithmeticTask(seed=4).question, range(50))] != [
        q.text for q in map(a.question, range(50))
    ]
    for i in range(200):
        q = a.question(i)
        assert 0 <= q.a <= 4 and 0 <= q.b <= 4 and q.answer == q.a + q.b
        assert q.text == f"{q.a}+{q.b}=" and q.prompt_ids[1:] == tuple(encode(q.text))
    mixed = ArithmeticTask(ops="+-*", max_operand=9)
    ops = {mixed.question(i).op for i in range(100)}
    assert ops == {"+", "-", "*"}


def test_reward_is_exact_and_shaping_never_beats_the_answer() -> None:
    task = ArithmeticTask()
    q = task.question(0)
    right = [*encode(str(q.answer)), EOS]
    assert task.score(q, right).exact and task.score(q, right).reward == 1.0
    assert task.score(q, encode(str(q.answer))).reward == 0.0  # no EOS: not an answer
    assert task.score(q, [*encode(f"0{q.answer}"), EOS]).reward == 0.0  # leading zero
    assert task.score(q, [*encode("1+"), EOS]).reward == 0.0
    shaped = ArithmeticTask(format_credit=0.1, closeness_credit=0.3)
    wrong = [*encode(str(q.answer + 1)), EOS]
    s = shaped.score(q, wrong)
    assert not s.exact and s.well_formed and 0.1 < s.reward < 1.0
    with pytest.raises(ValueError, match=r"below 1\.0"):
        ArithmeticTask(format_credit=0.5, closeness_credit=0.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ArithmeticTask(max_operand=9, ops="*", max_new_tokens=2)


def test_batch_layout_matches_the_grpo_loss() -> None:
    task = ArithmeticTask()
    task.check_config(PolicyConfig())
    q0 = task.question(0)
    g0 = task.score_group(0, [[*encode(str(q0.answer)), EOS], [*encode("9"), EOS]])
    g1 = task.score_group(1, [[*encode("12")], [EOS]])
    batch = task.build_batch([g0, g1])
    assert batch.tokens.shape == (4, task.seq_len) and batch.group_size == 2
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    row = batch.tokens[0].tolist()
    p = len(q0.prompt_ids)
    assert row[:p] == list(q0.prompt_ids) and row[p : p + 2] == [*encode(str(q0.answer)), EOS][:2]
    assert row[-1] == PAD
    # the mask marks exactly the positions whose next token is a completion token
    assert batch.completion[0].nonzero().flatten().tolist() == list(range(p - 1, p + 1))
    assert exact_rate([g0, g1]) == 0.25 and mean_reward([g0, g1]) == 0.25
    assert group_advantages(batch.rewards, batch.group_size)[2:].abs().sum() == 0  # flat group
    out = replica_loss(build_policy(PolicyConfig(), seed=0), batch, ON_POLICY)
    assert torch.isfinite(out.loss) and out.weight == 4  # seq_mean: weighed by its samples
