"""A sampling param of the wrong kind is refused naming its key, never read as something else.

`SamplingParams.from_json` cast each value with `int`, `float`, `bool` or `str`, so a value of
another kind was silently turned into one the client did not send: `"ignore_eos": "false"` ran
with EOS ignored (`bool("false")` is True), `"stop": [null]` stopped on the text "None",
`"sampling_seed": 1.5` drew with seed 1, `"stop_token_ids": [2.9]` stopped on id 2,
`"max_new_tokens": true` generated one token. Every one answered 200. Now each is a 400 naming
the key (an integral float such as `4.0` is still the integer it names, as SGLang reads it).

The HTTP case runs the engine's app under real uvicorn on a real socket, over the tiny model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ehp_fsm.rollout.engine import EngineCore, SamplingParams
from ehp_fsm.rollout.server import create_app
from tests.rollout.inprocess import serving

PROMPT = [1, 4, 5, 13, 6, 16]

MISREAD: list[tuple[dict[str, Any], str]] = [
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"ignore_eos": 0.0}, "ignore_eos"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"no_stop_trim": []}, "no_stop_trim"),
    ({"stop": [None]}, "stop"),
    ({"stop": [7]}, "stop"),
    ({"stop": ["a", {"b": 1}]}, "stop"),
    ({"stop_token_ids": [2.9]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 2.7}, "max_new_tokens"),
    ({"max_new_tokens": "4"}, "max_new_tokens"),
    ({"top_k": "5"}, "top_k"),
    ({"sampling_seed": 1.5}, "sampling_seed"),
    ({"seed": False}, "seed"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": [0.5]}, "top_p"),
]


@pytest.mark.parametrize(("params", "key"), MISREAD)
def test_a_value_of_the_wrong_kind_is_refused_naming_its_key(
    params: dict[str, Any], key: str
) -> None:
    with pytest.raises(ValueError, match=key):
        SamplingParams.from_json(params)


@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({"repetition_penalty": 1.2}, "repetition_penalty is 1.2: the embedded engine does not"),
        ({"min_p": 0.05}, "min_p is 0.05: "),
        ({"min_new_tokens": 3}, "min_new_tokens is 3: "),
        ({"frequency_penalty": -0.5}, "frequency_penalty is -0.5: "),
        ({"regex": "[0-9]+"}, "regex is "),
        ({"logit_bias": {"5": 2.0}}, "logit_bias is "),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens is False"),
        ({"temprature": 0.5}, "'temprature' is not a sampling param: did you mean 'temper"),
        ({"bogus": 1}, "'bogus' is not a sampling param (SGLang refuses it too)"),
    ],
)
def test_a_param_the_engine_would_not_honour_is_refused_naming_it(
    params: dict[str, Any], said: str
) -> None:
    """SGLang's params the embedded engine does not implement were ignored without a word
    (`repetition_penalty: 1.2` sampled as 1.0), and so was a key of no param at all (a typo),
    which SGLang refuses. Now each is refused naming it; sent at the value that changes
    nothing (what the run's own requests send: `training.task.PLAIN_SAMPLING`), it is taken."""
    with pytest.raises(ValueError, match=r"not a sampling param|does not implement") as err:
        SamplingParams.from_json(params)
    assert said in str(err.value), str(err.value)


def test_the_params_at_the_values_that_change_nothing_are_taken() -> None:
    from ehp_fsm.training.task import PLAIN_SAMPLING

    neutral = {
        **PLAIN_SAMPLING,
        "min_new_tokens": 0,
        "regex": None,
        "spaces_between_special_tokens": True,
        "repetition_penalty": 1,
        "n": 1,
        "seed": 3,
    }
    p = SamplingParams.from_json(neutral)
    assert (p.top_p, p.top_k, p.sampling_seed) == (1.0, -1, 3)


def test_values_of_their_own_kind_are_read_as_sent() -> None:
    p = SamplingParams.from_json(
        {
            "max_new_tokens": 4.0,  # integral: the integer it names
            "temperature": 1,
            "top_p": 0.5,
            "top_k": 3,
            "stop": "x",
            "stop_token_ids": [2, 5],
            "ignore_eos": False,
            "seed": 7,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
    )
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k) == (4, 1.0, 0.5, 3)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.sampling_seed) == (("x",), (2, 5), False, 7)
    assert (p.skip_special_tokens, p.no_stop_trim) == (False, True)
    assert type(p.max_new_tokens) is int and type(p.temperature) is float
    assert SamplingParams.from_json({"max_new_tokens": None, "stop": None}) == SamplingParams()


@pytest.fixture(scope="module")
def url(tiny_model: Path) -> Iterator[str]:
    core = EngineCore()
    ok, message, _ = core.update_weights_from_disk(str(tiny_model))
    assert ok, message
    with serving(create_app(core)) as base:
        yield base


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"ignore_eos": "false"}, "ignore_eos"),
        ({"stop": [None]}, "stop"),
        ({"sampling_seed": 1.5}, "sampling_seed"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"temprature": 0.5}, "temprature"),
    ],
)
def test_generate_answers_400_naming_the_key(url: str, params: dict[str, Any], key: str) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, **params}}
    r = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "invalid sampling_params" in message and key in message, message
    ok = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{url}/generate", json=ok, timeout=30).status_code == 200


@pytest.mark.parametrize("ids", [[True, 4, 5], [[1, 4], [5, False]]])
def test_a_token_id_that_is_true_or_false_is_refused(url: str, ids: list[Any]) -> None:
    """Lax, pydantic read `[true, 4, 5]` as the ids `[1, 4, 5]` and answered 200."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "input_ids" in r.json()["error"]["message"]


def test_a_weight_version_past_its_bound_is_refused_and_the_weights_stay(
    url: str, tiny_model: Path
) -> None:
    """Every later answer quotes the version an install gives: 1 MB was taken and echoed."""
    from ehp_fsm.rollout.server import MAX_WEIGHT_VERSION_CHARS

    before = httpx.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"]
    body = {"model_path": str(tiny_model), "weight_version": "v" * (MAX_WEIGHT_VERSION_CHARS + 1)}
    r = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "weight_version" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"] == before
    body["weight_version"] = "v" * MAX_WEIGHT_VERSION_CHARS
    r = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = httpx.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"]
    assert got == body["weight_version"]


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -0.5])
def test_a_temperature_that_is_not_finite_and_non_negative_is_refused(value: float) -> None:
    """An infinite temperature (JSON `Infinity`, or `1e309`) was taken and sampled the
    uniform distribution; NaN and negative ones were refused already."""
    with pytest.raises(ValueError, match="temperature must be finite and ≥ 0"):
        SamplingParams.from_json({"temperature": value})
    with pytest.raises(ValueError, match="temperature must be finite and ≥ 0"):
        SamplingParams(temperature=value)
