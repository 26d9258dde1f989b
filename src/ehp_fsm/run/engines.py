"""How the run's agents start engines: the plan's launch config, and its command line as
`ehp-fsm check` shows it.

Knows: the plan's engine backend and `[sglang] args`, the flags the run needs (deterministic
inference for SGLang: the dispatcher sends every sample's `sampling_seed`, which SGLang honours
only in deterministic mode; no memory saver: the run stops an engine to lend its GPUs, it never
releases an engine's memory). Does not know: processes or agents (`startup` hands the config
to them as `ehp-fsm agent` flags).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ehp_fsm.engine_command import API_KEY_ENV, EngineCommand, EngineLaunchConfig, engine_argv
from ehp_fsm.plan import Plan
from ehp_fsm.runtime.keys import API_KEY_FILE


def revisions_dir(plan: Plan, run_dir: Path) -> Path:
    """Where the run writes its revisions: the plan's `run.revisions` (a path every host can
    read: engines on other nodes install from it), else `revisions/` in the run directory."""
    return Path(plan.revisions).resolve() if plan.revisions else run_dir / "revisions"


def engine_key_file(plan: Plan, run_dir: Path) -> Path:
    """The file of the key every engine request must carry: beside the CURVE keys when the plan
    names their directory (a cluster's shared one), else in the run directory's `keys/`. The
    run writes it (`keys.ensure_api_key`) before it launches an engine."""
    keys = Path(plan.transport.curve_keys) if plan.transport.curve_keys else run_dir / "keys"
    return keys / API_KEY_FILE


def agent_engine_launch(plan: Plan) -> EngineLaunchConfig:
    """What an agent started by the cluster (`ehp-fsm agent --plan PLAN`) reads from the plan:
    the same config the run hands the agents it starts (the run directory is the transition
    log's)."""
    return engine_launch(plan, Path(plan.log).resolve().parent)


def engine_launch(plan: Plan, run_dir: Path) -> EngineLaunchConfig:
    """The plan's one backend (`check` refuses a mix), engines starting from the newest revision
    in the run's store (`revisions_dir`; from the plan's model directory while it holds none:
    the run launches its engines while its trainers start), with the plan's `[sglang] args`,
    the run's API key (`engine_key_file`), given as long to answer as the engine machine waits
    in `starting`."""
    backend = plan.engines[0].backend
    return EngineLaunchConfig(
        backend="sglang" if backend == "sglang" else "embedded",
        revisions=str(revisions_dir(plan, run_dir)),
        api_key_file=str(engine_key_file(plan, run_dir)),
        base_model=plan.model.path if plan.model is not None else None,
        extra_args=plan.sglang.args if backend == "sglang" else (),
        memory_saver=False,
        deterministic=backend == "sglang",
        start_deadline_s=plan.deadlines["rollout_engine"]["starting"],
    )


def shown_command(plan: Plan) -> str:
    """The command line of the plan's first engine, with what the agent fills in at launch as
    placeholders (run directory, the launch's links to the newest revision, revision, address,
    port)."""
    cfg = engine_launch(plan, Path("RUN_DIR"))
    own = () if cfg.backend == "sglang" else ("--torch-threads", "1", "--decode-delay-ms", "0.0")
    cmd = EngineCommand(
        model_path=f"{cfg.revisions}/.launch-RANDOM",  # links to the newest rNNNNNNNN
        weight_version="N",
        host="ADDR",
        port=1,
        tp_size=1,
        memory_saver=cfg.memory_saver,
        deterministic=cfg.deterministic,
        extra_args=(*own, *cfg.extra_args),  # `launch_engine` adds the embedded engine's own
        api_key="KEY",
    )
    argv = engine_argv(cmd, backend=cfg.backend, python="python")
    argv[argv.index("--port") + 1] = "PORT"
    tps = sorted({e.tp for e in plan.engines})
    argv[argv.index("--tp-size") + 1] = str(tps[0]) if len(tps) == 1 else "TP"
    line = shlex.join(argv)
    line += f" (KEY: from {cfg.api_key_file}"
    line += ", as --api-key)" if cfg.backend == "sglang" else f", in ${API_KEY_ENV})"
    if cfg.base_model is not None:
        line += f" (before revision 1 is saved: --model-path {shlex.quote(cfg.base_model)}"
        line += " without --weight-version)"
    return line + (" with CUDA_VISIBLE_DEVICES = its GPUs" if cfg.backend == "sglang" else "")
