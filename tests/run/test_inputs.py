"""`ehp-fsm check` refuses a run's bad inputs — model, data, reward, objective — before anything
starts, naming the file and line or the plan key; and it writes nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ehp_fsm import Orchestrator
from ehp_fsm.cli import main
from ehp_fsm.errors import EhpError, PlanError
from ehp_fsm.plan import load_plan
from ehp_fsm.run.inputs import check_log_folder, prepare, unsupported

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _plan(
    tmp: Path, *, data: str | None = None, model: str = "", reward: str = "", grpo: str = ""
) -> Path:
    text = (EXAMPLES / "short.toml").read_text()
    if model:  # (a model of the user's: `generate` dropped, as the plan's comment says)
        text = text.replace('path = "../runs/models/tiny-qwen3"', model)
        text = text.replace('generate = "qwen3"\n', "")
    if data is not None:
        (tmp / "train.jsonl").write_bytes(data.encode("utf-8", "surrogateescape"))
        text = text.replace('train = "data/add-0-4.jsonl"', 'train = "train.jsonl"')
    else:
        text = text.replace('train = "data/', f'train = "{EXAMPLES}/data/')
    if reward:
        text = text.replace('function = "exact_match"', reward)
    if grpo:
        text = text.replace("[grpo]\n", f"[grpo]\n{grpo}\n")
    text = text.replace('path = "../runs/', f'path = "{tmp}/')
    p = tmp / "plan.toml"
    p.write_text(text)
    return p


def test_the_example_plans_inputs_check_without_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _plan(tmp_path)
    plan = load_plan(path)
    inputs = prepare(plan, create=False)
    assert not inputs.model_dir.exists() and not inputs.generated  # `check` writes nothing
    assert len(inputs.task.dataset.examples) == 500
    q = inputs.task.question(0)
    assert q.prompt_ids[0] == 1 and q.label == str(eval(q.text.rstrip("=")))  # noqa: S307
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out  # the reward's time-out is each completion's (data.rewards)
    assert "reward exact_match (on error: raise, time-out 60 s a completion)" in out
    # the keys that decide what the engines are asked (they were not shown)
    assert "(500 prompts: 'prompt' → label 'label', chat template off, shuffle seed 0)" in out
    assert not inputs.model_dir.exists()


@pytest.mark.parametrize(
    ("data", "line", "why"),
    [
        ('{"prompt": "1+1=", "label": "2"}\n{"label": "3"}\n', 2, "prompt"),
        ('{"prompt": "1+1=", "label": "2"}\nnot json\n', 2, "JSON"),
        ('{"prompt": "1+1=+1+1+1=", "label": "2"}\n', 1, "longer"),
        ("", 0, "no records"),
        ('{"prompt": "1+1=", "label": "2"}\n{"prompt": "\udcff", "label": "2"}\n', 2, "UTF-8"),
    ],
)
def test_bad_data_is_refused_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: str, line: int, why: str
) -> None:
    plan = _plan(tmp_path, data=data)
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    where = f"train.jsonl:{line}" if line else "train.jsonl"
    assert where in err and why.lower() in err.lower(), err
    if why == "longer":  # the key a plan raises it by ([data] max_prompt_len is refused)
        assert "raise [model] max_prompt_len" in err, err


def test_a_reward_that_cannot_be_imported_is_refused(tmp_path: Path) -> None:
    plan = load_plan(_plan(tmp_path, reward='function = "no_such_module_xyz:score"'))
    with pytest.raises(EhpError, match="no_such_module_xyz"):
        prepare(plan, create=False)


def test_a_missing_model_without_generate_is_refused_by_its_key(tmp_path: Path) -> None:
    text = _plan(tmp_path).read_text().replace('generate = "qwen3"\n', "")
    (tmp_path / "plan.toml").write_text(text)
    with pytest.raises(PlanError, match=r"model\.path.*not a directory"):
        load_plan(tmp_path / "plan.toml")


@pytest.mark.parametrize(
    ("grpo", "key"),
    [
        ('loss_aggregation = "sum"', "grpo.loss_aggregation"),
        ("clip_low = 1.5", "grpo.clip_low"),
        ("kl_coef = -1", "grpo.kl_coef"),
        ("temperature = 0", "grpo.temperature"),
    ],
)
def test_objective_keys_are_checked(tmp_path: Path, grpo: str, key: str) -> None:
    with pytest.raises(PlanError, match=key.replace(".", r"\.")):
        load_plan(_plan(tmp_path, grpo=grpo))


def test_run_writes_the_model_it_is_told_to_generate(tmp_path: Path) -> None:
    said: list[str] = []
    inputs = prepare(load_plan(_plan(tmp_path)), create=True, say=said.append)
    assert inputs.generated and (inputs.model_dir / "config.json").is_file()
    assert said and "writing a tiny qwen3 model" in said[0]
    config = json.loads((inputs.model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    again = prepare(load_plan(_plan(tmp_path)), create=True, say=said.append)
    assert not again.generated and len(said) == 1  # there now: used as it is


@pytest.mark.parametrize(
    ("data", "reward", "needle"),
    [
        ('{"label": "3"}\n', "", "prompt"),
        (None, 'function = "no_such_module_xyz:score"', "no_such_module_xyz"),
    ],
)
def test_a_run_refuses_its_data_or_reward_before_writing_the_model_it_generates(
    tmp_path: Path, data: str | None, reward: str, needle: str
) -> None:
    """Before, `ehp-fsm run` wrote the tiny model first, then refused the data (or the reward),
    and the model it had been told to generate was left behind by a run that never began."""
    said: list[str] = []
    plan = load_plan(_plan(tmp_path, data=data, reward=reward))
    with pytest.raises(EhpError, match=needle):
        prepare(plan, create=True, say=said.append)
    assert not (tmp_path / "models").exists() and said == []


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("[[engines]]\n", '[[engines]]\nbackend = "sglang"\n', "engines[0].backend"),
        ("gpus = 1\n", 'gpus = 1\ndevice = "cuda"\n', "hosts[0].device"),
        ("max_response_len = 3", 'max_response_len = 3\ndtype = "bfloat16"', "model.dtype"),
    ],
)
def test_a_setting_the_run_does_not_honour_is_refused_not_run_as_something_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, key: str
) -> None:
    path = _plan(tmp_path)
    text = path.read_text()
    if 'backend = "torch"' not in text:
        text = text.replace("[core]\n", '[core]\nbackend = "torch"\n')
    assert old in text
    path.write_text(text.replace(old, new, 1))
    plan = load_plan(path)  # a valid plan ...
    with pytest.raises(PlanError, match=key.replace(".", r"\.").replace("[", r"\[")):
        prepare(plan, create=True)  # ... that the run refuses before it writes or starts anything
    assert not (tmp_path / "models").exists()
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr().out
    assert f"ehp-fsm run refuses {key}" in out
    # (its first line said "valid", and the command exited 2)
    assert f"({path}): valid, but `ehp-fsm run` refuses it (below)" in out.splitlines()[0]


def test_a_megatron_core_runs_and_check_says_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`core.backend = "megatron"` is run (not refused) on a CPU plan, and `check` says that
    the Core's lanes go through Megatron's CPU compatibility layer."""
    path = _plan(tmp_path)
    path.write_text(path.read_text().replace("[core]\n", '[core]\nbackend = "megatron"\n'))
    plan = load_plan(path)
    assert unsupported(plan) == []
    prepare(plan, create=False)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "core runs as: Megatron-Core lanes (GPTModel from the HF model through mbridge" in out
    assert "CPU compatibility layer (ehp_fsm.backends.megatron.cpu" in out


def test_megatron_hybrids_with_a_kl_reference_are_run(tmp_path: Path) -> None:
    # a parked Megatron lane drops its KL reference and builds it again at the next borrow
    # (tests/training_pool/test_megatron_kl_park.py); before, `check` refused this plan
    plan = load_plan(_plan(tmp_path))
    core = dataclasses.replace(plan.core, backend="megatron")
    grpo = dataclasses.replace(plan.grpo, kl_coef=0.05)
    with_kl = dataclasses.replace(plan, core=core, grpo=grpo)
    assert with_kl.ehp.enabled and unsupported(with_kl) == []


def test_megatron_context_parallelism_is_refused_with_its_key_and_why(tmp_path: Path) -> None:
    plan = load_plan(_plan(tmp_path))
    core = dataclasses.replace(plan.core, backend="megatron", cp=2)
    refused = dict(unsupported(dataclasses.replace(plan, core=core)))
    assert list(refused) == ["core.cp"]
    why = refused["core.cp"]
    assert why.startswith("2: ") and why.endswith(
        "set core.cp = 1 (core.tp and core.pp may be > 1)"
    )
    assert "only Transformer Engine's attention supports it" in why


def test_megatron_pp_runs_with_ehp_and_check_says_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Megatron PP 2 is run (not refused), Hybrids included: the pool gets the plan's PP, and
    `check` says what a lane of stages is and that one micro-batch runs its stages in turn."""
    from ehp_fsm.run.startup import pool_config

    path = _tp_plan(tmp_path, 2)
    path.write_text(path.read_text().replace("tp = 2\ndp = 1", "pp = 2\ndp = 1"))
    plan = load_plan(path)
    assert (plan.core.tp, plan.core.pp) == (1, 2)
    assert plan.ehp.enabled and unsupported(plan) == []
    inputs = prepare(plan, create=False)
    config = pool_config(plan, inputs.model_dir, tmp_path / "revisions")
    assert (config.tp, config.pp, config.lane_size) == (1, 2, 2)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Megatron-Core lanes at PP 2" in out and "each lane 2 processes" in out
    assert "PP splits the model's memory, not its time" in out
    assert "Hybrids are DP1 lanes of the Core's PP2 shape" in out


def _tp_plan(tmp: Path, tp: int) -> Path:
    """The short plan on Megatron with the Core at TP `tp` on h0 (and replica_size to match)."""
    path = _plan(tmp)
    text = path.read_text()
    core = '[core]\ndp = 1\ngpus = ["h0:g0"]'
    gpus = ", ".join(f'"h0:g{i}"' for i in range(tp))
    text = text.replace(core, f'[core]\nbackend = "megatron"\ntp = {tp}\ndp = 1\ngpus = [{gpus}]')
    text = text.replace('id = "h0"\ngpus = 1', f'id = "h0"\ngpus = {tp}')
    path.write_text(text.replace("[ehp]\n", f"[ehp]\nreplica_size = {tp}\n"))
    return path


def test_megatron_tp_runs_with_ehp_and_check_says_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Megatron TP 2 is run (not refused), Hybrids included: the pool gets the plan's TP and
    `check` says what a TP lane is."""
    from ehp_fsm.run.startup import pool_config

    plan = load_plan(_tp_plan(tmp_path, 2))
    assert plan.ehp.enabled and unsupported(plan) == []
    inputs = prepare(plan, create=False)
    assert pool_config(plan, inputs.model_dir, tmp_path / "revisions").tp == 2
    assert main(["check", str(tmp_path / "plan.toml")]) == 0
    out = capsys.readouterr().out
    assert "Megatron-Core lanes at TP 2" in out and "no sequence parallelism" in out
    assert "Hybrids are DP1 lanes of the Core's TP2 shape" in out


def test_a_tp_the_model_does_not_split_over_is_refused_with_its_key(tmp_path: Path) -> None:
    """TP 3 over the tiny model's 4 attention heads: refused before anything starts, naming
    `core.tp` and the model's size that does not split."""
    plan = load_plan(_tp_plan(tmp_path, 3))
    with pytest.raises(PlanError, match=r"core\.tp") as err:
        prepare(plan, create=False)
    assert "num_attention_heads = 4" in str(err.value)


def test_a_pp_the_models_layers_do_not_split_over_is_refused_with_its_key(tmp_path: Path) -> None:
    """Megatron splits a model's layers evenly over its pipeline stages: the tiny model's two
    layers go over 1 or 2 stages, not 3 (refused naming `core.pp` and the layer count), for a
    model still to be generated and for one on disk alike."""
    from ehp_fsm.models.tiny import init_model
    from ehp_fsm.run.inputs import _check_bridge

    _check_bridge(None, "qwen3", pp=2)
    with pytest.raises(PlanError, match=r"core\.pp") as err:
        _check_bridge(None, "qwen3", pp=3)
    assert "2 layers do not split over 3 pipeline stages" in str(err.value)
    model = init_model(tmp_path / "m", arch="qwen3")
    _check_bridge(model, None, pp=2)
    with pytest.raises(PlanError, match="2 layers do not split over 3"):
        _check_bridge(model, None, pp=3)


def test_curve_keys_that_bind_no_key_to_a_host_are_refused_by_check(tmp_path: Path) -> None:
    """An agent of a host the key directory does not bind is never heard: `check` says so
    before a run would wait for it in vain; a directory without keys is refused too."""
    from ehp_fsm.runtime.keys import generate_keys

    keys = tmp_path / "keys"
    generate_keys(keys, agents=["h0", "h1"])  # the plan has h0, h1 and h2
    transport = (
        f'[transport]\ncontroller = "tcp://127.0.0.1:*"\ncurve_keys = "{keys}"\nheartbeat_s = 1.0\n'
    )
    text = _plan(tmp_path).read_text()
    head, _, _ = text.partition("[transport]")
    plan = tmp_path / "keys.toml"
    plan.write_text(head + transport)
    with pytest.raises(PlanError, match=r"binds no key to the hosts \['h2'\]") as info:
        prepare(load_plan(plan), create=False)
    assert info.value.key == "transport.curve_keys"
    plan.write_text(head + transport.replace(str(keys), str(tmp_path / "none")))
    with pytest.raises(PlanError, match=r"does not exist|cannot be read") as info:
        prepare(load_plan(plan), create=False)
    assert info.value.key == "transport.curve_keys"
    said = str(info.value)  # one sentence, one fix (the key file's "because", "Fix:" came twice)
    assert said.count("because") == 1 and said.count("Fix:") == 1, said
    generate_keys(keys, agents=["h0", "h1", "h2"], overwrite=True)
    plan.write_text(head + transport)
    prepare(load_plan(plan), create=False)  # every host bound: accepted


def test_a_log_folder_that_cannot_be_made_is_refused_by_check_and_by_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `check` said valid, and `run` ended in a NotADirectoryError traceback (its
    own end-of-run code, making the run directory, hid the cause)."""
    (tmp_path / "a-file").write_text("")
    plan = _plan(tmp_path)
    text = plan.read_text()
    plan.write_text(
        text.replace(
            'log = "runs/short/transitions.jsonl"', f'log = "{tmp_path}/a-file/run/t.jsonl"'
        )
    )
    for command in ("check", "run"):
        assert main([command, str(plan)]) == 2
        err = capsys.readouterr().err
        assert "plan key `run.log` is invalid" in err and "is a file" in err, err
        assert "Traceback" not in err
    # the same for the revisions' shared path
    plan.write_text(
        text.replace("[run]\n", f'[run]\nrevisions = "{tmp_path}/a-file/revisions"\n', 1)
    )
    assert main(["check", str(plan)]) == 2
    assert "plan key `run.revisions` is invalid" in capsys.readouterr().err


def test_a_run_directory_on_a_read_only_file_system_is_named_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory on a file system mounted read-only (an earlier run's, on a disk
    remounted ro after an error) was "cannot be made: ... is not writable by this user" — as
    root too, of a folder that exists. Now "cannot be written: ... is on a read-only file
    system"; a resume says to make it writable again or to resume a copy. The mount is real (a
    read-only tmpfs), so the test runs only where it may mount one (root); elsewhere it is
    skipped."""
    ro = tmp_path / "ro"
    (ro / "runs" / "short").mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a read-only tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro / "runs" / "short")],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"no mount here: {done.stderr!r}")
    try:
        plan = _plan(tmp_path)
        log = ro / "runs" / "short" / "transitions.jsonl"
        plan.write_text(plan.read_text().replace("runs/short/transitions.jsonl", str(log)))
        assert main(["check", str(plan)]) == 2
        err = capsys.readouterr().err
        assert f"its folder {log.parent} (the run directory) cannot be written" in err, err
        assert f"{log.parent} is on a read-only file system" in err, err
        # a killed run's directory gone read-only: the resume says how to go on from it (it
        # said to point [run] log elsewhere, where no run was, to resume)
        assert main(["run", str(plan), "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"{log.parent} is on a read-only file system" in err, err
        assert "make its file system writable again" in err, err
        assert f"or copy {log.parent} to a folder you can write, point [run] log there" in err
    finally:
        subprocess.run(["umount", str(ro / "runs" / "short")], check=True)


def test_a_run_whose_run_directory_cannot_be_made_is_refused_before_it_begins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ehp-fsm run` of a plan whose log folder cannot be made (in /proc/sys, which no user
    may write) is refused by its key as `check` refuses it, and nothing else: it printed the
    summary of a run that never began ("last step 0") and said its receipt was not
    written."""
    path = _plan(tmp_path)
    log = Path("/proc/sys/ehp-fsm-test/transitions.jsonl")
    path.write_text(path.read_text().replace("runs/short/transitions.jsonl", str(log)))
    assert main(["run", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "plan key `run.log` is invalid" in err and "/proc/sys" in err, err
    assert "summary" not in out and "receipt" not in out, out


def test_an_os_error_is_a_clear_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = EXAMPLES / "gpu-4x8.toml"
    out = tmp_path / "o"
    (out / "summary.txt").mkdir(parents=True)  # where the simulation writes its summary
    assert main(["simulate", str(gpu), "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    # (refused before the simulation now, naming the file: it was IsADirectoryError after it)
    assert err.startswith(f"ehp-fsm: error: the simulation's {out}/summary.txt is a folder"), err
    assert "Traceback" not in err and not (out / "transitions.jsonl").exists()
    # `--out` under a file is refused by name before anything runs (it was this test's
    # NotADirectoryError, naming no flag)
    (tmp_path / "a-file").write_text("")
    under = tmp_path / "a-file" / "x"
    assert main(["simulate", str(gpu), "--steps", "1", "--out", str(under)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ehp-fsm: error: --out {under} cannot be made"), err


def test_a_log_path_that_is_a_directory_is_refused_by_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run.log` naming a directory passed `check`; the run then stopped "after step 0: Is a
    directory" and advised freeing disk space and `--resume`."""
    path = _plan(tmp_path)
    (tmp_path / "logdir").mkdir()
    path.write_text(
        path.read_text().replace("runs/short/transitions.jsonl", str(tmp_path / "logdir"))
    )
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "plan key `run.log` is invalid" in err and "logdir is a directory" in err, err


@pytest.mark.parametrize("target", ["data", "plan", "other", "device"])
def test_a_log_path_that_names_a_file_not_a_log_is_refused_by_check_and_by_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    """`run.log` naming the training data, the plan itself or any other file passed `check`,
    and the run replaced that file with its log (and made its run directory beside it);
    `/dev/null` passed `check` and the run wrote its files into /dev before it refused. Now
    both are refused by `check` and by `run`, naming the file, and nothing is written."""
    path = _plan(tmp_path, data='{"prompt": "1+1=", "label": "2"}\n')
    data, other = tmp_path / "train.jsonl", tmp_path / "notes.txt"
    other.write_text("mine\n")
    log = {"data": data, "plan": path, "other": other, "device": Path("/dev/null")}[target]
    path.write_text(path.read_text().replace("runs/short/transitions.jsonl", str(log)))
    before = {p: p.read_bytes() for p in (data, path, other)}
    for command in ("check", "run"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert "plan key `run.log` is invalid" in err and str(log) in err, err
        why = "is not a file" if target == "device" else "is not a transition log"
        assert why in err, err
    assert {p: p.read_bytes() for p in (data, path, other)} == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["notes.txt", "plan.toml", "train.jsonl"]


def test_a_log_path_that_names_an_earlier_run_s_log_or_an_empty_file_is_taken(
    tmp_path: Path,
) -> None:
    """A transition log (an earlier run's, which a fresh start replaces and `--resume` goes
    on from) and an empty file are what `run.log` may name."""
    path = _plan(tmp_path)
    log = tmp_path / "run" / "transitions.jsonl"
    log.parent.mkdir()
    path.write_text(path.read_text().replace("runs/short/transitions.jsonl", str(log)))
    log.write_bytes(b"")
    check_log_folder(load_plan(path))
    Orchestrator.from_plan(load_plan(path), log_path=log).close()
    assert log.stat().st_size > 0
    check_log_folder(load_plan(path))


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"model_type": "nonsense"}, "has model_type 'nonsense', which transformers"),
        ({"vocab_size": -5}, "cannot be built from its config.json"),
    ],
)
def test_a_model_whose_config_builds_no_causal_lm_is_refused_by_check(
    tmp_path: Path, change: dict[str, object], why: str
) -> None:
    """A config.json transformers cannot build a model from passed `check` (its tokenizer
    loads) and failed only once the run had started its agents and trainers."""
    model = prepare(load_plan(_plan(tmp_path)), create=True, say=lambda _: None).model_dir
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(PlanError, match=r"model\.path") as err:
        prepare(load_plan(_plan(tmp_path)), create=False)
    assert why in str(err.value), str(err.value)


def test_a_model_whose_config_claims_more_than_its_weights_is_refused_by_check(
    tmp_path: Path,
) -> None:
    """A config.json claiming layers its weights lack passed `check` (transformers initializes
    them at random); one claiming 40,000 took `check` 133 s and 2 GB to build on meta."""
    model = prepare(load_plan(_plan(tmp_path)), create=True, say=lambda _: None).model_dir
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"] + 1
    change = {"num_hidden_layers": layers, "layer_types": ["full_attention"] * layers}
    (model / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(PlanError, match=r"model\.path") as err:
        prepare(load_plan(_plan(tmp_path)), create=False)
    assert f"has {layers} layers and its weights hold {layers - 1}" in str(err.value)


def test_check_says_valid_only_once_the_inputs_are_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan whose data or reward is refused is not called valid first (check printed
    "valid", the roles and capacities, then the data's error)."""
    for bad in (
        _plan(tmp_path, data='{"prompt": "1+1=", "label": "2"}\nnot json\n'),
        _plan(tmp_path, reward='function = "no_such_module_xyz:score"'),
    ):
        assert main(["check", str(bad)]) == 2
        captured = capsys.readouterr()
        assert "valid" not in captured.out and "error" in captured.err, captured


def test_a_refused_reward_is_said_once_with_the_plans_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reward's refusal reads as one sentence with one fix (its "because" and its fix came
    twice), and the folder searched is the plan's, absolute (it said "(.)")."""
    (tmp_path / "two_args_reward.py").write_text("def score(p, c):\n    return 1.0\n")
    plan = _plan(tmp_path, reward='function = "two_args_reward:score"')
    monkeypatch.chdir(tmp_path)
    assert main(["check", plan.name]) == 2
    err = capsys.readouterr().err
    assert err.count("Fix:") == 1 and err.count("because") == 1, err
    plan.write_text(plan.read_text().replace("two_args_reward:score", "no_such_module_xyz:f"))
    assert main(["check", plan.name]) == 2
    err = capsys.readouterr().err
    assert f"the plan's folder ({tmp_path})" in err and err.count("Fix:") == 1, err


def test_check_shows_where_a_relative_log_goes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inputs start at the plan's folder, the log at the current directory: `check` run
    from elsewhere showed `log: runs/short/transitions.jsonl`, which did not say which."""
    plan = _plan(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert f"log: {elsewhere}/runs/short/transitions.jsonl" in out, out


def test_the_trainers_objective_is_at_the_plans_sampling_temperature(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[grpo] temperature` reached the engines' sampling only; the trainers took π_θ at 1."""
    from ehp_fsm.run.startup import pool_config
    from ehp_fsm.training.pool_protocol import PoolConfig

    plan = load_plan(_plan(tmp_path, grpo="temperature = 0.7"))
    inputs = prepare(plan, create=False)
    assert inputs.task.sampling_params(0)["temperature"] == 0.7
    config = pool_config(plan, inputs.model_dir, tmp_path / "revisions")
    assert config.objective.temperature == 0.7
    assert PoolConfig.from_json(config.to_json()).objective.temperature == 0.7  # to the workers
    assert main(["check", str(plan.source)]) == 0  # and check says so (it did not)
    assert "lr 0.001; sampling temperature 0.7" in capsys.readouterr().out


def test_a_context_named_otherwise_than_max_position_embeddings_is_checked(
    tmp_path: Path,
) -> None:
    """GPT-2's config names its context `n_positions`: a prompt + response longer than it
    passed `check`, and the model's position embedding then failed on it (IndexError)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from ehp_fsm.models.tiny import build_tokenizer

    tok = build_tokenizer()
    model_dir = tmp_path / "gpt2"
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=10,
        n_embd=8,
        n_layer=1,
        n_head=2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    one = '{"prompt": "1+1=", "label": "2"}\n'
    plan = load_plan(_plan(tmp_path, data=one, model=f'path = "{model_dir}"'))
    assert plan.model is not None and plan.model.max_prompt_len + plan.model.max_response_len > 10
    with pytest.raises(PlanError, match=r"model\.max_response_len") as err:
        prepare(plan, create=False)
    assert "the model's context of 10" in str(err.value)


def test_check_says_when_ehp_is_on_but_can_never_borrow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ehp: on` for a plan whose rollout reserve keeps every engine device serving (and no
    device is free): the run never borrows, and check did not say so."""
    plan = _plan(tmp_path)
    assert main(["check", str(plan)]) == 0
    assert "no Hybrid can ever be borrowed" not in capsys.readouterr().out
    plan.write_text(plan.read_text().replace("[rollout]\nreserve = 2", "[rollout]\nreserve = 3"))
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "ehp: on;" in out and "no Hybrid can ever be borrowed: [rollout] reserve = 3" in out
    # EHP off: said as such, without the borrowing settings it does not use ("max 5 hybrids")
    plan.write_text(plan.read_text().replace("[ehp]\n", "[ehp]\nenabled = false\n", 1))
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "ehp: off (no GPU is ever borrowed: the Core trains alone)" in out, out
    assert "hybrids" not in out.split("ehp: off")[1].splitlines()[0], out


def test_warm_workers_are_as_many_as_hybrids_can_run_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`max_hybrids = 5` on the short plan's hosts (3 devices beside the Core, a reserve of 2
    of its 3 engine devices): one Hybrid can ever run, and the pool started five warm workers
    (each a process holding the model). Now it starts one, and `check` says so; more room
    (reserve 1, or a free device) warms more, never past `max_hybrids`."""
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.placement import hybrids_at_once
    from ehp_fsm.run.startup import pool_config

    plan = _plan(tmp_path)
    text = plan.read_text().replace("max_hybrids = 1", "max_hybrids = 5")
    plan.write_text(text)
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "max 5 hybrids (at most 1 at once beside the Core and the reserve: 1 warm worker)" in out
    loaded = load_plan(plan)
    assert hybrids_at_once(loaded) == 1
    assert pool_config(loaded, tmp_path, tmp_path).max_hybrids == 1
    plan.write_text(text.replace("reserve = 2", "reserve = 1"))
    assert pool_config(load_plan(plan), tmp_path, tmp_path).max_hybrids == 2
    plan.write_text(text.replace("reserve = 2", "reserve = 0"))
    assert main(["check", str(plan)]) == 0
    assert "max 5 hybrids (at most 3 at once" in capsys.readouterr().out
    plan.write_text(
        text.replace("max_hybrids = 5", "max_hybrids = 2").replace("reserve = 2", "reserve = 0")
    )
    assert pool_config(load_plan(plan), tmp_path, tmp_path).max_hybrids == 2  # the plan's cap
    assert main(["check", str(plan)]) == 0
    assert "at most" not in capsys.readouterr().out.split("ehp: on")[1].splitlines()[0]


def test_check_says_when_a_step_holds_a_prompt_more_than_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three prompts and `prompts_per_step = 4`: every step spans two epochs of the shuffle, so
    one prompt is in it twice; `check` said nothing of it."""
    rows = "".join(f'{{"prompt": "{i}+1=", "label": "{i + 1}"}}\n' for i in range(3))
    plan = _plan(tmp_path, data=rows)
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "(3 prompts:" in out
    assert "fewer prompts than grpo.prompts_per_step = 4: a step holds some prompts" in out
    plan = _plan(tmp_path, data=rows + '{"prompt": "3+1=", "label": "4"}\n')
    assert main(["check", str(plan)]) == 0
    assert "fewer prompts" not in capsys.readouterr().out


def test_check_says_when_no_host_has_room_for_a_hybrid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TP 2 Core (a Hybrid needs 2 devices of one host) beside lending hosts of one device
    each: EHP is on and can never borrow; `check` says why."""
    plan = _plan(tmp_path)
    text = plan.read_text()
    for old, new in (
        ('id = "h0"\ngpus = 1', 'id = "h0"\ngpus = 2'),
        ('id = "h1"\ngpus = 2', 'id = "h1"\ngpus = 1'),
        (
            '[core]\ndp = 1\ngpus = ["h0:g0"]',
            '[core]\nbackend = "megatron"\ntp = 2\ndp = 1\ngpus = ["h0:g0", "h0:g1"]',
        ),
        ('[[engines]]\nid = "e1"\nhost = "h1"\ntp = 1\n', ""),
        ("reserve = 2", "reserve = 1"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    plan.write_text(text)
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "no Hybrid can ever be borrowed: a Hybrid needs 2 devices of one host" in out, out


def test_a_megatron_core_on_a_model_saved_as_pytorch_model_bin_is_refused_by_check(
    tmp_path: Path,
) -> None:
    """mbridge reads safetensors only: a Megatron Core over a `pytorch_model.bin` model passed
    `check` and failed in its ranks once the run had started. Refused naming `model.path`; the
    torch backend (transformers reads the .bin) is not concerned."""
    import torch
    from safetensors.torch import load_file

    from ehp_fsm.models.tiny import init_model
    from ehp_fsm.run.inputs import _check_bridge

    model = init_model(tmp_path / "m", arch="qwen3")
    _check_bridge(model, None)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    with pytest.raises(PlanError, match=r"model\.path") as err:
        _check_bridge(model, None)
    assert "pytorch_model.bin" in str(err.value) and "safetensors only" in str(err.value)


def test_the_task_ends_responses_where_the_engine_does(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The run's task takes its stop ids from the model's config.json and
    generation_config.json as the engine does (`models.stops`), not the tokenizer's eos alone."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], 7]
    (model_dir / "config.json").write_text(json.dumps(config))
    plan = load_plan(_plan(tmp_path, model=f'path = "{model_dir}"'))
    task = prepare(plan, create=False).task
    assert task.stop_ids == {config["eos_token_id"][0], 7}
    assert task.sampling_params(0)["stop_token_ids"] == sorted(task.stop_ids)


@pytest.mark.parametrize("resume", [False, True])
def test_a_log_that_is_a_symbolic_link_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], resume: bool
) -> None:
    """A `transitions.jsonl` that is a symbolic link — planted in the run directory before a
    run or between a run and its `--resume` — was followed: the run emptied the link's target
    and wrote its log into it, and made the target's folder its run directory (receipt,
    `run.json`, keys, agents, revisions written there; that folder's `revisions/`,
    `resume/`, `agents/`, `keys/` removed by the start). Now `run` (fresh or `--resume`) and
    `check` refuse the plan by `run.log`, naming the link and its target, and touch neither."""
    path = _plan(tmp_path)
    run_dir, other = tmp_path / "runs" / "short", tmp_path / "other"
    run_dir.mkdir(parents=True)
    (other / "revisions" / "r00000003").mkdir(parents=True)
    (other / "notes.txt").write_text("precious\n")
    (run_dir / "transitions.jsonl").symlink_to(other / "notes.txt")
    path.write_text(
        path.read_text().replace("runs/short/transitions.jsonl", str(run_dir / "transitions.jsonl"))
    )
    assert main(["run", str(path), *(["--resume"] if resume else [])]) == 2
    err = capsys.readouterr().err
    assert "plan key `run.log` is invalid" in err and "symbolic link" in err, err
    assert str(other / "notes.txt") in err, err
    assert main(["check", str(path)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "precious\n"
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt", "revisions"]
    assert (other / "revisions" / "r00000003").is_dir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["transitions.jsonl"]


def test_check_says_where_responses_end_and_when_they_never_can(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model with no `eos_token_id` anywhere (config, generation config, tokenizer) passed
    `check` silently, and every response of the run then ran to `max_response_len`."""
    plan = _plan(tmp_path)
    assert main(["check", str(plan)]) == 0
    assert "response ≤ 3 tokens; responses end at token 2" in capsys.readouterr().out
    model_dir = tmp_path / "no-eos"
    shutil.copytree(tiny_model_dir, model_dir)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        f = model_dir / name
        if f.exists():
            doc = json.loads(f.read_text())
            doc.pop("eos_token_id", None)
            doc.pop("eos_token", None)
            if name == "config.json":  # as a bf16 model (Qwen3, Llama) is published
                doc["dtype"] = "bfloat16"
            f.write_text(json.dumps(doc))
    plan = _plan(tmp_path, model=f'path = "{model_dir}"')
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "no end-of-sequence token" in out and "every response runs to max_response_len" in out
    # which model the folder holds, not its path alone (a Qwen3 or a Llama was not said), and
    # that it trains in float32 while its revisions, which the engines serve, are bf16
    assert (
        f"{model_dir} (Qwen3ForCausalLM: qwen3, 2 layers, hidden 64, vocab 19); float32 "
        "(revisions in bfloat16, its config.json's dtype); prompt" in out
    ), out


def test_check_names_the_architecture_of_a_users_model(tmp_path: Path) -> None:
    """`check`'s model line named the folder only: which model it holds (architecture, size)
    is read from its config.json — GPT-2's own key names and a multimodal `text_config` too."""
    from ehp_fsm.run import inputs

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_layer": 12,
                "n_embd": 768,
                "vocab_size": 50257,
            }
        )
    )
    assert inputs.architecture(tmp_path) == (
        "GPT2LMHeadModel: gpt2, 12 layers, hidden 768, vocab 50257"
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Gemma3ForConditionalGeneration"],
                "model_type": "gemma3",
                "text_config": {"num_hidden_layers": 26, "hidden_size": 1152},
            }
        )
    )
    assert inputs.architecture(tmp_path) == (
        "Gemma3ForConditionalGeneration: gemma3, 26 layers, hidden 1152"
    )


def test_check_names_the_file_the_users_reward_was_imported_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`check` named the reward by its module name alone: whether it was the file beside the
    plan or one of that name on PYTHONPATH was not said."""
    import uuid

    name = f"ehp_rw_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "def score(prompt, completion, label, metadata):\n    return 1.0\n"
    )
    plan = _plan(tmp_path, reward=f'function = "{name}:score"')
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert f"reward {name}:score ({tmp_path / name}.py; on error: raise, time-out 60 s" in out, out


def test_an_architecture_whose_saved_weight_names_are_not_its_own_is_refused_for_embedded(
    tmp_path: Path,
) -> None:
    """GPT-NeoX saves its output layer as `embed_out.weight` and builds it under another name
    (transformers renames it as it loads): `check` said valid, and every embedded engine then
    failed to start ("name tensors the model does not have: ['embed_out.weight']"). Refused
    naming the tensor; a Llama (names as saved) still passes."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from ehp_fsm.models.tiny import build_tokenizer, init_model
    from ehp_fsm.run.inputs import _check_embedded_weights

    tok = build_tokenizer()
    config = GPTNeoXConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    neox = tmp_path / "neox"
    AutoModelForCausalLM.from_config(config).save_pretrained(neox)
    tok.save_pretrained(neox)
    with pytest.raises(PlanError, match=r"model\.path") as err:
        _check_embedded_weights(neox, "plan.toml")
    said = str(err.value)
    assert "embed_out.weight" in said and "load them by name" in said, said
    _check_embedded_weights(init_model(tmp_path / "llama", arch="llama"), "plan.toml")


def test_a_reward_that_changes_directory_does_not_move_the_runs_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run.log` (and `run.revisions`) start at the current directory: a reward that changed
    it (code-execution rewards do, at import or at each call) moved them under the run — its
    log "was removed while the run ran" after step 1, and `check` showed the log under the
    reward's folder. They are fixed as the command starts."""
    import uuid

    from ehp_fsm import cli
    from ehp_fsm.run import job

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    name = f"ehp_cd_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import os\nos.chdir('/')\ndef score(prompt, completion, label, metadata):\n"
        "    os.chdir('/')\n    return 0.0\n"
    )
    plan = _plan(tmp_path, reward=f'function = "{name}:score"')
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    want = work / "runs" / "short" / "transitions.jsonl"
    assert f"log: {want} (runs/short/transitions.jsonl from the current directory)" in out, out
    taken = []
    monkeypatch.chdir(work)
    monkeypatch.setattr(job, "run", lambda p, **kw: taken.append(p) or 0)
    assert cli.main(["run", str(plan)]) == 0
    assert taken[0].log == str(want)


@pytest.mark.parametrize("named", ["LlamaForCausalLM", "FooBarForCausalLM"])
def test_a_config_whose_architectures_and_model_type_name_two_models_is_refused(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], named: str
) -> None:
    """transformers builds by `model_type`, SGLang by `architectures`: a config naming two
    models passed `check`, and the trainers trained the one while an engine would build the
    other."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = [named]
    (model_dir / "config.json").write_text(json.dumps(config))
    plan = _plan(tmp_path, model=f'path = "{model_dir}"')
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"architectures names {named}, and its model_type 'qwen3' builds Qwen3ForCausalLM" in (
        err
    ), err


def test_check_says_generate_is_not_used_when_the_folder_holds_a_model(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate` makes a model only where `path` holds none: with a model there it was taken
    without a word, as if the run would generate one."""
    plan = _plan(tmp_path, model=f'path = "{tiny_model_dir}"\ngenerate = "llama"')
    assert main(["check", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "generate = 'llama' not used: the folder holds one already" in out, out


@pytest.mark.parametrize(("kind", "meant"), [("foobar", None), ("qwen33", "qwen3")])
def test_a_model_type_transformers_does_not_know_is_refused_naming_it(
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    meant: str | None,
) -> None:
    """transformers' own refusal came after its warning ("You are using a model of type
    `foobar` to instantiate a model of type ``"), with escaped line breaks, cut in the middle
    of "pip install --upgrade tra"."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = kind
    (model_dir / "config.json").write_text(json.dumps(config))
    plan = _plan(tmp_path, model=f'path = "{model_dir}"')
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"has model_type {kind!r}, which transformers" in err and "does not know" in err, err
    assert "You are using a model of type" not in err and "\\n" not in err, err
    assert (f"did you mean {meant!r}?" in err) == (meant is not None), err


@pytest.mark.parametrize(
    ("arch", "edit", "said"),
    [
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 3,
                "max_window_layers": 0,
                "layer_types": ["sliding_attention", "sliding_attention"],
            },
            "sliding_attention layers",
        ),
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("llama", {"attention_bias": True}, "attention biases"),
        ("qwen3", {"attention_bias": True}, "attention biases"),
        ("llama", {"mlp_bias": True}, "MLP biases"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
            "rope_type 'linear'",
        ),
    ],
)
def test_a_model_mbridge_would_build_otherwise_is_refused_for_megatron(
    tmp_path: Path, arch: str, edit: dict[str, object], said: str
) -> None:
    """mbridge 0.15.1 builds full attention on every layer, SiLU MLPs, no output-projection
    or MLP biases and the plain rope, whatever the config says: a sliding-window Qwen3 or a
    GELU Llama passed `check` and trained off-policy on the Megatron backend (step 1's ratio
    1.011/1.508 where the torch backend's is 1.000/1.000), a biased one failed once the run
    had started (every engine refused the revision it exported), a scaled rope only in the
    trainers. Refused by `check` naming the feature; the same refusal in the lane itself."""
    import warnings

    from ehp_fsm.models.tiny import init_model
    from ehp_fsm.run.inputs import _check_bridge

    with warnings.catch_warnings():  # Megatron's "Apex / Transformer Engine not installed"
        warnings.simplefilter("ignore")
        from ehp_fsm.backends.megatron.errors import MegatronBackendError
        from ehp_fsm.backends.megatron.hf import _hf_config

    model = init_model(tmp_path / "m", arch=arch)
    _check_bridge(model, None)  # as generated: built as it is
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(PlanError, match=r"core\.backend") as err:
        _check_bridge(model, None)
    assert said in str(err.value) and "core.backend = 'torch'" in str(err.value), err.value
    with pytest.raises(MegatronBackendError, match=said.replace("(", r"\(")):
        _hf_config(str(model))


def test_check_refuses_a_gelu_model_under_a_megatron_core(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ehp_fsm.models.tiny import init_model

    model = init_model(tmp_path / "gelu", arch="llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    text = (EXAMPLES / "local-megatron.toml").read_text()
    text = text.replace('train = "data/', f'train = "{EXAMPLES}/data/')
    plan = tmp_path / "plan.toml"
    plan.write_text(
        "\n".join(
            f'path = "{model}"' if line.startswith("path = ") else line
            for line in text.splitlines()
            if not line.startswith("generate = ")
        )
    )
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "core.backend" in err and "hidden_act 'gelu'" in err, err
    plan.write_text(plan.read_text().replace('backend = "megatron"', 'backend = "torch"', 1))
    assert main(["check", str(plan)]) == 0  # transformers builds it as it is


def test_a_pad_token_the_model_has_no_row_for_pads_with_an_id_it_has(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A pad token added to the tokenizer and not to the model (`add_special_tokens({"pad_token":
    ...})`: id 19 of a vocabulary of 19) passed `check`, and every step then failed with
    "IndexError: index out of range in self" (an ML user's find): the trainers' batches are
    padded with the pad id. The filler is masked out of the loss and never attended to, so the
    batch now pads with the first of pad, eos, 0 the embedding has a row for, and the model's
    forward pass takes it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"pad_token": "<newpad>"})
    tok.save_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    assert tok.pad_token_id == vocab  # no row for it
    plan = load_plan(_plan(tmp_path, model=f'path = "{model}"'))
    task = prepare(plan, create=False, say=lambda _: None).task
    assert task.pad == tok.eos_token_id < vocab
    group = task.score_group(0, [[tok.eos_token_id]] * plan.grpo.group_size)
    batch = task.build_batch([group])
    assert (batch.tokens == task.pad).any()  # padded
    lm = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        assert lm(batch.tokens).logits.isfinite().all()


def test_a_model_whose_config_names_no_context_length_is_refused_by_check(
    tmp_path: Path,
) -> None:
    """A Bloom model (ALiBi: its config names no position limit) passed `check`, and every
    embedded engine then failed to start ("the context length of ... is 0"), 30 s into the
    run, which gives no way to pass `--context-length` (an ML user's find). A tiny Bloom with
    the generated model's tokenizer is refused naming `model.path` and what to add; given
    `max_position_embeddings` it is taken."""
    from transformers import BloomConfig, BloomForCausalLM

    qwen = prepare(load_plan(_plan(tmp_path)), create=True, say=lambda _: None).model_dir
    bloom = tmp_path / "bloom"
    shutil.copytree(qwen, bloom)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (bloom / name).unlink(missing_ok=True)
    vocab = json.loads((qwen / "config.json").read_text())["vocab_size"]
    config = BloomConfig(vocab_size=vocab, hidden_size=16, n_layer=1, n_head=2)
    BloomForCausalLM(config).save_pretrained(bloom)
    plan = _plan(tmp_path, model=f'path = "{bloom}"')
    with pytest.raises(PlanError, match=r"model\.path") as err:
        prepare(load_plan(plan), create=False)
    assert "names no context length" in str(err.value), str(err.value)
    assert '"max_position_embeddings": N' in str(err.value) and "= 11" in str(err.value)
    saved = json.loads((bloom / "config.json").read_text())
    (bloom / "config.json").write_text(json.dumps({**saved, "max_position_embeddings": 64}))
    assert prepare(load_plan(plan), create=False).model_dir == bloom


def test_check_of_a_plan_the_run_refuses_here_still_checks_its_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan for the cluster checked on a machine without its devices (a CUDA host here): its
    model, data and keys were not checked at all, and `check` said "valid, but ..." of a TP
    the model's heads do not split over, naming only the devices (a user's find). Now what the
    run would refuse next is listed too."""
    path = _tp_plan(tmp_path, 3)
    text = path.read_text().replace('id = "h0"\ngpus = 3', 'id = "h0"\ngpus = 3\ndevice = "cuda"')
    path.write_text(text)
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr().out
    assert "valid, but `ehp-fsm run` refuses it (below)" in out, out
    assert "ehp-fsm run refuses hosts[0].device" in out, out
    assert "ehp-fsm run refuses core.tp = " in out and "num_attention_heads = 4" in out, out
    # TP 1 on the same hosts: the model is fine, the device alone is refused
    path.write_text(
        _tp_plan(tmp_path, 1)
        .read_text()
        .replace("gpus = 1\n[[hosts]]", 'gpus = 1\ndevice = "cuda"\n[[hosts]]', 1)
    )
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr().out
    assert "core.tp" not in out.split("(below)")[1], out
