"""The run's folders of trained weights and optimizer state are the run's user's alone.

`resume/` (the Core's saved state: weights and Adam moments), `revisions/` (every published
revision's weights) and `verify/` were made with the umask (0755) and their files 0644: any
user of the machine read them (an attacker's find, 2026-12-07). `private_folder` makes them
0700 and narrows one an older run left open; a folder of another user's is left alone. The
whole run's folders are checked by `test_run.py::test_run_borrows_returns_and_ends_clean`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.run.startup import private_folder


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_folder_is_made_private_and_one_an_older_run_left_open_is_narrowed(
    tmp_path: Path,
) -> None:
    made = tmp_path / "run" / "resume"
    private_folder(made)
    assert _mode(made) == 0o700
    old = tmp_path / "run" / "revisions"
    old.mkdir(mode=0o755)
    old.chmod(0o755)  # (the umask may have narrowed it already)
    (old / "r00000001").mkdir()
    private_folder(old)
    assert _mode(old) == 0o700
    assert (old / "r00000001").is_dir()  # nothing inside is touched


def test_a_revision_store_makes_its_folder_private_and_leaves_a_shared_one(
    tmp_path: Path,
) -> None:
    new = tmp_path / "new" / "revisions"
    RevisionStore(new)
    assert _mode(new) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o750)  # a `[run] revisions` folder the plan chose to share
    RevisionStore(shared)
    assert _mode(shared) == 0o750


def test_a_link_is_not_followed_to_narrow_its_target(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    target.chmod(0o755)
    link = tmp_path / "resume"
    link.symlink_to(target)
    private_folder(link)
    assert _mode(target) == 0o755 and os.path.islink(link)


def test_a_fresh_start_keeps_the_last_runs_model_in_a_private_folder(tmp_path: Path) -> None:
    """A fresh start moves the previous run's newest revision beside the revisions folder
    (`revisions.previous/`): that folder was made with the umask (0755), the trained model in it
    readable by every user (a reviewer's find)."""
    from ehp_fsm.run.startup import clear_run_dir

    run_dir = tmp_path / "run"
    revisions = run_dir / "revisions"
    (revisions / "r00000003").mkdir(parents=True)
    (revisions / "r00000003" / "model.safetensors").write_bytes(b"weights")
    clear_run_dir(run_dir, revisions, resume=False)
    previous = run_dir / "revisions.previous"
    assert (previous / "r00000003" / "model.safetensors").read_bytes() == b"weights"
    assert _mode(previous) == 0o700
