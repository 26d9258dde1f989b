"""A user's own Hugging Face model directory: what `check` must refuse before `run` starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main
from tests.run.test_user_plan_inputs import _plan


def test_a_pytorch_model_bin_model_served_by_embedded_engines_is_refused_by_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded engines start from `[model] path` and load safetensors only: a
    `pytorch_model.bin` model on the torch backend passed `check`, then every engine failed to
    start ("has no safetensors weights") and the run ended at step 0. Refused now by `check`
    and `run`, naming `model.path`, before anything starts."""
    import torch
    from safetensors.torch import load_file

    from ehp_fsm.models.tiny import init_model

    model = init_model(tmp_path / "bin-model", arch="llama")
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    plan = _plan(tmp_path, model=f'path = "{model}"')
    plan.write_text(plan.read_text().replace('generate = "qwen3"\n', ""))  # the user's own
    assert f'path = "{model}"' in plan.read_text()
    for command in ("check", "run"):
        assert main([command, str(plan)]) == 2, command
        err = capsys.readouterr().err
        assert "plan key `model.path` is invalid" in err, err
        assert "pytorch_model.bin" in err and "embedded engines" in err, err
        assert "Traceback" not in err, err
    assert not (tmp_path / "run" / "transitions.jsonl").exists()  # nothing was started
