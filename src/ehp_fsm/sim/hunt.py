"""`--faults heavy` over many seeds: the first seed that breaks an invariant (or stalls the
controller), with the command that reproduces it.

Each seed is a whole simulated run with invariants checked at every event; the hunt stops at
the first failure. Knows: how to run a seed. Does not know what the failure means.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ehp_fsm.embedded import InvariantViolation
from ehp_fsm.plan import Plan
from ehp_fsm.sim.story import RunStopped, SimError, Simulation

__all__ = ["HuntResult", "hunt"]


@dataclass(frozen=True)
class HuntResult:
    seeds_run: int
    failing_seed: int | None
    reason: str
    command: str
    stopped: int = 0  # seeds whose run stopped by design (`RunStopped`)
    faults: int = 0  # faults injected over the runs that did not break (clean or stopped)


def hunt(
    plan: Plan,
    *,
    plan_path: str,
    hosts: int,
    steps: int,
    seeds: range,
    ehp: bool = True,
    faults: str = "heavy",
    say: Callable[[str], None] = lambda _s: None,
) -> HuntResult:
    """Run `seeds` in order; stop at the first that breaks."""
    n = stopped = injected = 0

    def _command(seed: int) -> str:
        return (
            f"ehp-fsm simulate {shlex.quote(plan_path)} --hosts {hosts} --steps {steps} "
            f"--seed {seed} --faults {faults} --ehp {'on' if ehp else 'off'}"
        )

    with tempfile.TemporaryDirectory(prefix="ehp-hunt-") as tmp:
        for seed in seeds:
            n += 1
            sim = Simulation(
                plan,
                seed=seed,
                faults=faults,
                ehp=ehp,
                steps=steps,
                log_path=Path(tmp) / f"seed-{seed}.jsonl",
                check=True,
            )
            try:
                r = sim.run()
            except RunStopped as exc:
                stopped += 1
                # its faults count too: a hunt whose every run the faults stopped said "0
                # injected in all" and told the user to give more --hosts or --steps
                injected += sum(sim.result.faults_seen.values())
                say(f"seed {seed}: the run stopped as `ehp-fsm run` would: {exc}")
                continue
            except (InvariantViolation, SimError) as exc:
                return HuntResult(n, seed, str(exc), _command(seed), stopped)
            except (OSError, MemoryError):  # this machine's, not the seed's
                raise
            except Exception as exc:  # a crash of the controller under faults is a finding too:
                # it was a traceback that named neither the seed nor how to reproduce it
                why = (
                    f"{type(exc).__name__}: {exc} (raised by the controller or the simulator, "
                    "a bug: the command below shows its traceback)"
                )
                return HuntResult(n, seed, why, _command(seed), stopped)
            injected += sum(r.faults_seen.values())
            say(
                f"seed {seed}: clean ({r.transitions:,} transitions, faults "
                f"{sum(r.faults_seen.values())})"
            )
    return HuntResult(n, None, "", "", stopped, injected)
