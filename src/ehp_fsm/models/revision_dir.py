"""A published revision as a Hugging Face directory: what `from_pretrained` and SGLang's
`/update_weights_from_disk` load, plus `manifest.json` naming the revision and its hashes.

A revision directory holds

* the base model's config and tokenizer files, copied byte for byte (config.json,
  generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, …), and
  the files of the subfolders transformers reads beside them (`CARRIED_DIRS`: the named chat
  templates in `additional_chat_templates/`), listed in the manifest as "<folder>/<file>";
* the weights: `model.safetensors`, or — when they pass `max_shard_bytes` — shards
  `model-00001-of-0000N.safetensors` with the standard `model.safetensors.index.json`
  (`{"metadata": {"total_size": …}, "weight_map": {tensor: shard}}`), as transformers writes.
  Floating-point tensors are written in the `dtype` the writer is given — the revision store
  gives the one the base config names (`config_dtype`: a bf16 model trained in fp32 publishes
  bf16 weights, what its config describes and what an engine serving it casts them to anyway);
  integer and bool tensors are written as they are;
* `manifest.json`: format, revision, parent revision, the optimizer step it comes from, every
  other file's byte size and SHA-256, and `sha256`, a digest over that file list (one string
  that identifies the content; `checksum` is it as "sha256:<hex>").

Writing is atomic: everything goes into a hidden sibling `.tmp-<name>-<uuid>/`, every file and
the folder are fsync'ed, the folder is renamed to its final name (atomic on POSIX), and the
parent is fsync'ed. A reader sees the whole revision or nothing. The hashes are computed from
the bytes as they are written (one pass; at most one shard is in memory at a time).

Where integrity is checked:

* `write_revision` hashes what it writes and records it in the manifest;
* `open_revision` (the hot path: trainer restore, an engine installing from local disk) reads
  the manifest and checks that exactly the listed files are present with the listed sizes — a
  `stat` per file, no re-hash — and tensors come through `safetensors.safe_open` (mmap, the
  header's offsets are bounds-checked by safetensors);
* `verify` re-hashes every file against the manifest and names the first file that differs.
  Run it where bytes crossed something that can damage them: after copying a revision to
  another host or shared file system, before installing one that was not written locally, when
  a restarted run adopts revisions left on disk, and in audits.

What it does not know: which revisions are in use or may be retired (the publication machine
decides), the revision store's folder naming, engines.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ehp_fsm.models.load import ModelError
from ehp_fsm.models.stops import model_json
from ehp_fsm.rollout.errors import RevisionCorrupt

if TYPE_CHECKING:  # imported where tensors are made: an agent opens revisions without torch
    import torch

FORMAT = "ehp-fsm-hf-revision/1"
MANIFEST_FILE = "manifest.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB"
#: Weights in a base folder, never carried into a revision (it writes its own): torch's, and the
#: same model for other frameworks a Hub clone holds beside them (GPT-2's repository:
#: `tf_model.h5`, `flax_model.msgpack`, `rust_model.ot`, `model.onnx`, each as large as the
#: model; a `.gguf` quantization) — every revision copied them, read whole and hashed each step.
_WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ot", ".onnx", ".onnx_data",
    ".gguf", ".ckpt", ".npz", ".tflite", ".mlmodel",
)  # fmt: skip
_SKIP_FROM_BASE = {MANIFEST_FILE, INDEX_FILE, "pytorch_model.bin.index.json"}
#: Subfolders of a model folder whose files a revision carries (one level, weights left out as
#: above): what `from_pretrained` reads from a model folder besides its top-level files.
#: `additional_chat_templates/<name>.jinja` holds the named chat templates transformers ≥ 4.54
#: saves (`transformers.utils.hub.CHAT_TEMPLATE_DIR`; `AutoTokenizer`/`AutoProcessor` load each
#: as `chat_template[<name>]`): without it an engine installing a revision lost them all.
#: Every other file a tokenizer or processor reads (vocab.json, merges.txt, tokenizer.model,
#: spiece.model, *.tiktoken, special_tokens_map.json, added_tokens.json, chat_template.json,
#: preprocessor_config.json, processor_config.json, …) is a top-level file, carried already.
CARRIED_DIRS: tuple[str, ...] = ("additional_chat_templates",)


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class RevisionManifest:
    """What `manifest.json` says: revision, parent (None for the first), files and digest."""

    revision: int
    parent: int | None
    files: Mapping[str, FileEntry]
    sha256: str
    step: int = 0
    format: str = FORMAT

    @property
    def checksum(self) -> str:
        """The content digest as "sha256:<hex>" (what the revision machine records)."""
        return f"sha256:{self.sha256}"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "revision": self.revision,
            "parent": self.parent,
            "step": self.step,
            "files": {
                name: {"bytes": e.bytes, "sha256": e.sha256}
                for name, e in sorted(self.files.items())
            },
            "sha256": self.sha256,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, path: str) -> RevisionManifest:
        try:
            if data["format"] != FORMAT:
                raise RevisionCorrupt(path, f"manifest format {data['format']!r} is not {FORMAT}")
            return cls(
                revision=int(data["revision"]),
                parent=None if data["parent"] is None else int(data["parent"]),
                files={
                    str(k): FileEntry(bytes=int(v["bytes"]), sha256=str(v["sha256"]))
                    for k, v in data["files"].items()
                },
                sha256=str(data["sha256"]),
                step=int(data.get("step", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RevisionCorrupt(path, f"the manifest is malformed ({exc!r})") from exc


def files_digest(files: Mapping[str, FileEntry]) -> str:
    """SHA-256 over the sorted (name, size, sha256) list: the revision's content identity."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name].bytes}\0{files[name].sha256}\n".encode())
    return h.hexdigest()


def config_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The floating-point dtype the weights of the HF directory `model_dir` are published in:
    the one its config.json names (`dtype`; `torch_dtype`, transformers 4's key) when it is
    bfloat16 or float16. None — publish the tensors as they are — when it names float32, none,
    or something else, or there is no readable config.json (the writer refuses that itself)."""
    try:
        config = model_json(Path(model_dir) / "config.json")
    except (OSError, ValueError):  # (a FIFO is refused, not waited on: `model_json`)
        return None
    if not isinstance(config, dict):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    if name not in ("bfloat16", "float16"):
        return None
    import torch

    return torch.bfloat16 if name == "bfloat16" else torch.float16


def revision_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with tied duplicates dropped (the first name of a shared tensor
    is kept — `model.embed_tokens.weight` before a tied `lm_head.weight` — as save_pretrained
    does; from_pretrained re-ties them from the config)."""
    return distinct_tensors(model.state_dict())


def distinct_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with every tensor that views the same memory as an earlier one dropped (see
    `revision_tensors`)."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        key = (
            t.untyped_storage().data_ptr(),
            int(t.storage_offset()),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
        )
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach()
    return out


def plan_shards(
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int,
    *,
    dtype: torch.dtype | None = None,
) -> list[list[str]]:
    """Tensor names per shard, in the given order: a shard closes before the tensor that would
    take it past `max_shard_bytes`; a tensor larger than that is a shard of its own. Sizes are
    those written: floating-point tensors in `dtype` (None: their own)."""
    if max_shard_bytes < 1:
        raise ModelError(
            f"max_shard_bytes = {max_shard_bytes}", "a shard holds at least one byte", "use ≥ 1"
        )
    shards: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        n = t.numel() * _written_dtype(t, dtype).itemsize
        if shards and shards[-1] and size + n <= max_shard_bytes:
            shards[-1].append(name)
            size += n
        else:
            shards.append([name])
            size = n
    return shards


def write_revision(
    dest: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    revision: int,
    parent: int | None,
    base: str | Path,
    step: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> RevisionManifest:
    """Write revision `revision` (child of `parent`, made at optimizer step `step`) to the new
    directory `dest`, atomically: `tensors` (e.g. `revision_tensors(model)`) as safetensors —
    the floating-point ones cast to `dtype` (None: as they are; the cast is torch's, round to
    nearest even, one shard at a time), integer and bool ones as they are — sharded above
    `max_shard_bytes`, with the config and tokenizer files of the HF directory `base`. Returns
    the manifest."""
    out = Path(dest)
    src = Path(base)
    if revision < 0 or (parent is not None and not 0 <= parent < revision):
        raise ModelError(
            f"revision {revision} with parent {parent} is not a valid lineage",
            "revisions are ≥ 0 and strictly increase from parent to child",
            "pass parent=None for the first revision, else an earlier revision",
        )
    if out.exists():
        raise ModelError(
            f"revision directory {out} already exists",
            "a published revision is immutable",
            "publish under a new revision number, or retire the old one first",
        )
    if not (src / "config.json").is_file():
        raise ModelError(
            f"base directory {src} has no config.json",
            "a revision carries its model's config and tokenizer files",
            "pass the HF directory the model was loaded from as `base`",
        )
    if not tensors:
        raise ModelError(f"revision {revision} has no tensors", "", "pass the model's tensors")
    if step < 0:
        raise ModelError(f"step {step} is negative", "optimizer steps count from 0", "pass ≥ 0")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        files: dict[str, FileEntry] = {}
        folders: set[Path] = set()
        for name, f in base_files(src).items():
            (tmp / name).parent.mkdir(exist_ok=True)
            folders.add((tmp / name).parent)
            files[name] = _write_bytes(tmp / name, f.read_bytes())
        files.update(_write_weights(tmp, tensors, max_shard_bytes, dtype))
        manifest = RevisionManifest(
            revision=revision, parent=parent, files=files, sha256=files_digest(files), step=step
        )
        _write_bytes(tmp / MANIFEST_FILE, _json_bytes(manifest.to_json()))
        for folder in sorted(folders - {tmp}):
            _fsync_dir(folder)
        _fsync_dir(tmp)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def base_files(model_dir: Path) -> dict[str, Path]:
    """The files of the HF directory `model_dir` that a revision carries, by their name in the
    revision ("tokenizer.json", "additional_chat_templates/tool_use.jinja"): every regular file
    but the weights, and those of `CARRIED_DIRS`."""
    out: dict[str, Path] = {}
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            if _carried(f.name):
                out[f.name] = f
        elif f.name in CARRIED_DIRS and f.is_dir():
            for g in sorted(f.iterdir()):
                if g.is_file() and _carried(g.name):
                    out[f"{f.name}/{g.name}"] = g
    return out


def _carried(name: str) -> bool:
    return name not in _SKIP_FROM_BASE and Path(name).suffix not in _WEIGHT_SUFFIXES


def _revision_file_name(name: str) -> bool:
    """Whether `name` (a manifest's) names a file of the revision: a plain name, or one in a
    folder of `CARRIED_DIRS` ("../x", "/x", "a/b" do not)."""
    folder, sep, rest = name.rpartition("/")
    if sep and folder not in CARRIED_DIRS:
        return False
    return rest not in ("", ".", "..") and Path(rest).name == rest


def _write_weights(
    tmp: Path, tensors: Mapping[str, torch.Tensor], max_shard_bytes: int, dtype: torch.dtype | None
) -> dict[str, FileEntry]:
    from safetensors.torch import save

    shards = plan_shards(tensors, max_shard_bytes, dtype=dtype)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    files: dict[str, FileEntry] = {}
    weight_map: dict[str, str] = {}
    total = 0
    for file, shard in zip(names, shards, strict=True):
        part = {n: _cpu_contiguous(n, tensors[n], dtype) for n in shard}
        try:
            data = save(part, metadata={"format": "pt"})
        except RuntimeError as exc:  # safetensors refuses tensors that share memory
            raise ModelError(
                f"the tensors of {file} cannot be saved",
                str(exc),
                "pass revision_tensors(model), which drops tied duplicates",
            ) from exc
        files[file] = _write_bytes(tmp / file, data)
        total += sum(t.numel() * t.element_size() for t in part.values())
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        files[INDEX_FILE] = _write_bytes(tmp / INDEX_FILE, _json_bytes(index))
    return files


def _cpu_contiguous(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    import torch

    if not isinstance(t, torch.Tensor):
        raise ModelError(f"{name!r} is a {type(t).__name__}, not a tensor", "", "pass tensors")
    return t.detach().to(device="cpu", dtype=_written_dtype(t, dtype)).contiguous()


def _written_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `t` is written in: `dtype` for a floating-point tensor (when given), else its
    own (integer and bool buffers are never cast)."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


@dataclass(frozen=True)
class RevisionReader:
    """An opened revision directory: its manifest and lazy (mmap) access to its tensors."""

    path: Path
    manifest: RevisionManifest
    weight_map: Mapping[str, str]  # tensor name → shard file

    def names(self) -> list[str]:
        return list(self.weight_map)

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"revision {self.manifest.revision} has no tensor {name!r}")
        with safe_open(self.path / self.weight_map[name], framework="pt") as fh:
            t: torch.Tensor = fh.get_tensor(name)
        return t

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) shard by shard, each shard opened once."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name, file in self.weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with safe_open(self.path / file, framework="pt") as fh:
                for name in names:
                    yield name, fh.get_tensor(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.iter_tensors())


def read_manifest(path: str | Path) -> RevisionManifest:
    p = Path(path) / MANIFEST_FILE
    if not p.is_file():
        raise RevisionCorrupt(str(p), "the revision directory has no manifest.json")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        # (RecursionError: `[[[...` nested past what the JSON reader recurses into)
        raise RevisionCorrupt(str(p), f"the manifest cannot be read ({exc})") from exc
    if not isinstance(data, dict):
        raise RevisionCorrupt(str(p), "the manifest is not a JSON object")
    return RevisionManifest.from_json(data, path=str(p))


def open_revision(path: str | Path) -> RevisionReader:
    """Open a revision directory for reading: manifest, file list and sizes checked (no hashes;
    see the module docstring), the weight map from the index or the single file's header."""
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise RevisionCorrupt(str(root), "it is not a directory")
    manifest = read_manifest(root)
    _check_listing(root, manifest, stat_only=True)
    if INDEX_FILE in manifest.files:
        try:
            index = json.loads((root / INDEX_FILE).read_text(encoding="utf-8"))
            weight_map = {str(k): str(v) for k, v in index["weight_map"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise RevisionCorrupt(str(root / INDEX_FILE), f"unreadable index ({exc!r})") from exc
        for file in set(weight_map.values()):
            if file not in manifest.files:
                raise RevisionCorrupt(
                    str(root / INDEX_FILE), f"it names {file}, which the manifest does not list"
                )
    elif SINGLE_FILE in manifest.files:
        # the names only: the numpy binding reads the same header without importing torch
        with safe_open(root / SINGLE_FILE, framework="numpy") as fh:
            weight_map = dict.fromkeys(fh.keys(), SINGLE_FILE)
    else:
        raise RevisionCorrupt(str(root), f"the manifest lists neither {SINGLE_FILE} nor an index")
    return RevisionReader(path=root, manifest=manifest, weight_map=weight_map)


def verify(path: str | Path) -> RevisionManifest:
    """Re-hash every file of the revision directory against its manifest. Raises
    `RevisionCorrupt` naming the first file that is missing, extra, resized or altered."""
    root = Path(path)
    manifest = read_manifest(root)
    _check_listing(root, manifest, stat_only=False)
    if files_digest(manifest.files) != manifest.sha256:
        raise RevisionCorrupt(
            str(root / MANIFEST_FILE), "its sha256 does not match the file list it holds"
        )
    return manifest


def _check_listing(root: Path, manifest: RevisionManifest, *, stat_only: bool) -> None:
    present: set[str] = set()
    for f in root.iterdir():
        if f.name in CARRIED_DIRS and f.is_dir():
            present.update(f"{f.name}/{g.name}" for g in f.iterdir())
        elif f.name != MANIFEST_FILE:
            present.add(f.name)
    extra = sorted(present - set(manifest.files))
    if extra:
        raise RevisionCorrupt(
            str(root / extra[0]), "the file is not in the manifest (it could change what loads)"
        )
    for name, entry in sorted(manifest.files.items()):
        if not _revision_file_name(name):  # "../x", "/x", "a/b"
            raise RevisionCorrupt(
                str(root / MANIFEST_FILE), f"it lists {name[:200]!r}, not a file of the revision"
            )
        f = root / name
        if not f.is_file():
            raise RevisionCorrupt(str(f), "the manifest lists it but it is missing")
        size = f.stat().st_size
        if size != entry.bytes:
            raise RevisionCorrupt(str(f), f"it has {size} bytes, the manifest says {entry.bytes}")
        if not stat_only:
            digest = _hash_file(f)
            if digest != entry.sha256:
                raise RevisionCorrupt(
                    str(f), f"its sha256 is {digest}, the manifest says {entry.sha256}"
                )


def base_files_problem(model_dir: str | Path, revision: str | Path) -> str | None:
    """Why the HF directory `model_dir` is not the base of `revision` (None: it is): a file the
    revision carries from its base (config, tokenizer: all but the weights) that the directory
    lacks or holds with other bytes. A file added to the directory since (a README) is not
    compared. Hashes the directory's few small files; reads the revision's manifest only."""
    manifest = read_manifest(revision)
    carried = {n: e for n, e in manifest.files.items() if _carried(n)}
    here = base_files(Path(model_dir))
    for name in sorted(carried):
        if name not in here:
            return f"it has no {name}, which revision {manifest.revision} carries"
        entry = carried[name]
        if here[name].stat().st_size != entry.bytes or _hash_file(here[name]) != entry.sha256:
            return f"its {name} differs from revision {manifest.revision}'s"
    return None


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_bytes(path: Path, data: bytes) -> FileEntry:
    """Write and fsync `data`; its SHA-256 is computed meanwhile on another thread (hashlib
    releases the GIL), so a large shard's hash costs no time beyond the write + fsync."""
    digest = hashlib.sha256()
    hasher = threading.Thread(target=digest.update, args=(data,), name="ehp-revision-hash")
    hasher.start()
    try:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        hasher.join()
    return FileEntry(bytes=len(data), sha256=digest.hexdigest())


def _json_bytes(data: object) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
