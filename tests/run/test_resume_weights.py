"""`--resume` holds the KL reference's weights: with `grpo.kl_coef > 0` the reference is the
model folder's weights, loaded anew by a resume (the policy comes from the saved state)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ehp_fsm.plan import load_plan
from ehp_fsm.run.resume import (
    HASH_CHUNK,
    MODEL_WEIGHTS,
    ResumeError,
    check_resumed_plan,
    record_plan,
)
from tests.procs import sigterm_when

ROOT = Path(__file__).resolve().parents[2]


def _plan(tmp: Path, model: Path, kl: float) -> Path:
    text = (ROOT / "examples" / "short.toml").read_text()
    text = text.replace('train = "data/', f'train = "{ROOT}/examples/data/')
    text = text.replace('path = "../runs/models/tiny-qwen3"', f'path = "{model}"')
    text = text.replace('generate = "qwen3"\n', "")
    text = text.replace("[grpo]\n", f"[grpo]\nkl_coef = {kl}\n")
    path = tmp / f"plan-{kl}.toml"
    path.write_text(text)
    return path


def _scale_embeddings(model: Path, by: float) -> None:
    tensors = load_file(model / "model.safetensors")
    name = next(n for n in tensors if "embed_tokens" in n)
    tensors[name] = tensors[name] * by
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kl", [0.5, 0.0])
def test_a_resume_refuses_other_weights_in_the_model_folder_when_kl_is_on(
    tmp_path: Path, tiny_model_dir: Path, kl: float
) -> None:
    """Other weights put in `[model] path` between a kill and its resume (config and
    tokenizer the same) were taken without a word: the KL term was then measured against them
    (an ML user's run: ref KL 79.8 on the resumed steps where the run had 0.04, the loss +39.8
    where it was +0.02). With `kl_coef > 0` the start records a digest of the weights and a
    resume refuses others, naming them; with `kl_coef = 0` the folder's weights are not read
    by a resume, so they are not held."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    plan = _plan(tmp_path, model, kl)
    run_dir = tmp_path / "run"
    record_plan(run_dir, load_plan(plan))
    assert check_resumed_plan(run_dir, load_plan(plan)) == []
    _scale_embeddings(model, 50.0)
    if kl == 0.0:
        assert check_resumed_plan(run_dir, load_plan(plan)) == []
        return
    with pytest.raises(ResumeError) as err:
        check_resumed_plan(run_dir, load_plan(plan))
    said = str(err.value)
    assert f"{MODEL_WEIGHTS}: the weights in [model] path are not those the run started" in said
    assert "put back the weights the run started from in [model] path" in said, said
    shutil.copyfile(tiny_model_dir / "model.safetensors", model / "model.safetensors")
    assert check_resumed_plan(run_dir, load_plan(plan)) == []  # put back: it resumes


def test_a_kl_term_dropped_at_the_resume_is_named_not_the_weights(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`kl_coef` from 0.5 to 0 between the kill and the resume: the refusal is the change of
    `grpo.kl_coef`; the weights, held only with a KL term, are not said to differ (a reviewer's
    find: "the weights ... are not those the run started from (... -> (not set))")."""
    record_plan(tmp_path / "run", load_plan(_plan(tmp_path, tiny_model_dir, 0.5)))
    with pytest.raises(ResumeError) as err:
        check_resumed_plan(tmp_path / "run", load_plan(_plan(tmp_path, tiny_model_dir, 0.0)))
    said = str(err.value)
    assert "grpo.kl_coef: 0.5 -> 0.0" in said and MODEL_WEIGHTS not in said, said


def _with_large_weights(model: Path, where: Path, size: int) -> Path:
    """A copy of `model` with a sparse file of `size` zero bytes among its weights
    (`zeros.safetensors`: `from_pretrained` loads `model.safetensors` alone; the digest of
    the initial weights hashes every safetensors file, as it does a sharded model's)."""
    copy = shutil.copytree(model, where / "model")
    with (copy / "zeros.safetensors").open("wb") as fh:
        fh.truncate(size)
    return copy


def test_hashing_the_initial_weights_calls_the_checkpoint_and_ends_at_its_raise(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A 7B model's 15 GB were hashed whole before a stop was looked at again (tens of
    seconds); the hashing now calls its checkpoint every `HASH_CHUNK` bytes."""
    model = _with_large_weights(tiny_model_dir, tmp_path, 64 << 20)
    plan = load_plan(_plan(tmp_path, model, 0.5))
    calls: list[int] = []
    record_plan(tmp_path / "a", plan, checkpoint=lambda: calls.append(1))
    assert len(calls) >= (64 << 20) // HASH_CHUNK, len(calls)

    class Stop(Exception):
        pass

    def stop_at_the_second() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise Stop

    calls.clear()
    zeros = model / "zeros.safetensors"  # changed since: hashed again (not the process's cache)
    os.utime(zeros, ns=(zeros.stat().st_atime_ns, zeros.stat().st_mtime_ns + 1))
    with pytest.raises(Stop):
        record_plan(tmp_path / "b", plan, checkpoint=stop_at_the_second)
    assert len(calls) == 2 and not (tmp_path / "b" / "resume" / "plan.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_stop_while_the_run_hashes_the_initial_weights_ends_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`ehp-fsm run` with `kl_coef > 0` hashes the model folder's weights before it starts
    anything (what a resume is held to). A SIGTERM sent while it hashes 8 GiB (a sparse file:
    no disk) ends the run then, exit 143 naming it; before, the whole file was hashed first
    and the run stopped later, at its next look (`waiting for the host agents`)."""
    model = _with_large_weights(tiny_model_dir, tmp_path, 8 << 30)
    plan = _plan(tmp_path, model, 0.5)
    text = plan.read_text().replace(
        'log = "runs/short/transitions.jsonl"', f'log = "{tmp_path}/run/transitions.jsonl"'
    )
    plan.write_text(text)
    zeros = str(model / "zeros.safetensors")
    status, out, took = sigterm_when(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        lambda pid: _has_open(pid, zeros),
        "hashing of the weights",
    )
    assert status == 128 + 15, out
    assert "stopped by a signal while hashing the plan's data file and initial weights" in out
    # measured: 0.16 s; the code before hashed the 8 GiB first (the test took 31.5 s there,
    # 7.7 s here)
    assert took < 4.0, took


def _has_open(pid: int, path: str) -> bool:
    """Whether process `pid` has `path` open (its /proc fd links)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        links = [os.readlink(fd) for fd in fds.iterdir()]
    except OSError:  # an fd closed while listed
        return False
    return path in links


@pytest.mark.parametrize("size", [0, 1, 4096, 3 * 4096 + 5])
def test_the_digest_is_the_files_sha256_whatever_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """The buffer is the file's size up to `HASH_CHUNK` (here 4 KiB), and the checkpoint is
    called after every piece read."""
    import hashlib

    from ehp_fsm.run import resume

    monkeypatch.setattr(resume, "HASH_CHUNK", 4096)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    calls: list[None] = []
    got = resume._file_digest(path, lambda: calls.append(None))
    assert got == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(calls) == -(-size // 4096)
    assert resume._file_digest(tmp_path / "missing.bin") is None
