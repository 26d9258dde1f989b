"""The run's loop keeps serving while the trainer steps: the step is computed on the trainer's
own thread, so the agents, the engines and rollout are served during it, and the step's
transitions come as the pool reaches them — `delivered` once every delivery is in, `stepped`
after the commit — not all at once when the pool returns.

`ehp-fsm run` of the short plan in this process; the Core trainer is held for 3 s at the door of
step 1's gradient reduction (the workers' test hook, `tests/reduce_hook.py`'s file protocol:
the only seam, nothing else is faked), and a serving engine is killed (SIGKILL) as the hold
begins: its agent reports the death, and the engine's machine must fail during the hold. Before,
the loop took no turn for the whole hold: no transition but the step's own, all stamped at its
end, and the dead engine seen only after the step. (Whether groups complete during the hold
depends on how far rollout got before the step: on this plan the next step's groups are often
all done by then; the default plan's runs show the overlap, see the README.)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from ehp_fsm.training.worker import REDUCE_HOOK_ENV
from tests.run.soundness import assert_run_sound
from tests.run.test_run import _serving_engine, assert_no_orphans, run_in_process

HOLD_S = 3.0


def _hold_step_one(hook: Path, log: Path, released: list[float], killed: list[str]) -> None:
    end = time.monotonic() + 240
    while not (hook / "enter-0-1").exists():
        if time.monotonic() > end:
            return
        time.sleep(0.005)
    engine = _serving_engine(log)
    engine.kill()  # SIGKILL, no goodbye
    killed.append(str(engine.pid))
    time.sleep(HOLD_S)
    (hook / "hold-0").unlink()
    released.append(time.monotonic())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rollout_goes_on_while_the_trainer_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "hold-0").write_text("")
    monkeypatch.setenv(REDUCE_HOOK_ENV, str(hook))
    released: list[float] = []
    killed: list[str] = []
    log = tmp_path / "run" / "transitions.jsonl"  # run_in_process's
    holder = threading.Thread(
        target=_hold_step_one, args=(hook, log, released, killed), daemon=True
    )
    holder.start()
    status, out, _receipt, log, run_id = run_in_process(tmp_path, monkeypatch, steps=3)
    holder.join(10)
    assert status == 0, out  # the dead engine is survived
    assert released and killed, "the Core never reached step 1's reduction"

    records = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    accepted = [r for r in records if r.get("accepted") and "machine" in r]
    step = {
        r["event"]: r["time"]
        for r in accepted
        if r["machine"] == "training_step" and r["instance"] == "step-1"
    }
    # delivered when every delivery was in (before the reduction the Core was held at),
    # stepped after it: the hold lies between them
    assert step["stepped"] - step["delivered"] >= HOLD_S - 0.5, step
    during = [r for r in accepted if step["delivered"] < r["time"] < step["stepped"]]
    # the engine's death seen during the hold: its machine's `fail`, or (when the agent's report
    # beat the pool's last delivery, so `fail` came just before `delivered`) its GPUs' release
    # confirmed by the agent — either is a loop turn taken while the trainer stepped
    death = [
        r
        for r in during
        if (r["machine"], r["event"]) in {("rollout_engine", "fail"), ("gpu", "confirm_free")}
    ]
    assert death, sorted({(r["machine"], r["event"]) for r in during})
    assert_no_orphans(run_id)
    assert_run_sound(log, run_id=run_id)
