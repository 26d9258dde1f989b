"""The revision store on a real filesystem: atomic, checksummed, increasing, bounded; each
revision an HF directory of the tiny model."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ehp_fsm.models import revision_dir
from ehp_fsm.models.load import load_model
from ehp_fsm.models.tiny import TinyShape, init_model
from ehp_fsm.rollout import (
    RevisionCorrupt,
    RevisionInUse,
    RevisionNotFound,
    RevisionNotIncreasing,
    RevisionStore,
)

from .hf import revision_state


@pytest.fixture
def sd(tiny_model: Path) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda seed: revision_state(tiny_model, seed)


def test_save_load_round_trip_and_manifest(tmp_path: Path, tiny_model: Path) -> None:
    store = RevisionStore(tmp_path)
    model = load_model(tiny_model).model
    full = dict(model.state_dict())  # tied: lm_head.weight is embed_tokens.weight
    assert full["lm_head.weight"].data_ptr() == full["model.embed_tokens.weight"].data_ptr()
    man = store.save(revision=3, step=7, state_dict=full, base=tiny_model)
    assert (man.revision, man.step, man.parent) == (3, 7, None)
    assert man.checksum == f"sha256:{man.sha256}"
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(man.files)
    on_disk = json.loads((store.path(3) / "manifest.json").read_text())
    assert (on_disk["revision"], on_disk["step"], on_disk["sha256"]) == (3, 7, man.sha256)
    assert store.manifest(3) == man
    assert (store.path(3) / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()
    loaded = store.load(3)
    assert loaded.manifest == man
    tensors = loaded.state_dict()
    assert set(tensors) == set(full) - {"lm_head.weight"}  # the tied duplicate is dropped
    for k, v in tensors.items():
        assert torch.equal(v, full[k])
    # what the store wrote is what transformers loads
    again = load_model(store.path(3)).model
    for k, v in again.state_dict().items():
        assert torch.equal(v, full[k]), k
    assert store.verify(3) == man
    assert store.revisions() == [3]
    assert store.latest() == 3
    nxt = store.save(revision=4, step=8, state_dict=full, base=tiny_model)
    assert nxt.parent == 3 and nxt.sha256 == man.sha256  # same bytes, same content digest


@pytest.mark.parametrize("bad", [2, 3])
def test_revisions_strictly_increase(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]], bad: int
) -> None:
    store = RevisionStore(tmp_path)
    store.save(revision=3, step=0, state_dict=sd(0), base=tiny_model)
    with pytest.raises(RevisionNotIncreasing, match=r"revision 3 already exists.*save revision 4"):
        store.save(revision=bad, step=1, state_dict=sd(1), base=tiny_model)
    assert store.revisions() == [3]
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".tmp")]


def test_monotonicity_survives_reopening(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]]
) -> None:
    RevisionStore(tmp_path).save(revision=5, step=0, state_dict=sd(0), base=tiny_model)
    with pytest.raises(RevisionNotIncreasing):
        RevisionStore(tmp_path).save(revision=5, step=0, state_dict=sd(0), base=tiny_model)


def test_altered_weights_pass_the_hot_path_and_fail_verify(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]]
) -> None:
    """`load` checks sizes, not hashes (the install path does not re-read every byte to hash
    it); `verify` re-hashes and names the altered file."""
    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=sd(0), base=tiny_model)
    weights = store.path(1) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0xFF  # inside the last tensor's bytes: the header still parses
    weights.write_bytes(bytes(data))
    assert set(store.load(1).state_dict()) == set(sd(0))
    with pytest.raises(RevisionCorrupt, match=r"model\.safetensors.*its sha256 is"):
        store.verify(1)


def test_truncated_extra_and_missing_files_are_refused(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]]
) -> None:
    store = RevisionStore(tmp_path)
    for r in (1, 2, 3):
        store.save(revision=r, step=0, state_dict=sd(0), base=tiny_model)
    weights = store.path(1) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(RevisionCorrupt, match="bytes, the manifest says"):
        store.load(1)
    (store.path(2) / "manifest.json").unlink()
    with pytest.raises(RevisionCorrupt, match=r"has no manifest\.json"):
        store.load(2)
    with pytest.raises(RevisionCorrupt, match=r"has no manifest\.json"):
        store.manifest(2)
    (store.path(3) / "pytorch_model.bin").write_bytes(b"x")  # would change what loads
    with pytest.raises(RevisionCorrupt, match="not in the manifest"):
        store.load(3)
    with pytest.raises(RevisionNotFound):
        store.load(9)


def test_an_extra_file_named_with_a_newline_is_named_on_one_line(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]]
) -> None:
    """A file planted in a revision under a name holding a newline and an escape sequence: the
    error names it with both written as escapes, on the one line an error takes (the path was
    printed raw, so the planted name could forge a line of the run's output)."""
    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=sd(0), base=tiny_model)
    (store.path(1) / "x\nehp-fsm: ok \x1b[2K").write_bytes(b"x")
    with pytest.raises(RevisionCorrupt, match="not in the manifest") as caught:
        store.load(1)
    assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value)
    assert "x\\nehp-fsm: ok \\x1b[2K" in str(caught.value)


@pytest.mark.parametrize("name", ["manifest.json", "model.safetensors.index.json"])
def test_a_manifest_or_index_nested_too_deep_is_refused_as_corrupt(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]], name: str
) -> None:
    """`[[[...` 200,000 deep in a revision's manifest (or its index) raised a bare
    RecursionError out of the engine's install: now `RevisionCorrupt`, naming the file."""
    from ehp_fsm.models import revision_dir

    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=sd(0), base=tiny_model)
    target = store.path(1) / name
    if name != "manifest.json":  # the manifest must list an index for it to be read
        manifest = json.loads((store.path(1) / "manifest.json").read_text())
        manifest["files"][name] = {"bytes": 200_000, "sha256": "0" * 64}
        (store.path(1) / "manifest.json").write_text(json.dumps(manifest))
    target.write_text("[" * 200_000)
    with pytest.raises(RevisionCorrupt, match="cannot be used"):
        revision_dir.open_revision(store.path(1))


def test_a_manifest_that_lists_a_file_outside_its_revision_is_refused(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]]
) -> None:
    """Revision 1's manifest and index name `../r00000002/model.safetensors` (the right size and
    hash): the weights came from outside the revision directory, any file the engine may read.
    Now a listed name must be a file of the revision itself."""
    store = RevisionStore(tmp_path)
    for r in (1, 2):
        store.save(revision=r, step=0, state_dict=sd(r), base=tiny_model)
    root = store.path(1)
    (root / "model.safetensors").unlink()
    outside = "../r00000002/model.safetensors"
    index = json.dumps({"metadata": {}, "weight_map": {"x": outside}}).encode()
    (root / revision_dir.INDEX_FILE).write_bytes(index)
    data = json.loads((root / revision_dir.MANIFEST_FILE).read_text())
    data["files"][outside] = data["files"].pop("model.safetensors")
    data["files"][revision_dir.INDEX_FILE] = {
        "bytes": len(index),
        "sha256": hashlib.sha256(index).hexdigest(),
    }
    (root / revision_dir.MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(RevisionCorrupt, match="not a file of the revision"):
        store.load(1)


def test_retire_guards(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]]
) -> None:
    store = RevisionStore(tmp_path)
    for r in (1, 2, 3):
        store.save(revision=r, step=r, state_dict=sd(r), base=tiny_model)
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
        store.save(revision=2, step=0, state_dict=sd(0), base=tiny_model)


def test_crash_during_write_leaves_no_visible_revision(
    tmp_path: Path,
    tiny_model: Path,
    sd: Callable[[int], dict[str, torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=sd(0), base=tiny_model)
    real_write = revision_dir._write_bytes

    def dies_on_the_weights(path: Path, data: bytes) -> revision_dir.FileEntry:
        if path.suffix == ".safetensors":
            path.write_bytes(data[: len(data) // 2])
            raise OSError("disk full (injected)")
        return real_write(path, data)

    monkeypatch.setattr(revision_dir, "_write_bytes", dies_on_the_weights)
    with pytest.raises(OSError, match="injected"):
        store.save(revision=2, step=0, state_dict=sd(0), base=tiny_model)
    assert store.revisions() == [1]
    assert os.listdir(tmp_path) == ["r00000001"]


def test_stale_temporaries_are_invisible_and_removable(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]]
) -> None:
    store = RevisionStore(tmp_path)
    store.save(revision=1, step=0, state_dict=sd(0), base=tiny_model)
    (tmp_path / ".tmp-r00000002-dead").mkdir()
    (tmp_path / ".tmp-r00000002-dead" / "model.safetensors").write_bytes(b"x" * 10)
    assert store.revisions() == [1]
    assert store.remove_stale_temporaries() == 1
    assert os.listdir(tmp_path) == ["r00000001"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_readers_never_see_half_written_revisions(tmp_path: Path) -> None:
    """A reader thread lists and loads whatever it sees while the writer saves and retires."""
    store = RevisionStore(tmp_path)
    big = init_model(
        tmp_path / "big-model", seed=0, shape=TinyShape(hidden_size=128, intermediate_size=512)
    )
    sd = revision_state(big, 0)
    store.save(revision=0, step=0, state_dict=sd, base=big)
    done = threading.Event()
    seen: set[int] = set()
    errors: list[BaseException] = []

    def reader() -> None:
        reader_store = RevisionStore(tmp_path)
        while not done.is_set():
            for r in reader_store.revisions():
                try:
                    reader_store.load(r).state_dict()
                    seen.add(r)
                except RevisionNotFound:
                    pass  # retired between listing and opening: fine
                except FileNotFoundError as exc:
                    if (tmp_path / f"r{r:08d}").exists():
                        errors.append(exc)  # else retired between opening and reading: fine
                except RevisionCorrupt as exc:
                    if (tmp_path / f"r{r:08d}").exists():
                        errors.append(exc)  # a listed, still-present revision must load

    t = threading.Thread(target=reader)
    t.start()
    try:
        for r in range(1, 25):
            store.save(revision=r, step=r, state_dict=sd, base=big)
            store.retire(r - 1, referenced={r})
    finally:
        done.set()
        t.join()
    assert not errors, errors
    assert len(seen) > 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_disk_stays_bounded_over_a_long_run(
    tmp_path: Path, tiny_model: Path, sd: Callable[[int], dict[str, torch.Tensor]]
) -> None:
    """50 revisions; each engine keeps the one it installed, the store retires the rest."""
    store = RevisionStore(tmp_path)
    one = None
    installed = {"e0": 0, "e1": 0}
    peak = 0
    for r in range(50):
        store.save(revision=r, step=r, state_dict=sd(r), base=tiny_model)
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
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, ops: list[tuple[str, int]]
) -> None:
    store = RevisionStore(tmp_path_factory.mktemp("prop"))
    model: list[int] = []
    sd = {"w": torch.arange(4.0)}
    for op, r in ops:
        if op == "save":
            if model and r <= model[-1]:
                with pytest.raises(RevisionNotIncreasing):
                    store.save(revision=r, step=0, state_dict=sd, base=tiny_model)
            else:
                store.save(revision=r, step=0, state_dict=sd, base=tiny_model)
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
            assert torch.equal(store.load(model[-1]).tensor("w"), sd["w"])
