"""The revision store: published policy weights on disk, one folder per revision.

A revision `r` lives in `<root>/r<r:08d>/` as two files:

* `weights.pt` — the state dict, written by `torch.save` and read back only with
  `torch.load(..., weights_only=True)` (no pickle of arbitrary objects);
* `manifest.json` — revision, optimizer step, the `PolicyConfig` that builds the module, every
  tensor's name/shape/dtype, the byte size and the SHA-256 of `weights.pt`.

A revision is written into a temporary sibling folder (`.tmp-…`), every file and the folder are
fsync'ed, and the folder is renamed into place; the root is fsync'ed after. Rename is atomic on
POSIX, so a reader that lists the store sees either the whole revision or nothing. Loading
re-hashes the file and refuses a mismatch. Retiring renames the folder out of the listing first
(atomic), then deletes it.

What it knows: folders, manifests, checksums, monotonicity (r must exceed the newest revision on
disk; the newest revision can never be retired, so the newest on disk is the high-water mark).
What it does not know: who references a revision. The caller — the publication machine — passes
the set of revisions still installed on engines or referred to by in-flight requests to `retire`.
One writer per store is assumed (the trainer's publisher); concurrent readers are safe.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ehp_fsm.rollout.errors import (
    RevisionCorrupt,
    RevisionInUse,
    RevisionNotFound,
    RevisionNotIncreasing,
)
from ehp_fsm.training.policy import PolicyConfig

MANIFEST_FORMAT = "ehp-fsm-revision/1"
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.pt"
_DIR_RE = re.compile(r"^r(\d{8})$")


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tensor spec needs a non-empty name")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r} has a negative dimension in {self.shape}")


@dataclass(frozen=True, kw_only=True)
class RevisionManifest:
    """What `manifest.json` says about one revision."""

    revision: int
    step: int
    policy_config: PolicyConfig
    tensors: tuple[TensorSpec, ...]
    num_bytes: int
    checksum: str  # "sha256:<hex>" of weights.pt
    format: str = MANIFEST_FORMAT

    def __post_init__(self) -> None:
        if self.revision < 0:
            raise ValueError(f"revision must be ≥ 0, got {self.revision}")
        if self.step < 0:
            raise ValueError(f"step must be ≥ 0, got {self.step}")
        if not self.checksum.startswith("sha256:"):
            raise ValueError(f"checksum must be 'sha256:<hex>', got {self.checksum!r}")
        if self.format != MANIFEST_FORMAT:
            raise ValueError(f"unknown manifest format {self.format!r}; expected {MANIFEST_FORMAT}")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "revision": self.revision,
            "step": self.step,
            "policy_config": self.policy_config.to_dict(),
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.tensors
            ],
            "weights_file": WEIGHTS_FILE,
            "num_bytes": self.num_bytes,
            "checksum": self.checksum,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RevisionManifest:
        return cls(
            format=str(data["format"]),
            revision=int(data["revision"]),
            step=int(data["step"]),
            policy_config=PolicyConfig(**data["policy_config"]),
            tensors=tuple(
                TensorSpec(name=str(t["name"]), shape=tuple(t["shape"]), dtype=str(t["dtype"]))
                for t in data["tensors"]
            ),
            num_bytes=int(data["num_bytes"]),
            checksum=str(data["checksum"]),
        )


@dataclass(frozen=True, kw_only=True)
class LoadedRevision:
    manifest: RevisionManifest
    state_dict: dict[str, torch.Tensor]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """File-like that hashes and counts every byte `torch.save` writes through it, so the
    checksum costs no second pass over the file."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.num_bytes += len(data)
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()


def read_manifest(revision_dir: str | os.PathLike[str]) -> RevisionManifest:
    """The manifest of the revision folder at `revision_dir` (no checksum check)."""
    path = Path(revision_dir) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
        return RevisionManifest.from_json(data)
    except FileNotFoundError:
        raise RevisionCorrupt(str(revision_dir), f"{MANIFEST_FILE} does not exist") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise RevisionCorrupt(str(revision_dir), f"{MANIFEST_FILE} is invalid: {exc}") from None


def load_revision_dir(revision_dir: str | os.PathLike[str]) -> LoadedRevision:
    """Read, checksum and deserialize the revision folder at `revision_dir`.

    The file is read once into memory, hashed, and parsed from that buffer, so what is checked is
    exactly what is loaded. Raises `RevisionCorrupt` naming the mismatch.
    """
    root = Path(revision_dir)
    manifest = read_manifest(root)
    weights = root / WEIGHTS_FILE
    try:
        data = weights.read_bytes()
    except OSError as exc:
        raise RevisionCorrupt(str(root), f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    if len(data) != manifest.num_bytes:
        raise RevisionCorrupt(
            str(root), f"{WEIGHTS_FILE} has {len(data)} bytes, manifest says {manifest.num_bytes}"
        )
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if digest != manifest.checksum:
        raise RevisionCorrupt(
            str(root), f"checksum mismatch: file {digest}, manifest {manifest.checksum}"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RevisionCorrupt(str(root), f"{WEIGHTS_FILE} does not deserialize: {exc}") from None
    if not isinstance(state, dict):
        raise RevisionCorrupt(str(root), f"{WEIGHTS_FILE} holds {type(state).__name__}, not dict")
    expected = {t.name: t for t in manifest.tensors}
    if set(state) != set(expected):
        missing, extra = set(expected) - set(state), set(state) - set(expected)
        raise RevisionCorrupt(
            str(root), f"tensor names differ from manifest (missing {missing}, extra {extra})"
        )
    for name, spec in expected.items():
        t = state[name]
        if tuple(t.shape) != spec.shape or str(t.dtype) != spec.dtype:
            raise RevisionCorrupt(
                str(root),
                f"tensor {name!r} is {tuple(t.shape)}/{t.dtype}, manifest says "
                f"{spec.shape}/{spec.dtype}",
            )
    return LoadedRevision(manifest=manifest, state_dict=state)


class RevisionStore:
    """Revisions under one root folder. See the module docstring for the layout and guarantees."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

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
        return read_manifest(self.path(revision))

    def load(self, revision: int) -> LoadedRevision:
        """The state dict of `revision`, checksum-verified."""
        return load_revision_dir(self.path(revision))

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
        config: PolicyConfig,
    ) -> RevisionManifest:
        """Write `state_dict` as `revision` atomically; return its manifest.

        Raises `RevisionNotIncreasing` if `revision` ≤ the newest revision on disk.
        """
        latest = self.latest()
        if latest is not None and revision <= latest:
            raise RevisionNotIncreasing(revision, latest)
        if revision < 0:
            raise ValueError(f"revision must be ≥ 0, got {revision}")
        tensors = {k: v.detach().to("cpu") for k, v in state_dict.items()}
        tmp = self.root / f".tmp-r{revision:08d}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            weights = tmp / WEIGHTS_FILE
            with weights.open("wb") as fh:
                writer = _HashingWriter(fh)
                torch.save(tensors, writer)  # type: ignore[arg-type]  # write()/flush() suffice
                fh.flush()
                os.fsync(fh.fileno())
            manifest = RevisionManifest(
                revision=revision,
                step=step,
                policy_config=config,
                tensors=tuple(
                    TensorSpec(name=k, shape=tuple(v.shape), dtype=str(v.dtype))
                    for k, v in tensors.items()
                ),
                num_bytes=writer.num_bytes,
                checksum="sha256:" + writer.sha256.hexdigest(),
            )
            with (tmp / MANIFEST_FILE).open("w") as fh:
                json.dump(manifest.to_json(), fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(tmp)
            final = self.root / f"r{revision:08d}"
            try:
                os.rename(tmp, final)
            except OSError as exc:  # another writer got there first
                raise RevisionNotIncreasing(revision, self.latest() or revision) from exc
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
        """Delete `.tmp-*`/`.retired-*` leftovers of a crashed writer; returns how many.

        Call only when no writer is active (e.g. when the publisher starts)."""
        n = 0
        for entry in os.listdir(self.root):
            if entry.startswith((".tmp-", ".retired-")):
                shutil.rmtree(self.root / entry, ignore_errors=True)
                n += 1
        return n
