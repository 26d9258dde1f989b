"""`engines.backend = "sglang"` in a plan: what `ehp-fsm check` and `ehp-fsm run` accept, what
they refuse (with its key and why), and the launch config the run hands its agents."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan
from ehp_fsm.run.engines import engine_launch, shown_command
from ehp_fsm.run.inputs import unsupported

PLAN = """
[run]
name = "sglang"
log = "runs/sglang/transitions.jsonl"
[[hosts]]
id = "h0"
gpus = 1
[[hosts]]
id = "n1"
gpus = 4
device = "{device}"
[core]
gpus = ["h0:g0"]
[[engines]]
id = "e0"
host = "n1"
tp = 2
backend = "sglang"
[[engines]]
id = "e1"
host = "n1"
tp = 2
backend = "{backend}"
[rollout]
reserve = 2
[grpo]
prompts_per_step = 2
group_size = 2
steps = 1
[ehp]
enabled = {ehp}
{extra}
"""


def _plan(
    tmp: Path,
    *,
    device: str = "cuda",
    backend: str = "sglang",
    ehp: str = "false",
    extra: str = '[sglang]\nargs = ["--mem-fraction-static", "0.8"]',
) -> Path:
    p = tmp / "plan.toml"
    p.write_text(PLAN.format(device=device, backend=backend, ehp=ehp, extra=extra))
    return p


def test_sglang_engines_on_a_cuda_host_are_run_with_the_plans_args(tmp_path: Path) -> None:
    plan = load_plan(_plan(tmp_path))
    assert unsupported(plan) == []
    cfg = engine_launch(plan, tmp_path)  # the run directory
    assert cfg.backend == "sglang" and cfg.revisions == str(tmp_path / "revisions")
    assert cfg.api_key_file == str(tmp_path / "keys" / "engine-api-key")  # the run writes it
    assert cfg.extra_args == ("--mem-fraction-static", "0.8")
    assert cfg.deterministic  # the dispatcher's sampling seeds are honoured only so
    assert not cfg.memory_saver  # the run stops engines; it never releases their memory


def test_embedded_engines_get_no_sglang_flags(tmp_path: Path) -> None:
    path = _plan(tmp_path, device="cpu", backend="embedded", extra="")
    path.write_text(path.read_text().replace('backend = "sglang"', 'backend = "embedded"'))
    cfg = engine_launch(load_plan(path), tmp_path)
    assert (cfg.backend, cfg.extra_args, cfg.deterministic) == ("embedded", (), False)


@pytest.mark.parametrize(
    ("kw", "key", "why"),
    [
        ({"device": "cpu"}, "engines[0].backend", "SGLang serves on CUDA GPUs only"),
        ({"backend": "embedded"}, "engines[1].backend", "the run's one backend"),
        ({"ehp": "true"}, "hosts[1].device", "a Hybrid borrowed there would train on CPU"),
    ],
)
def test_what_the_run_cannot_honour_is_refused_by_key(
    tmp_path: Path, kw: dict[str, str], key: str, why: str
) -> None:
    refused = dict(unsupported(load_plan(_plan(tmp_path, **kw))))
    assert key in refused and why in refused[key], refused


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ('[sglang]\nargs = ["--tp-size", "4"]', "the launcher sets itself"),
        ('[sglang]\nargs = ["--port=9"]', "the launcher sets itself"),
        ('[sglang]\nargs = ["--dp-size", "2"]', "GPUs or nodes the ledger did not give"),
        ("[sglang]\nargs = [1]", "not a string"),
        ('[sglang]\nargs = []\nmem = "x"', "not a known key"),
    ],
)
def test_sglang_args_that_collide_are_refused_when_the_plan_loads(
    tmp_path: Path, extra: str, why: str
) -> None:
    with pytest.raises(PlanError, match="sglang") as err:
        load_plan(_plan(tmp_path, extra=extra))
    assert why in str(err.value)


@pytest.mark.parametrize(
    ("extra", "fix", "not_fix"),
    [
        ('[sglang]\nargs = ["--tp-size", "4"]', "the run sets it from the plan", None),
        (
            '[sglang]\nargs = ["--dp-size", "2"]',
            "[[engines]] entry's `tp` GPUs of its `host`",
            "the run sets it from the plan",  # no plan key sets --dp-size
        ),
        ("[sglang]\nargs = [1]", "write it as a string", "the run sets it from the plan"),
    ],
)
def test_a_refused_sglang_arg_is_given_the_fix_of_its_kind(
    tmp_path: Path, extra: str, fix: str, not_fix: str | None
) -> None:
    with pytest.raises(PlanError) as err:
        load_plan(_plan(tmp_path, extra=extra))
    assert fix in err.value.fix, err.value.fix
    assert not_fix is None or not_fix not in str(err.value)


def test_a_refused_sglang_arg_is_quoted_cut_short() -> None:
    """A 10 MB list of ints in `[sglang] args` made a 10 MB refusal (its whole repr), and a
    megabyte option string one of a megabyte: each is quoted to 80 characters, printable."""
    from ehp_fsm.engine_command import extra_args_refusal

    for arg, why in (
        (list(range(2_000_000)), "is not a string"),
        ("--tp-size=" + "9" * 1_000_000, "which the launcher sets itself"),
        ("--dp-size=2\n" + "x" * 1_000_000, "would place the engine on GPUs"),
    ):
        refusal = extra_args_refusal([arg])
        assert refusal is not None
        message = refusal[0]
        assert why in message and len(message) < 400, message[:300]
        assert "..." in message and "\n" not in message, message  # (the cut shown)


def test_sglang_args_without_an_sglang_engine_are_refused(tmp_path: Path) -> None:
    text = _plan(tmp_path, backend="embedded").read_text()
    text = text.replace('backend = "sglang"', 'backend = "embedded"')
    (tmp_path / "plan.toml").write_text(text)
    with pytest.raises(PlanError, match=r"sglang\.args.*nothing would be launched"):
        load_plan(tmp_path / "plan.toml")


def test_check_shows_the_engine_command_line(tmp_path: Path) -> None:
    line = shown_command(load_plan(_plan(tmp_path)))
    assert line.startswith(
        "python -m sglang.launch_server --model-path RUN_DIR/revisions/.launch-RANDOM"
    )
    assert "--tp-size 2 --host ADDR --port PORT --weight-version N" in line
    assert line.endswith(
        "--enable-deterministic-inference --api-key KEY --mem-fraction-static 0.8 "
        "(KEY: from RUN_DIR/keys/engine-api-key, as --api-key) "
        "with CUDA_VISIBLE_DEVICES = its GPUs"
    )


@pytest.mark.parametrize(
    ("engines", "allowed", "key"),
    [
        ("tp = 3", "", "engines[0].tp"),  # its own TP
        (  # a returned engine's: three TP1 engines on the host's three devices
            "tp = 1\n"
            + "".join(
                f'[[engines]]\nid = "e{k}"\nhost = "n1"\ntp = 1\nbackend = "sglang"\n'
                for k in (1, 2)
            ),
            "[rollout]\nallowed_tp = [1, 3]\nreserve = 1",
            "rollout.allowed_tp",
        ),
    ],
)
def test_an_sglang_tp_that_does_not_divide_the_heads_is_refused(
    tmp_path: Path, engines: str, allowed: str, key: str
) -> None:
    """SGLang refuses at launch an engine whose TP does not divide the model's attention heads
    (4 in the tiny model): `check` passed a TP3 engine, and every launch would have failed."""
    from ehp_fsm.run.inputs import prepare
    from tests.run.test_run import session_model

    examples = Path(__file__).resolve().parents[2] / "examples"
    plan = tmp_path / "plan.toml"
    text = f"""
[run]
name = "heads"
log = "{tmp_path}/run/transitions.jsonl"
[[hosts]]
id = "h0"
gpus = 1
[[hosts]]
id = "n1"
gpus = 3
device = "cuda"
[core]
gpus = ["h0:g0"]
[[engines]]
id = "e0"
host = "n1"
backend = "sglang"
{engines}
{allowed}
[grpo]
prompts_per_step = 2
group_size = 2
steps = 1
[ehp]
enabled = false
[model]
path = "{session_model()}"
max_prompt_len = 8
max_response_len = 3
[data]
train = "{examples}/data/add-0-4.jsonl"
"""
    plan.write_text(text)
    with pytest.raises(PlanError, match="attention heads do not split over 3 ranks") as err:
        prepare(load_plan(plan), create=False)
    assert err.value.key == key and "use a TP that divides 4 (1, 2, 4)" in str(err.value)
    if "tp = 3" in engines:  # one TP2 engine on a host of two devices
        text = text.replace("tp = 3", "tp = 2").replace("gpus = 3", "gpus = 2")
    plan.write_text(text.replace("[1, 3]", "[1, 2]"))
    prepare(load_plan(plan), create=False)  # a TP that divides them: taken


def test_a_health_deadline_shorter_than_sglangs_health_check_is_refused(tmp_path: Path) -> None:
    """SGLang's `/health` is a one-token generation answered no sooner than 1 s after the
    request: `[deadlines.run] health = 0.5` was taken, and every probe of a healthy SGLang
    engine would have timed out. The embedded engine answers at once: its bound stays free."""
    extra = "[deadlines.run]\nhealth = 0.5"
    with pytest.raises(PlanError, match="shorter than a healthy SGLang engine") as err:
        load_plan(_plan(tmp_path, extra=extra))
    assert err.value.key == "deadlines.run.health" and "set health = 3 or more" in str(err.value)
    assert load_plan(_plan(tmp_path, extra="[deadlines.run]\nhealth = 3")).run_deadlines.health == 3
    embedded = _plan(tmp_path, extra=extra).read_text().replace('"sglang"', '"embedded"')
    (tmp_path / "plan.toml").write_text(embedded)
    assert load_plan(tmp_path / "plan.toml").run_deadlines.health == 0.5
