"""`ehp-fsm`: check plans, show machine specs, replay transition logs, run, resume or stop a job.

Each subcommand is a small function from parsed arguments to an exit code; errors from the
library (`EhpError`) are printed as one message naming what was wrong and what to do, exit 2.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import functools
import gc
import json
import os
import shlex
import signal
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Final, NoReturn

from ehp_fsm.errors import EhpError, PlanError, printable

if TYPE_CHECKING:
    from ehp_fsm.plan import Plan
    from ehp_fsm.replay import ReplayResult

PARALLEL_REPLAY_BYTES = 8 << 20
#: The most worker processes `replay --jobs` starts (each verifies one stretch of the log).
MAX_REPLAY_JOBS = 256
#: The most bytes `replay --receipt` reads: a 100-step run's receipt is ~32 kB (a 1 GiB file was
#: read whole, 2.1 GB of memory and 8.6 s, before it was refused as not JSON).
MAX_RECEIPT_BYTES = 16 << 20


def _cmd_check(args: argparse.Namespace) -> int:
    from ehp_fsm.errors import PlanError
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.inputs import (
        architecture,
        check_keys,
        core_runtime,
        prepare,
        unknown_characters,
        unsupported,
    )
    from ehp_fsm.run.samples import samples_file
    from ehp_fsm.specfiles import load_specs

    specs = load_specs()
    plan = load_plan(args.plan)
    outputs = _where(plan.log), _where(plan.revisions) if plan.revisions else None
    plan = plan.outputs_anchored()  # before the reward is imported: it may change directory
    refused = unsupported(plan)
    inputs = None
    if not refused and (plan.model is not None or plan.data is not None):
        # the model, the data (file and line) and the reward, read before "valid" is said
        inputs = prepare(plan, create=False)
    elif refused:
        # what the run would refuse next is said too: a plan for the cluster checked on a
        # machine without its devices (CUDA hosts) skipped the model's, data's and keys' checks
        # and said "valid" of a TP its model's heads do not split over (a user's find)
        try:
            check_keys(plan)
            if plan.model is not None or plan.data is not None:
                prepare(plan, create=False, refuse_unsupported_first=False)
        except PlanError as exc:
            refused.append((exc.key, exc.why))
    # (a plan the run refuses said "valid" first, then exited 2 at its end)
    verdict = "valid, but `ehp-fsm run` refuses it (below)" if refused else "valid"
    print(f"plan {plan.name!r} ({args.plan}): {verdict}; {len(specs)} machine specs checked")
    print(
        f"  hosts: {len(plan.hosts)}, devices: {len(plan.inventory)} "
        f"({', '.join(f'{h.id}×{len(h.gpus)} {h.device}' for h in plan.hosts)})"
    )
    c = plan.core
    print(
        f"  core: {c.backend} TP{c.tp}×PP{c.pp}×CP{c.cp}×DP{c.dp} on {len(c.gpus)} devices "
        f"(replica = {c.replica_gpus})"
    )
    tps: dict[int, int] = {}
    for e in plan.engines:
        tps[e.tp] = tps.get(e.tp, 0) + 1
    mix = ", ".join(f"{n}×TP{tp}" for tp, n in sorted(tps.items()))
    print(
        f"  rollout: {len(plan.engines)} engines ({mix}) on {plan.rollout_gpus} devices; "
        f"reserve {plan.rollout.reserve}; restart TPs {list(plan.rollout.allowed_tp)}"
    )
    from ehp_fsm.run.engines import shown_command

    print(f"  engines start as: {shown_command(plan)}")
    free = len(plan.inventory) - len(c.gpus) - plan.rollout_gpus
    print(f"  reserve devices (no owner): {free}")
    g = plan.grpo
    print(
        f"  grpo: {g.prompts_per_step} groups × {g.group_size} samples = global batch "
        f"{g.global_batch}; {g.steps} steps; max staleness {g.max_staleness}; loss "
        f"{g.loss_aggregation}, clip [{1 - g.clip_low:g}, {1 + g.clip_high:g}], kl {g.kl_coef:g}; "
        f"lr {g.learning_rate:g}; sampling temperature {g.temperature:g}"
    )
    # the cost model `ehp-fsm simulate` runs the plan with: its [simulate], else every default
    # (a plan without the section showed none, while the simulation's errors send the reader
    # here for each key's value)
    from ehp_fsm.plan import SIMULATE_DEFAULTS, simulate_costs

    s = simulate_costs(plan)
    if s.response_lengths:
        responses = f"{len(s.response_lengths)} response lengths from response_lengths_file"
        if s.response_lengths_capped:
            responses += (
                f" ({s.response_lengths_capped} above response_max_tokens, capped at "
                f"{s.response_max_tokens} as an engine ends a response there)"
            )
    else:
        responses = f"responses median {s.response_median_tokens:g} tokens"
        if s.response_median_tokens >= s.response_max_tokens:  # (said as if they were 600)
            responses += f", each capped at response_max_tokens = {s.response_max_tokens}"
    model = "cost model" if plan.simulate else "no [simulate] section: the default cost model"
    print(
        f"  simulate: {model} read only by `ehp-fsm simulate` (engine "
        f"{s.engine_tokens_per_s:g} tokens/s at TP1, {responses}, "
        f"{s.train_s_per_sample:g} s/sample, faults {s.gpu_fault_per_hour:g}/GPU-hour); "
        "`ehp-fsm run` measures real times instead"
    )
    # every key, and where its value comes from (the story's errors send here for them); a
    # plan without the section: every key at its default, on a few lines (each default's
    # source in `plan.SIMULATE_DEFAULTS`: 25 lines of sources on every plan's check drowned
    # what the plan itself says)
    if not plan.simulate:
        values = [f"{key}={getattr(s, key):g}" for key in SIMULATE_DEFAULTS]
        print(
            textwrap.fill(
                "defaults (each one's source: plan.SIMULATE_DEFAULTS, or a [simulate] "
                "section's check): " + ", ".join(values),
                width=100,
                initial_indent="    ",
                subsequent_indent="      ",
                break_on_hyphens=False,
            )
        )
    for key, (_d, _low, _high, source) in SIMULATE_DEFAULTS.items() if plan.simulate else ():
        if s.response_lengths and key in ("response_median_tokens", "response_sigma"):
            whence = "not used: response_lengths_file gives the lengths"
        else:
            whence = "the plan's" if key in s.given else f"default: {source}"
        print(f"    {key} = {getattr(s, key):g} ({whence})")
    print(f"  core runs as: {core_runtime(plan)}")
    from ehp_fsm.run.placement import core_lane_hosts, hybrid_slots

    lanes: dict[str, list[int]] = {}
    for rank, host in enumerate(core_lane_hosts(plan)):
        lanes.setdefault(host, []).append(rank)
    # the hosts with room for a whole Hybrid (`replica_size` devices outside the Core): a host
    # of one device was listed at replica_size 2
    lenders = [h for h, n in hybrid_slots(plan).items() if n > 0]
    print(
        "  trains on: "
        + "; ".join(
            f"Core lane{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} on {h}"
            for h, r in lanes.items()
        )
        + (f"; a Hybrid on the host it is borrowed on ({', '.join(lenders)})" if lenders else "")
    )
    elsewhere = (
        f"they share [run] revisions = {plan.revisions} (Core rank 0 saves the revisions "
        "there, Gloo's rendezvous files go beside it) and, with Core rank 0 elsewhere, the "
        "log's folder (its resume states)"
        if plan.revisions
        # said as what is not available, not as an error (it read like one on a valid plan)
        else "not available with this plan: agents on other machines read the revisions from "
        "a shared [run] revisions folder, which it does not set (set it to use them)"
    )
    print(
        "  launched by: the run, for a lane whose host's agent runs on its machine; else that "
        f"host's agent, on its machine (`--agents external`): {elsewhere}"
    )
    for key, why in refused:
        print(f"  ehp-fsm run refuses {key} = {why}")
    if refused:
        m, d = plan.model, plan.data
        if m is not None:  # named, not read: the run would not get to it
            print(
                f"  model: {m.path}; {m.dtype}; prompt ≤ {m.max_prompt_len}, response ≤ "
                f"{m.max_response_len} tokens"
            )
        if d is not None:
            print(f"  data: {d.train}; reward {plan.reward.function}")
        print("  (the plan parses; `ehp-fsm run` refuses the keys above: exit 2)")
        return 2
    if inputs is not None:
        m, d = plan.model, plan.data
        assert m is not None and d is not None
        dtype = m.dtype
        if inputs.model_dir.exists():  # which model the folder holds, not its path alone
            made = f" ({what})" if (what := architecture(inputs.model_dir)) else ""
            if m.generate:  # (taken without a word: it generates only a missing folder)
                made += f"; generate = {m.generate!r} not used: the folder holds one already"
            from ehp_fsm.models.revision_dir import config_dtype

            # a bf16 model trains in [model] dtype, and its revisions (what the engines serve)
            # are written in its config's: "float32" alone read as what the engines run
            served = str(config_dtype(inputs.model_dir) or "").removeprefix("torch.")
            if served and served != m.dtype:
                dtype += f" (revisions in {served}, its config.json's dtype)"
        else:
            made = f" (to be generated: {m.generate})"
        stops = inputs.task.stop_ids
        ends = (
            f"; responses end at token{'s' if len(stops) > 1 else ''} "
            f"{', '.join(map(str, sorted(stops)))}"
            if stops
            else "; no end-of-sequence token (eos_token_id in none of config.json, "
            "generation_config.json, the tokenizer): every response runs to max_response_len"
        )
        from ehp_fsm.data.task import unused_generation_defaults

        # a model's own sampling defaults (Qwen3's top_p 0.95, top_k 20) are not the run's
        unused = unused_generation_defaults(inputs.model_dir if inputs.model_dir.exists() else None)
        samples = (
            f"; samples at temperature {plan.grpo.temperature:g} over the whole vocabulary"
            + (
                " (generation_config.json's sampling defaults ("
                + ", ".join(f"{k} {v}" for k, v in unused.items())
                + ") are not used: the loss takes π_θ at [grpo] temperature, unrestricted)"
                if unused
                else ""
            )
        )
        print(
            f"  model: {m.path}{made}; {dtype}; prompt ≤ {m.max_prompt_len}, "
            f"response ≤ {m.max_response_len} tokens{ends}{samples}"
        )
        n, per_step = len(inputs.task.dataset.examples), plan.grpo.prompts_per_step
        print(
            f"  data: {d.train} ({n} prompts: "
            f"{d.prompt_key!r} → label {d.label_key!r}, chat template "
            f"{'on' if d.chat_template else 'off'}, shuffle seed {d.seed}); reward "
            f"{plan.reward.function} ({_reward_source(plan.reward.function)}on error: "
            f"{plan.reward.on_error}, time-out "
            f"{plan.reward.timeout_s:g} s a completion)"
            + (
                f"; fewer prompts than grpo.prompts_per_step = {per_step}: a step holds "
                "some prompts more than once (each epoch is one shuffle of them all)"
                if n < per_step
                else ""
            )
            + (
                f"; {unknown}"
                if (unknown := unknown_characters(inputs.task.dataset, inputs.task.tokenizer))
                else ""
            )
        )
    x = plan.ehp
    print(
        f"  ehp: on; replica_size {x.replica_size}; borrow > {x.borrow_threshold}, release < "
        f"{x.release_threshold}; cooldown {x.cooldown_s}s; max {x.max_hybrids} hybrids"
        f"{_hybrids_that_fit(plan)}{_never_borrows(plan)}{_floor_note(plan)}"
        if x.enabled
        else "  ehp: off (no GPU is ever borrowed: the Core trains alone)"
    )
    print(
        f"  transport: {plan.transport.controller}"
        f"{' (CURVE)' if plan.transport.curve_keys else ''}"
        f"{' (CURVE, local keys)' if plan.transport.curve == 'local' else ''}"
        f"; log: {outputs[0]}"
    )
    w, engine = plan.run_deadlines, plan.deadlines["rollout_engine"]
    print(
        f"  revisions: {outputs[1] or 'revisions/ beside the log'}"
        f"; waits: agents "
        f"{w.agents_connect:g}s, engine start {engine['starting'] + engine['installing']:g}s, "
        f"install {max(engine['installing'], engine['updating']):g}s, generate "
        f"{w.generate:g}s, rollout {w.rollout:g}s"
    )
    if (samples_to := samples_file(plan)) is not None:
        print(
            "  samples: every trained sample (prompt, completion, reward, advantage) to "
            + str(samples_to)
        )
    return 0


def _reward_source(function: str) -> str:
    """Where `check`'s reward was imported from ("/plans/my_rewards.py; "), which the module
    name alone did not say (beside the plan, or one of the same name on PYTHONPATH); "" for a
    built-in or a module without a file."""
    name, sep, _ = function.partition(":")
    where = getattr(sys.modules.get(name), "__file__", None) if sep else None
    return f"{where}; " if where else ""


def _planner_fits(plan: Plan) -> int:
    """How many Hybrids the planner can place at once with the plan's engines serving, at most
    `max_hybrids`: its own allocation (`planner_alloc.allocate_replicas`, as `planner._borrow`
    calls it) over the run's first state — every engine serving, the devices of no Core and no
    engine free — within the budget `serving - [rollout] reserve`. An engine is stopped whole,
    so two TP2 engines with a reserve of 3 lend nothing (`placement.hybrids_at_once` counted
    devices, 4 - 3 = 1, and `check` said a Hybrid fit: the run's planner never borrowed)."""
    from ehp_fsm.core.planner_alloc import ViewIndex, allocate_replicas
    from ehp_fsm.core.planner_model import EngineView, GpuView
    from ehp_fsm.run.placement import lending_hosts

    x = plan.ehp
    if not x.enabled:
        return 0
    lenders = set(lending_hosts(plan))
    taken = set(plan.core.gpus).union(*(e.gpus for e in plan.engines))
    free = [
        GpuView(gpu_id=g, host=h.id, state="free")
        for h in plan.hosts
        if h.id in lenders
        for g in h.gpus
        if g not in taken
    ]
    engines = [
        EngineView(engine_id=e.id, host=e.host, tp=e.tp, gpu_ids=e.gpus, state="serving")
        for e in plan.engines
        if e.host in lenders
    ]
    index = ViewIndex(
        odd=free,
        not_owned={g.gpu_id for g in free},
        pickable=engines,
        serving_gpus=plan.rollout_gpus,
        current=[],
    )
    budget = plan.rollout_gpus - plan.rollout.reserve
    placed = allocate_replicas(index, x.max_hybrids, budget, x.replica_size)
    return sum(len(a.replicas) for a in placed)


def _hybrids_that_fit(plan: Plan) -> str:
    """What `check` adds when fewer Hybrids can run at once than `max_hybrids` says (beside
    the Core, within the rollout reserve, engines stopped whole: `_planner_fits`), and how many
    warm workers the run starts for them (`placement.local_warm_lanes`: as many as
    `placement.hybrids_at_once` counts, which can be more)."""
    from ehp_fsm.run.placement import hybrids_at_once

    if not plan.ehp.enabled:
        return ""
    fits = _planner_fits(plan)
    warm = min(plan.ehp.max_hybrids, hybrids_at_once(plan))
    if fits >= plan.ehp.max_hybrids or fits == 0:
        return ""  # (none at all: `_never_borrows` says why)
    if warm == fits:
        workers = f"{fits} warm worker{'s' if fits > 1 else ''}"
        return f" (at most {fits} at once beside the Core and the reserve: {workers})"
    return (
        f" (at most {fits} at once beside the Core and the reserve while the plan's engines "
        f"serve, an engine stopped whole; the run starts {warm} warm workers, as many as the "
        f"devices could hold: {warm - fits} of them only of use on devices an engine left free)"
    )


def _floor_note(plan: Plan) -> str:
    """What `check` says of `[ehp] min_hybrids`: the floor the planner borrows up to whatever
    the measured times predict, and how much of it cannot fit while the plan's engines serve
    (the run records a shortfall for the rest)."""
    x = plan.ehp
    if not x.enabled or not x.min_hybrids:
        return ""
    fits = _planner_fits(plan)
    note = f"; at least {x.min_hybrids} (min_hybrids: borrowed whatever the measured times predict)"
    batch = plan.grpo.prompts_per_step - plan.core.dp
    if batch < x.min_hybrids:  # (as max_hybrids is: each replica trains whole groups)
        return note + (
            f" — cut to {max(batch, 0)}: {plan.grpo.prompts_per_step} groups a step "
            f"([grpo] prompts_per_step) beside the Core's {plan.core.dp} replicas"
        )
    if fits < x.min_hybrids:
        note += (
            f" — but only {fits} fit beside the Core and the reserve: the run records a "
            f"shortfall of {x.min_hybrids - fits}"
        )
    return note


def _never_borrows(plan: Plan) -> str:
    """What `check` adds to an EHP that is on but can never borrow: no host has a Hybrid's
    devices outside the Core, or the rollout reserve keeps every engine GPU serving (a drain
    below it is refused) with no free device, or every engine is too large to stop without
    going below the reserve (an engine stops whole), so the run trains on the Core alone —
    said, not left to be found."""
    from ehp_fsm.run.placement import hybrid_slots, hybrids_at_once

    x = plan.ehp
    if not x.enabled or _planner_fits(plan) > 0:
        return ""
    if not any(hybrid_slots(plan).values()):
        return (
            f" — but no Hybrid can ever be borrowed: a Hybrid needs {x.replica_size} devices "
            "of one host outside the Core, and no host has them; give a host more devices, "
            "or set [ehp] enabled = false"
        )
    spare = plan.rollout_gpus - plan.rollout.reserve
    if hybrids_at_once(plan) == 0:
        return (
            f" — but no Hybrid can ever be borrowed: [rollout] reserve = {plan.rollout.reserve} "
            f"keeps {plan.rollout_gpus - spare} of the {plan.rollout_gpus} engine devices "
            f"serving and a Hybrid needs {x.replica_size}; lower the reserve, or set [ehp] "
            "enabled = false"
        )
    smallest = min(e.tp for e in plan.engines)
    warm = min(x.max_hybrids, hybrids_at_once(plan))
    return (
        f" — but no Hybrid can be borrowed while the plan's engines serve: an engine is "
        f"stopped whole (all its devices leave rollout), and no host can make a set of "
        f"{x.replica_size} device"
        f"{'s' if x.replica_size > 1 else ''} from its free devices and whole engines while "
        f"[rollout] reserve = {plan.rollout.reserve} of the {plan.rollout_gpus} engine devices "
        f"keep serving (at most {spare} may stop, the smallest engine is TP{smallest}); lower "
        "the reserve, use smaller engines, or set [ehp] enabled = false (the run still starts "
        f"{warm} warm worker{'s' if warm > 1 else ''} for it)"
    )


def _where(path: str) -> str:
    """An output path of a plan as the run will use it: a relative one starts at the current
    directory (the inputs start at the plan's folder), so `check` shows it absolute."""
    if Path(path).is_absolute():
        return path
    return f"{Path(path).absolute()} ({path} from the current directory)"


def _cmd_spec(args: argparse.Namespace) -> int:
    from ehp_fsm.reference import mermaid, text_table
    from ehp_fsm.specfiles import load_specs

    specs = load_specs()
    names = [args.machine] if args.machine else list(specs)
    for name in names:
        if name not in specs:
            raise EhpError(
                f"unknown machine {name!r}",
                f"the machines are the specs' ({len(specs)} of them)",
                f"use one of {sorted(specs)}, or none for all",
            )
        if args.format != "mermaid":
            print(text_table(specs[name]))
        elif args.machine:
            print(mermaid(specs[name]))  # one diagram: a mermaid document of its own
        else:  # several diagrams are no one mermaid document: Markdown, a fenced block each
            print(f"## {name}\n\n```mermaid\n{mermaid(specs[name]).rstrip()}\n```\n")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from ehp_fsm.replay import check_receipt, is_log_chain, replay

    if not Path(args.log).is_file():
        log = Path(args.log)
        why = (
            "it does not exist"
            if not log.exists()
            else "it is a directory"
            if log.is_dir()
            else "it is not a regular file (a device, a pipe or a socket)"
        )
        raise EhpError(f"{args.log} is not a log file", why, "give the path of a transitions.jsonl")
    if args.at is not None and args.at < 1:  # seqs start at 1: there is no world "at -1"
        raise EhpError(
            f"--at {args.at} is not a record's seq",
            "a log's records count from 1",
            "give --at 1 or more",
        )
    if args.timeline is not None:  # before the replay: '' was skipped, a/x failed after it
        parent = Path(args.timeline).parent
        if not args.timeline.strip() or args.timeline.endswith("/") or not parent.is_dir():
            raise EhpError(
                f"--timeline {printable(args.timeline)!r} names no file in an existing folder",
                "the timeline is written to OUT.png and OUT.svg",
                "give --timeline a file name in a folder that exists, e.g. runs/local/timeline",
            )
        from ehp_fsm.report.timeline import timeline_paths

        timeline_paths(args.timeline)  # a device, or a folder where OUT.png goes: refused now
    jobs = args.jobs
    if jobs is not None and not 1 <= jobs <= MAX_REPLAY_JOBS:  # 10**8 spun minutes on cuts
        raise EhpError(
            f"--jobs {jobs} is not a number of processes",
            f"replay verifies at most {MAX_REPLAY_JOBS} stretches of a log at once",
            f"give --jobs within 1..{MAX_REPLAY_JOBS} (the CPU count is a good choice)",
        )
    if jobs is None:  # auto: parallel stretches pay off once a log is a few MiB
        big = Path(args.log).stat().st_size >= PARALLEL_REPLAY_BYTES
        jobs = min(os.cpu_count() or 1, MAX_REPLAY_JOBS) if big else 1
    receipt = None
    if args.receipt is not None:
        if args.at is not None:
            raise EhpError("--receipt checks the whole log", "--at stops early", "drop one")
        if not Path(args.receipt).is_file():  # /dev/zero was read until the memory was gone
            raise EhpError(
                f"--receipt {args.receipt} is not a receipt file",
                "it does not exist, or is a directory or a device",
                "give the receipt.json the run wrote beside this log",
            )
        try:
            with Path(args.receipt).open("rb") as fh:
                raw = fh.read(MAX_RECEIPT_BYTES + 1)
            if len(raw) > MAX_RECEIPT_BYTES:
                raise EhpError(
                    f"--receipt {args.receipt} is not a run's receipt",
                    f"it holds more than {MAX_RECEIPT_BYTES >> 20} MiB, far more than a run "
                    "or a simulation writes (a 100-step run's: ~32 kB)",
                    "give --receipt the receipt.json the run wrote beside this log",
                )
            receipt = json.loads(raw.decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            why = (
                "it is nested too deep to read (a run's receipt nests a few levels)"
                if isinstance(exc, RecursionError)
                else str(exc)
            )
            raise EhpError(
                f"{args.receipt} is not a readable JSON receipt", why, "give the run's receipt"
            ) from None
        # checked before the log is replayed; a receipt of `null` skipped the check (exit 0)
        if not isinstance(receipt, dict) or not is_log_chain(receipt.get("log_chain")):
            if isinstance(receipt, dict) and "log" in receipt and receipt["log"] is None:
                raise EhpError(  # (it was "not a run's receipt": it is, of a run with no log)
                    f"--receipt {args.receipt} is the receipt of a run that wrote no log",
                    'its "log" is null: that run stopped before it began its transition log '
                    "(its summary says why), so no log is the one it wrote",
                    f"replay {args.log} without --receipt, or give the receipt written beside it",
                )
            held = (
                "" if isinstance(receipt, dict) else f" (it holds JSON {json.dumps(receipt)[:40]})"
            )
            raise EhpError(
                f"--receipt {args.receipt} is not a run's receipt",
                'it has no `log_chain: {"count": N, "hash": "..."}`' + held,
                "give --receipt the receipt.json the run wrote beside this log",
            )
    # the whole log: forget finished instances (memory follows the live world); --at prints
    # the world, so it keeps them
    try:  # (replay only reads: a failure is the log's, or an earlier segment's, reading)
        result = replay(args.log, until_seq=args.at, jobs=jobs, forget_finished=args.at is None)
    except OSError as exc:
        if exc.errno not in _READ_FAILURES:
            raise
        raise read_failure(exc, args.log) from None
    if receipt is not None:
        check_receipt(result, receipt)
    if args.at is not None and result.last_seq < args.at:
        # (it printed the world at the log's end, exit 0: a script took it for the one asked)
        raise EhpError(
            f"--at {args.at} is past the end of {args.log}: its last record is seq "
            f"{result.last_seq} ({result.transitions} transitions verified)",
            "there is no world at a record the log does not hold",
            f"give --at {result.last_seq} or less",
        )
    # with --at, stdout is the world's JSON alone (`| jq` read the lines said after it as
    # JSON): what is said of it goes to stderr
    note = functools.partial(print, file=sys.stderr) if args.at is not None else print
    if args.at is not None:
        print(json.dumps(result.world.snapshot(), indent=2, sort_keys=True))
        ends = (
            # a cascade is one atomic step: the world after its first record never existed
            f" (the end of the event that holds record {args.at}: its cascade is applied whole)"
            if result.last_seq > args.at
            else ""
        )
        note(f"world at seq {result.last_seq}{ends}: {result.transitions} transitions verified")
        meta = result.header.get("meta")
        resumes = meta.get("resumes") if isinstance(meta, dict) else None
        if isinstance(resumes, dict):  # (exit 0 said nothing of them: an edited one passed)
            note(
                f"  this log resumes {printable(str(resumes.get('log')))[:200]}: the segments "
                "before it are not replayed with --at (its world starts afresh from the plan); "
                "replay without --at to verify them too"
            )
    else:
        chained = ""
        if result.chain is not None:
            kind = result.header.get("chain_kind")
            lines = result.chain[0]
            chained = f"; hash chain ({kind}) intact over {lines} line{'s' if lines != 1 else ''}"
            chained += ", matches the receipt" if receipt is not None else ""
        print(f"{result.transitions} transitions verified ({result.events} events){chained}")
        if _being_written(Path(args.log)):
            print(
                "  the log is still being written (a live run or Orchestrator holds it): this "
                "is what it held so far; its receipt.json comes when the run ends"
            )
        seg = result
        while seg.previous is not None:  # a resumed run: the segments before, each verified
            r = seg.header["meta"]["resumes"]
            print(
                f"  resumes {r['log']} after step {r['step']}: {seg.previous.transitions} "
                f"transitions verified ({seg.previous.events} events), and it ends where "
                "the resume says"
            )
            seg = seg.previous
    if args.jobs is not None and result.stretches < args.jobs:  # asked for, and not had
        note(_stretches_note(args.jobs, result, args.at))
    if args.timeline:  # after the verdict: a timeline that cannot be written loses none of it
        _draw_replayed(args.log, args.timeline, result.last_seq, note)
    return 0


def _draw_replayed(log: str, out: str, last_seq: int, note: Callable[[str], object]) -> None:
    from ehp_fsm.report.timeline import draw_timeline, role_intervals

    try:
        paths = draw_timeline(role_intervals(log, until_seq=last_seq), out, title=log)
    except OSError as exc:
        raise EhpError(
            f"the timeline {printable(out)!r} cannot be written",
            f"{exc.strerror or exc} ({printable(str(exc.filename or out))})",
            "the log was verified (above); give --timeline a name in a folder you can write",
        ) from None
    for path in paths:
        note(f"timeline written to {path}")


def _stretches_note(jobs: int, result: ReplayResult, at: int | None) -> str:
    """What `--jobs N` had to split: a log is cut only at its checkpoint lines (one every
    10,000 events), and a run's log of a few thousand events holds none, so `--jobs 4` went on
    in one process without a word. The cuts are the checkpoints nearest even splits of the
    whole log (`replay._cuts`); with `--at`, those at or after it are not used."""
    n = result.stretches
    stretches = f"--jobs {jobs}: {n} stretch{'es' if n > 1 else ''}"
    processes = f"replayed in {n} processes" if n > 1 else "replayed in one process"
    if result.has_checkpoints is False:
        return f"{stretches} (this log has no checkpoint lines; {processes})"
    from ehp_fsm.translog import FINISHED_SINCE

    if at is not None and result.header.get("schema_version", 0) >= FINISHED_SINCE:
        return (
            f"{stretches} (--at keeps every instance, and this log's checkpoints list its "
            f"finished instances by id only: it is replayed from its start; {processes})"
        )
    if at is not None:
        return (
            f"{stretches} (a log is cut only at the checkpoint lines nearest even splits of the "
            f"whole log, and with --at {at} only those before it; {processes})"
        )
    return (
        f"{stretches} (a log is cut only at its checkpoint lines, and this one has too few to "
        f"cut it in {jobs}; {processes})"
    )


def _being_written(log: Path) -> bool:
    """A writer holds `log`'s lock (`translog`'s `flock`): a live run or Orchestrator."""
    try:
        import fcntl
    except ImportError:  # no flock here: no writer holds one either
        return False
    try:
        with log.open("rb") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    except OSError:
        return False
    return False


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Ctrl-C while the block runs is held, and raised as `KeyboardInterrupt` when it ends;
    pressed again, it is raised at once (whoever presses twice will not wait).

    For imports: torch's C extension imports numpy while it initialises and drops an exception
    raised there, so a Ctrl-C landing in that moment of `ehp-fsm run`'s start was lost and the
    run went on. Held, it ends the run before anything starts, as a Ctrl-C a moment earlier or
    later does. Only in the main thread, and not where SIGINT is ignored (`nohup`, `&`)."""
    held: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)
        if len(held) > 1:
            raise KeyboardInterrupt

    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or old in (None, signal.SIG_IGN):
        yield  # signals reach the main thread only; None: a handler Python cannot put back
        return
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if held:
        raise KeyboardInterrupt


def _cmd_run(args: argparse.Namespace) -> int:
    from ehp_fsm.plan import load_plan

    # a bad plan fails before anything starts (or is imported); its output paths are fixed
    # before the reward is imported (it may change directory)
    given = load_plan(args.plan)
    plan = given.outputs_anchored()
    with _ctrl_c_held():  # a Ctrl-C inside torch's import was lost (see there)
        from ehp_fsm.run.job import check_flags, run  # torch and the rest: for a plan that loads
    # contradicting flags (--resume --fresh) are said as such, not as "no run to resume"
    check_flags(
        steps=args.steps,
        resume=args.resume,
        fresh=args.fresh,
        verify=args.verify,
        agents=args.agents,
    )
    if args.resume and not Path(given.log).is_absolute():
        from ehp_fsm.run.resume import resumable_run

        # nothing to resume here: refused saying the log is taken from this directory
        resumable_run(plan.name, Path(plan.log), relative=given.log)

    return run(
        plan,
        verify=args.verify,
        steps=args.steps,
        resume=args.resume,
        agents=args.agents,
        fresh=args.fresh,
    )


def _cmd_stop(args: argparse.Namespace) -> int:
    from ehp_fsm.plan import load_plan
    from ehp_fsm.run.owned import (
        RUN_STATE,
        RunStateError,
        read_run_state,
        recorded_plan,
        run_process,
        runs_elsewhere,
        runs_near,
        starting_run,
        stop_owned,
        stop_starting,
        unreadable_run_state,
    )

    relative_log: str | None = None  # the plan's `[run] log`, when relative
    stopped_starting: list[str] = []  # a run still starting, stopped through its lock
    if not os.path.lexists(args.plan):  # it was refused as a plan alone ("plan key `<file>`")
        raise EhpError(
            f"{printable(args.plan)} does not exist",  # (a newline in it broke the one line)
            "`ehp-fsm stop` takes a plan file or a run's directory (the folder of its log, "
            "holding run.json)",
            "check the path",
        )
    if Path(args.plan).is_dir():  # a run directory: its plan may be edited, or unreadable
        run_dir = Path(args.plan).resolve()
        name = recorded_plan(run_dir)
        if name is None and (why := unreadable_run_state(run_dir)) is not None:
            state = run_dir / RUN_STATE  # there, but unreadable: not "nothing to stop"
            raise RunStateError(
                f"{state} cannot be read, so nothing was stopped, and the processes that run "
                "recorded (the run, its agents, engines and trainers) may still run",
                why,
                "look for them with `ps -u \"$USER\" -o pid,args | grep -E 'ehp[-_]fsm|sglang'` "
                "(on every host of the run: agents elsewhere started their engines and trainers "
                f"there) and in {run_dir / 'controller.log'} (what the run started), stop them by "
                f"hand, then remove {state}",
            )
        near = runs_near(run_dir) if name is None else []
        if name is None and not near:
            print(f"ehp-fsm stop: no run state in {run_dir}: nothing to stop")
            return 0
        if name is None:  # a folder above or below a live run's directory
            print(
                f"ehp-fsm stop: no run state in {run_dir}, but a run runs in a folder "
                "above or below it; nothing was stopped"
            )
            for where, live in near:
                print(
                    f"  {', '.join(f'{o.what} pid {o.pid}' for o in live[:3])}, run directory "
                    f"{where}: to stop it, ehp-fsm stop {shlex.quote(str(where))}"
                )
            return 1
    else:
        try:
            plan = load_plan(args.plan)
        except PlanError as exc:
            if not exc.key.startswith("<"):
                raise
            # (a run's own file given, e.g. its transitions.jsonl or run.json: "fix the syntax")
            folder = printable(str(Path(args.plan).parent))
            raise EhpError(
                f"{printable(args.plan)} is neither a plan nor a run's directory",
                f"as a plan: {exc.why}",
                "give `ehp-fsm stop` the plan the run was started with, or the run's directory "
                f"(the folder of its log, holding run.json: e.g. {folder})",
            ) from None
        run_dir = Path(plan.log).resolve().parent
        name = plan.name
        relative_log = None if Path(plan.log).is_absolute() else plan.log
    doc = read_run_state(run_dir, name)
    starting = starting_run(run_dir, name)
    if starting is not None and (doc is None or run_process(doc, run_dir).pid != starting.pid):
        # a run that has not yet recorded itself (reading its inputs, clearing the directory)
        print(
            f"ehp-fsm stop {name}: a run (pid {starting.pid}) is starting in {run_dir}: "
            "asking it to stop (SIGTERM)"
        )
        stopped_starting = stop_starting(starting)
        for line in stopped_starting:
            print(f"  stopped {line}")
        doc = read_run_state(run_dir, name)  # what it recorded before it stopped
        if doc is None:
            print(f"ehp-fsm stop {name}: the run had started no process")
            return 0 if starting.process() is None else 1
    if doc is None:
        elsewhere = [] if relative_log is None else runs_elsewhere(name, run_dir)
        if not elsewhere:
            print(f"ehp-fsm stop {name}: no run state in {run_dir}: nothing to stop")
            return 0
        print(
            f"ehp-fsm stop {name}: no run state in {run_dir}, but a run of this plan "
            f"runs elsewhere: [run] log = {relative_log!r} is relative, taken from the "
            "directory a run starts in; nothing was stopped"
        )
        for found, where in elsewhere:
            print(
                f"  pid {found.pid}, run directory {where}: to stop it, "
                f"ehp-fsm stop {shlex.quote(str(where))}"
            )
        return 1
    report = stop_owned(run_dir, doc, say=print)
    for line in report.stopped:
        print(f"  stopped {line}")
    if report.left:
        print(f"ehp-fsm stop {name}: still running: {', '.join(report.left)}")
        return 1
    if report.refused:  # each said why, above
        print(
            f"ehp-fsm stop {name}: {len(report.refused)} live process(es) named in {run_dir} "
            "did not prove they are the run's and were not signalled"
        )
        return 1
    # (a starting run it stopped counts: "nothing was running" followed its "stopped run
    # (pid N): SIGTERM" when the directory held an earlier run's run.json)
    stopped = len(report.stopped) + len(stopped_starting)
    what = f"stopped {stopped}" if stopped else "nothing was running"
    print(
        f"ehp-fsm stop {name}: {what}; none of the {report.recorded} processes the run "
        "recorded is running"
    )
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from ehp_fsm.plan import load_plan
    from ehp_fsm.sim.command import simulate

    plan = load_plan(args.plan)
    return simulate(
        plan,
        plan_path=args.plan,
        hosts=args.hosts,
        steps=args.steps,
        seed=args.seed,
        # (the plan's `[ehp] enabled = false` was simulated with EHP on, unsaid)
        ehp=args.ehp if args.ehp is not None else ("on" if plan.ehp.enabled else "off"),
        faults=args.faults,
        seeds=args.seeds,
        out_dir=args.out,
        out=sys.stdout,
    )


def _cmd_init_model(args: argparse.Namespace) -> int:
    from ehp_fsm.fspaths import path_problem

    if (problem := path_problem(args.dir)) is not None:  # '' wrote the model into the cwd
        raise EhpError(
            f"init-model DIR {printable(args.dir[:80])!r} is not a directory to write",
            problem,
            "give the directory to create, e.g. ehp-fsm init-model models/tiny",
        )
    from ehp_fsm.models.tiny import init_model

    out = init_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"tiny {args.arch} model (seed {args.seed}) written to {printable(str(out))}")
    return 0


def _cmd_agent(args: argparse.Namespace) -> int:
    from ehp_fsm.runtime.agent import agent_main

    return agent_main(args.rest)


def _cmd_keys(args: argparse.Namespace) -> int:
    from ehp_fsm.runtime.controller import keys_main

    return keys_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ehp-fsm",
        description="Explicit state-machine orchestration for Elastic Hybrid Parallelism.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("check", help="validate a plan and the specs; print roles and capacities")
    p.add_argument("plan")
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("spec", help="show a machine spec as text or a mermaid diagram")
    p.add_argument("machine", nargs="?", help="gpu, rollout_engine, hybrid_replica, ... (all)")
    p.add_argument(
        "--format",
        choices=("text", "mermaid"),
        default="text",
        help="mermaid: one machine's diagram; every machine's as Markdown, a ```mermaid block each",
    )
    p.set_defaults(func=_cmd_spec)
    p = sub.add_parser(
        "replay",
        help="verify a transition log against the specs",
        description="Verify a transition log against the specs: every record re-stepped, every "
        "checkpoint and hash-chain link checked, and a resumed run's earlier segments (named in "
        "its header, beside it) too.",
        epilog="exit status: 0 the log verifies (with --at: the world printed); 2 it does not "
        "(one line on stderr: which line, what differs, why and what to do), or the log, the "
        "receipt or an option cannot be used (said on stderr); 130 Ctrl-C.",
    )
    p.add_argument("log", help="the transition log: a run's or simulation's transitions.jsonl")
    p.add_argument(
        "--at",
        type=int,
        metavar="SEQ",
        help="print the world after record SEQ (after its event: a cascade is applied whole)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="verify N stretches between checkpoints at once (default: the CPU count for logs "
        "of 8 MiB or more, else 1)",
    )
    p.add_argument(
        "--timeline", metavar="OUT", help="draw every GPU's role over time (OUT.png/.svg)"
    )
    p.add_argument(
        "--receipt",
        metavar="RECEIPT.json",
        help="the run's receipt: the log must end where its `log_chain` {count, hash} says "
        "(catches a log cut short or rebuilt); a keyed chain reads its key from EHP_LOG_KEY",
    )
    p.set_defaults(func=_cmd_replay)
    p = sub.add_parser("run", help="run an EHP training job from a plan")
    p.add_argument("plan")
    p.add_argument(
        "--verify",
        action="store_true",
        help="record every step's batch, partition and weights' fingerprint, then check the "
        "run: bit for bit against its own partitions replayed (Core-only when no Hybrid "
        "trained), each step's split against the whole batch's gradient, no group twice",
    )
    p.add_argument("--steps", type=int, help="override the plan's grpo.steps")
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on with a stopped or killed run of this plan from its last saved step (what "
        "is left of it is stopped first; its log becomes a segment the new log chains to)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start anew over a run of this plan that stopped before its last step, removing "
        "its saved state and log (refused without it; its newest revision is kept)",
    )
    p.add_argument(
        "--agents",
        choices=("local", "external"),
        default="local",
        help="local: start one host agent per host here (default); external: wait for agents "
        "the cluster starts (srun ... ehp-fsm agent; see examples/slurm)",
    )
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser(
        "stop", help="stop every process a run of this plan owned (by pid and start time)"
    )
    p.add_argument(
        "plan",
        help="the plan, or the run's directory (its log's folder, holding run.json): for a "
        "plan edited or broken since its run started",
    )
    p.set_defaults(func=_cmd_stop)
    p = sub.add_parser(
        "init-model", help="write a tiny model of a real architecture (config, weights, tokenizer)"
    )
    p.add_argument("dir", help="directory to create (new, or empty)")
    p.add_argument(
        "--arch",
        choices=("qwen3", "llama"),
        default="qwen3",
        help="the transformers architecture of its config (default qwen3)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.set_defaults(func=_cmd_init_model)
    p = sub.add_parser(
        "agent", help="run one host agent (see `ehp-fsm agent --help`)", add_help=False
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_agent)
    p = sub.add_parser(
        "simulate", help="the real controller on a simulated cluster, in virtual time"
    )
    p.add_argument("plan")
    p.add_argument("--hosts", type=int, default=None, help="repeat the plan's hosts to N hosts")
    p.add_argument("--steps", type=int, default=None, help="steps (default: the plan's)")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the simulation's seed, 0..2^32-1 (default: the plan's [run] seed)",
    )
    p.add_argument(
        "--ehp",
        choices=("on", "off", "both"),
        default=None,
        help="the planner may borrow (on) or not (off); the default is the plan's [ehp] "
        "enabled; both: one run each, compared (time to the steps, GPU-hours, idle share, "
        "borrows and returns)",
    )
    p.add_argument(
        "--faults",
        choices=("off", "on", "heavy"),
        default="off",
        help="inject the [simulate] fault rates (dying processes, silent agents, slow hosts): "
        "off (the default), on (the plan's or the default rates), heavy (5,000 times them, for a "
        "fault hunt)",
    )
    p.add_argument("--seeds", type=int, default=None, help="fault hunt: run N seeds from --seed")
    p.add_argument("--out", default=None, help="output folder (default runs/<plan>-sim)")
    p.set_defaults(func=_cmd_simulate)
    p = sub.add_parser("keys", help="generate CURVE keys for the control plane", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_keys)
    return parser


def shown(exc: BaseException) -> str:
    """An error's message for the terminal: its lines kept, and on each line every character a
    terminal would act on (escape sequences, carriage returns, bidi overrides) escaped, since
    a message may quote a plan's or a file's text."""
    return "\n".join(printable(line) for line in str(exc).split("\n"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("agent", "keys"):  # their own parsers own every option
        args = argparse.Namespace(rest=argv[1:])
        try:
            return _cmd_agent(args) if argv[0] == "agent" else _cmd_keys(args)
        except EhpError as exc:
            print(f"ehp-fsm: error: {shown(exc)}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside `run` (which stops cleanly on its own)
        print(f"ehp-fsm {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT
    except EhpError as exc:
        print(f"ehp-fsm: error: {shown(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ehp-fsm check PLAN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # 128 + SIGPIPE, as a command killed by the signal would say
    except OSError as exc:  # a path in the way, no permission, a full disk: no traceback
        where = f" ({printable(str(exc.filename))})" if exc.filename else ""
        print(
            f"ehp-fsm: error: {type(exc).__name__}: {exc.strerror or exc}{where}. "
            f"Fix: {_os_error_fix(exc)}",
            file=sys.stderr,
        )
        return 2
    return code


#: The errors a read of a file fails with (not the machine's: no memory, no processes).
_READ_FAILURES: Final = frozenset(
    {
        *(errno.EACCES, errno.EPERM, errno.EIO, errno.EISDIR, errno.ENOENT, errno.ENOTDIR),
        *(errno.ENXIO, errno.ENODEV, errno.EINVAL, errno.ESTALE),
    }
)
#: The errors only a write fails with.
_WRITE_FAILURES: Final = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS))


def read_failure(exc: OSError, path: str) -> EhpError:
    """The error of a read of `path` (or of `exc.filename`) that failed with `exc`. Reading
    failures were told to "check that the path ... is writable, and that its disk has room"
    (`replay /proc/1/environ`: permission denied; `replay /proc/self/mem`: an I/O error)."""
    where = printable(str(exc.filename or path))
    if exc.errno in (errno.EACCES, errno.EPERM):
        why = "this user may not read it (permission denied)"
        fix = (
            f"check its permissions (`ls -l {where}`): give a file this user may read, or run "
            "as a user who may (a process's /proc files are its own user's)"
        )
    elif exc.errno == errno.EIO:
        why = "reading it gave an input/output error (EIO)"
        fix = (
            "it is a special file (under /proc or /dev) that cannot be read as a file, or its "
            "disk fails (see `dmesg`): copy it to a regular file on a working disk and give that"
        )
    elif exc.errno == errno.EISDIR:
        why, fix = "it is a directory", "give the path of a file"
    elif exc.errno in (errno.ENOENT, errno.ENOTDIR):
        why, fix = "it does not exist (any more)", "check the path"
    else:
        why = f"{exc.strerror or exc}"
        fix = "check that it is a regular file this user may read"
    return EhpError(f"{where} cannot be read", why, fix)


def _os_error_fix(exc: OSError) -> str:
    """What to do about an `OSError` no command named: a write's advice (room, a writable
    path) only for what only a write fails with — a failed read was told to check that the
    path is writable and its disk has room."""
    if exc.errno in _WRITE_FAILURES:
        return "check that the path is writable and that its disk has room (`df -h`)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            "check the path's permissions (`ls -l`): this user must be able to read what the "
            "command reads and write what it writes"
        )
    if exc.errno == errno.EIO:
        return (
            "the path is a special file (under /proc or /dev) that cannot be read or written "
            "as a file, or its disk fails (see `dmesg`): give a regular file on a working disk"
        )
    return "check that the path exists, and is a directory where one is expected"


def entry() -> NoReturn:
    """The `ehp-fsm` command (and `python -m ehp_fsm.cli`): `main`, then exit with its code.

    What the command had to write is written and closed when `main` returns; the heap is then
    frozen (`gc.freeze`) so that the interpreter's teardown does not walk it with the cyclic
    collector: after a run, a heap of torch, transformers, matplotlib and the run's state took
    1–3 s to tear down (a Megatron `run --verify`, ~8 s) after the receipt was printed, and the
    caller waited for it. Exit handlers still run, and what is not in a reference cycle is still
    freed and finalized as the modules are cleared."""
    code = main()
    gc.freeze()
    _not_waiting_for_stray_threads(code)
    sys.exit(code)


#: The name prefixes of ehp-fsm's own threads that are not daemons (its thread pools':
#: `concurrent.futures` workers never are).
OWN_THREADS: Final = ("ehp-", "verify-partitions", "grad-snapshot")


def _not_waiting_for_stray_threads(code: int) -> None:
    """End the process now (exit handlers run, then `os._exit(code)`) when threads that are
    not daemons are still running once the command is done: a reward that started one (a
    worker pool it never shut down) kept `ehp-fsm run` from exiting after its summary, until
    a Ctrl-C printed "Exception ignored ... threading._shutdown". Said on stderr, naming
    them and whose they are: ehp-fsm's own (`OWN_THREADS`: a worker thread still in work that
    the run's error cut short, e.g. a training step when the disk filled) or user code's. A
    full disk's run said its own step thread was the reward's (an operator's find)."""
    left = [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    if not left:
        return
    names = ", ".join(sorted(printable(t.name) for t in left))
    own = sum(t.name.startswith(OWN_THREADS) for t in left)
    whose = [
        *([f"{own} of ehp-fsm's own, still in work the run's end cut short"] if own else []),
        *([f"{len(left) - own} started by user code (the reward's)"] if len(left) > own else []),
    ]
    print(
        f"ehp-fsm: not waiting for {len(left)} thread{'s' if len(left) > 1 else ''} still "
        f"running ({names[:300]}): {'; '.join(whose)}; they would keep the process from "
        "exiting",
        file=sys.stderr,
    )
    atexit._run_exitfuncs()  # what sys.exit runs, before it waits for the threads
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
