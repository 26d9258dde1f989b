"""`ehp-fsm run --verify` with `core.backend = "megatron"`: the CI's shortened
`examples/local-megatron.toml` (the short plan's sizes, so it fits the CI's time).

Real processes throughout: Megatron-Core Core and warm Hybrid lanes (GPTModel built from the HF
model through mbridge, DistributedOptimizer, Megatron's CPU compatibility layer), agents,
embedded engines serving the revisions the Megatron lanes export through mbridge. The planner
borrows at the first step boundary and the run returns the Hybrid at the end. The same at
Megatron TP 2 and at PP 2 (the Core and the Hybrid each a lane of two processes, the Hybrid
borrowing two engine slots, replica_size = 2) are the runs of `test_megatron_hybrid_dies.py`,
which also kill their Hybrid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from ehp_fsm.replay import check_receipt, replay
from tests.run.test_run import (
    assert_engines_at_end,
    assert_no_handler_failures,
    assert_no_orphans,
    plan_text,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-megatron.toml"


def test_the_example_is_the_default_plan_on_megatron() -> None:
    """What CI shortens: the example differs from the default plan only in the Core's backend,
    its name and log, its step count and its comments."""
    from ehp_fsm.plan import load_plan

    mine, default = load_plan(EXAMPLE), load_plan(EXAMPLE.parent / "local.toml")
    assert mine.core.backend == "megatron" and default.core.backend == "torch"
    assert mine.hosts == default.hosts and mine.engines == default.engines
    assert mine.ehp == default.ehp and mine.model == default.model
    assert mine.grpo.prompts_per_step == default.grpo.prompts_per_step


def test_the_tp2_example_is_the_megatron_example_at_tp2() -> None:
    """`examples/local-megatron-tp2.toml` differs from the Megatron example only in the Core's
    TP (two slots on h0), a fourth engine on h2's second slot, `replica_size` and its name; and
    the run takes it (nothing refused)."""
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.inputs import unsupported

    tp2, tp1 = load_plan(EXAMPLE.parent / "local-megatron-tp2.toml"), load_plan(EXAMPLE)
    assert (tp2.core.tp, tp2.core.gpus, tp2.ehp.replica_size) == (2, ("h0:g0", "h0:g1"), 2)
    assert tp2.engines[:3] == tp1.engines and [e.host for e in tp2.engines[3:]] == ["h2"]
    assert tp2.grpo == tp1.grpo and tp2.model == tp1.model and tp2.rollout == tp1.rollout
    assert unsupported(tp2) == []


def test_the_pp2_example_is_the_tp2_example_at_pp2() -> None:
    """`examples/local-megatron-pp2.toml` is the TP 2 example with the Core's two slots as two
    pipeline stages instead of two TP ranks (and its name); the run takes it."""
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.inputs import unsupported

    pp2 = load_plan(EXAMPLE.parent / "local-megatron-pp2.toml")
    tp2 = load_plan(EXAMPLE.parent / "local-megatron-tp2.toml")
    assert (pp2.core.tp, pp2.core.pp, pp2.core.gpus) == (1, 2, tp2.core.gpus)
    assert pp2.engines == tp2.engines and pp2.hosts == tp2.hosts and pp2.ehp == tp2.ehp
    assert pp2.grpo == tp2.grpo and pp2.model == tp2.model and pp2.rollout == tp2.rollout
    assert unsupported(pp2) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_megatron_run_borrows_returns_and_verifies(tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(log, 10).replace("[core]\n", '[core]\nbackend = "megatron"\n'))
    proc = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), "--verify"],
        capture_output=True,
        text=True,
        env={**os.environ, "EHP_TEST_RUN": run_id},
        timeout=280,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "step 10/10" in out and "borrow" in out and "return" in out, out
    receipt = json.loads((log.parent / "receipt.json").read_text())
    assert receipt["error"] is None and receipt["last_step"] == 10
    assert receipt["clean_controller"] is True and receipt["shutdown_errors"] == []
    kinds = [m["kind"] for m in receipt["moves"]]
    assert "borrow" in kinds and "return" in kinds, receipt["moves"]
    final = receipt["last_revision"]
    # every engine serves the last revision the Megatron Core exported through mbridge
    assert_engines_at_end(receipt, slots=2)
    verified = receipt["verify"]
    assert verified["passed"] is True and verified["hybrid_steps"] >= 1, verified["lines"]
    check_receipt(replay(log), receipt)
    revision = log.parent / "revisions" / f"r{final:08d}"
    loads_with_from_pretrained(revision)
    assert_no_handler_failures(log)
    assert_no_orphans(run_id)


def tp2_plan_text(log: Path, steps: int) -> str:
    """The short plan on Megatron at TP 2: the Core on h0's two slots, two engines on each of h1
    and h2, a Hybrid of two slots (a whole host's engines drained for it)."""
    text = plan_text(log, steps, engines=3)
    for host in ("h0", "h2"):
        text = text.replace(f'id = "{host}"\ngpus = 1', f'id = "{host}"\ngpus = 2')
    core = '[core]\ndp = 1\ngpus = ["h0:g0"]'
    assert core in text and "[ehp]\n" in text and "[rollout]\n" in text
    text = text.replace(
        core, '[core]\nbackend = "megatron"\ntp = 2\ndp = 1\ngpus = ["h0:g0", "h0:g1"]'
    )
    text = text.replace("[rollout]\n", '[[engines]]\nid = "e3"\nhost = "h2"\ntp = 1\n\n[rollout]\n')
    return text.replace("[ehp]\n", "[ehp]\nreplica_size = 2\n")


def pp2_plan_text(log: Path, steps: int) -> str:
    """`tp2_plan_text` at PP 2 instead: the Core a lane of two pipeline stages on h0's two
    slots, a Hybrid of the same two-stage shape borrowed from two engine slots."""
    text = tp2_plan_text(log, steps)
    assert "tp = 2\ndp = 1" in text
    return text.replace("tp = 2\ndp = 1", "pp = 2\ndp = 1")


# The same at TP 2 and at PP 2 (`tp2_plan_text`, `pp2_plan_text`: `--verify`, a Hybrid of the
# Core's shape borrowed from two engine slots and returned, both shards compared, the revision
# gathered over the lane loaded): on the runs `test_megatron_hybrid_dies.py` kills the Hybrid of
# (one run carries both).


def loads_with_from_pretrained(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    model, info = auto.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 6, 7]])).logits
    assert bool(torch.isfinite(logits).all())
