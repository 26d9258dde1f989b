"""A newcomer's first hour with the README (h-journey, 2026-12-06): the statements the README
gained from it, held to what the code does.

- the tiny model (`generate`, `ehp-fsm init-model`) has a character tokenizer that knows
  `0123456789+-*= ` only: any other character encodes as `<unk>`, which `check` says, naming the
  characters and the line (a first own prompt, "What is 2+3?", passed `check` without a word
  and trained as `<unk>`s);
- `check` names the dtype revisions are written in only where it differs from the training one;
- a plan without `[run] name` is named "plan" (not after its file) and logs to
  `runs/plan/transitions.jsonl`, and `[transport] controller` defaults to port 5555.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.models.tiny import init_model
from ehp_fsm.plan import load_plan

ALPHABET = "0123456789+-*= "


def _plan(tmp: Path, model: Path, prompt: str, *, header: str = "") -> Path:
    """The smallest plan a newcomer writes: no [run] table unless `header` gives one."""
    (tmp / "prompts.jsonl").write_text(json.dumps({"prompt": prompt, "label": "5"}) + "\n")
    (tmp / "my_rewards.py").write_text(
        "def score(prompt, completion, label, metadata):\n    return float(completion == label)\n"
    )
    plan = tmp / "first.toml"
    plan.write_text(
        f"{header}"
        '[[hosts]]\nid = "h0"\ngpus = 2\n'
        '[core]\ngpus = ["h0:g0"]\n'
        '[[engines]]\nid = "e0"\nhost = "h0"\ntp = 1\n'
        f'[model]\npath = "{model}"\nmax_prompt_len = 16\nmax_response_len = 4\n'
        '[data]\ntrain = "prompts.jsonl"\n'
        '[reward]\nfunction = "my_rewards:score"\n'
        "[grpo]\nprompts_per_step = 1\ngroup_size = 2\nsteps = 1\n"
        "[ehp]\nenabled = false\n"
    )
    return plan


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "tiny", arch="llama", seed=0)


def test_the_tiny_tokenizer_knows_the_readme_alphabet_and_encodes_the_rest_as_unk(
    tiny: Path,
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    specials = {"<pad>", "<bos>", "<eos>", "<unk>"}
    assert {t for t in tok.get_vocab() if t not in specials} == set(ALPHABET)
    ids = tok("What is 2+3?", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids).count("<unk>") == 7  # W h a t i s ?
    assert json.loads((tiny / "ehp_tiny.json").read_text())["vocab"] == ALPHABET


def test_check_takes_a_prompt_of_letters_for_the_tiny_model(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check` takes it (the plan runs) and says which characters the model sees as `<unk>`,
    and on which line; a prompt the tokenizer knows gets no such words."""
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(_plan(tmp_path, tiny, "What is 2+3?"))]) == 0
    out = capsys.readouterr().out
    assert "vocab 19" in out and "float32;" in out, out
    assert (
        "1 prompt(s) hold text the tokenizer does not know (line 1: 'W', 'h', 'a', 't', 'i', "
        "'s', '?'), encoded as '<unk>'" in out
    ), out
    assert "revisions in" not in out, out  # the same dtype: named once
    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert main(["check", str(_plan(tmp_path, bf16, "2+3="))]) == 0
    out = capsys.readouterr().out
    assert "does not know" not in out, out
    assert "float32 (revisions in bfloat16, its config.json's dtype)" in out, out


def test_an_unnamed_plan_is_plan_and_logs_to_runs_plan(tiny: Path, tmp_path: Path) -> None:
    plan = load_plan(str(_plan(tmp_path, tiny, "2+3=")))
    assert plan.name == "plan"
    assert Path(plan.log) == Path("runs/plan/transitions.jsonl")
    assert plan.transport.controller == "tcp://127.0.0.1:5555"


def test_a_plan_the_run_refuses_is_refused_before_its_port_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ehp-fsm run examples/gpu-4x8.toml` answered "cannot bind the controller to
    tcp://10.0.0.1:5555" where `check` promised the hosts' refusal, and a receipt and summary
    were left in `runs/gpu-4x8/` for a run that never began."""
    monkeypatch.chdir(tmp_path)
    gpu = Path(__file__).resolve().parents[2] / "examples" / "gpu-4x8.toml"
    assert main(["run", str(gpu)]) == 2
    err = capsys.readouterr().err
    assert "plan key `hosts[0].device` is invalid" in err and "cannot bind" not in err, err
    left = sorted(p.name for p in (tmp_path / "runs" / "gpu-4x8").iterdir())
    assert "receipt.json" not in left and "summary.txt" not in left, left


def test_a_resume_with_no_run_to_resume_writes_nothing(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run never.toml --resume` printed a summary and wrote `runs/never/receipt.json` and
    `summary.txt`, then said there was no run to resume."""
    monkeypatch.chdir(tmp_path)
    plan = _plan(tmp_path, tiny, "2+3=", header='[run]\nname = "never"\n')
    assert main(["run", str(plan), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "there is no run of plan 'never' to resume" in err, err
    run_dir = tmp_path / "runs" / "never"
    left = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert "receipt.json" not in left and "summary.txt" not in left, left
