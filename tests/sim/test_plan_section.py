"""`[simulate]` in a plan: parsed, range-checked, refused by `ehp-fsm check` with its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.errors import PlanError
from ehp_fsm.plan import SIMULATE_DEFAULTS, load_plan

GPU_PLAN = Path(__file__).parents[2] / "examples" / "gpu-4x8.toml"


def _plan(tmp_path: Path, section: str) -> Path:
    p = tmp_path / "plan.toml"
    p.write_text(GPU_PLAN.read_text() + "\n[simulate]\n" + section)
    return p


def test_defaults_come_from_the_table_and_the_plan(tmp_path: Path) -> None:
    plan = load_plan(_plan(tmp_path, "model_gb = 30\n"))
    s = plan.simulate
    assert s is not None and s.model_gb == 30.0
    assert s.engine_tokens_per_s == SIMULATE_DEFAULTS["engine_tokens_per_s"][0]
    assert s.engine_start_s == plan.ehp.engine_restart_cost_s  # taken from the plan
    assert all(len(v[3]) > 10 for v in SIMULATE_DEFAULTS.values()), "every default has a source"
    assert load_plan(GPU_PLAN).simulate is None


@pytest.mark.parametrize(
    ("section", "key", "why"),
    [
        ("engine_tokens_per_sec = 1\n", "simulate.engine_tokens_per_sec", "not a known key"),
        ("response_sigma = -1\n", "simulate.response_sigma", "must be within"),
        ("slow_node_fraction = 2\n", "simulate.slow_node_fraction", "must be within"),
        ("response_max_tokens = 0\n", "simulate.response_max_tokens", "integer in 1.."),
        (
            'response_lengths_file = "nope.txt"\n',
            "simulate.response_lengths_file",
            "cannot be read (it does not exist)",  # it said "(it is not a file)"
        ),
        ('response_lengths_file = "."\n', "simulate.response_lengths_file", "it is not a file"),
    ],
)
def test_bad_keys_are_refused_with_their_key(
    tmp_path: Path, section: str, key: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _plan(tmp_path, section)
    with pytest.raises(PlanError) as err:
        load_plan(path)
    assert err.value.key == key and why in str(err.value)
    assert main(["check", str(path)]) == 2
    assert key in capsys.readouterr().err


def test_lengths_file_is_read_and_a_bad_line_named(tmp_path: Path) -> None:
    (tmp_path / "lengths.txt").write_text("# tokens\n120\n\n4000\n")
    plan = load_plan(_plan(tmp_path, 'response_lengths_file = "lengths.txt"\n'))
    assert plan.simulate is not None and plan.simulate.response_lengths == (120, 4000)
    # '²' passes str.isdigit and not int(); 5,000 digits pass neither int() nor any response
    for line, shown in (("lots", "'lots'"), ("\u00b2", "'²'"), ("9" * 5000, "'9999"), ("0", "'0'")):
        (tmp_path / "lengths.txt").write_text(f"120\n{line}\n")
        with pytest.raises(PlanError, match=rf"lengths.txt:2: {shown}.* is not a token count"):
            load_plan(tmp_path / "plan.toml")
    (tmp_path / "lengths.txt").write_text("120\n10000001\n")  # above response_max_tokens' cap
    with pytest.raises(PlanError, match=r"not a token count within 1\.\.10000000"):
        load_plan(tmp_path / "plan.toml")


def test_check_says_the_section_is_read_only_by_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["check", str(_plan(tmp_path, "model_gb = 30\n"))])
    out = capsys.readouterr().out
    assert "simulate: cost model read only by `ehp-fsm simulate`" in out
    # every key with its value and where it comes from (a simulation's errors send the reader
    # to `check` for keys such as model_gb and install_gb_per_s, which it did not show)
    for key in SIMULATE_DEFAULTS:
        assert f"\n    {key} = " in out, key
    assert "    model_gb = 30 (the plan's)\n" in out
    assert "    install_gb_per_s = 5 (default: assumed: SGLang" in out
    assert "    engine_start_s = 90 (default: the plan's [ehp] engine_restart_cost_s" in out
    # a lengths file replaces the log-normal: its median and sigma, if given, are not used
    (tmp_path / "lengths.txt").write_text("120\n")
    plan = _plan(tmp_path, 'response_lengths_file = "lengths.txt"\nresponse_median_tokens = 9\n')
    main(["check", str(plan)])
    out = capsys.readouterr().out
    assert "    response_median_tokens = 9 (not used: response_lengths_file gives" in out
    assert "    response_sigma = 0.8 (not used: response_lengths_file gives" in out


def test_check_lists_the_default_cost_model_of_a_plan_without_the_section(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`ehp-fsm simulate` runs a plan without `[simulate]` (the README's gpu-4x8.toml) on every
    default, and its errors send the reader to `ehp-fsm check PLAN` for each key's value: check
    showed nothing of the cost model for such a plan."""
    assert load_plan(GPU_PLAN).simulate is None
    main(["check", str(GPU_PLAN)])  # (2: `ehp-fsm run` refuses its CUDA hosts; it is valid)
    out = capsys.readouterr().out
    assert "  simulate: no [simulate] section: the default cost model read only by" in out
    # every key at its value, on a few lines (the sources are `SIMULATE_DEFAULTS`')
    section = out.split("  simulate: ", 1)[1].split("\n  core runs as:", 1)[0]
    assert "    defaults (each one's source: plan.SIMULATE_DEFAULTS" in section
    assert len(section.splitlines()) <= 10, section  # (the list was 25 lines)
    for key in SIMULATE_DEFAULTS:
        assert f"{key}=" in section, key
    assert "train_s_per_sample=0.2," in section
    assert "engine_start_s=90," in section  # the plan's [ehp] engine_restart_cost_s


def test_check_says_when_every_simulated_response_is_capped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """short.toml's responses are capped at 3 tokens: `check` said "responses median 600
    tokens", as if the simulation drew them so."""
    from ehp_fsm.cli import main

    short = Path(__file__).parents[2] / "examples" / "short.toml"
    assert main(["check", str(short)]) == 0
    assert "responses median 600 tokens, each capped at response_max_tokens = 3" in (
        capsys.readouterr().out
    )
