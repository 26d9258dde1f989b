"""The ids a response ends at (`models.stops`): the engine stops on them and the task counts a
completion that reached one as well formed. The task used to know only the tokenizer's
`eos_token_id` while the engine stopped on the config's whole list: on a Llama-3-like model
(config `eos_token_id` [128001, 128008, 128009], tokenizer 128009) an answer ended by 128008
counted as not well formed, and SGLang itself also stops on generation_config.json's list."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from ehp_fsm.data.dataset import DataConfig, load_dataset
from ehp_fsm.data.rewards import Reward
from ehp_fsm.data.task import DatasetTask, unused_generation_defaults
from ehp_fsm.models import stops
from ehp_fsm.models.revision_dir import config_dtype
from ehp_fsm.models.stops import stop_token_ids
from ehp_fsm.models.tiny import build_tokenizer
from ehp_fsm.rollout.engine import EngineCore, SamplingParams


def _dir(tmp_path: Path, config: object, generation: object | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": config}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation}))
    return tmp_path


def test_the_union_of_config_generation_config_and_tokenizer(tmp_path: Path) -> None:
    tok = SimpleNamespace(eos_token_id=128009)
    d = _dir(tmp_path, [128001, 128008, 128009], 7)
    assert stop_token_ids(d, tok) == {128001, 128008, 128009, 7}
    assert stop_token_ids(None, tok) == {128009}  # a model still to be generated
    (tmp_path / "generation_config.json").unlink()
    assert stop_token_ids(_dir(tmp_path, 5), SimpleNamespace(eos_token_id=None)) == {5}


def test_what_is_no_token_id_adds_nothing(tmp_path: Path) -> None:
    tok = SimpleNamespace(eos_token_id=None)
    assert stop_token_ids(_dir(tmp_path, [True, -1, "2", 3.0, None, 4]), tok) == {4}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert stop_token_ids(tmp_path, tok) == {4}
    assert stop_token_ids(tmp_path / "missing", tok) == frozenset()


def test_the_task_counts_a_completion_ended_by_any_stop_id_as_well_formed(tmp_path: Path) -> None:
    tok = build_tokenizer()
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+2=", "label": "3"}\n')
    three = tok.encode("3", add_special_tokens=False)
    extra = three[0] + 1  # another id the model's config names as an end
    reward = Reward(fn=lambda p, c, label, m: 1.0 if c == label else 0.0, name="f")
    kw = {"max_new_tokens": 4, "temperature": 1.0, "max_prompt_len": 8}
    task = DatasetTask(load_dataset(DataConfig(train=data), tok), tok, reward, **kw,
                       stop_ids=frozenset({tok.eos_token_id, extra}))  # fmt: skip
    assert task.sampling_params(0)["stop_token_ids"] == sorted({tok.eos_token_id, extra})
    scored = task.score_group(0, [[*three, extra], [*three, tok.eos_token_id], three]).scores
    assert [s.well_formed for s in scored] == [True, True, False]
    # the tokenizer's eos only (the task before: what the run built)
    alone = DatasetTask(load_dataset(DataConfig(train=data), tok), tok, reward, **kw)
    assert [s.well_formed for s in alone.score_group(0, [[*three, extra]]).scores] == [False]


def test_the_engine_stops_on_generation_config_eos_ids_as_sglang_does(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    plain = tmp_path / "model"
    shutil.copytree(tiny_model_dir, plain)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    core = EngineCore()
    try:
        assert core.update_weights_from_disk(str(plain))[0]
        free = core.submit(input_ids=[1, 5, 6], params=greedy).result(timeout=30)
        first = free["output_ids"][0]
        config = json.loads((plain / "config.json").read_text())
        assert first not in stop_token_ids(plain, build_tokenizer()), (first, config)
        gen = plain / "generation_config.json"
        doc = json.loads(gen.read_text()) if gen.exists() else {}
        gen.write_text(json.dumps({**doc, "eos_token_id": [config["eos_token_id"], first]}))
        assert core.update_weights_from_disk(str(plain))[0]
        r = core.submit(input_ids=[1, 5, 6], params=greedy).result(timeout=30)
        assert r["output_ids"] == [first]
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    finally:
        core.shutdown()


def _without_waiting(what: str, read: Callable[[], object], fifo: Path) -> object:
    """`read()` (`what` reads), in a thread given 10 s: a read that waits on the FIFO `fifo`
    for a writer is released (a writer opens it) and fails the test, never hanging it."""
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(read()), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        with contextlib.suppress(OSError):  # the waiting open goes on, reads nothing
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail(f"{what} waited on the FIFO {fifo} for a writer")
    return got[0]


def test_a_fifo_for_a_model_json_is_not_waited_on(tmp_path: Path) -> None:
    """A FIFO where a model folder's config.json or generation_config.json belongs: the stop
    ids, the unused sampling defaults and the dtype revisions are published in were read with
    `read_text`, which waits for a writer for ever; each was safe only because `check_model_dir`
    refuses a FIFO first. Each now reads a regular file alone (`stops.model_json`): the FIFO
    adds nothing, as a missing file does."""
    tok = SimpleNamespace(eos_token_id=9)
    d = _dir(tmp_path, 5)
    gen = tmp_path / "generation_config.json"
    os.mkfifo(gen)
    assert _without_waiting("stop_token_ids", lambda: stop_token_ids(d, tok), gen) == {5, 9}
    assert (
        _without_waiting("unused_generation_defaults", lambda: unused_generation_defaults(d), gen)
        == {}
    )
    config = tmp_path / "config.json"
    config.unlink()
    os.mkfifo(config)
    assert _without_waiting("config_dtype", lambda: config_dtype(d), config) is None
    assert _without_waiting("stop_token_ids", lambda: stop_token_ids(d, tok), config) == {9}
    with pytest.raises(OSError, match="is a FIFO, not a file"):
        stops.model_json(config)


def test_a_model_json_past_its_limit_or_nested_too_deep_is_refused(tmp_path: Path) -> None:
    """Bounded by size before a byte is read, and `[[[...` nested past the parser's depth is a
    ValueError like any JSON that does not parse (a RecursionError traceback otherwise)."""
    big = tmp_path / "config.json"
    with big.open("wb") as fh:
        fh.truncate(stops.MODEL_JSON_MAX + 1)  # sparse: no real bytes written
    with pytest.raises(ValueError, match="larger than"):
        stops.model_json(big)
    assert config_dtype(tmp_path) is None
    big.write_text("[" * 200_000)
    with pytest.raises(ValueError, match="nests deeper"):
        stops.model_json(big)
    assert stop_token_ids(tmp_path, SimpleNamespace(eos_token_id=None)) == frozenset()
