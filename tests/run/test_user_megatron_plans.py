"""A user's Megatron plan at TP > 1: what `check` says about where its Hybrids may train."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_check_names_as_lenders_only_hosts_a_whole_hybrid_fits_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At replica_size 2 (the Core's TP 2) a host of one engine device can never hold a
    Hybrid, yet `check` said "a Hybrid on the host it is borrowed on (h1, h2)" of such an h2."""
    text = (EXAMPLES / "local-megatron-tp2.toml").read_text()
    text = text.replace('path = "../runs/', f'path = "{tmp_path}/').replace(
        'train = "data/', f'train = "{EXAMPLES}/data/'
    )
    text = text.replace('log = "runs/', f'log = "{tmp_path}/runs/')
    h2 = '[[hosts]]\nid = "h2"\ngpus = 2\n'
    assert h2 in text and text.count('host = "h2"') == 2, text
    text = text.replace(h2, h2.replace("gpus = 2", "gpus = 1"))
    # the second engine on h2 goes (its device with it); the reserve still leaves a borrow
    first = text.index('host = "h2"')
    second = text.index("[[engines]]", text.index('host = "h2"', first + 1) - 40)
    text = text[:second] + text[text.index("\n[", second + 1) + 1 :]
    assert text.count('host = "h2"') == 1, text
    plan = tmp_path / "plan.toml"
    plan.write_text(text)
    assert main(["check", str(plan)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "replica = 2" in out, out
    assert "a Hybrid on the host it is borrowed on (h1)" in out, out
