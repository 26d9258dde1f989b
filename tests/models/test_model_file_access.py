"""A model's weights that the user may not read are named so, not as a damaged file: safetensors
says "No such file or directory" of a file it may not open, and the refusal told the user to
copy the file again. And `ehp-fsm init-model` writes its weights as readable as its other files
(they were 0600 while the rest was 0644: a model shared on a machine was unreadable to others).

As root (CI runs so), a file's mode does not stop a read: the check runs in a process without
the capabilities that bypass it (`setpriv --bounding-set=-dac_override,-dac_read_search`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ehp_fsm.models.tiny import init_model

_CHECK = """
import sys
from pathlib import Path
from ehp_fsm.errors import EhpError
from ehp_fsm.models.load import _check_weight_files
try:
    _check_weight_files(Path(sys.argv[1]))
except EhpError as exc:
    print(exc)
"""


def _as_a_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *argv]


def test_init_model_writes_its_weights_as_readable_as_its_other_files(tmp_path: Path) -> None:
    model = init_model(tmp_path / "m", arch="qwen3", seed=0)
    config = (model / "config.json").stat().st_mode & 0o777
    assert (model / "model.safetensors").stat().st_mode & 0o777 == config


def test_unreadable_weights_are_named_as_such_not_as_a_damaged_file(tmp_path: Path) -> None:
    model = init_model(tmp_path / "m", arch="qwen3", seed=0)
    weights = model / "model.safetensors"
    weights.chmod(0)
    out = subprocess.run(
        _as_a_user([sys.executable, "-c", _CHECK, str(model)]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"weight file {weights} cannot be read: because Permission denied" in out.stdout, out
    assert "not valid" not in out.stdout and "copy the file again" not in out.stdout, out
    assert "chmod a+r" in out.stdout, out
