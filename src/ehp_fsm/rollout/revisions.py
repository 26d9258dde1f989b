"""The revision store: published policy weights on disk, one Hugging Face directory per revision.

A revision `r` lives in `<root>/r<r:08d>/`, written by `models.revision_dir.write_revision`: the
base model's config and tokenizer files, the weights as safetensors (`model.safetensors`, or
shards with `model.safetensors.index.json`) and `manifest.json` (revision, parent, optimizer
step, every file's size and SHA-256, and a digest over them — the revision's `checksum`). It is
what `from_pretrained` and SGLang's `/update_weights_from_disk` load.

A revision is written into a temporary sibling folder (`.tmp-…`), every file and the folder are
fsync'ed, and the folder is renamed into place; the root is fsync'ed after. Rename is atomic on
POSIX, so a reader that lists the store sees either the whole revision or nothing. Retiring
renames the folder out of the listing first (atomic), then deletes it.

Integrity: the writer hashes the bytes as it writes them (one pass). `load` — the hot path, what
a trainer restores from and what an engine installs — does not re-hash: it checks the manifest's
file list and sizes (a `stat` per file) and reads tensors through safetensors (mmap, header
offsets bounds-checked). `verify` re-hashes every file; run it where bytes crossed something
that can damage them (a copy to another host, a revision adopted after a restart).

What it knows: folders, manifests, monotonicity (r must exceed the newest revision on disk; the
newest revision can never be retired, so the newest on disk is the high-water mark).
What it does not know: who references a revision. The caller — the publication machine — passes
the set of revisions still installed on engines or referred to by in-flight requests to `retire`.
One writer per store is assumed (the trainer's publisher); concurrent readers are safe.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

# The module, not its names: `models.revision_dir` imports `rollout.errors`, which runs this
# package's `__init__` (and so this module) while `revision_dir` is still half-initialized when
# it is the first of the two imported. Its names are looked up when they are used.
from ehp_fsm.models import revision_dir
from ehp_fsm.models.load import ModelError
from ehp_fsm.rollout.errors import (
    RevisionCorrupt,
    RevisionInUse,
    RevisionNotFound,
    RevisionNotIncreasing,
)

if TYPE_CHECKING:
    import torch

    from ehp_fsm.models.revision_dir import RevisionManifest, RevisionReader

_DIR_RE = re.compile(r"^r(\d{8})$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RevisionStore:
    """Revisions under one root folder. See the module docstring for the layout and guarantees."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        # made 0700: the trained weights are the run's user's (`run.startup.private_folder`);
        # one already there (a shared `[run] revisions` folder) is left as it is
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    # -- reading ---------------------------------------------------------------------------
    def revisions(self) -> list[int]:
        """Revisions present on disk, ascending."""
        out = []
        for entry in os.listdir(self.root):
            m = _DIR_RE.match(entry)
            if m and (self.root / entry).is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int | None:
        revs = self.revisions()
        return revs[-1] if revs else None

    def path(self, revision: int) -> Path:
        """Folder of `revision` (what `/update_weights_from_disk` receives as `model_path`)."""
        p = self.root / f"r{revision:08d}"
        if not p.is_dir():
            raise RevisionNotFound(revision, str(self.root))
        return p

    def manifest(self, revision: int) -> RevisionManifest:
        """`revision`'s manifest: `.revision`, `.step`, `.checksum` ("sha256:<hex>"), `.files`."""
        return revision_dir.read_manifest(self.path(revision))

    def load(self, revision: int) -> RevisionReader:
        """A reader of `revision` (`.manifest`, `.state_dict()`, `.iter_tensors()`): file list
        and sizes checked against the manifest, no re-hash (see the module docstring).
        `RevisionNotFound` if it is not there, or was retired while it was being opened."""
        path = self.path(revision)
        try:
            return revision_dir.open_revision(path)
        except (OSError, RevisionCorrupt):
            if not path.exists():
                raise RevisionNotFound(revision, str(self.root)) from None
            raise

    def verify(self, revision: int) -> RevisionManifest:
        """Re-hash every file of `revision`; `RevisionCorrupt` names the first that differs."""
        return revision_dir.verify(self.path(revision))

    def disk_bytes(self) -> int:
        """Bytes used under the root, temporaries included."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                total += os.path.getsize(os.path.join(dirpath, f))
        return total

    # -- writing ---------------------------------------------------------------------------
    def save(
        self,
        *,
        revision: int,
        step: int,
        state_dict: Mapping[str, torch.Tensor],
        base: str | os.PathLike[str],
    ) -> RevisionManifest:
        """Write `state_dict` as `revision` atomically, with the config and tokenizer files of
        the HF model directory `base`; return its manifest. Tensors that view the memory of an
        earlier one (tied embeddings) are written once, as `save_pretrained` does. Floating-point
        tensors are written in the dtype `base`'s config names when it is bf16 or fp16
        (`revision_dir.config_dtype`: a bf16 model trained in fp32 wrote fp32 weights under its
        bf16 config, twice the bytes per publish and per install, cast back to bf16 by every
        engine); otherwise, and integer or bool tensors always, as they are.

        Raises `RevisionNotIncreasing` if `revision` ≤ the newest revision on disk.
        """
        latest = self.latest()
        if latest is not None and revision <= latest:
            raise RevisionNotIncreasing(revision, latest)
        if revision < 0:
            raise ValueError(f"revision must be ≥ 0, got {revision}")
        if step < 0:
            raise ValueError(f"step must be ≥ 0, got {step}")
        final = self.root / f"r{revision:08d}"
        try:
            manifest = revision_dir.write_revision(
                final,
                revision_dir.distinct_tensors(state_dict),
                revision=revision,
                parent=latest,
                base=Path(base),
                step=step,
                dtype=revision_dir.config_dtype(Path(base)),
            )
        except (ModelError, OSError) as exc:
            if final.exists():  # another writer got there first
                raise RevisionNotIncreasing(revision, self.latest() or revision) from exc
            raise
        _fsync_dir(self.root)
        return manifest

    def retire(self, revision: int, *, referenced: Collection[int]) -> None:
        """Delete `revision`'s folder.

        `referenced` is every revision that an engine has installed as current or an in-flight
        request refers to; the caller computes it. Refuses (RevisionInUse) a referenced revision
        and the newest revision (it is what a restarted engine must install).
        """
        path = self.path(revision)
        if revision in referenced:
            raise RevisionInUse(revision, "an engine or an in-flight request still refers to it")
        if revision == self.latest():
            raise RevisionInUse(
                revision, "it is the newest revision, which any (re)started engine must install"
            )
        doomed = self.root / f".retired-r{revision:08d}-{uuid.uuid4().hex}"
        os.rename(path, doomed)
        _fsync_dir(self.root)
        shutil.rmtree(doomed)

    def remove_stale_temporaries(self) -> int:
        """Delete `.tmp-*`/`.retired-*` leftovers of a crashed writer (and `.launch-*` links
        an agent made for an engine that never answered); returns how many.

        Call only when no writer is active (e.g. when the publisher starts)."""
        n = 0
        for entry in os.listdir(self.root):
            if entry.startswith((".tmp-", ".retired-", ".launch-")):
                shutil.rmtree(self.root / entry, ignore_errors=True)
                n += 1
        return n
