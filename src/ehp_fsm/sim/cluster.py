"""A plan at another cluster size: its hosts repeated, everything per host kept.

`scale(plan, hosts)` repeats the plan's hosts in order (copy k of host `n1` is `n1.k`; copy 0
keeps the plan's names) with their Core GPUs and engines, and scales what is per cluster with
the copies: the Core's DP, the rollout reserve, `max_hybrids` and the global batch (G groups per
step; at least a group per Core replica where the plan gives one), so every GPU has the work it
has in the plan. With `hosts` = the plan's own count the plan is returned unchanged. Knows
plans; does not know the machines.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ehp_fsm.errors import EhpError
from ehp_fsm.plan import EngineSpec, Host, Plan

__all__ = ["ScaleError", "scale"]


class ScaleError(EhpError):
    """The plan cannot be repeated to the asked size."""


#: The largest simulated cluster: 16 × the 8,192 GPUs the simulator is built for. Memory grows
#: ~26 KiB per GPU (860 MiB at 4,096 hosts × 8 GPUs, 2 steps), so this is ~3.4 GiB; past it a
#: typo (`--hosts 100000000`) would take the machine's memory before printing anything.
MAX_GPUS = 131_072
#: The most groups a simulated step holds: what `examples/gpu-4x8.toml` (2 a GPU) makes at
#: `MAX_GPUS`. A group is ~1.5 KiB in the simulation (16,384 → 262,144 groups a step of a
#: 3-host plan: 318 → 685 MiB), so ~0.4 GiB; a plan's own `prompts_per_step` is at most
#: `plan.MAX_PROMPTS_PER_STEP`, which `--hosts` multiplies (65,536 on 4 hosts at --hosts 1024
#: were 16.8 M groups a step: ~24 GiB).
MAX_GROUPS = 262_144


def _copy_name(name: str, k: int) -> str:
    return name if k == 0 else f"{name}.{k}"


def _gpu(gpu: str, host: str, k: int) -> str:
    return f"{_copy_name(host, k)}:{gpu.split(':', 1)[1]}" if ":" in gpu else f"{gpu}.{k}"


def scale(plan: Plan, hosts: int) -> Plan:
    """`plan` repeated to `hosts` hosts (see the module docstring)."""
    base = len(plan.hosts)
    if hosts == base:
        return plan
    if hosts < 1:  # (it said only "give --hosts 1 or more": gpu-4x8.toml refuses 1)
        raise ScaleError(
            f"--hosts {hosts} is not a number of hosts",
            "a simulated cluster is the plan's hosts repeated in order, at least one",
            f"give --hosts {_smallest(plan)} or more (the plan has {base}; a multiple of "
            f"{base} keeps its mix of Core and rollout hosts)",
        )
    per_host = max(len(h.gpus) for h in plan.hosts)
    if hosts * per_host > MAX_GPUS:
        raise ScaleError(
            f"--hosts {hosts} is {hosts * per_host:,} GPUs at {per_host} a host",
            f"the simulator is bounded at {MAX_GPUS:,} GPUs (~26 KiB of memory each)",
            f"give --hosts {MAX_GPUS // per_host:,} or fewer",
        )
    host_of = {g: h.id for h in plan.hosts for g in h.gpus}
    new_hosts: list[Host] = []
    core_gpus: list[str] = []
    engines: list[EngineSpec] = []
    for i in range(hosts):
        k, tpl = divmod(i, base)
        h = plan.hosts[tpl]
        new_hosts.append(
            Host(
                id=_copy_name(h.id, k),
                gpus=tuple(_gpu(g, h.id, k) for g in h.gpus),
                device=h.device,
            )
        )
        core_gpus += [_gpu(g, h.id, k) for g in plan.core.gpus if host_of[g] == h.id]
        engines += [
            replace(
                e,
                id=_copy_name(e.id, k),
                host=_copy_name(e.host, k),
                gpus=tuple(_gpu(g, e.host, k) for g in e.gpus),
            )
            for e in plan.engines
            if e.host == h.id
        ]
    c = plan.core
    if not core_gpus or len(core_gpus) % c.replica_gpus:
        raise ScaleError(
            f"--hosts {hosts}: {hosts} hosts hold {len(core_gpus)} Core GPUs, not whole Core "
            f"replicas of {c.replica_gpus}",
            "the Core's hosts are repeated in the plan's order",
            f"give --hosts as a multiple of the plan's {base} hosts",
        )
    if not engines:  # (its fix said "≥ the plan's N" where fewer hosts than N ran)
        first = _smallest(plan)
        raise ScaleError(
            f"--hosts {hosts}: the plan's first {hosts} hosts hold no rollout engine",
            "a run needs an engine to roll out on",
            f"give --hosts {first} or more" + (f" (the plan has {base})" if first != base else ""),
        )
    _check_unique(
        ("host", [h.id for h in new_hosts]),
        ("GPU", [g for h in new_hosts for g in h.gpus]),
        ("engine", [e.id for e in engines]),
    )
    factor = hosts / base
    rollout_gpus = sum(e.tp for e in engines)
    reserve = min(rollout_gpus, math.ceil(plan.rollout.reserve * factor))
    prompts = max(1, round(plan.grpo.prompts_per_step * factor))
    dp = len(core_gpus) // c.replica_gpus
    if plan.grpo.prompts_per_step >= c.dp:
        # a group for each Core replica, as the plan gives: the Core's hosts are repeated
        # whole, so its DP grows faster than the hosts' ratio (a plan of G = DP = 4 on one of
        # 4 hosts was 5 groups for 8 replicas at --hosts 5, and failed its first step)
        prompts = max(prompts, dp)
    if prompts > MAX_GROUPS:
        most = max(1, MAX_GROUPS * base // plan.grpo.prompts_per_step)
        raise ScaleError(
            f"--hosts {hosts} makes the plan's {plan.grpo.prompts_per_step:,} groups a step on "
            f"{base} hosts {prompts:,} groups a step",
            f"the simulator is bounded at {MAX_GROUPS:,} groups a step (~1.5 KiB of memory "
            "each, all of a step's held at once)",
            f"give --hosts {most:,} or fewer, or lower [grpo] prompts_per_step",
        )
    hybrids = plan.ehp.max_hybrids
    most = max(1, round(hybrids * factor)) if hybrids else 0
    floor = min(most, round(plan.ehp.min_hybrids * factor))  # (scaled as max_hybrids, within it)
    return replace(
        plan,
        hosts=tuple(new_hosts),
        core=replace(c, dp=dp, gpus=tuple(core_gpus)),
        engines=tuple(engines),
        rollout=replace(plan.rollout, reserve=reserve),
        grpo=replace(plan.grpo, prompts_per_step=prompts),
        # (none stays none: a plan of `enabled = false` may allow no Hybrid)
        ehp=replace(plan.ehp, max_hybrids=most, min_hybrids=floor),
    )


def _smallest(plan: Plan) -> int:
    """The fewest hosts `scale` takes for `plan`: its first hosts, repeated in order, holding
    whole Core replicas and a rollout engine (the plan's own count at most)."""
    base = len(plan.hosts)
    core_gpus = set(plan.core.gpus)
    on_host = {h.id: sum(1 for g in h.gpus if g in core_gpus) for h in plan.hosts}
    with_engine = {e.host for e in plan.engines}
    core = 0
    engines = False
    for i in range(1, base + 1):
        h = plan.hosts[i - 1].id
        core += on_host[h]
        engines = engines or h in with_engine
        if engines and core and core % plan.core.replica_gpus == 0:
            return i
    return base


def _check_unique(*named: tuple[str, list[str]]) -> None:
    """A copy's name (`n1.2`) may be one the plan already uses (a host, GPU or engine id of the
    form `ID.k`): two instances of one id were refused deep in the run as an odd event."""
    for kind, ids in named:
        seen: set[str] = set()
        for i in ids:
            if i in seen:
                raise ScaleError(
                    f"--hosts: the copies of the plan's hosts would have two {kind}s {i!r}",
                    "copy k of an id is named `ID.k`, and the plan already has an id of that form",
                    f"rename the plan's {kind} {i!r} (no `.<number>` ending), or simulate "
                    "without --hosts",
                )
            seen.add(i)
