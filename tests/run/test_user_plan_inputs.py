"""A new user's plans that `ehp-fsm check` said valid and `ehp-fsm run` then failed on, or worse:
each is refused now by `check` and by `run` alike, naming the key, before anything is written."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan
from ehp_fsm.run.inputs import prepare

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _plan(tmp: Path, *, run: str = "", grpo: str = "", model: str = "") -> Path:
    """examples/short.toml with its data, model and log in `tmp`; `run` and `grpo`: lines added
    to those tables, `model`: the `[model] path` line's replacement."""
    text = (EXAMPLES / "short.toml").read_text()
    text = text.replace('train = "data/', f'train = "{EXAMPLES}/data/')
    text = text.replace('path = "../runs/', f'path = "{tmp}/')
    text = text.replace('log = "runs/short/', f'log = "{tmp}/run/')
    if model:
        text = text.replace(f'path = "{tmp}/models/tiny-qwen3"', model)
    text = text.replace("[run]\n", f"[run]\n{run}\n", 1).replace("[grpo]\n", f"[grpo]\n{grpo}\n")
    path = tmp / "plan.toml"
    path.write_text(text)
    return path


def test_a_revisions_folder_shared_with_other_files_is_refused_not_emptied(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[run] revisions = "/shared"` (a folder every node sees, holding other files) passed
    `check`, and a fresh `run` removed that folder whole — the user's files with it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("mine")
    plan = _plan(tmp_path, run=f'revisions = "{shared}"')
    for command in ("check", "run"):
        assert main([command, str(plan)]) == 2, command
        err = capsys.readouterr().err
        assert "plan key `run.revisions` is invalid" in err, err
        assert "'notes.txt', which no run wrote there" in err and "Traceback" not in err, err
    assert (shared / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("inside", ["model", "log", "data"])
def test_a_revisions_folder_holding_the_runs_own_inputs_is_refused(
    tmp_path: Path, inside: str
) -> None:
    """The revisions folder the model, the log or the data lies in (or the log file itself):
    the model and data would be deleted by a fresh start; a log there ended the run with
    "Is a directory" and a fix meant for the embedded API."""
    folder = tmp_path / "work"
    if inside == "data":
        folder.mkdir()
        shutil.copy(EXAMPLES / "data" / "add-0-4.jsonl", folder / "train.jsonl")
    plan = _plan(
        tmp_path,
        run=f'revisions = "{tmp_path / "run" / "transitions.jsonl"}"'
        if inside == "log"
        else f'revisions = "{folder}"',
        model=f'path = "{folder}/model"' if inside == "model" else "",
    )
    if inside == "data":
        plan.write_text(
            plan.read_text().replace(f"{EXAMPLES}/data/add-0-4.jsonl", str(folder / "train.jsonl"))
        )
    loaded = load_plan(plan)
    with pytest.raises(PlanError) as info:
        prepare(loaded, create=False)
    assert info.value.key == "run.revisions", info.value
    key = {"model": "model.path", "log": "run.log", "data": "data.train"}[inside]
    assert f"it is or holds {key} = " in str(info.value), info.value


def test_the_runs_own_revisions_folder_is_accepted(tmp_path: Path) -> None:
    """A folder holding only what runs write there (revisions, their temporaries) is taken."""
    rev = tmp_path / "rev"
    (rev / "r00000003").mkdir(parents=True)
    (rev / ".tmp-r00000004-abc").mkdir()
    plan = _plan(tmp_path, run=f'revisions = "{rev}"')
    assert main(["check", str(plan)]) == 0


def test_curve_keys_in_the_run_directorys_keys_folder_are_refused_not_deleted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ehp-fsm keys RUN_DIR/keys ...` and `curve_keys` naming them: `check` said valid, and
    `run` removed them with the run directory's `keys/` as it started, then stopped: "key file
    .../controller.key_secret does not exist"."""
    from ehp_fsm.runtime.keys import generate_keys

    keys = tmp_path / "run" / "keys"
    generate_keys(keys, agents=["h0", "h1", "h2"])
    plan = _plan(tmp_path)
    plan.write_text(
        plan.read_text().replace("[transport]\n", f'[transport]\ncurve_keys = "{keys}"\n', 1)
    )
    assert load_plan(plan).transport.curve_keys == str(keys)
    for command in ("check", "run"):
        assert main([command, str(plan)]) == 2, command
        err = capsys.readouterr().err
        assert "plan key `transport.curve_keys` is invalid" in err, err
        assert "which a run removes as it starts" in err, err
    assert (keys / "controller.key_secret").is_file()


@pytest.mark.parametrize("value", ["0", "0.0", "-0.0"])
def test_a_learning_rate_of_zero_is_refused_by_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """`learning_rate = 0` passed `check`; `run` cleared the run directory and ended in a
    traceback ("ValueError: lr=0.0 must be > 0", from the trainer's Adam settings)."""
    plan = _plan(tmp_path, grpo=f"learning_rate = {value}")
    with pytest.raises(PlanError) as info:
        load_plan(plan)
    assert info.value.key == "grpo.learning_rate" and "must be above 0" in str(info.value)
    assert main(["check", str(plan)]) == 2
    assert "plan key `grpo.learning_rate` is invalid" in capsys.readouterr().err


def test_a_model_to_generate_in_a_folder_that_cannot_be_written_is_refused_by_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`[model] generate` with `path` on a read-only file system: `check` said valid (the model
    "to be generated"), `run` then refused it. The mount is real (a read-only tmpfs) where the
    test may mount one (root). Elsewhere the far edge is faked, for that folder only: the
    kernel's answers for a read-only mount (write access refused, `ST_RDONLY` in statvfs)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = (
        os.geteuid() == 0
        and shutil.which("mount") is not None
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    if not mounted:
        real_access, real_statvfs = os.access, os.statvfs

        def access(path: object, mode: int, **kw: object) -> bool:
            if Path(str(path)) == ro and mode & os.W_OK:
                return False
            return real_access(path, mode, **kw)  # type: ignore[arg-type]

        def statvfs(path: object) -> os.statvfs_result:
            got = real_statvfs(path)  # type: ignore[arg-type]
            if Path(str(path)) != ro:
                return got
            fields = list(got)
            fields[8] |= os.ST_RDONLY  # f_flag
            return os.statvfs_result(fields)

        monkeypatch.setattr(os, "access", access)
        monkeypatch.setattr(os, "statvfs", statvfs)
    try:
        plan = _plan(tmp_path, model=f'path = "{ro}/tiny"')
        assert main(["check", str(plan)]) == 2
        err = capsys.readouterr().err
        assert "plan key `model.path` is invalid" in err, err
        assert f"{ro} is on a read-only file system" in err, err
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize(
    ("key", "line"),
    [
        ("model.path", 'path = "~/models/tiny-qwen3"'),
        ("data.train", 'train = "~/prompts.jsonl"'),
        ("run.log", 'log = "~/runs/short/transitions.jsonl"'),
        ("run.revisions", 'revisions = "~/revisions"'),
    ],
)
def test_a_path_starting_with_a_tilde_is_refused_naming_the_key(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    key: str,
    line: str,
) -> None:
    """`path = "~/models/Qwen3-0.6B"` (as a shell would take it) was read as a folder named
    `~` in the plan's folder: "PLAN_DIR/~/models/Qwen3-0.6B is not a directory" for a model
    that was there, and with `generate` (or a `log` or `revisions` key) `run` made a folder
    literally named `~` — in the plan's folder or the current one — the one a later
    `rm -rf ~` removes the user's home with. Refused now by name, with the path it meant."""
    monkeypatch.chdir(tmp_path)  # a relative log starts here
    plan = _plan(tmp_path)
    text = plan.read_text()
    table, name = key.split(".")
    text = text.replace(f"[{table}]\n", f"[{table}]\n{line}\n", 1)
    if name in ("path", "train", "log"):  # the line it replaces
        old = {"path": f'path = "{tmp_path}/models/tiny-qwen3"',
               "train": f'train = "{EXAMPLES}/data/add-0-4.jsonl"',
               "log": f'log = "{tmp_path}/run/transitions.jsonl"'}[name]  # fmt: skip
        assert old in text, text
        text = text.replace(f"\n{old}\n", "\n", 1)
    plan.write_text(text)
    for command in ("check", "run"):
        assert main([command, str(plan)]) == 2, command
        err = capsys.readouterr().err
        assert f"plan key `{key}` is invalid" in err, err
        assert "starts with '~'" in err and str(Path.home()) in err, err
        assert "Traceback" not in err, err
    assert not list(tmp_path.rglob("~")), list(tmp_path.rglob("~"))
