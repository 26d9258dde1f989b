"""Every key a plan can hold is used by the run or refused: a walk over the plan schema.

The schema is not listed by hand: it is every key the plan reader asks for while it reads the
example plans (`_Reader.get` is observed), plus `[data]`'s and `[simulate]`'s keys (the cost
model only `ehp-fsm simulate` reads: its change shows in what the simulation runs with). For
each key the walk changes its value in a base plan and asks two questions: is the changed plan
refused, naming that key (or one the change necessarily breaks, listed with the mutation), by
the plan, by `check`'s refusals or by the run's input check? Otherwise, does something the run
is built from change — the world's config, the planner's policy, the trainer pool's config, the
rollout shell's settings, the agents' command lines, the engines' launch, the run's waits, the
controller's transport, the run's inputs (model directory, prompts in the order the run asks
for them, sampling, reward)? These are the values `ehp-fsm run` passes on, built by the same
functions (`pool_config`, `agent_argv`, `RolloutSettings.of`, `waits`, `engine_launch`, ...). A
key that is parsed and changes nothing fails the test; so does a key of the schema with no
mutation here (add one when you add a key).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm import plan as plan_module
from ehp_fsm.data.dataset import DataConfig
from ehp_fsm.errors import EhpError, PlanError
from ehp_fsm.plan import Plan, parse_plan, simulate_costs
from ehp_fsm.run.engines import engine_launch, revisions_dir
from ehp_fsm.run.inputs import prepare, unsupported
from ehp_fsm.run.job import waits
from ehp_fsm.run.samples import samples_file
from ehp_fsm.run.startup import RolloutSettings, agent_argv, pool_config
from ehp_fsm.runtime.controller import transport_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
Doc = dict[str, Any]


# -- the schema ---------------------------------------------------------------------------------
def schema_keys() -> set[str]:
    """Every key the plan reader asks for on the example plans (array indices as `[]`)."""
    seen: set[str] = set()
    original = plan_module._Reader.get

    def observed(self: Any, name: str, kind: Any, default: Any = ...) -> Any:
        seen.add(re.sub(r"\[\d+\]", "[]", self.key(name)))
        return original(self, name, kind, default)

    plan_module._Reader.get = observed  # type: ignore[method-assign]
    try:
        for path in sorted(EXAMPLES.glob("*.toml")):
            plan_module.load_plan(path)
    finally:
        plan_module._Reader.get = original  # type: ignore[method-assign]
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = {f"data.{k}" for k in fields - {"max_prompt_len"}}  # refused in a plan
    # `[simulate]` is in no example plan (`ehp-fsm simulate` reads it, `run` does not)
    simulate = {f"simulate.{k}" for k in (*plan_module.SIMULATE_DEFAULTS, "response_lengths_file")}
    return seen | data | simulate


# -- base plans ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Doc]:
    """The local example on the session's model, with a data file that also has the fields
    other `prompt_key`/`label_key` values name; the same on Megatron; and an SGLang variant
    (CUDA hosts holding only SGLang engines, EHP off: what the run accepts)."""
    tmp = tmp_path_factory.mktemp("keys")
    rows = [json.loads(x) for x in (EXAMPLES / "data" / "add-0-4.jsonl").read_text().splitlines()]
    data = tmp / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({**r, "question": r["prompt"] + " ", "answer": r["label"] + "0"}) + "\n"
            for r in rows
        )
    )
    local = tomllib.loads((EXAMPLES / "local.toml").read_text())
    local["model"]["path"] = str(tiny_model_dir)
    local["data"]["train"] = str(data)
    local["run"]["log"] = str(tmp / "run" / "transitions.jsonl")
    megatron = copy.deepcopy(local)
    megatron["core"]["backend"] = "megatron"
    sglang = copy.deepcopy(local)
    for h in sglang["hosts"][1:]:
        h["device"] = "cuda"
    for e in sglang["engines"]:
        e["backend"] = "sglang"
    sglang["ehp"]["enabled"] = False
    sglang["sglang"] = {"args": ["--mem-fraction-static", "0.8"]}
    return {"local": local, "megatron": megatron, "sglang": sglang}


# -- what the run is built from -----------------------------------------------------------------
def built(plan: Plan) -> dict[str, Any]:
    """The values `ehp-fsm run` builds from `plan` and hands on (see the module docstring)."""
    run_dir = Path(plan.log).resolve().parent
    store = revisions_dir(plan, run_dir)
    inputs = prepare(plan, create=False)
    task = inputs.task
    argv = [agent_argv(plan, h, "tcp://127.0.0.1:1", run_dir) for h in plan.hosts]
    for a in argv:  # this process's pid is not the plan's
        a[a.index("--parent-pid") + 1] = "PID"
    return {
        "log": (plan.log, plan.name),  # the log's path and its header's meta.plan
        "revisions": str(store),
        "samples": samples_file(plan),  # where the run writes every trained sample, if at all
        "world": plan.world_config(),
        "policy": plan.planner_policy(),
        "pool": pool_config(plan, inputs.model_dir, store),
        "rollout": RolloutSettings.of(plan),
        "waits": (waits(plan), plan.run_deadlines),
        "steps": plan.grpo.steps,
        "agents": argv,
        "engines": (
            engine_launch(plan, store),
            [(e.id, e.host, e.gpus, e.tp) for e in plan.engines],  # Controller.launch_engines
        ),
        "transport": (
            transport_config(plan),
            plan.transport.controller,
            plan.transport.curve_keys,
            plan.transport.curve,
        ),
        "simulate": simulate_costs(plan),  # what `ehp-fsm simulate` runs the plan with
        "inputs": (
            str(inputs.model_dir),
            [dataclasses.astuple(task.question(i)) for i in range(0, 40)],
            task.sampling_params(0),
            task.seq_len,
            (task.reward.name, task.reward.on_error, task.reward.timeout_s),
        ),
    }


@dataclasses.dataclass(frozen=True)
class Refused:
    key: str
    why: str


def outcome(doc: Doc) -> dict[str, Any] | Refused:
    """What the run is built from, or the refusal naming its key (plan, `check`, inputs)."""
    try:
        plan = parse_plan(copy.deepcopy(doc), file="plan.toml")
        refused = unsupported(plan)
        if refused:
            return Refused(*refused[0])
        return built(plan)
    except PlanError as exc:
        return Refused(exc.key, str(exc))
    except EhpError as exc:  # an input the run cannot read (model, data, reward, keys)
        return Refused("<input>", str(exc))


# -- the mutations ------------------------------------------------------------------------------
Mutation = Callable[[Doc, Path], None]


def put(path: str, value: Any) -> Mutation:
    """Set `a.b.c` (or `a[1].b`) to `value`."""

    def mutate(doc: Doc, _tmp: Path) -> None:
        node: Any = doc
        parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
        for part in parts[:-1]:
            node = node[int(part[1:-1])] if part.startswith("[") else node.setdefault(part, {})
        node[parts[-1]] = value

    return mutate


def rename_host(doc: Doc, _tmp: Path) -> None:
    old, new = "h2", "node-7"
    doc["hosts"][2]["id"] = new
    for e in doc["engines"]:
        if e["host"] == old:
            e["host"] = new


def move_core(doc: Doc, _tmp: Path) -> None:
    doc["hosts"][0]["gpus"] = 2
    doc["core"]["gpus"] = ["h0:g1"]


def keys_dir(doc: Doc, tmp: Path) -> None:
    from ehp_fsm.runtime.keys import generate_keys

    keys = tmp / "curve"
    if not keys.exists():
        generate_keys(keys, agents=[h["id"] for h in doc["hosts"]])
    doc["transport"]["curve_keys"] = str(keys)


def wider_engine(doc: Doc, _tmp: Path) -> None:
    doc["hosts"][1]["gpus"] = 3
    doc["engines"][0]["tp"] = 2


def other_model(doc: Doc, tmp: Path) -> None:
    target = tmp / "model-copy"
    if not target.exists():
        shutil.copytree(doc["model"]["path"], target)
    doc["model"]["path"] = str(target)


def generated_elsewhere(arch: str) -> Mutation:
    """`generate` decides what a missing model directory becomes: point `path` at a missing
    directory, so the same plan with each `generate` is told apart by what it would write."""

    def mutate(doc: Doc, tmp: Path) -> None:
        doc["model"]["path"] = str(tmp / f"missing-{arch}")
        doc["model"]["generate"] = arch

    return mutate


def data_copy(doc: Doc, tmp: Path) -> None:
    src = Path(doc["data"]["train"])
    target = tmp / "train-first-half.jsonl"
    lines = src.read_text().splitlines(keepends=True)
    target.write_text("".join(lines[: len(lines) // 2]))
    doc["data"]["train"] = str(target)


# key -> (base plan, mutation, keys a refusal may name besides the key itself)
MUTATIONS: dict[str, tuple[str, Mutation, tuple[str, ...]]] = {
    "run.name": ("local", put("run.name", "renamed"), ()),
    "run.seed": ("local", put("run.seed", 7), ()),
    "run.log": ("local", put("run.log", "/tmp/elsewhere/transitions.jsonl"), ()),
    "run.revisions": ("local", put("run.revisions", "/tmp/shared/revisions"), ()),
    "run.samples": ("local", put("run.samples", True), ()),
    "hosts[].id": ("local", rename_host, ()),
    "hosts[].gpus": ("local", put("hosts[1].gpus", 3), ()),
    "hosts[].device": ("local", put("hosts[0].device", "cuda"), ()),
    "core.backend": ("local", put("core.backend", "megatron"), ()),
    "core.tp": ("local", put("core.tp", 2), ("ehp.replica_size", "core.gpus")),
    "core.pp": ("local", put("core.pp", 2), ("ehp.replica_size", "core.gpus")),
    "core.cp": ("local", put("core.cp", 2), ("ehp.replica_size", "core.gpus")),
    "core.dp": ("local", put("core.dp", 2), ("core.gpus",)),
    "core.gpus": ("local", move_core, ()),
    "engines[].id": ("local", put("engines[2].id", "e9"), ()),
    "engines[].host": ("local", put("engines[2].host", "h1"), ("engines[2].gpus",)),
    "engines[].gpus": ("local", put("engines[0].gpus", ["h1:g1"]), ("engines[1].gpus",)),
    "engines[].tp": ("local", wider_engine, ()),
    "engines[].backend": ("local", put("engines[0].backend", "sglang"), ()),
    "rollout.reserve": ("local", put("rollout.reserve", 1), ()),
    "rollout.allowed_tp": ("local", put("rollout.allowed_tp", [1, 2]), ()),
    "grpo.prompts_per_step": ("local", put("grpo.prompts_per_step", 8), ()),
    "grpo.group_size": ("local", put("grpo.group_size", 8), ()),
    "grpo.global_batch": ("local", put("grpo.global_batch", 128), ()),
    "grpo.steps": ("local", put("grpo.steps", 7), ()),
    "grpo.max_staleness": ("local", put("grpo.max_staleness", 0), ()),
    "grpo.learning_rate": ("local", put("grpo.learning_rate", 0.01), ()),
    "grpo.clip_low": ("local", put("grpo.clip_low", 0.1), ()),
    "grpo.clip_high": ("local", put("grpo.clip_high", 0.4), ()),
    "grpo.kl_coef": ("local", put("grpo.kl_coef", 0.01), ()),
    "grpo.loss_aggregation": ("local", put("grpo.loss_aggregation", "seq_mean_token_sum"), ()),
    "grpo.temperature": ("local", put("grpo.temperature", 0.7), ()),
    "ehp.enabled": ("local", put("ehp.enabled", False), ()),
    "ehp.replica_size": ("local", put("ehp.replica_size", 2), ()),
    "ehp.borrow_threshold": ("local", put("ehp.borrow_threshold", 2.5), ()),
    "ehp.release_threshold": ("local", put("ehp.release_threshold", 0.5), ()),
    "ehp.cooldown_s": ("local", put("ehp.cooldown_s", 9.0), ()),
    "ehp.max_hybrids": ("local", put("ehp.max_hybrids", 2), ()),
    "ehp.min_hybrids": ("local", put("ehp.min_hybrids", 0), ()),
    "ehp.engine_restart_cost_s": ("local", put("ehp.engine_restart_cost_s", 7.0), ()),
    "ehp.release_resume_cost_s": ("local", put("ehp.release_resume_cost_s", 2.0), ()),
    "transport.controller": ("local", put("transport.controller", "tcp://127.0.0.1:5999"), ()),
    "transport.allow_non_loopback": (
        "local",
        put("transport.allow_non_loopback", True),
        ("transport.curve_keys",),  # a non-loopback control plane needs CURVE keys
    ),
    "transport.curve_keys": ("local", keys_dir, ()),
    "transport.curve": ("local", put("transport.curve", "off"), ()),  # (default: "local")
    "transport.max_message_bytes": ("local", put("transport.max_message_bytes", 2 << 20), ()),
    "transport.heartbeat_s": ("local", put("transport.heartbeat_s", 0.5), ()),
    "model.path": ("local", other_model, ()),
    "model.generate": ("local", generated_elsewhere("llama"), ()),
    "model.dtype": ("local", put("model.dtype", "bfloat16"), ()),
    "model.max_prompt_len": ("local", put("model.max_prompt_len", 7), ()),
    "model.max_response_len": ("local", put("model.max_response_len", 4), ()),
    "data.train": ("local", data_copy, ()),
    "data.prompt_key": ("local", put("data.prompt_key", "question"), ()),
    "data.label_key": ("local", put("data.label_key", "answer"), ()),
    "data.chat_template": ("local", put("data.chat_template", True), ()),
    "data.seed": ("local", put("data.seed", 11), ()),
    "reward.function": ("local", put("reward.function", "math_answer"), ()),
    "reward.on_error": ("local", put("reward.on_error", "zero"), ()),
    "reward.timeout_s": ("local", put("reward.timeout_s", 7.5), ()),
    "sglang.args": ("sglang", put("sglang.args", ["--mem-fraction-static", "0.7"]), ()),
}
for _machine, _states in plan_module._DEADLINE_STATES.items():
    for _state in _states:
        MUTATIONS[f"deadlines.{_machine}.{_state}"] = (
            "local",
            put(f"deadlines.{_machine}.{_state}", 17.5),
            (),
        )
for _key, (_default, _low, _high, _why) in plan_module.SIMULATE_DEFAULTS.items():
    _value = 3 if _default is None else _default * 1.5 if _high >= _default * 1.5 else _low
    if _key in plan_module._SIMULATE_INTS:
        _value = int(_value) + 1
    MUTATIONS[f"simulate.{_key}"] = ("local", put(f"simulate.{_key}", _value), ())


def lengths_file(doc: Doc, tmp: Path) -> None:
    (tmp / "lengths.txt").write_text("12\n40\n3\n")
    doc.setdefault("simulate", {})["response_lengths_file"] = str(tmp / "lengths.txt")


MUTATIONS["simulate.response_lengths_file"] = ("local", lengths_file, ())
for _wait in ("agents_connect", "rollout", "generate", "health", "trainers_start"):
    MUTATIONS[f"deadlines.run.{_wait}"] = ("local", put(f"deadlines.run.{_wait}", 17.5), ())


def test_every_key_of_the_schema_has_a_mutation() -> None:
    missing = sorted(schema_keys() - set(MUTATIONS))
    assert not missing, f"keys with no mutation in this walk (add one): {missing}"


def walk() -> Iterator[str]:
    yield from sorted(MUTATIONS)


@pytest.mark.parametrize("key", list(walk()))
def test_each_key_changes_what_runs_or_is_refused(
    key: str, bases: dict[str, Doc], tmp_path: Path
) -> None:
    base_name, mutate, also = MUTATIONS[key]
    base = bases[base_name]
    before = outcome(base)
    assert isinstance(before, dict), f"the base plan is refused: {before}"
    doc = copy.deepcopy(base)
    mutate(doc, tmp_path)
    assert doc != base, "the mutation changed nothing in the plan"
    after = outcome(doc)
    if isinstance(after, Refused):
        named = re.sub(r"\[\d+\]", "[]", after.key)
        assert key in (after.key, named) or after.key in also, (
            f"{key} changed, but the refusal names {after.key}: {after.why}"
        )
        return
    changed = sorted(k for k in before if before[k] != after[k])
    assert changed, f"{key} changed in the plan and nothing the run is built from changed"


def test_the_example_plans_are_all_walked() -> None:
    """Every example plan's keys are in the schema walked above (the GPU plan included: its
    keys are the same keys, refused there by `check` where this machine cannot run them)."""
    keys: set[str] = set()

    def leaves(node: Any, prefix: str) -> None:
        for k, v in node.items():
            path = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                leaves(v, path)
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    leaves(item, f"{path}[]")
            else:
                keys.add(path)

    for path in sorted(EXAMPLES.glob("*.toml")):
        leaves(tomllib.loads(path.read_text()), "")
    assert keys <= set(MUTATIONS), sorted(keys - set(MUTATIONS))
