"""load_model names the path, what is missing and what to do, before transformers is asked."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ehp_fsm.models.load import ModelError, check_model_dir, load_model


def test_loads_config_model_and_tokenizer_in_the_asked_dtype(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir, "bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    assert not loaded.model.training  # dropout off: π_θ is the engines' policy
    assert loaded.config.model_type == "qwen3"
    assert loaded.tokenizer.eos_token == "<eos>"


def _copy_without(src: Path, dest: Path, *names: str) -> Path:
    shutil.copytree(src, dest)
    for n in names:
        (dest / n).unlink()
    return dest


@pytest.mark.parametrize(
    ("remove", "needle", "fix"),
    [
        (("config.json",), "has no config.json", "init-model"),
        (("model.safetensors",), "has no weights", "save_pretrained"),
        (("tokenizer.json", "tokenizer_config.json"), "has no tokenizer", "tokenizer"),
    ],
)
def test_missing_pieces_are_named(tiny_dir, tmp_path, remove, needle, fix) -> None:
    d = _copy_without(tiny_dir, tmp_path / "m", *remove)
    with pytest.raises(ModelError, match=needle) as err:
        load_model(d)
    assert str(d) in str(err.value)
    assert fix in err.value.fix


@pytest.mark.parametrize("kind", ["a FIFO", "a folder"])
@pytest.mark.parametrize(
    ("name", "gone"),
    [
        ("config.json", ()),
        ("model.safetensors", ()),
        ("tokenizer.json", ("tokenizer_config.json",)),
        ("generation_config.json", ()),  # read for the stop tokens: a FIFO hung `check`
    ],
)
def test_a_piece_that_is_not_a_file_is_named_for_what_it_is(
    tiny_dir, tmp_path, kind, name, gone
) -> None:
    """A FIFO or a folder named config.json (or model.safetensors, tokenizer.json) was told
    "has no config.json" (`is_file`), sending the user to look for a file that is there; a
    FIFO named generation_config.json passed, and `check` then waited on it for ever."""
    d = _copy_without(tiny_dir, tmp_path / "m", name, *gone)
    os.mkfifo(d / name) if kind == "a FIFO" else (d / name).mkdir()
    with pytest.raises(ModelError) as err:
        check_model_dir(d)
    assert f"{name} is {kind}" in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "generation_config.json",
        "chat_template.jinja",
        # told as missing ("has no weights: none of model.safetensors ... is there"), and as
        # transformers' "Couldn't instantiate the backend tokenizer"
        "model.safetensors",
        "tokenizer.json",
    ],
)
def test_a_dangling_link_where_a_file_read_by_name_should_be_is_refused(
    tiny_dir, tmp_path, name
) -> None:
    """A link whose target does not exist at a file the run reads by name was taken as no file
    (a dangling generation_config.json passed `check`, its stop tokens silently not the
    model's; config.json was "has no config.json"), where a reader may follow it and fail
    later. Now the link and its target are named."""
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    (d / name).unlink(missing_ok=True)
    (d / name).symlink_to(tmp_path / "gone" / name)
    with pytest.raises(ModelError) as err:
        check_model_dir(d)
    want = f"{d / name} is a link to {tmp_path / 'gone' / name}, which does not exist"
    assert want in str(err.value), str(err.value)
    assert "remove the link" in err.value.fix


def test_missing_directory_and_a_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist") as err:
        load_model(tmp_path / "nope")
    assert "ehp-fsm init-model" in err.value.fix
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ModelError, match="is not a directory"):
        load_model(f)


def test_unreadable_config_is_an_error_not_a_traceback(tiny_dir, tmp_path) -> None:
    d = _copy_without(tiny_dir, tmp_path / "m")
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ModelError, match="cannot be loaded"):
        load_model(d)


def test_unknown_dtype_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ModelError, match="float64"):
        load_model(tiny_dir, "float64")


@pytest.mark.parametrize("damage", ["overwritten", "truncated"])
def test_a_damaged_weight_file_is_named_before_loading(tiny_dir, tmp_path, damage) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"garbage\n" if damage == "overwritten" else data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"weight file .*model\.safetensors cannot be read") as err:
        check_model_dir(d)
    assert "copy the file again" in str(err.value)


def test_a_shard_the_index_names_must_be_there(tiny_dir, tmp_path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    names = ["a", "b"]
    weight_map = {
        names[0]: "model-00001-of-00002.safetensors",
        names[1]: "model-00002-of-00002.safetensors",
    }
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    with pytest.raises(ModelError, match=r"model-00002-of-00002\.safetensors is missing"):
        check_model_dir(d)
    # transformers reads the index's metadata: an index without one failed in the run's
    # processes, after start-up
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError, match=r"index\.json cannot be read.*a metadata object"):
        check_model_dir(d)
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"model\.safetensors\.index\.json cannot be read"):
        check_model_dir(d)


def _claiming(tiny_dir: Path, dest: Path, **config: object) -> Path:
    """A copy of the tiny model whose config.json claims more than its weights hold."""
    d = _copy_without(tiny_dir, dest)
    c = json.loads((d / "config.json").read_text())
    c.update(config)
    if "num_hidden_layers" in config:
        c["layer_types"] = ["full_attention"] * int(config["num_hidden_layers"])  # type: ignore[call-overload]
    (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.mark.parametrize(
    ("claim", "needle"),
    [
        # one layer more than the weights: randomly initialized and loaded without a word;
        # 40,000 of them took 3 minutes and every byte of memory before a MemoryError
        ({"num_hidden_layers": 3}, "has 3 layers and its weights hold 2"),
        # wider than the weights: a RuntimeError from transformers; in the engine, a vocabulary
        # of 10⁹ was allocated (256 GB) by `from_config` before any shape was compared
        ({"intermediate_size": 256}, "parameters and its weights hold"),
    ],
)
def test_a_config_claiming_more_than_its_weights_is_refused_before_anything_is_built(
    tiny_dir: Path, tmp_path: Path, claim: dict[str, object], needle: str
) -> None:
    from ehp_fsm.rollout.engine import EngineCore

    d = _claiming(tiny_dir, tmp_path / "m", **claim)
    with pytest.raises(
        ModelError, match=r"does not hold the model its config\.json describes"
    ) as e:
        load_model(d)
    assert needle in str(e.value) and "came with these weights" in str(e.value)
    core = EngineCore()  # the embedded engine's install, as /update_weights_from_disk calls it
    try:
        ok, message, _ = core.update_weights_from_disk(str(d))
        assert not ok and needle in message
    finally:
        core.shutdown()


def test_a_config_claiming_more_than_pytorch_model_bin_holds_is_refused(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """The same check where the weights are a `pytorch_model.bin` (before, only safetensors
    headers were compared: one layer more was initialized at random without a word). Its shapes
    come from the file mapped onto the meta device, with `weights_only`."""
    import torch
    from safetensors.torch import load_file

    d = _claiming(tiny_dir, tmp_path / "m", num_hidden_layers=3)
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="has 3 layers and its weights hold 2"):
        load_model(d)
    # a .bin torch cannot map (not torch's zip format) is left to transformers, which names it
    (d / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match="cannot be loaded"):
        load_model(d)


def _bin_shards(d: Path) -> list[str]:
    """Rewrite `d`'s weights as a two-shard `pytorch_model.bin` with its index (the layout
    `save_pretrained(safe_serialization=False)` writes for a large model)."""
    from safetensors.torch import load_file

    state = load_file(d / "model.safetensors")
    names = sorted(state)
    halves = {
        "pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
        "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :],
    }
    for file, part in halves.items():
        torch.save({n: state[n] for n in part}, d / file)
    weight_map = {n: file for file, part in halves.items() for n in part}
    size = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (d / "model.safetensors").unlink()
    return list(halves)


def test_a_sharded_pytorch_model_bin_loads_and_a_missing_shard_is_named(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A model saved as `pytorch_model.bin` shards with their index (transformers loads it)
    was refused as having "no weights". It loads, with the same tensors; its shapes are every
    shard's (a config claiming a layer more is refused); a shard the index names but nobody
    copied is named before transformers is asked."""
    d = _copy_without(tiny_dir, tmp_path / "m")
    shards = _bin_shards(d)
    want = load_model(tiny_dir).model.state_dict()
    got = load_model(d).model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)

    claiming = _claiming(d, tmp_path / "c", num_hidden_layers=3)
    with pytest.raises(ModelError, match="has 3 layers and its weights hold 2"):
        load_model(claiming)

    (d / shards[1]).unlink()
    with pytest.raises(ModelError, match=f"weight file .*{shards[1]} is missing") as err:
        check_model_dir(d)
    assert "copy every shard" in str(err.value)


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_model_folder_that_brings_its_own_code_is_refused_and_none_of_it_runs(
    tiny_dir: Path, tmp_path: Path, where: str
) -> None:
    """A config with `auto_map` (custom code): transformers asked "Do you wish to run the
    custom code? [y/N]" inside `check`, and a "y" ran the folder's modeling file in the run's
    process. Refused before transformers reads the folder; the file never runs."""
    d = tmp_path / "custom"
    shutil.copytree(tiny_dir, d)
    ran = tmp_path / "ran"
    (d / "modeling_x.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    doc = json.loads((d / where).read_text())
    doc["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (d / where).write_text(json.dumps(doc))
    for load in (check_model_dir, load_model):
        with pytest.raises(ModelError, match=f"brings its own code \\({where} has auto_map"):
            load(d)
    assert not ran.exists()


def test_a_pickle_holding_more_than_tensors_is_refused_and_never_unpickled(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """torch's refusal, passed on, advised re-running `torch.load` with `weights_only=False`:
    unpickling a file that can run code. Refused saying why, and the payload never runs."""
    from safetensors.torch import load_file

    d = tmp_path / "pickled"
    shutil.copytree(tiny_dir, d)
    ran = tmp_path / "ran"
    state: dict[str, object] = dict(load_file(d / "model.safetensors"))
    state["payload"] = _Payload(str(ran))
    torch.save(state, d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError) as err:
        load_model(d)
    said = str(err.value)
    assert "holds more than tensors, and ehp-fsm never unpickles one" in said, said
    assert "weights_only" not in said and not ran.exists()


class _Payload:
    """What a malicious pickle holds: unpickled, it would create `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (open, (self.path, "w"))
