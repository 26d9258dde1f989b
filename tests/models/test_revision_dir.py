"""Revisions as HF directories: from_pretrained loads them bit for bit, sharded or not; the
reader maps tensors without hashing; verify names the damaged file; writing is atomic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ehp_fsm.models.load import ModelError, load_model
from ehp_fsm.models.revision_dir import (
    INDEX_FILE,
    MANIFEST_FILE,
    base_files_problem,
    config_dtype,
    open_revision,
    plan_shards,
    revision_tensors,
    verify,
    write_revision,
)
from ehp_fsm.rollout.errors import RevisionCorrupt


@pytest.fixture(scope="module")
def trained(tiny_dir: Path):
    """The tiny model after two Adam steps on a fixed batch: weights no init reproduces."""
    loaded = load_model(tiny_dir)
    model = loaded.model
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor([loaded.tokenizer("3+4=7").input_ids] * 2)
    for _ in range(2):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    return model


def _from_pretrained(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def _assert_bitwise_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def test_a_revision_loads_with_from_pretrained_bit_for_bit(trained, tiny_dir, tmp_path) -> None:
    dest = tmp_path / "r00000001"
    m = write_revision(dest, revision_tensors(trained), revision=1, parent=0, base=tiny_dir, step=3)
    assert (dest / "model.safetensors").is_file()
    assert not (dest / INDEX_FILE).exists()
    _assert_bitwise_equal(_from_pretrained(dest), trained)
    manifest = json.loads((dest / MANIFEST_FILE).read_text())
    assert (manifest["revision"], manifest["parent"], manifest["sha256"]) == (1, 0, m.sha256)
    assert manifest["step"] == m.step == 3 and m.checksum == f"sha256:{m.sha256}"
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(manifest["files"])
    assert (dest / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    assert verify(dest) == m
    assert [p.name for p in tmp_path.iterdir()] == ["r00000001"]  # no temp folder left


def test_sharding_writes_the_standard_index_that_from_pretrained_loads(
    trained, tiny_dir, tmp_path
) -> None:
    dest = tmp_path / "r2"
    tensors = revision_tensors(trained)
    write_revision(dest, tensors, revision=2, parent=1, base=tiny_dir, max_shard_bytes=60_000)
    index = json.loads((dest / INDEX_FILE).read_text())
    shards = sorted(p.name for p in dest.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    _assert_bitwise_equal(_from_pretrained(dest), trained)
    verify(dest)


def test_the_reader_maps_the_same_tensors(trained, tiny_dir, tmp_path) -> None:
    tensors = revision_tensors(trained)
    for i, shard in enumerate((10**9, 60_000)):
        dest = tmp_path / f"r{i}"
        write_revision(dest, tensors, revision=i, parent=None, base=tiny_dir, max_shard_bytes=shard)
        reader = open_revision(dest)
        assert reader.manifest.revision == i
        assert sorted(reader.names()) == sorted(tensors)
        got = reader.state_dict()
        assert all(torch.equal(got[n], tensors[n]) for n in tensors)
        name = next(iter(tensors))
        assert torch.equal(reader.tensor(name), tensors[name])


def test_tied_embeddings_are_stored_once(trained) -> None:
    tensors = revision_tensors(trained)
    assert "model.embed_tokens.weight" in tensors
    assert "lm_head.weight" not in tensors
    assert "lm_head.weight" in trained.state_dict()


def _flip_one_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_names_the_corrupted_file(trained, tiny_dir, tmp_path) -> None:
    dest = tmp_path / "r3"
    write_revision(
        dest, revision_tensors(trained), revision=3, parent=2, base=tiny_dir, max_shard_bytes=60_000
    )
    shards = sorted(dest.glob("model-*.safetensors"))
    assert len(shards) > 2
    victim = shards[1]
    _flip_one_byte(victim, victim.stat().st_size - 5)  # inside tensor data: the header still parses
    open_revision(dest)  # the hot path does not re-hash (sizes are unchanged)
    with pytest.raises(RevisionCorrupt, match="sha256") as err:
        verify(dest)
    assert err.value.path == str(victim)


def test_missing_extra_and_resized_files_are_named(trained, tiny_dir, tmp_path) -> None:
    tensors = revision_tensors(trained)
    for i, damage in enumerate(("missing", "extra", "resized", "manifest")):
        dest = tmp_path / damage
        write_revision(dest, tensors, revision=i, parent=None, base=tiny_dir)
        if damage == "missing":
            (dest / "tokenizer.json").unlink()
            victim, needle = dest / "tokenizer.json", "missing"
        elif damage == "extra":
            (dest / "model-extra.safetensors").write_bytes(b"x")
            victim, needle = dest / "model-extra.safetensors", "not in the manifest"
        elif damage == "resized":
            with open(dest / "config.json", "a") as fh:
                fh.write(" ")
            victim, needle = dest / "config.json", "bytes"
        else:
            (dest / MANIFEST_FILE).unlink()
            victim, needle = dest / MANIFEST_FILE, "no manifest"
        for check in (open_revision, verify):
            with pytest.raises(RevisionCorrupt, match=needle) as err:
                check(dest)
            assert err.value.path == str(victim)


def test_an_existing_revision_is_never_overwritten_and_failures_leave_nothing(
    trained, tiny_dir, tmp_path
) -> None:
    tensors = revision_tensors(trained)
    dest = tmp_path / "r5"
    write_revision(dest, tensors, revision=5, parent=4, base=tiny_dir)
    with pytest.raises(ModelError, match="already exists"):
        write_revision(dest, tensors, revision=5, parent=4, base=tiny_dir)
    shared = torch.zeros(4)
    with pytest.raises(ModelError, match="revision_tensors"):
        write_revision(
            tmp_path / "r6", {"a": shared, "b": shared}, revision=6, parent=5, base=tiny_dir
        )
    with pytest.raises(ModelError, match="lineage"):
        write_revision(tmp_path / "r7", tensors, revision=7, parent=7, base=tiny_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r5"]


def test_a_hub_clones_other_framework_weights_are_not_copied_into_every_revision(
    trained, tiny_dir, tmp_path
) -> None:
    """A model folder cloned from the Hub holds the same weights for other frameworks beside
    the safetensors (GPT-2's repository: `tf_model.h5`, `flax_model.msgpack`, `rust_model.ot`,
    `model.onnx`, each as large as the model; a `.gguf` quantization put beside it). Every
    revision copied each of them — read whole into memory, hashed and written at every step —
    and `--resume` hashed them again. A revision carries the config and tokenizer files only."""
    import shutil

    base = tmp_path / "hub-clone"
    shutil.copytree(tiny_dir, base)
    others = ("tf_model.h5", "flax_model.msgpack", "rust_model.ot", "model.onnx",
              "model.onnx_data", "model-q4_k_m.gguf", "model.ckpt", "weights.npz",
              "model.tflite", "coreml.mlmodel")  # fmt: skip
    for name in others:
        (base / name).write_bytes(b"\0" * 1000)
    (base / "merges.txt").write_text("#version: 0.2\n")  # a BPE tokenizer's own files are kept
    (base / "tokenizer.model").write_bytes(b"\x0a\x01x")
    dest = tmp_path / "r00000001"
    m = write_revision(dest, revision_tensors(trained), revision=1, parent=0, base=base)
    carried = set(m.files)
    assert not carried & set(others), sorted(carried & set(others))
    assert {"merges.txt", "tokenizer.model", "tokenizer.json", "config.json"} <= carried
    assert base_files_problem(base, dest) is None


def test_a_models_additional_chat_templates_are_carried_into_every_revision(
    trained, tiny_dir, tmp_path
) -> None:
    """transformers (≥ 4.54) saves a tokenizer's named chat templates beside
    `chat_template.jinja`, one file each in the subfolder `additional_chat_templates/`, and
    `AutoTokenizer.from_pretrained` reads them from there. A revision copied the model folder's
    files only: an engine that installed one lost every named template (a "tool_use" template
    the prompts are rendered with), and `--resume` never saw them change."""
    import shutil

    from transformers import AutoTokenizer

    base = tmp_path / "model"
    shutil.copytree(tiny_dir, base)
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    tool_use = "{% for message in messages %}[{{ message['content'] }}]{% endfor %}"
    tok.chat_template = {"default": tok.chat_template, "tool_use": tool_use}
    tok.save_pretrained(base)
    assert (base / "additional_chat_templates" / "tool_use.jinja").is_file()  # as transformers
    dest = tmp_path / "r00000001"
    m = write_revision(dest, revision_tensors(trained), revision=1, parent=0, base=base)
    loaded = AutoTokenizer.from_pretrained(dest, local_files_only=True)
    assert isinstance(loaded.chat_template, dict), loaded.chat_template  # (a str: none named)
    assert loaded.chat_template["tool_use"] == tool_use
    assert "additional_chat_templates/tool_use.jinja" in m.files, sorted(m.files)
    chat = [{"role": "user", "content": "1+2="}]
    assert loaded.apply_chat_template(chat, chat_template="tool_use", tokenize=False) == "[1+2=]"
    open_revision(dest)  # the subfolder's files are the manifest's: nothing extra, nothing lost
    assert verify(dest).sha256 == m.sha256
    assert base_files_problem(base, dest) is None
    # the template edited in the model folder: not the base of that revision any more
    (base / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'other' }}")
    assert base_files_problem(base, dest) == (
        "its additional_chat_templates/tool_use.jinja differs from revision 1's"
    )
    # the subfolder's files are held to the manifest as the others are
    template = dest / "additional_chat_templates" / "tool_use.jinja"
    template.write_text(tool_use.replace("[", "<"))
    with pytest.raises(RevisionCorrupt, match="sha256") as err:
        verify(dest)
    assert err.value.path == str(template)
    (dest / "additional_chat_templates" / "extra.jinja").write_text("{{ 'x' }}")
    with pytest.raises(RevisionCorrupt, match="not in the manifest") as err:
        open_revision(dest)
    assert err.value.path == str(dest / "additional_chat_templates" / "extra.jinja")


def test_config_dtype_is_the_half_precision_dtype_the_config_names(tmp_path) -> None:
    """`dtype` (transformers 5), `torch_dtype` (transformers 4); float32, none, an unknown name
    or an unreadable config: None (the tensors are published as they are)."""
    cases = [
        ({"dtype": "bfloat16"}, torch.bfloat16),
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),
        ({"torch_dtype": "float16"}, torch.float16),
        ({"dtype": "float32", "torch_dtype": "bfloat16"}, None),  # the newer key wins
        ({"dtype": "float32"}, None),
        ({}, None),
        ({"dtype": "int8"}, None),
        ([], None),
    ]
    for i, (config, want) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        assert config_dtype(d) is want, config
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    assert config_dtype(tmp_path / "bad") is None
    assert config_dtype(tmp_path / "none") is None


def test_floating_tensors_are_written_in_the_dtype_asked_and_the_others_as_they_are(
    tiny_dir, tmp_path
) -> None:
    tensors = {
        "w": torch.randn(4, 3),
        "h": torch.randn(5, dtype=torch.float16),
        "n": torch.arange(6, dtype=torch.int64),
        "b": torch.tensor([True, False]),
    }
    dest = tmp_path / "r1"
    write_revision(dest, tensors, revision=1, parent=None, base=tiny_dir, dtype=torch.bfloat16)
    got = open_revision(dest).state_dict()
    assert {k: t.dtype for k, t in got.items()} == {
        "w": torch.bfloat16, "h": torch.bfloat16, "n": torch.int64, "b": torch.bool,
    }  # fmt: skip
    assert torch.equal(got["w"], tensors["w"].bfloat16())  # torch's cast: round to nearest even
    assert torch.equal(got["n"], tensors["n"]) and torch.equal(got["b"], tensors["b"])
    # shards are planned in the bytes written: 4×3 + 5 bf16 values (34 bytes), 6 int64, 2 bool
    assert plan_shards(tensors, 34 + 48 + 2, dtype=torch.bfloat16) == [["w", "h", "n", "b"]]
    assert plan_shards(tensors, 34 + 48 + 2) == [["w", "h"], ["n", "b"]]  # 48 + 10 fp32/fp16
