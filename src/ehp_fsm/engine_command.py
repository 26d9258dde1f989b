"""The engine command line: one pure function builds it for SGLang and for the embedded engine.

(A light module — no third-party import — beside `plan`, which checks `[sglang] args` with it.)

`engine_argv(EngineCommand, backend=...)` is the only place an engine's command line is made. For
`backend="sglang"` it is `python -m sglang.launch_server ...`; for `backend="embedded"` it is the
same line with `sglang.launch_server` swapped for `ehp_fsm.rollout.server`, which accepts the same
option names for what it supports and refuses the rest (see `server.py`). So the CPU tests that
launch the embedded engine through this function test the command line a GPU host runs.

The options it sets (SGLang's names, checked against `python/sglang/srt/server_args.py` of the
floor the `sglang` extra pins, 0.5.3 — `tests/rollout/test_command.py` holds that version's list):
`--model-path` (the revision directory the engine starts from), `--tp-size`, `--host`, `--port`,
`--weight-version` (the revision number), `--enable-memory-saver` and
`--enable-deterministic-inference` when the run needs them, SGLang's `--api-key` (the embedded
engine takes the key from its environment instead: `engine_env`), then the plan's extra
arguments. An SGLang engine's environment also sets `SGLANG_RETURN_ORIGINAL_LOGPROB` off
(`TEMPERED_LOGPROBS`), so the log-probs it returns are of the tempered distribution it samples
from, whatever the launching process exports. The GPUs are not on the command line: the agent
sets `CUDA_VISIBLE_DEVICES` to the ones the ledger gave.

`extra_args_problem` is what `ehp-fsm check` refuses in `[sglang] args` (`extra_args_refusal`: that
and what to do instead): an option the launcher sets itself (or an alias or abbreviation of one —
argparse accepts unambiguous prefixes), and the options that would make the engine use GPUs the
ledger did not give it.

`EngineLaunchConfig` is what a host agent is told about the engines it starts (backend, revision
store, extra arguments, flags, start deadline) and how the run hands it over (`agent_flags`).

Knows: option names and the two module names. Does not know: processes, ports in use, plans.
"""

from __future__ import annotations

import json
import reprlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from ehp_fsm.errors import printable

Backend = Literal["embedded", "sglang"]
BACKENDS: Final = ("embedded", "sglang")
MODULES: Final[dict[str, str]] = {
    "sglang": "sglang.launch_server",
    "embedded": "ehp_fsm.rollout.server",
}

#: The options `engine_argv` sets, each with its SGLang aliases (0.5.3's `add_argument` names).
LAUNCHER_OPTIONS: Final[dict[str, tuple[str, ...]]] = {
    "--model-path": ("--model-path", "--model"),
    "--tp-size": ("--tp-size", "--tensor-parallel-size"),
    "--host": ("--host",),
    "--port": ("--port",),
    "--weight-version": ("--weight-version",),
    "--enable-memory-saver": ("--enable-memory-saver",),
    "--enable-deterministic-inference": ("--enable-deterministic-inference",),
    "--api-key": ("--api-key",),
}
#: The embedded engine's API key comes through its environment, not its command line (`ps`
#: shows every process's arguments to every user of the host); SGLang takes only `--api-key`.
API_KEY_ENV: Final = "EHP_ENGINE_API_KEY"
#: Set off in every SGLang engine's environment, whatever the launching process holds: with
#: `SGLANG_RETURN_ORIGINAL_LOGPROB` true (RL launch scripts export it; older SGLang read
#: `RETURN_ORIGINAL_LOGPROB`) SGLang samples from softmax(logits / T) but returns the log-probs
#: of softmax(logits), so at T ≠ 1 the behaviour log-probs the loss's ratio π_θ/π_old divides
#: by were not those of the distribution sampled from: a ratio ≠ 1 at the very weights that
#: sampled, and a clip fraction that is the temperature's, not the policy's change.
TEMPERED_LOGPROBS: Final[dict[str, str]] = {
    "SGLANG_RETURN_ORIGINAL_LOGPROB": "false",
    "RETURN_ORIGINAL_LOGPROB": "false",
}

#: SGLang options that would put the engine on GPUs the ledger did not give it (an engine holds
#: exactly its `tp` GPUs, made visible through CUDA_VISIBLE_DEVICES).
GPU_LAYOUT_OPTIONS: Final[tuple[str, ...]] = (
    "--data-parallel-size",
    "--dp-size",
    "--pipeline-parallel-size",
    "--pp-size",
    "--base-gpu-id",
    "--gpu-id-step",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--nccl-init-addr",
)
#: SGLang options that would run the engine on another kind of device (cuda, cpu, ...) than
#: the GPUs the ledger gave it.
DEVICE_OPTIONS: Final[tuple[str, ...]] = ("--device",)
#: SGLang options that read more options from a file (`--config`: a YAML of any server
#: options): what it sets is checked by nobody, the launcher's own options and the ones above
#: included (it passed `check` and was shown on the launch line: a user's find).
OPTION_FILES: Final[tuple[str, ...]] = ("--config",)


@dataclass(frozen=True, kw_only=True)
class EngineCommand:
    """What one engine is started with. `model_path` None starts an empty embedded engine (it
    serves after an install); SGLang always needs one."""

    model_path: str | None
    weight_version: str | None
    host: str
    port: int
    tp_size: int = 1
    memory_saver: bool = False
    deterministic: bool = False
    extra_args: tuple[str, ...] = ()
    #: requests must carry `Authorization: Bearer <api_key>` (`engine_argv`, `engine_env`)
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: give a key, or None for an engine without one")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be ≥ 1, got {self.tp_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be within 1..65535, got {self.port}")
        problem = extra_args_problem(self.extra_args)
        if problem is not None:
            raise ValueError(problem)


def engine_argv(cmd: EngineCommand, *, backend: Backend, python: str = sys.executable) -> list[str]:
    """The command line of one engine: `python -m MODULE` and SGLang's options."""
    if backend not in MODULES:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "sglang" and cmd.model_path is None:
        raise ValueError("an SGLang engine needs a model path (it cannot start empty)")
    argv = [python, "-m", MODULES[backend]]
    if cmd.model_path is not None:
        argv += ["--model-path", cmd.model_path]
    argv += ["--tp-size", str(cmd.tp_size), "--host", cmd.host, "--port", str(cmd.port)]
    if cmd.weight_version is not None:
        argv += ["--weight-version", cmd.weight_version]
    if cmd.memory_saver:
        argv.append("--enable-memory-saver")
    if cmd.deterministic:
        argv.append("--enable-deterministic-inference")
    if cmd.api_key is not None and backend == "sglang":
        argv += ["--api-key", cmd.api_key]  # SGLang has no other way to take it
    return argv + list(cmd.extra_args)


def authorization(api_key: str) -> str:
    """The `Authorization` header value an engine started with `api_key` requires (SGLang's)."""
    return f"Bearer {api_key}"


def api_key_headers(api_key: str | None) -> dict[str, str]:
    """The headers of every request to an engine started with `api_key` (none without one)."""
    return {} if api_key is None else {"Authorization": authorization(api_key)}


def engine_env(cmd: EngineCommand, *, backend: Backend) -> dict[str, str]:
    """What the engine's environment must hold besides the command line: the embedded engine's
    API key (`API_KEY_ENV`: kept out of the process list); for SGLang, `TEMPERED_LOGPROBS`."""
    if backend == "sglang":
        return dict(TEMPERED_LOGPROBS)
    if cmd.api_key is not None:
        return {API_KEY_ENV: cmd.api_key}
    return {}


def _option_name(arg: str) -> str | None:
    """`--name` of an argument (`--name=value` → `--name`); None for a value."""
    if not arg.startswith("--") or arg == "--":
        return None
    return arg.split("=", 1)[0]


def _names(name: str, option: str) -> bool:
    """Whether `name` (as typed) names `option`: itself, or a prefix argparse would take."""
    return option == name or (len(name) > 2 and option.startswith(name))


#: The options refused in `[sglang] args` besides the launcher's own: (options, why, fix).
_REFUSED_KINDS: Final[tuple[tuple[tuple[str, ...], str, str], ...]] = (
    (
        OPTION_FILES,
        "reads more options from a file, which nothing checks: it may set what the launcher "
        "sets itself or move the engine to other GPUs",
        "give each option in args itself, where it is checked",
    ),
    (
        DEVICE_OPTIONS,
        "would run the engine on another device than the GPUs the ledger gave it (an engine "
        "holds exactly its `tp` GPUs of one host)",
        "drop it: an engine runs on its host's devices ([[hosts]] device)",
    ),
    (
        GPU_LAYOUT_OPTIONS,
        "would place the engine on GPUs or nodes the ledger did not give it (an engine holds "
        "exactly its `tp` GPUs of one host)",
        "drop it: an engine runs on its [[engines]] entry's `tp` GPUs of its `host`; for more "
        "engines, add [[engines]] entries",
    ),
)


def extra_args_problem(args: Sequence[object]) -> str | None:
    """Why `args` cannot follow the launcher's own options (None: they can)."""
    refusal = extra_args_refusal(args)
    return None if refusal is None else refusal[0]


def extra_args_refusal(args: Sequence[object]) -> tuple[str, str] | None:
    """Why `args` cannot follow the launcher's own options, and what to do instead (None: they
    can). The fix depends on the kind: an option the launcher sets comes from the plan, but no
    plan key sets an option that would move the engine to other GPUs (the fix "the run sets it
    from the plan" sent the user looking for a `--dp-size` key that does not exist)."""
    reserved = {alias: name for name, aliases in LAUNCHER_OPTIONS.items() for alias in aliases}
    value_may_follow = False  # the argument before was an option without `=value`
    for arg in args:
        if not isinstance(arg, str):
            return (
                f"{_shown(arg)} is not a string: each argument is one TOML string",
                'write it as a string, each option and each value its own: args = ["--name", "1"]',
            )
        if "\x00" in arg:  # the OS takes no argument with a NUL byte: the launch would fail
            return (
                f"{arg[:80]!r} holds a NUL byte, which no command-line argument may hold",
                "remove the NUL byte (\\u0000 in the TOML string)",
            )
        name = _option_name(arg)
        if name is None:
            if not value_may_follow:  # SGLang takes no positional argument: its launch fails
                return (
                    f"{_shown(arg)} is neither an option (--name) nor the value of one: SGLang's "
                    "launcher takes no positional argument, and the engine would not start",
                    'write options as "--name" followed by their value: args = ["--name", "1"]',
                )
            value_may_follow = False
            continue
        value_may_follow = "=" not in arg
        for alias, own in reserved.items():
            if _names(name, alias):
                return (
                    f"{_shown(arg)} sets {own}, which the launcher sets itself (model path = the "
                    "revision, TP, host, port, weight version, memory saver, deterministic "
                    "inference and the API key come from the plan and the run)",
                    "drop it: the run sets it from the plan",
                )
        for options, why, fix in _REFUSED_KINDS:
            if any(_names(name, option) for option in options):
                return f"{_shown(arg)} {why}", fix
    return None


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 3


def _shown(arg: object) -> str:
    """`arg` as a refusal quotes it: its repr, at most 80 characters (a list of millions of
    ints in `[sglang] args` made an error message of 10 MB; `reprlib` stops early, so the
    whole repr is never built) and printable (a newline or escape shows as its escape)."""
    text = printable(_REPR.repr(arg))
    return text if len(text) <= 80 else f"{text[:80]}…"


@dataclass(frozen=True, kw_only=True)
class EngineLaunchConfig:
    """How a host agent starts the engines it is asked to launch: the run's one backend, the
    revision store an engine starts from (its newest revision directory is the model path and
    its number the weight version; without a store an embedded engine starts empty), the model
    directory an engine starts from while the store holds no revision yet (`base_model`: the
    run launches its engines while its trainers start, before revision 1 is saved; the engine
    installs revision 1 before it serves), and the flags the run needs. `agent_flags` is how
    the run hands it to `ehp-fsm agent`."""

    backend: Backend = "embedded"
    revisions: str | None = None
    base_model: str | None = None
    extra_args: tuple[str, ...] = ()
    memory_saver: bool = False
    deterministic: bool = False
    #: how long a launch may take to answer (the plan's `rollout_engine` `starting` deadline);
    #: None: the agent's default
    start_deadline_s: float | None = None
    #: the file holding the key every engine request must carry (read at each launch: the run
    #: may write it after a cluster's agents started); None: engines without a key
    api_key_file: str | None = None

    def __post_init__(self) -> None:
        if self.start_deadline_s is not None and not self.start_deadline_s > 0:
            raise ValueError(f"start_deadline_s must be > 0, got {self.start_deadline_s}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "sglang" and self.revisions is None:
            raise ValueError("SGLang engines start from a revision: pass the revision store")
        if self.base_model is not None and self.revisions is None:
            raise ValueError(
                "base_model is where an engine starts before the revision store holds a "
                "revision: pass the revision store too"
            )
        problem = extra_args_problem(self.extra_args)
        if problem is not None:
            raise ValueError(problem)

    def agent_flags(self) -> list[str]:
        """The `ehp-fsm agent` options that carry this config."""
        flags = ["--engine-backend", self.backend]
        if self.revisions is not None:
            flags += ["--revisions", self.revisions]
        if self.base_model is not None:
            flags += ["--engine-base-model", self.base_model]
        if self.extra_args:
            flags += ["--engine-args", json.dumps(list(self.extra_args))]
        if self.memory_saver:
            flags.append("--engine-memory-saver")
        if self.deterministic:
            flags.append("--engine-deterministic")
        if self.start_deadline_s is not None:
            flags += ["--engine-start-deadline-s", repr(self.start_deadline_s)]
        if self.api_key_file is not None:
            flags += ["--engine-api-key-file", self.api_key_file]
        return flags
