"""A resume reads back a saved Core state (`resume/state-<step>/`: `index.json` and one torch
file per tensor) that a damaged disk or a hand may have changed since the save. Each change is
refused before the optimizer state is installed, naming the file and what to do — a truncated,
empty or replaced tensor file, a malformed index, an index whose Adam steps or hyperparameters
were changed (they are not tensors: the tensors' digests did not cover them, and a resume
trained on with another step count or learning rate), a `latest.json` naming a folder outside
`resume/` — and, on a Core of two ranks, without breaking the pool's world."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.run.resume import (
    RESUME_DIR,
    ResumeError,
    ResumePoint,
    drop_revisions_after,
    latest_state,
    restore,
)
from ehp_fsm.training.dpzero import local_dp_zero, scatter_dp_zero
from ehp_fsm.training.lane import LaneSpec, TrainingLane
from ehp_fsm.training.pool import PoolFailure, TrainerPool
from ehp_fsm.training.verify import (
    INDEX_FILE,
    VerifyError,
    check_restored,
    read_index,
    read_state,
    write_state,
)
from tests.training_pool.rig import batch_of, ok, run_step, tiny_config


def _lane(seed: int) -> TrainingLane:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return TrainingLane(model, LaneSpec(role="hybrid", replica="h", pad_multiple=4))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A state dir after three optimizer steps (Adam steps 3, moments not the initial ones)."""
    a = _lane(0)
    for _ in range(3):
        a.apply([torch.randn(s) for s in a.grad_shapes()])
    path = tmp_path / "state-000003"
    write_state(path, params=dict(a.named), world=local_dp_zero(a), layout=a.layout)
    return path


def _master_file(path: Path) -> Path:
    entry = next(e for e in read_index(path)["tensors"] if e["key"].startswith("master/"))
    return path / str(entry["file"])


def _edit_index(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    index = json.loads((path / INDEX_FILE).read_text())
    change(index)
    (path / INDEX_FILE).write_text(json.dumps(index, indent=1))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:100])


def _empty(f: Path) -> None:
    f.write_bytes(b"")


def _not_a_tensor(f: Path) -> None:
    torch.save({"numel": 1}, f)


def _a_directory(f: Path) -> None:
    f.unlink()
    f.mkdir()


def _a_fifo(f: Path) -> None:  # opening it would wait for a writer forever
    f.unlink()
    os.mkfifo(f)


def _a_link_elsewhere(f: Path) -> None:
    f.unlink()
    f.symlink_to("/proc/self/status")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "damage",
    [_truncate, _empty, _not_a_tensor, _a_directory, _a_fifo, _a_link_elsewhere],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_damaged_tensor_file_is_refused_naming_it(
    saved: Path, damage: Callable[[Path], None]
) -> None:
    """It was raised as it came (`EOFError: ` and nothing else for an empty file, a torch zip
    error, `'dict' object has no attribute 'numel'`), naming no file; on a Core of two ranks
    rank 0 raised before it told its peer, which then waited in the scatter (the pool broke)."""
    f = _master_file(saved)
    damage(f)
    with pytest.raises(VerifyError, match=f"{f.name}.*master/") as err:
        read_state(saved, _lane(1).layout)
    assert "with --fresh" in str(err.value)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d["tensors"].__setitem__(1, "t00001.pt"), "TypeError"),
        (lambda d: d["tensors"][1].pop("file"), "file"),
        (lambda d: d["tensors"][1].__setitem__("file", "../elsewhere.pt"), "elsewhere"),
        (lambda d: d["tensors"][1].__setitem__("file", "/etc/passwd"), "passwd"),
        (lambda d: d["steps"].__setitem__("0.weight", "x"), "x"),
        (lambda d: d["hyper"][0].pop("lr"), "lr"),
        (lambda d: d.__setitem__("version", "three"), "three"),
    ],
    ids=["entry", "no-file", "dotdot", "absolute", "steps", "hyper", "version"],
)
def test_a_malformed_index_is_refused_naming_it(
    saved: Path, change: Callable[[dict[str, Any]], None], named: str
) -> None:
    _edit_index(saved, change)
    with pytest.raises(VerifyError, match=f"{INDEX_FILE}.*{named}"):
        read_state(saved, _lane(1).layout)


def test_an_index_that_is_not_an_object_is_refused_naming_it(saved: Path) -> None:
    (saved / INDEX_FILE).write_text("[]")
    with pytest.raises(VerifyError, match=f"{INDEX_FILE}.*not a JSON object"):
        read_state(saved, _lane(1).layout)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["steps"].__setitem__("0.weight", 2.0),  # '3' -> '2': one bit on the disk
        lambda d: d["hyper"][0].__setitem__("lr", 0.003),
        lambda d: d["hyper"][0].__setitem__("eps", 1e-3),
        lambda d: d["tensors"][2].__setitem__("sha256", "0" * 64),
    ],
    ids=["adam-step", "lr", "eps", "tensor-digest"],
)
def test_an_index_changed_after_the_save_is_refused_before_anything_is_installed(
    saved: Path, change: Callable[[dict[str, Any]], None]
) -> None:
    """The Adam steps and hyperparameters come from the index, and the restored lane was held
    to the index itself: a step count or learning rate changed there was installed and passed
    the check, and the resumed run trained on from optimizer state the killed run never had."""
    _edit_index(saved, change)
    b = _lane(1)
    before = local_dp_zero(b)
    with pytest.raises(VerifyError, match=f"{INDEX_FILE}.*changed since the save"):
        read_state(saved, b.layout)
    assert local_dp_zero(b).steps == before.steps  # nothing was installed


def test_an_intact_state_still_restores_bit_for_bit(saved: Path) -> None:
    b = _lane(1)
    scatter_dp_zero(read_state(saved, b.layout), b, group=None)
    n, digest = check_restored(saved, params=dict(b.named), world=local_dp_zero(b), layout=b.layout)
    assert n == 4 * len(b.layout.params) and digest is not None


def test_a_latest_json_naming_a_folder_outside_resume_is_refused(tmp_path: Path) -> None:
    """`latest.json` names the state by its folder in `resume/`; a path there (absolute, or
    with `..`) restored whatever state dir it pointed at."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / INDEX_FILE).write_text("{}")
    root = tmp_path / "run" / RESUME_DIR
    root.mkdir(parents=True)
    for name in (str(elsewhere), "../../elsewhere"):
        (root / "latest.json").write_text(json.dumps({"step": 3, "state": name}))
        with pytest.raises(ResumeError, match=r"latest\.json.*not a folder of"):
            latest_state(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_core_of_two_ranks_refuses_a_damaged_state_by_name_and_stays_usable(
    tmp_path: Path,
) -> None:
    """Core DP2: rank 0 reads the state and scatters it. A damaged file is refused on rank 0
    and its peer is told before any transfer; the pool is not broken, and the intact state
    restores afterwards."""
    cfg = tiny_config(core_dp=2, max_hybrids=0, command_timeout_s=60.0)
    with TrainerPool.spawn(cfg, work_dir=tmp_path / "pool") as pool:
        ok(run_step(pool, 0, 0, batch_of(0)))
        ok(pool.save_state(tmp_path / "s"))
        shutil.copytree(tmp_path / "s", tmp_path / "damaged")
        f = _master_file(tmp_path / "damaged")
        _empty(f)
        got = pool.restore_state(tmp_path / "damaged")
        assert isinstance(got, PoolFailure)
        assert f.name in str(got) and not got.broken_world, str(got)
        # the resume's message: the file and one fix (it gave two "Fix:", the second
        # hedging "where the reason names the saved state ...")
        point = ResumePoint(
            step=1,
            state=tmp_path / "damaged",
            next_group=0,
            segment=tmp_path / "transitions.1.jsonl",
            chain=None,
            stopped=(),
            repair="",
            abandoned=(),
        )
        with pytest.raises(ResumeError) as err:
            restore(pool, point)
        said = str(err.value)
        assert f.name in said and said.count("Fix:") == 1, said
        assert "start the run again with --fresh (or from an intact copy" in said, said
        restored = ok(pool.restore_state(tmp_path / "s"))
        assert restored.version == 1
        ok(run_step(pool, 1, 0, batch_of(1)))


def _revision(root: Path, r: int) -> Path:
    path = root / f"r{r:08d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    return path


def test_a_revision_linked_from_elsewhere_is_unlinked_and_what_it_points_to_kept(
    tmp_path: Path,
) -> None:
    """The killed run's revisions from the restored one on are removed; one that is a symbolic
    link to a folder outside the store was left silently (`rmtree` refuses a link), and the
    resume failed at its first publication above it."""
    store = RevisionStore(tmp_path / "revisions")
    _revision(store.root, 1)
    _revision(store.root, 2)
    outside = _revision(tmp_path / "outside", 7)
    (store.root / "r00000003").symlink_to(outside)
    assert store.revisions() == [1, 2, 3]
    drop_revisions_after(store, 2)
    assert store.revisions() == [1]
    assert (outside / "manifest.json").is_file()  # nothing outside the store is deleted


def test_a_revision_that_cannot_be_removed_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RevisionStore(tmp_path / "revisions")
    kept = _revision(store.root, 4)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # e.g. a read-only folder
    with pytest.raises(ResumeError, match=f"revision 4 \\({kept}\\) could not be removed"):
        drop_revisions_after(store, 3)
