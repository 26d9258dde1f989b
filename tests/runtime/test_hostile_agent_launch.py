"""A `launch` whose token or instance is not a plain name is refused before anything is done
with it: both name files on the agent's host.

The token names the engine's pin folder in the revision store (`<store>/.launch-<token>`,
emptied with `rmtree` before it is made) and, with the instance, its log file
(`<state>/logs/<instance>-<token[:8]>.log`). A pool worker's launch had these checked
(`pool_launch.TOKEN`, `INSTANCE`); an engine's or a Hybrid's did not: the token
`x/../../victim` had the agent delete the folder `victim` beside the store (once any
`.launch-x` existed), and an instance `../../f` put the log outside the agent's state folder.
Now each is refused (`bad_args`, naming the field) and the agent goes on.

Real agent, real controller endpoint, real sockets; the store holds a real revision of the tiny
model. No engine is started (every launch here is refused).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.engine_command import EngineLaunchConfig
from tests.rollout.conftest import make_store

from .agent_rig import agent_rig, engine_launch_args


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("token", "instance", "field"),
    [
        ("x/../../victim", "e0", "token"),  # rmtree'd <store>/../victim
        ("tok-00000001", "../../../outside/e0", "instance"),  # the log beside the state folder
        ("tok-00000001", "e0/../../x", "instance"),
        ("", "e0", "token"),
        ("tok\x00-1", "e0", "token"),
    ],
)
def test_a_launch_whose_names_are_not_plain_names_is_refused(
    tmp_path: Path, tiny_model_dir: Path, token: str, instance: str, field: str
) -> None:
    store = make_store(tmp_path / "revisions", tiny_model_dir, revisions=(1,))
    (store.root / ".launch-x").mkdir()  # a pin folder, as an earlier launch of token x leaves
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    (tmp_path / "outside").mkdir()
    engines = EngineLaunchConfig(revisions=str(store.root))
    with agent_rig(tmp_path / "agent", engines=engines) as rig:
        try:
            reply = rig.command("launch", engine_launch_args(token, instance), seconds=1.0)
            assert reply is not None and reply.ok is False, reply
            assert reply.result["reason"] == "bad_args", reply.result
            assert field in reply.result["detail"], reply.result
            assert not rig.agent.processes.managed and not rig.agent.processes.starting()
            good = rig.command("report", {}, seconds=1.0)
            assert good is not None and good.ok is True  # still serving
        finally:
            rig.agent.processes.stop_all(grace_s=5)  # (an engine started before the fix)
    assert (victim / "precious").read_text() == "keep me"
    assert not list((tmp_path / "outside").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent", "outside", "revisions", "victim"]
