"""The revision store on a real filesystem: atomic, checksummed, increasing, bounded."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ehp_fsm.rollout import (
    RevisionCorrupt,
    RevisionInUse,
    RevisionNotFound,
    RevisionNotIncreasing,
    RevisionStore,
    load_revision_dir,
)
from ehp_fsm.rollout import revisions as revisions_mod
from ehp_fsm.training.policy import PolicyConfig, build_policy

TINY = PolicyConfig()


def _sd(seed: int) -> dict[str, torch.Tensor]:
    return build_policy(TINY, seed=seed).state_dict()


def test_save_load_round_trip_and_manifest(tmp_path: Path) -> None:
    store = RevisionStore(tmp_path)
    sd = _sd(0)
    man = store.save(revision=3, step=7, state_dict=sd, config=TINY)
    assert (man.revision, man.step, man.policy_config) == (3, 7, TINY)
    assert {t.name for t in man.tensors} == set(sd)
    assert all(t.shape == tuple(sd[t.name].shape) for t in man.tensors)
    assert man.checksum.startswith("sha256:")
    on_disk = json.loads((store.path(3) / "manifest.json").read_text())
    assert on_disk["revision"] == 3
    assert on_disk["checksum"] == man.checksum
    loaded = store.load(3)
    assert loaded.manifest == man
    for k, v in sd.items():
        assert torch.equal(loaded.state_dict[k], v)
    assert store.revisions() == [3]
    assert store.latest() == 3


@pytest.mark.parametrize("bad", [2, 3])
def test_revisions_strictly_increase(tmp_path: Path, bad: int) -> None:
    store = RevisionStore(tmp_path)
    store.save(revision=3, step=0, state_dict=_sd(0), config=TINY)
    with pytest.raises(RevisionNotIncreasing, match=r"revision 3 already exists.*save revision 4"):
        store.save(revision=bad, step=1, state_dict=_sd(1), config=TINY)
    assert store.revisions() == [3]
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".tmp")]


def test_monotonicity_survives_reopening(tmp_path: Path) -> None:
    RevisionStore(tmp_path).save(revision=5, step=0, state_dict=_sd(0), config=TINY)
    with pytest.raises(RevisionNotIncreasing):
        RevisionStore(tmp_path).save(revision=5, step=0, state_dict=_sd(0), config=TINY)


def test_corrupted_weights_are_refused_on_load(tmp_path: Path) -> None:
    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=_sd(0), config=TINY)
    weights = store.path(1) / "weights.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RevisionCorrupt, match="checksum mismatch"):
        store.load(1)


def test_truncated_and_missing_files_are_refused(tmp_path: Path) -> None:
    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=_sd(0), config=TINY)
    store.save(revision=2, step=0, state_dict=_sd(0), config=TINY)
    weights = store.path(1) / "weights.pt"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(RevisionCorrupt, match="bytes, manifest says"):
        store.load(1)
    (store.path(2) / "manifest.json").unlink()
    with pytest.raises(RevisionCorrupt, match=r"manifest\.json does not exist"):
        load_revision_dir(store.path(2))
    with pytest.raises(RevisionCorrupt, match="does not exist"):
        load_revision_dir(tmp_path / "nowhere")


def test_retire_guards(tmp_path: Path) -> None:
    store = RevisionStore(tmp_path)
    for r in (1, 2, 3):
        store.save(revision=r, step=r, state_dict=_sd(r), config=TINY)
    with pytest.raises(RevisionInUse, match="still refers to it"):
        store.retire(1, referenced={1, 3})
    with pytest.raises(RevisionInUse, match="newest revision"):
        store.retire(3, referenced=set())
    with pytest.raises(RevisionNotFound):
        store.retire(9, referenced=set())
    store.retire(1, referenced={3})
    assert store.revisions() == [2, 3]
    with pytest.raises(RevisionNotFound):
        store.load(1)
    # retiring never lowers the high-water mark
    with pytest.raises(RevisionNotIncreasing):
        store.save(revision=2, step=0, state_dict=_sd(0), config=TINY)


def test_crash_during_write_leaves_no_visible_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=_sd(0), config=TINY)

    def dies_midway(obj: object, fh: object) -> None:
        fh.write(b"half a file")  # type: ignore[attr-defined]
        raise OSError("disk full (injected)")

    monkeypatch.setattr(revisions_mod.torch, "save", dies_midway)
    with pytest.raises(OSError, match="injected"):
        store.save(revision=2, step=0, state_dict=_sd(0), config=TINY)
    assert store.revisions() == [1]
    assert os.listdir(tmp_path) == ["r00000001"]


def test_stale_temporaries_are_invisible_and_removable(tmp_path: Path) -> None:
    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=_sd(0), config=TINY)
    (tmp_path / ".tmp-r00000002-dead").mkdir()
    (tmp_path / ".tmp-r00000002-dead" / "weights.pt").write_bytes(b"x" * 10)
    assert store.revisions() == [1]
    assert store.remove_stale_temporaries() == 1
    assert os.listdir(tmp_path) == ["r00000001"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_readers_never_see_half_written_revisions(tmp_path: Path) -> None:
    """A reader thread lists and loads whatever it sees while the writer saves and retires."""
    store = RevisionStore(tmp_path)
    big = PolicyConfig(d_model=128, d_ff=512, n_layers=2)
    sd = build_policy(big, seed=0).state_dict()
    store.save(revision=0, step=0, state_dict=sd, config=big)
    done = threading.Event()
    seen: set[int] = set()
    errors: list[BaseException] = []

    def reader() -> None:
        reader_store = RevisionStore(tmp_path)
        while not done.is_set():
            for r in reader_store.revisions():
                try:
                    reader_store.load(r)
                    seen.add(r)
                except RevisionNotFound:
                    pass  # retired between listing and loading: fine
                except RevisionCorrupt as exc:
                    if (tmp_path / f"r{r:08d}").exists():
                        errors.append(exc)  # a listed, still-present revision must load

    t = threading.Thread(target=reader)
    t.start()
    try:
        for r in range(1, 25):
            store.save(revision=r, step=r, state_dict=sd, config=big)
            store.retire(r - 1, referenced={r})
    finally:
        done.set()
        t.join()
    assert not errors, errors
    assert len(seen) > 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_disk_stays_bounded_over_a_long_run(tmp_path: Path) -> None:
    """50 revisions; each engine keeps the one it installed, the store retires the rest."""
    store = RevisionStore(tmp_path)
    one = None
    installed = {"e0": 0, "e1": 0}
    peak = 0
    for r in range(50):
        store.save(revision=r, step=r, state_dict=_sd(r), config=TINY)
        one = one or store.disk_bytes()
        installed[f"e{r % 2}"] = r  # engines install alternately: one lags by a revision
        referenced = set(installed.values())
        for old in store.revisions():
            if old not in referenced and old != store.latest():
                store.retire(old, referenced=referenced)
        peak = max(peak, store.disk_bytes())
        assert len(store.revisions()) <= 2
    assert one is not None
    assert peak <= 2 * one + 4096
    assert store.revisions() == [48, 49]


# Each example writes and fsyncs several revisions; 40 examples cover the small op alphabet.
@settings(max_examples=40)
@given(ops=st.lists(st.tuples(st.sampled_from(["save", "retire"]), st.integers(0, 6)), max_size=12))
def test_store_matches_a_model_under_random_operations(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]]
) -> None:
    store = RevisionStore(tmp_path_factory.mktemp("prop"))
    model: list[int] = []
    sd = {"w": torch.arange(4.0)}
    for op, r in ops:
        if op == "save":
            if model and r <= model[-1]:
                with pytest.raises(RevisionNotIncreasing):
                    store.save(revision=r, step=0, state_dict=sd, config=TINY)
            else:
                store.save(revision=r, step=0, state_dict=sd, config=TINY)
                model.append(r)
        else:
            referenced = {r} if r % 3 == 0 else set()
            if r not in model:
                with pytest.raises(RevisionNotFound):
                    store.retire(r, referenced=referenced)
            elif r in referenced or r == model[-1]:
                with pytest.raises(RevisionInUse):
                    store.retire(r, referenced=referenced)
            else:
                store.retire(r, referenced=referenced)
                model.remove(r)
        assert store.revisions() == model
        if model:
            assert torch.equal(store.load(model[-1]).state_dict["w"], sd["w"])
