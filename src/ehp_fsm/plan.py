"""Plan files: `plan.toml` parsed once into frozen, validated dataclasses.

What it knows: the schema of a plan (run, hosts, core, engines, rollout, grpo, ehp, deadlines,
transport, and `[simulate]`: the cost model only `ehp-fsm simulate` reads) and every
cross-field rule (replica_size = TP×PP×CP, engines on one host within its GPUs, no GPU used
twice, reserve within the rollout GPUs, a global batch of whole groups, ...).
A bad plan raises `PlanError` with the TOML key path and the reason. What it does not know: how
the plan is executed.
"""

from __future__ import annotations

import difflib
import io
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

from ehp_fsm.addresses import endpoint_problem, is_loopback_endpoint
from ehp_fsm.core.planner_model import PlannerInputError, PlannerPolicy
from ehp_fsm.data.dataset import DataConfig
from ehp_fsm.engine_command import extra_args_refusal
from ehp_fsm.errors import PlanError, toml_key
from ehp_fsm.fspaths import path_problem
from ehp_fsm.models.load import DTYPE_NAMES

_Doc = Mapping[str, Any]


# -- limits the runtime enforces, kept here so that `ehp-fsm check` refuses what `run` would --
#: A host id: the agent's routing id, the prefix of its GPU ids (`h1:g0`), a directory and a
#: CURVE key file name — so letters, digits, '.', '_', '-', at most 64 characters. `\Z`, not
#: `$`: `$` also matches before a final newline, and `"h2\n"` passed as a host id.
HOST_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
#: GPUs (device slots) of one host: every GPU is an instance of the world, built in memory.
MAX_GPUS_PER_HOST: Final = 4096
#: The smallest and largest control-plane message (`runtime.endpoint.TransportConfig`).
MIN_MESSAGE_BYTES: Final = 1024
MAX_MESSAGE_BYTES: Final = 1 << 30
#: Any other count (steps, prompts per step, group size, a Core dimension, a TP).
MAX_COUNT: Final = 1 << 30
#: Samples of one GRPO group (`[grpo] group_size`). Real groups are 4 to 64 samples, a few
#: recipes use up to 1024; every group's samples are drawn, held and simulated together (100M
#: grew `simulate` for minutes and ended in a MemoryError), so the cap is 64 times the largest.
MAX_GROUP_SIZE: Final = 1 << 16
#: Groups of one step (`[grpo] prompts_per_step`). Real recipes use tens to a few thousand; each
#: group is a request the controller creates, logs and holds as its step begins (two steps'
#: worth are kept queued): 65,536 a step are enqueued in ~1.2 s, while 10,000,000 had a run
#: write 5.9 GB of log and grow to 11 GB before its first sample, and answer SIGTERM only
#: after ~8 minutes (`simulate` holds ~1.5 KiB a group).
MAX_PROMPTS_PER_STEP: Final = 1 << 16
#: Samples of one optimizer step (prompts × group size): a signed 32-bit count everywhere.
MAX_GLOBAL_BATCH: Final = (1 << 31) - 1
#: Seconds of a heartbeat (a ZMTP heartbeat is set in milliseconds, a 32-bit int).
MAX_HEARTBEAT_S: Final = 3600.0
#: The largest plan file read (a plan is a few KiB; a device such as /dev/zero never ends).
MAX_PLAN_BYTES: Final = 16 << 20
#: Seeds every generator takes (numpy's is 32 bits).
MAX_SEED: Final = (1 << 32) - 1


def engine_id_problem(engine_id: object) -> str | None:
    """Why `engine_id` cannot be an engine id (None: it can): the host ids' characters, since
    an agent names the engine's log file after it (`e/../x` or 5,000 characters passed
    `check`, and the launch then failed)."""
    if not isinstance(engine_id, str) or not HOST_ID_RE.match(engine_id):
        return (
            f"engine id {str(engine_id)[:80]!r} must be 1..64 letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (its agent names the engine's log after it)"
        )
    return None


def host_id_problem(host_id: object) -> str | None:
    """Why `host_id` cannot be a host id (None: it can). The agent refuses the same ids."""
    if not isinstance(host_id, str) or not HOST_ID_RE.match(host_id):
        return (
            f"host id {str(host_id)[:80]!r} must be 1..64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it is the agent's routing id and its GPU ids' "
            "prefix `ID:g0`)"
        )
    return None


class _Reader:
    """Typed access to one TOML table that remembers its key path and rejects unknown keys."""

    def __init__(self, doc: object, path: str, file: str) -> None:
        if not isinstance(doc, dict):
            raise PlanError(
                path or "<root>", f"expected a table, got {type(doc).__name__}", path=file
            )
        self.doc: dict[str, Any] = doc
        self.path, self.file = path, file
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        part = toml_key(name)
        return f"{self.path}.{part}" if self.path else part

    def err(self, name: str, why: str, fix: str = "") -> PlanError:
        return PlanError(self.key(name), why, fix, path=self.file)

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        self.used.add(name)
        if name not in self.doc:
            if default is ...:
                if (typo := self._misspelled(name)) is not None:  # `group_sise = 8`
                    raise self.err(
                        name,
                        f"it is required, and [{self.path}] has `{typo}`, not a key of it",
                        f"did you mean `{name}`? Rename `{typo}` to `{name}`",
                    )
                raise self.err(name, "it is required", f"add `{name} = ...` to [{self.path}]")
            return default
        value = self.doc[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.err(
                name,
                f"expected {_names(kinds)}, got a boolean",
                f"write {name} as {_names(kinds)}, not true or false",
            )
        if int in kinds and float in kinds and isinstance(value, int):
            return value
        if not isinstance(value, kinds):
            raise self.err(
                name, f"expected {_names(kinds)}, got {value!r}", f"write {name} as {_names(kinds)}"
            )
        return value

    def positive(
        self,
        name: str,
        default: Any = ...,
        *,
        maximum: int = MAX_COUNT,
        past_max: tuple[str, str] | None = None,
    ) -> int:
        """An integer in 1..maximum; `past_max`: what a value above `maximum` is (said after
        the value, e.g. "groups a step is past ...") and its fix, where the plain range would
        not tell the user why the bound is there."""
        value: int = self.get(name, int, default)
        if past_max is not None and value > maximum:
            what, fix = past_max
            raise self.err(name, f"{str(value)[:20]} {what}", fix)
        if not 1 <= value <= maximum:
            raise self.err(
                name,
                f"must be an integer in 1..{maximum}, got {value}",
                f"give {name} a whole number within 1..{maximum}",
            )
        return value

    def number(
        self, name: str, default: Any = ..., *, minimum: float = 0.0, maximum: float = 1e9
    ) -> float:
        raw = self.get(name, (int, float), default)
        fix = f"give {name} a number within {minimum:g}..{maximum:g}"
        try:
            value = float(raw)
        except OverflowError:  # an integer too large for a float
            raise self.err(name, f"must be at most {maximum:g}, got {raw}", fix) from None
        if not math.isfinite(value):
            raise self.err(name, f"must be a finite number, got {value}", fix)
        if not minimum <= value <= maximum:
            raise self.err(name, f"must be within {minimum:g}..{maximum:g}, got {value}", fix)
        return value

    def fs_path(self, name: str, default: Any = ...) -> Any:
        """A file or directory path: a string the OS can take (no NUL byte), not blank, and
        no `~` or `$VAR` the reader would expect expanded (`plan_path_problem`)."""
        value = self.get(name, str, default)
        if isinstance(value, str) and (problem := plan_path_problem(value)) is not None:
            raise self.err(name, problem, "give a file system path")
        return value

    def table(self, name: str) -> _Reader:
        self.used.add(name)
        return _Reader(self.doc.get(name, {}), self.key(name), self.file)

    def tables(self, name: str) -> list[_Reader]:
        self.used.add(name)
        raw = self.doc.get(name, [])
        if not isinstance(raw, list):
            raise self.err(name, "expected an array of tables", f"write `[[{name}]]` entries")
        return [_Reader(x, f"{self.key(name)}[{i}]", self.file) for i, x in enumerate(raw)]

    def _misspelled(self, name: str) -> str | None:
        """A key of this table's document that is no key of the table and looks like `name`."""
        table = _ARRAY_INDEX.sub("", self.path)
        known = _table_keys().get(f"[{table}]") or _table_keys().get(f"[[{table}]]") or ()
        strays = sorted(k for k in self.doc if k not in known)
        close = difflib.get_close_matches(name, strays, n=1, cutoff=0.6)
        return close[0] if close else None

    def done(self) -> None:
        extra = sorted(set(self.doc) - self.used)
        if extra and (homes := _homes_of(extra[0], self.path)):
            # a key of another table ("[grpo] max_hybrids") was said to be misspelled
            table = _ARRAY_INDEX.sub("", self.path)
            here = f"[{self.path}]" if self.path else "the top level"
            if table != self.path:
                here = f"[[{table}]]"
            if homes == ["the top level"]:
                fix = f"write it as a table of its own, [{extra[0]}]"
            else:
                fix = f"move it under {homes[0] if len(homes) == 1 else 'the one you meant'}"
            raise self.err(
                extra[0], f"it is not a key of {here}: it is a key of {' or '.join(homes)}", fix
            )
        if extra:  # the keys asked for by now are known ones: name the nearest, if any
            close = difflib.get_close_matches(extra[0], sorted(self.used), n=1, cutoff=0.6)
            fix = f"did you mean `{close[0]}`? Else " if close else ""
            raise self.err(
                extra[0], "it is not a known key", f"{fix}check the spelling in the README"
            )


#: An array of tables' index at the end of a reader's key path (`engines[2]`).
_ARRAY_INDEX: Final = re.compile(r"\[\d+\]\Z")


def _table_keys() -> dict[str, tuple[str, ...]]:
    """Every table of a plan, as TOML writes its header, and the keys it takes (the top level's
    are its tables). `tests/run/test_plan_author_review.py` holds it to the keys the reader asks
    for."""
    return {
        "the top level": (
            *("run", "hosts", "core", "engines", "sglang", "rollout", "grpo", "model", "data"),
            *("reward", "ehp", "deadlines", "transport", "simulate"),
        ),
        "[run]": ("name", "seed", "log", "revisions", "samples"),
        "[[hosts]]": ("id", "gpus", "device"),
        "[core]": ("backend", "tp", "pp", "cp", "dp", "gpus"),
        "[[engines]]": ("id", "host", "tp", "gpus", "backend"),
        "[sglang]": ("args",),
        "[rollout]": ("reserve", "allowed_tp"),
        "[grpo]": (
            *("prompts_per_step", "group_size", "global_batch", "steps", "max_staleness"),
            *("learning_rate", "temperature", "clip_low", "clip_high", "kl_coef"),
            "loss_aggregation",
        ),
        "[model]": ("path", "generate", "dtype", "max_prompt_len", "max_response_len"),
        "[data]": ("train", "prompt_key", "label_key", "chat_template", "seed"),
        "[reward]": ("function", "on_error", "timeout_s"),
        "[ehp]": (
            *("enabled", "replica_size", "borrow_threshold", "release_threshold", "cooldown_s"),
            *("max_hybrids", "min_hybrids", "engine_restart_cost_s", "release_resume_cost_s"),
        ),
        "[deadlines]": (*_DEADLINE_STATES, "run"),
        **{f"[deadlines.{m}]": states for m, states in _DEADLINE_STATES.items()},
        "[deadlines.run]": tuple(f.name for f in fields(RunDeadlines)),
        "[transport]": (
            *("controller", "allow_non_loopback", "curve_keys", "max_message_bytes"),
            *("heartbeat_s", "curve"),
        ),
        "[simulate]": (*SIMULATE_DEFAULTS, "response_lengths_file"),
    }


def _homes_of(name: str, path: str) -> list[str]:
    """The tables other than the one at `path` (a reader's key path) that take key `name`."""
    table = _ARRAY_INDEX.sub("", path)
    here = {f"[{table}]", f"[[{table}]]"} if table else {"the top level"}
    return [t for t, keys in _table_keys().items() if name in keys and t not in here]


#: A shell variable in a path (`$HOME`, `${SCRATCH}`): no part of a plan expands one.
_SHELL_VARIABLE: Final = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def plan_path_problem(path: str) -> str | None:
    """Why `path` cannot be a path of a plan (None: it can): `fspaths.path_problem`'s reasons
    (a NUL byte, blank, a leading `~`, too long), and a shell variable — taken as is,
    `$HOME/models/m` named a folder called `$HOME` in the plan's folder (and a run made it),
    as `~` did before it was refused."""
    if (problem := path_problem(path)) is not None:
        return problem
    if (var := _SHELL_VARIABLE.search(path)) is not None:
        name = next(part for part in path.split("/") if var[0] in part)
        whole = os.path.expandvars(path)
        return (
            f"{path[:80]!r} holds {var[0]!r}, which is not expanded here: the path would hold "
            f"a name {name[:80]!r} as written (a run makes its output folders so named); write "
            "the whole path" + (f", e.g. {whole[:120]!r}" if whole != path else "")
        )
    return None


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


@dataclass(frozen=True, kw_only=True)
class Host:
    id: str
    gpus: tuple[str, ...]
    device: str = "cpu"


@dataclass(frozen=True, kw_only=True)
class CoreLayout:
    backend: str
    tp: int
    pp: int
    cp: int
    dp: int
    gpus: tuple[str, ...]

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(f"core:{i}" for i in range(self.dp))


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    id: str
    host: str
    tp: int
    gpus: tuple[str, ...]
    backend: str = "embedded"


@dataclass(frozen=True)
class SGLangSpec:
    """`[sglang]`: what every `sglang.launch_server` of the run gets after the launcher's own
    options (model path, TP, host, port, weight version, deterministic inference)."""

    args: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Rollout:
    reserve: int
    allowed_tp: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Grpo:
    prompts_per_step: int
    group_size: int
    steps: int
    max_staleness: int
    learning_rate: float
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    loss_aggregation: str = "token_mean"

    @property
    def global_batch(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """`[model]`: the Hugging Face causal LM the run trains and serves. `path` is absolute (a
    relative path in the plan is taken from the plan file's directory); `generate` names the
    architecture `ehp-fsm init-model` writes there when the directory does not exist yet."""

    path: str
    generate: str | None
    dtype: str
    max_prompt_len: int
    max_response_len: int


@dataclass(frozen=True)
class RewardSpec:
    """`[reward]`: a built-in name or "module:callable", what a failing reward does, and how
    long one call may take before it counts as failed (`timed_out`)."""

    function: str
    on_error: str
    timeout_s: float = 60.0


@dataclass(frozen=True, kw_only=True)
class EhpPolicy:
    enabled: bool
    replica_size: int
    borrow_threshold: float
    release_threshold: float
    cooldown_s: float
    max_hybrids: int
    engine_restart_cost_s: float
    release_resume_cost_s: float
    # Hybrids kept at least, whatever the measured times predict (`PlannerPolicy.min_hybrids`)
    min_hybrids: int = 0


@dataclass(frozen=True, kw_only=True)
class Transport:
    controller: str
    allow_non_loopback: bool
    curve_keys: str | None
    max_message_bytes: int
    heartbeat_s: float
    #: "local": the run makes CURVE keys for its own agents in its run directory (one machine;
    #: the default of a plan without `curve_keys`); "off": no keys made (`curve_keys`' CURVE,
    #: or none: a plain loopback channel).
    curve: str = "off"


#: The shortest `[deadlines.run] health` with SGLang engines (see `parse_plan`).
SGLANG_HEALTH_S: Final = 3.0


@dataclass(frozen=True, kw_only=True)
class RunDeadlines:
    """`[deadlines.run]`: the waits of the run itself (the machines' own deadlines are the
    other `[deadlines.*]` tables). Seconds."""

    #: every host agent connects and reconciles (local or external agents)
    agents_connect: float = 60.0
    #: one step's rollout produces its groups
    rollout: float = 300.0
    #: one group's `/generate` call answers (client-side bound of the HTTP call)
    generate: float = 60.0
    #: an engine whose `/generate` got no answer answers its one `/health` probe (no answer:
    #: the engine has failed, and its groups go to the others)
    health: float = 5.0
    #: every trainer worker says hello: the Core's ranks and the warm Hybrid workers, those the
    #: run starts and those the agents of other machines start (model built, Gloo world joined;
    #: the world's rendezvous waits as long for its last member)
    trainers_start: float = 120.0


@dataclass(frozen=True, kw_only=True)
class Plan:
    name: str
    seed: int
    log: str
    hosts: tuple[Host, ...]
    core: CoreLayout
    engines: tuple[EngineSpec, ...]
    rollout: Rollout
    grpo: Grpo
    ehp: EhpPolicy
    deadlines: Mapping[str, Mapping[str, float]]
    transport: Transport
    model: ModelSpec | None = None
    data: DataConfig | None = None
    reward: RewardSpec = field(default_factory=lambda: RewardSpec("exact_match", "raise"))
    #: where revisions are written (a path every host can read: a shared file system when the
    #: engines run on other nodes); None: `revisions/` beside the transition log
    revisions: str | None = None
    #: write every trained sample (prompt, completion, reward, advantage) to `samples.jsonl`
    #: beside the transition log (`run.samples`)
    samples: bool = False
    run_deadlines: RunDeadlines = field(default_factory=RunDeadlines)
    sglang: SGLangSpec = field(default_factory=SGLangSpec)
    simulate: SimulateSpec | None = None
    source: str = field(default="", compare=False)

    @property
    def inventory(self) -> tuple[str, ...]:
        return tuple(g for h in self.hosts for g in h.gpus)

    def host_of(self, gpu: str) -> str:
        for h in self.hosts:
            if gpu in h.gpus:
                return h.id
        raise KeyError(gpu)

    @property
    def rollout_gpus(self) -> int:
        return sum(e.tp for e in self.engines)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("source")
        return out

    def planner_policy(self) -> PlannerPolicy:
        """The plan's EHP policy in the planner's terms."""
        x = self.ehp
        return PlannerPolicy(
            rollout_reserve=self.rollout.reserve,
            replica_size=x.replica_size,
            allowed_engine_tps=tuple(sorted(set(self.rollout.allowed_tp))),
            borrow_threshold=x.borrow_threshold,
            release_threshold=x.release_threshold,
            cooldown_s=x.cooldown_s,
            engine_restart_s=x.engine_restart_cost_s,
            release_resume_s=x.release_resume_cost_s,
            max_hybrids=x.max_hybrids if x.enabled else 0,
            groups_per_step=self.grpo.prompts_per_step,
            rollout_overlaps_training=self.grpo.max_staleness >= 1,
            min_hybrids=x.min_hybrids if x.enabled else 0,
        )

    def outputs_anchored(self) -> Plan:
        """The plan with its output paths (`run.log`, `run.revisions`: a relative one starts
        at the current directory) made absolute now, as a run starts. A reward that changes the
        working directory (code-execution rewards do) moved them under the run: its log "was
        removed while the run ran", and `check` showed the log under the reward's folder."""
        anchored = str(Path(self.revisions).absolute()) if self.revisions else self.revisions
        return replace(self, log=str(Path(self.log).absolute()), revisions=anchored)

    def world_config(self) -> dict[str, Any]:
        """The static config the engine world reads (stored in the transition-log header)."""
        return {
            "inventory": {g: h.id for h in self.hosts for g in h.gpus},
            "core_gpus": list(self.core.gpus),
            "core_replicas": list(self.core.replicas),
            "replica_size": self.ehp.replica_size,
            "groups_per_step": self.grpo.prompts_per_step,
            "group_size": self.grpo.group_size,
            "max_staleness": self.grpo.max_staleness,
            # The capacity rules the core enforces (guards `keeps_rollout_reserve`,
            # `within_max_hybrids`), the same numbers the planner plans with.
            "rollout_reserve": self.rollout.reserve,
            "max_hybrids": self.ehp.max_hybrids if self.ehp.enabled else 0,
            "deadlines": {m: dict(t) for m, t in self.deadlines.items()},
        }


@dataclass(frozen=True, kw_only=True)
class SimulateSpec:
    """`[simulate]`: the cost model of `ehp-fsm simulate` (read by nothing else: `ehp-fsm run`
    measures real times). Every default and its source is in `SIMULATE_DEFAULTS`; times are
    virtual seconds. A group of n samples takes max(Σ lengths / engine throughput, longest /
    sequence speed); throughput at TP t is `engine_tokens_per_s · t**tp_exponent`."""

    engine_tokens_per_s: float
    tp_exponent: float
    sequence_tokens_per_s: float
    response_median_tokens: float
    response_sigma: float
    response_max_tokens: int
    #: samples from `response_lengths_file`, each capped at `response_max_tokens` (an engine
    #: ends a response there); () = log-normal
    response_lengths: tuple[int, ...]
    train_s_per_sample: float
    optimizer_s: float
    model_gb: float
    state_bytes_factor: float
    reduce_gb_per_s: float
    save_gb_per_s: float
    install_gb_per_s: float
    state_gb_per_s: float
    engine_start_s: float
    engine_stop_s: float
    hybrid_launch_s: float
    finalizer_s: float
    gpu_fault_per_hour: float
    agent_silence_per_hour: float
    agent_silence_s: float
    slow_node_fraction: float
    slow_node_factor: float
    tick_s: float
    #: how many of `response_lengths_file`'s lengths were above `response_max_tokens`
    response_lengths_capped: int = 0
    #: the keys the plan's `[simulate]` gives (the rest are `SIMULATE_DEFAULTS`'), in its order:
    #: what `check` shows, no part of the cost model (two specs of the same costs are equal)
    given: tuple[str, ...] = field(default=(), compare=False)


#: key: (default, minimum, maximum, source). A default `None` is taken from the plan (noted).
SIMULATE_DEFAULTS: Final[dict[str, tuple[float | None, float, float, str]]] = {
    "engine_tokens_per_s": (
        3000.0,
        1e-3,
        1e9,
        "assumed: decode throughput of one TP1 SGLang engine serving a 7-8B model on one "
        "H100-class GPU at a large batch (the order of SGLang's published offline benchmarks)",
    ),
    "tp_exponent": (0.8, 0.0, 2.0, "assumed: TP scales throughput sub-linearly"),
    "sequence_tokens_per_s": (
        50.0,
        1e-3,
        1e9,
        "assumed: one sequence's decode speed inside a large batch",
    ),
    "response_median_tokens": (600.0, 1.0, 1e7, "assumed: reasoning-style GRPO responses (median)"),
    "response_sigma": (
        0.8,
        0.0,
        5.0,
        "assumed: log-normal spread; a long tail, as reasoning RL reports",
    ),
    "response_max_tokens": (None, 1.0, 1e7, "the plan's [model] max_response_len, else 8192"),
    "train_s_per_sample": (
        0.2,
        1e-9,
        1e6,
        "6·N·tokens FLOPs (Kaplan et al. 2020) for 7B params × 1,600 tokens = 6.7e13: "
        "0.17 s on one H100 at 40% of 989 TFLOP/s bf16 (0.085 s on a TP2 replica), rounded "
        "up (one H100 at 34%)",
    ),
    "optimizer_s": (0.3, 0.0, 1e6, "assumed: a distributed Adam step of 7B params"),
    "model_gb": (15.0, 1e-6, 1e6, "7B parameters in bf16"),
    "state_bytes_factor": (
        7.0,
        1.0,
        100.0,
        "bf16 weights + fp32 master + two fp32 Adam moments = 14 bytes/param over 2 bytes",
    ),
    "reduce_gb_per_s": (
        50.0,
        1e-6,
        1e6,
        "400 Gb/s InfiniBand per GPU: a ring all-reduce moves 2·size·(R-1)/R",
    ),
    "save_gb_per_s": (2.0, 1e-6, 1e6, "assumed: a safetensors write to local NVMe"),
    "install_gb_per_s": (
        5.0,
        1e-6,
        1e6,
        "assumed: SGLang /update_weights_from_disk reading local NVMe",
    ),
    "state_gb_per_s": (
        25.0,
        1e-6,
        1e6,
        "assumed: Core→Hybrid state over NVLink/PCIe (DP-zero gather+scatter)",
    ),
    "engine_start_s": (
        None,
        0.0,
        1e6,
        "the plan's [ehp] engine_restart_cost_s (DESIGN: a restart costs tens of seconds to "
        "minutes of graph capture)",
    ),
    "engine_stop_s": (5.0, 0.0, 1e6, "assumed: SIGTERM to exit of an SGLang server"),
    "hybrid_launch_s": (
        None,
        0.0,
        1e6,
        "the plan's [ehp] release_resume_cost_s (a warm trainer worker)",
    ),
    "finalizer_s": (0.5, 0.0, 1e6, "assumed: NVML sees the process gone and memory free"),
    "gpu_fault_per_hour": (
        2e-5,
        0.0,
        1e6,
        "Llama 3 (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in 54 days on "
        "16,384 H100s ≈ 2e-5 per GPU-hour; an engine or Hybrid fails at its GPUs' sum",
    ),
    # at most 100 (x5000 under --faults heavy): a silence changes nothing lasting, so the
    # simulation goes on at ever more events per virtual second (1e6 took ~1,000 s a step)
    "agent_silence_per_hour": (
        1e-5,
        0.0,
        100.0,
        "assumed: a host agent (network, kernel) goes silent; per host",
    ),
    "agent_silence_s": (30.0, 0.0, 1e6, "assumed: how long a silent agent stays silent"),
    "slow_node_fraction": (0.01, 0.0, 1.0, "assumed: hosts running slow (thermal, bad link)"),
    "slow_node_factor": (2.0, 1.0, 1e3, "assumed: how much slower a slow host runs"),
    "tick_s": (0.02, 1e-6, 60.0, "the run's loop: one turn every 20 ms (run.job.Job.until)"),
}
_SIMULATE_INTS: Final = frozenset({"response_max_tokens"})


def _simulate(
    root: _Reader, base: Path, model: ModelSpec | None, ehp: EhpPolicy
) -> SimulateSpec | None:
    """`[simulate]`, every key checked against its range; absent: None (the defaults apply
    when `ehp-fsm simulate` runs the plan, see `simulate_spec`)."""
    if "simulate" not in root.doc:
        return None
    return simulate_spec(root.table("simulate"), base, model, ehp)


def simulate_spec(
    sr: _Reader | None, base: Path, model: ModelSpec | None, ehp: EhpPolicy
) -> SimulateSpec:
    """The cost model from a `[simulate]` reader (None: every default)."""
    plan_defaults: dict[str, float] = {
        "response_max_tokens": float(model.max_response_len if model else 8192),
        "engine_start_s": ehp.engine_restart_cost_s,
        "hybrid_launch_s": ehp.release_resume_cost_s,
    }
    values: dict[str, Any] = {}
    for key, (default, low, high, _source) in SIMULATE_DEFAULTS.items():
        d = plan_defaults[key] if default is None else default
        if sr is None:
            values[key] = d
        elif key in _SIMULATE_INTS:
            values[key] = sr.positive(key, int(d), maximum=int(high))
        else:
            values[key] = sr.number(key, d, minimum=low, maximum=high)
    lengths: tuple[int, ...] = ()
    if sr is not None:
        raw = sr.fs_path("response_lengths_file", None)
        if raw is not None:
            lengths = _response_lengths(sr, base / raw)
        sr.done()
    cap = values["response_max_tokens"] = int(values["response_max_tokens"])
    capped = sum(1 for n in lengths if n > cap)
    return SimulateSpec(
        **values,
        response_lengths=tuple(min(n, cap) for n in lengths),
        response_lengths_capped=capped,
        given=tuple(sr.doc) if sr is not None else (),
    )


def simulate_costs(plan: Plan) -> SimulateSpec:
    """The cost model `ehp-fsm simulate` runs `plan` with: its `[simulate]`, else every default."""
    return plan.simulate or simulate_spec(None, Path("."), plan.model, plan.ehp)


def _response_lengths(sr: _Reader, path: Path) -> tuple[int, ...]:
    """Real response lengths, one positive integer per line (blank lines and `#` skipped)."""
    if not path.is_file():  # a FIFO would block the read, a device never end it
        raise sr.err(
            "response_lengths_file",
            # (a missing file was "not a file" too, which reads as if something else were there)
            f"{path} cannot be read (it {'is not a file' if path.exists() else 'does not exist'})",
            "write one response length (tokens) per line in a file, named relative to the "
            "plan's folder",
        )
    try:  # (-sig: a byte-order mark, as some tools write one, is no part of the first line)
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise sr.err(
            "response_lengths_file",
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
            "write one response length (tokens) per line, as text",
        ) from None
    except OSError as exc:
        raise sr.err(
            "response_lengths_file",
            f"{path} cannot be read ({exc})",
            "make the file readable by this user",
        ) from None
    out = []
    high = int(SIMULATE_DEFAULTS["response_max_tokens"][2])  # a response's tokens, at most
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        # ASCII digits, few enough for int(): '²' is a digit to isdigit() and not to int(),
        # and int() refuses 4,300 digits and more (both were tracebacks)
        if (
            not (line.isascii() and line.isdigit() and len(line) <= len(str(high)))
            or not 1 <= int(line) <= high
        ):
            raise sr.err(
                "response_lengths_file",
                f"{path}:{n}: {line[:40]!r} is not a token count within 1..{high}",
                "write one response length (tokens) per line",
            )
        out.append(int(line))
    if not out:
        raise sr.err(
            "response_lengths_file",
            f"{path} holds no lengths (only blank lines or `#` comments)",
            "write one response length (tokens) per line",
        )
    return tuple(out)


#: The loss aggregations of `training.objective` (kept here: a plan loads without torch).
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
#: The trainer pool's limit on warm workers (`training.pool_protocol.MAX_WARM_WORKERS`).
MAX_HYBRIDS = 32
#: Warm workers when a plan does not say (`ehp.max_hybrids`).
DEFAULT_MAX_HYBRIDS = 5
#: The plan key of each planner policy field (a policy the planner refuses names its plan key).
_POLICY_KEYS = {
    "rollout_reserve": "rollout.reserve",
    "replica_size": "ehp.replica_size",
    "allowed_engine_tps": "rollout.allowed_tp",
    "borrow_threshold": "ehp.borrow_threshold",
    "release_threshold": "ehp.release_threshold",
    "cooldown_s": "ehp.cooldown_s",
    "engine_restart_s": "ehp.engine_restart_cost_s",
    "release_resume_s": "ehp.release_resume_cost_s",
    "max_hybrids": "ehp.max_hybrids",
    "min_hybrids": "ehp.min_hybrids",
}

_DEADLINE_STATES = {
    "rollout_engine": ("starting", "installing", "updating", "draining", "stopping"),
    "hybrid_replica": ("requested", "allocated", "launching", "loading", "ready", "leaving"),
    "training_step": ("computing",),
}
_DEFAULT_DEADLINES = {
    "rollout_engine": {
        "starting": 120.0,
        "installing": 60.0,
        "updating": 60.0,
        "draining": 30.0,
        "stopping": 30.0,
    },
    "hybrid_replica": {
        "requested": 30.0,
        "allocated": 30.0,
        "launching": 60.0,
        "loading": 60.0,
        "ready": 120.0,
        "leaving": 30.0,
    },
    "training_step": {"computing": 300.0},
}


def _gpu_ids(r: _Reader, raw: list[Any]) -> tuple[str, ...]:
    if not all(isinstance(g, str) and g for g in raw):
        raise r.err(
            "gpus",
            f"expected a list of GPU ids (strings), got {raw!r}",
            'write them as strings, e.g. gpus = ["h0:g0", "h0:g1"]',
        )
    return tuple(raw)


def _host_gpus(r: _Reader) -> tuple[str, ...]:
    hid = r.get("id", str)
    if (problem := host_id_problem(hid)) is not None:
        raise r.err("id", problem, 'name the host with letters, digits, "-" or "_", e.g. id = "h0"')
    raw = r.get("gpus", (int, list))
    if isinstance(raw, int):
        if not 1 <= raw <= MAX_GPUS_PER_HOST:
            raise r.err(
                "gpus",
                f"a host has 1..{MAX_GPUS_PER_HOST} GPUs, got {raw}",
                "give the host's GPU count, e.g. gpus = 8",
            )
        return tuple(f"{hid}:g{i}" for i in range(raw))
    if not raw:
        raise r.err(
            "gpus",
            "expected a GPU count or a list of GPU ids",
            'give a count (gpus = 8) or the ids (gpus = ["h0:g0", ...])',
        )
    if len(raw) > MAX_GPUS_PER_HOST:
        raise r.err(
            "gpus",
            f"a host has 1..{MAX_GPUS_PER_HOST} GPUs, got {len(raw)}",
            f"list at most {MAX_GPUS_PER_HOST} GPUs, or split the machine into hosts",
        )
    gpus = _gpu_ids(r, raw)
    # A host's agent names its devices `ID:g0`, `ID:g1`, ... (CUDA device k, or CPU slot k of
    # the `--slots N` the run starts it with): an engine on any other id was refused by the
    # agent at its launch ("unknown_gpus"), after `check` had passed the plan.
    device, n = r.doc.get("device", "cpu"), len(gpus)
    for g in gpus:
        k = g.removeprefix(f"{hid}:g")
        ok = k != g and len(k) <= 5 and k.isascii() and k.isdigit() and str(int(k)) == k
        if not ok or (device == "cpu" and int(k) >= n):
            names = (
                f"its {n} CPU slot{'s' if n > 1 else ''} {hid}:g0..{hid}:g{n - 1}"
                if device == "cpu"
                else f"CUDA device k {hid}:gk ({hid}:g0, {hid}:g1, ...)"
            )
            raise r.err(
                "gpus",
                f"GPU id {g[:80]!r} is not one the host's agent has: it names {names}",
                f"write gpus = {n}, or list ids of that form",
            )
    return gpus


def _message_bytes(tr: _Reader) -> int:
    value: int = tr.get("max_message_bytes", int, 1 << 20)
    if not MIN_MESSAGE_BYTES <= value <= MAX_MESSAGE_BYTES:
        raise tr.err(
            "max_message_bytes",
            f"must be within {MIN_MESSAGE_BYTES}..{MAX_MESSAGE_BYTES} bytes, got {value}",
            "the control plane's smallest frame limit is 1024 bytes; the default is 1048576",
        )
    return value


def parse_plan(doc: _Doc, *, file: str = "") -> Plan:
    """Validate a parsed TOML document into a `Plan` or raise `PlanError` with the key path."""
    root = _Reader(doc, "", file)
    run = root.table("run")
    name = run.get("name", str, "plan")
    if "\x00" in name:  # the default log's folder is named after the plan
        raise run.err("name", f"{name[:80]!r} holds a NUL byte", "name the plan without it")
    # ... and simulate's `runs/<name>-sim`: "/" made that the file system's root `/-sim`,
    # "" made the log `runs//transitions.jsonl` and the output `runs/-sim`
    if not name.strip() or "/" in name or name in (".", "..") or not name.isprintable():
        raise run.err(
            "name",
            f"{name[:80]!r} cannot name the plan's folders (`runs/<name>/`, `runs/<name>-sim/`)",
            'name the plan with printable characters and no "/", e.g. name = "my-run"',
        )
    seed = run.get("seed", int, 0)
    if not 0 <= seed <= MAX_SEED:
        raise run.err(
            "seed", f"must be within 0..{MAX_SEED}, got {seed}", "pick a seed in that range"
        )
    log = run.fs_path("log", f"runs/{name}/transitions.jsonl")
    revisions = run.fs_path("revisions", None)
    samples = run.get("samples", bool, False)
    run.done()

    hosts: list[Host] = []
    owner_of: dict[str, str] = {}
    gpus_of: dict[str, tuple[str, ...]] = {}  # host id → its GPUs
    host_readers = root.tables("hosts")
    if not host_readers:
        raise root.err(
            "hosts",
            "a plan needs at least one [[hosts]] entry",
            'add one: [[hosts]] id = "h0" gpus = 2 (see examples/local.toml)',
        )
    for hr in host_readers:
        gpus = _host_gpus(hr)
        device = hr.get("device", str, "cpu")
        if device not in ("cpu", "cuda"):
            raise hr.err(
                "device",
                f"must be 'cpu' or 'cuda', got {device!r}",
                'set device = "cpu" or "cuda" (default "cpu")',
            )
        hr.done()
        if hr.doc["id"] in gpus_of:
            raise hr.err(
                "id", f"host id {hr.doc['id']!r} is used twice", "give each [[hosts]] its own id"
            )
        seen: set[str] = set()
        for g in gpus:
            if g in seen:  # else said to be "listed by two hosts"
                raise hr.err(
                    "gpus",
                    f"GPU {g} is listed twice by host {hr.doc['id']!r}",
                    "list each GPU once",
                )
            seen.add(g)
            if g in owner_of:
                raise hr.err(
                    "gpus", f"GPU {g} is listed by two hosts", "list each GPU under its one host"
                )
            owner_of[g] = ""
        hosts.append(Host(id=hr.doc["id"], gpus=gpus, device=device))
        gpus_of[hr.doc["id"]] = gpus
    host_of = {g: h.id for h in hosts for g in h.gpus}

    def claim(reader: _Reader, key: str, gpus: tuple[str, ...], who: str) -> None:
        for g in gpus:
            if g not in host_of:
                raise reader.err(
                    key, f"GPU {g} is not on any host", f"use one of {sorted(host_of)[:8]}..."
                )
            if owner_of[g]:
                raise reader.err(
                    key,
                    f"GPU {g} is used twice: by {owner_of[g]} and by {who}",
                    "give each GPU one owner (the Core or one engine)",
                )
            owner_of[g] = who

    cr = root.table("core")
    backend = cr.get("backend", str, "torch")
    if backend not in ("torch", "megatron"):
        raise cr.err(
            "backend",
            f"must be 'torch' or 'megatron', got {backend!r}",
            'set backend = "torch" (default) or "megatron"',
        )
    tp, pp, cp = cr.positive("tp", 1), cr.positive("pp", 1), cr.positive("cp", 1)
    dp = cr.positive("dp", 1)
    core_gpus = _gpu_ids(cr, cr.get("gpus", list))
    if len(core_gpus) != tp * pp * cp * dp:
        raise cr.err(
            "gpus",
            f"Core TP{tp}×PP{pp}×CP{cp}×DP{dp} needs {tp * pp * cp * dp} GPUs, "
            f"got {len(core_gpus)}",
            f"list {tp * pp * cp * dp} GPUs in [core] gpus, or change tp/pp/cp/dp",
        )
    claim(cr, "gpus", core_gpus, "core")
    lane = tp * pp * cp
    for i in range(dp):  # DP rank i trains on gpus[i*lane : (i+1)*lane], one host's devices
        lane_hosts = list(dict.fromkeys(host_of[g] for g in core_gpus[i * lane : (i + 1) * lane]))
        if len(lane_hosts) > 1:
            raise cr.err(
                "gpus",
                f"Core lane {i} (core:{i}: devices {list(core_gpus[i * lane : (i + 1) * lane])}) "
                f"spans hosts {lane_hosts}; a lane's {lane} devices must be on one host",
                f"list the Core's devices lane by lane, {lane} of one host for each of the "
                f"{dp} lanes",
            )
    cr.done()
    core = CoreLayout(backend=backend, tp=tp, pp=pp, cp=cp, dp=dp, gpus=core_gpus)

    engines: list[EngineSpec] = []
    engine_ids: set[str] = set()
    for er in root.tables("engines"):
        eid = er.get("id", str)
        if (problem := engine_id_problem(eid)) is not None:
            raise er.err(
                "id", problem, 'name the engine with letters, digits, "-" or "_", e.g. id = "e0"'
            )
        if eid in engine_ids:
            raise er.err(
                "id", f"engine id {eid!r} is used twice", "give each [[engines]] its own id"
            )
        engine_ids.add(eid)
        host = er.get("host", str)
        if host not in gpus_of:
            raise er.err(
                "host",
                f"host {host!r} is not declared in [[hosts]]",
                f"use one of {sorted(gpus_of)[:8]}, or declare it",
            )
        etp = er.positive("tp")
        host_gpus = gpus_of[host]
        if etp > len(host_gpus):
            raise er.err(
                "tp",
                f"TP{etp} exceeds host {host}'s {len(host_gpus)} GPUs",
                "an engine never spans hosts: lower tp, or give the host more GPUs",
            )
        raw = er.get("gpus", list, None)
        if raw is None:
            free = [g for g in host_gpus if not owner_of[g]]
            if len(free) < etp:
                raise er.err(
                    "gpus",
                    f"host {host} has only {len(free)} unused GPUs for TP{etp}",
                    "lower tp, or move this engine (or another owner) to another host",
                )
            gpus = tuple(free[:etp])
        else:
            gpus = _gpu_ids(er, raw)
            if len(gpus) != etp:
                raise er.err(
                    "gpus",
                    f"a TP{etp} engine needs {etp} GPUs, got {len(gpus)}",
                    f"list {etp} GPUs, or set tp = {len(gpus)}",
                )
            for g in gpus:
                if host_of.get(g, host) != host:
                    raise er.err(
                        "gpus",
                        f"GPU {g} is on host {host_of[g]}, not {host}: an engine never spans hosts",
                        f"list GPUs of host {host} only",
                    )
        claim(er, "gpus", gpus, f"engine {eid}")
        ebackend = er.get("backend", str, "embedded")
        if ebackend not in ("embedded", "sglang"):
            raise er.err(
                "backend",
                f"must be 'embedded' or 'sglang', got {ebackend!r}",
                'set backend = "embedded" (default) or "sglang"',
            )
        er.done()
        engines.append(EngineSpec(id=eid, host=host, tp=etp, gpus=gpus, backend=ebackend))
    if not engines:
        raise root.err(
            "engines",
            "a plan needs at least one [[engines]] entry",
            'add one: [[engines]] id = "e0" host = "h0" tp = 1 (see examples/local.toml)',
        )
    sglang = _sglang(root, engines)

    rr = root.table("rollout")
    rollout_gpus = sum(e.tp for e in engines)
    reserve = rr.get("reserve", int, 1)
    if not 0 <= reserve <= rollout_gpus:
        raise rr.err(
            "reserve",
            f"reserve {reserve} must be within the {rollout_gpus} rollout GPUs",
            f"set reserve to 0..{rollout_gpus}: the GPUs that keep serving rollout (default 1)",
        )
    allowed = tuple(rr.get("allowed_tp", list, sorted({e.tp for e in engines})))
    if not allowed or not all(type(t) is int and t >= 1 for t in allowed):
        raise rr.err(
            "allowed_tp",
            f"expected positive integers, got {list(allowed)}",
            "list the TPs a returned engine may restart with, e.g. allowed_tp = [1, 2]",
        )
    # A returned engine is started on one host's devices outside the Core (an engine never
    # spans hosts): a TP larger than every host's such devices is never started, and was
    # accepted (`[1, 1099511627776]`, `[3]` on hosts of 2) and shown as a restart TP.
    room = max(sum(g not in core.gpus for g in h.gpus) for h in hosts)
    if (big := max(allowed)) > room:
        usable = sorted({t for t in allowed if t <= room} | {e.tp for e in engines})
        raise rr.err(
            "allowed_tp",
            f"TP{str(big)[:20]} fits on no host: an "
            f"engine is restarted on the devices of one host outside the Core, and no host has "
            f"more than {room}",
            f"list TPs within 1..{room}, e.g. allowed_tp = {usable}",
        )
    rr.done()

    gr = root.table("grpo")
    prompts = gr.positive(
        "prompts_per_step",
        maximum=MAX_PROMPTS_PER_STEP,
        past_max=(
            f"groups a step is past the largest {MAX_PROMPTS_PER_STEP:,}: every group of a step "
            "is a request the run creates, logs and holds as the step begins (10,000,000 wrote "
            "5.9 GB of log before the first sample), and real recipes use tens to a few "
            "thousand",
            f"set prompts_per_step within 1..{MAX_PROMPTS_PER_STEP} (e.g. 512 prompts of a "
            "group of 16 samples each)",
        ),
    )
    group = gr.positive(
        "group_size",
        maximum=MAX_GROUP_SIZE,
        past_max=(
            f"samples a group is past the largest {MAX_GROUP_SIZE:,}: a group's samples are "
            "generated, held and scored together (GRPO normalises inside a group), and real "
            "groups are 4 to 64 samples, 1024 at most",
            f"set group_size within 2..{MAX_GROUP_SIZE} (4 to 64 is usual)",
        ),
    )
    if group < 2:
        raise gr.err(
            "group_size",
            "a group of 1 sample trains nothing: a GRPO advantage is the reward minus its own "
            "group's mean (`training.grpo.group_advantages`, the only advantage the run has), "
            "so every sample's advantage, and the policy gradient, is 0",
            "sample several answers per prompt: set group_size = 2 or more (4 to 16 is usual)",
        )
    if prompts * group > MAX_GLOBAL_BATCH:
        raise gr.err(
            "group_size",
            f"{prompts} prompts × {group} samples exceed the largest global batch "
            f"{MAX_GLOBAL_BATCH}",
            "use fewer prompts per step or a smaller group",
        )
    batch = gr.get("global_batch", int, prompts * group)
    if batch % group or batch // group != prompts:
        raise gr.err(
            "global_batch",
            f"global batch {batch} is not {prompts} whole groups of {group}",
            f"set global_batch = {prompts * group}",
        )
    aggregation = gr.get("loss_aggregation", str, "token_mean")
    if aggregation not in AGGREGATIONS:
        raise gr.err(
            "loss_aggregation",
            f"{aggregation!r} is not one of {list(AGGREGATIONS)}",
            f"set loss_aggregation to one of them (default {'token_mean'!r})",
        )
    grpo = Grpo(
        prompts_per_step=prompts,
        group_size=group,
        steps=gr.positive("steps"),
        max_staleness=gr.get("max_staleness", int, 1),
        learning_rate=gr.number("learning_rate", 1e-3),
        temperature=gr.number("temperature", 1.0, minimum=1e-6),
        clip_low=gr.number("clip_low", 0.2),
        clip_high=gr.number("clip_high", 0.28),
        kl_coef=gr.number("kl_coef", 0.0),
        loss_aggregation=aggregation,
    )
    if grpo.prompts_per_step < dp:  # `check` said valid; every step's partition refused it
        raise gr.err(
            "prompts_per_step",
            f"{grpo.prompts_per_step} groups a step cannot give each of the Core's {dp} data-"
            "parallel replicas a group (a replica trains whole groups)",
            f"set prompts_per_step to at least {dp}, or lower [core] dp",
        )
    if not 0 <= grpo.max_staleness <= MAX_COUNT:
        raise gr.err(
            "max_staleness",
            f"must be within 0..{MAX_COUNT}, got {grpo.max_staleness}",
            "set max_staleness to the revisions a group may lag the trainer (default 1)",
        )
    if grpo.clip_low >= 1.0:
        raise gr.err(
            "clip_low",
            f"{grpo.clip_low} must be below 1 (the bound is 1 − clip_low)",
            "set clip_low in [0, 1), e.g. 0.2",
        )
    if grpo.learning_rate <= 0.0:  # passed `check`; `run` ended in Adam's ValueError
        raise gr.err(
            "learning_rate",
            f"must be above 0, got {grpo.learning_rate:g}: Adam refuses a step size of 0",
            "set a positive learning_rate, e.g. 1e-6",
        )
    gr.done()

    base = Path(file).resolve().parent if file else Path.cwd()
    model = _model(root, base)
    data = None
    if "data" in root.doc:
        raw = root.table("data").doc  # a table, or refused with its key
        if "max_prompt_len" in raw:  # DataConfig's own field, filled from [model] in a plan
            raise PlanError(
                "data.max_prompt_len",
                "a plan's prompt limit is the model's: [data] would be overridden by it",
                "set [model] max_prompt_len instead",
                path=file,
            )
        train = raw.get("train")
        if isinstance(train, str) and (problem := plan_path_problem(train)) is not None:
            raise PlanError(  # (DataConfig refuses the rest: `fspaths.path_problem`)
                "data.train", problem, 'name a JSONL file: train = "x.jsonl"', path=file
            )
        data = DataConfig.from_table({"seed": seed, **raw}, base_dir=base, file=file)
    if data is not None and model is not None and data.max_prompt_len != model.max_prompt_len:
        data = replace(data, max_prompt_len=model.max_prompt_len)
    wr = root.table("reward")
    reward = RewardSpec(
        function=wr.get("function", str, "exact_match"),
        on_error=wr.get("on_error", str, "raise"),
        timeout_s=wr.number("timeout_s", 60.0, minimum=0.001, maximum=86400.0),
    )
    if reward.on_error not in ("raise", "zero"):
        raise wr.err(
            "on_error",
            f"{reward.on_error!r} is not 'raise' or 'zero'",
            'set on_error = "raise" (default: stop the run) or "zero" (score 0, counted)',
        )
    wr.done()

    xr = root.table("ehp")
    replica_size = xr.positive("replica_size", core.replica_gpus)
    if replica_size != core.replica_gpus:
        raise xr.err(
            "replica_size",
            f"a Hybrid replica has the Core replica shape "
            f"TP{tp}×PP{pp}×CP{cp} = {core.replica_gpus} GPUs, "
            f"got {replica_size}",
            f"set replica_size = {core.replica_gpus}",
        )
    borrow = xr.number("borrow_threshold", 1.5)
    release = xr.number("release_threshold", 0.8)
    if release >= borrow:
        raise xr.err(
            "release_threshold",
            f"release threshold {release} must be below the borrow threshold {borrow} (hysteresis)",
            "lower release_threshold (default 0.8) or raise borrow_threshold (default 1.5)",
        )
    ehp = EhpPolicy(
        enabled=xr.get("enabled", bool, True),
        replica_size=replica_size,
        borrow_threshold=borrow,
        release_threshold=release,
        cooldown_s=xr.number("cooldown_s", 10.0),
        max_hybrids=xr.get("max_hybrids", int, DEFAULT_MAX_HYBRIDS),
        engine_restart_cost_s=xr.number("engine_restart_cost_s", 60.0),
        release_resume_cost_s=xr.number("release_resume_cost_s", 5.0),
        min_hybrids=xr.get("min_hybrids", int, 0),
    )
    if ehp.enabled and ehp.max_hybrids == 0:
        raise xr.err(
            "max_hybrids",
            "EHP is on (`enabled = true`) but may start no Hybrid replica (`max_hybrids = 0`): "
            "it could never borrow a GPU",
            "set enabled = false to train on the Core alone, or max_hybrids = 1 or more",
        )
    low = 1 if ehp.enabled else 0
    if not low <= ehp.max_hybrids <= MAX_HYBRIDS:
        # (with EHP off too: -3 and 10**30 passed as a setting nothing would read)
        raise xr.err(
            "max_hybrids",
            f"{str(ehp.max_hybrids)[:40]} is outside {low}..{MAX_HYBRIDS}: the trainer pool keeps "
            "one warm worker process per Hybrid, all in one Gloo world",
            f"set max_hybrids between 1 and {MAX_HYBRIDS}"
            + (" (or enabled = false)" if ehp.enabled else " (or 0, or leave it out, EHP off)"),
        )
    # (range-checked with EHP off too, as max_hybrids is: the planner reads neither then)
    if not 0 <= ehp.min_hybrids <= ehp.max_hybrids:
        raise xr.err(
            "min_hybrids",
            f"{str(ehp.min_hybrids)[:40]} is outside 0..max_hybrids ({ehp.max_hybrids})",
            f"set min_hybrids between 0 and {ehp.max_hybrids}",
        )
    if ehp.release_resume_cost_s > ehp.engine_restart_cost_s:
        raise xr.err(
            "release_resume_cost_s",
            f"{ehp.release_resume_cost_s} s exceeds "
            f"engine_restart_cost_s {ehp.engine_restart_cost_s} s",
            "a release/resume is the cheap path; check the two costs",
        )
    xr.done()

    dr = root.table("deadlines")
    deadlines: dict[str, dict[str, float]] = {}
    for machine, states in _DEADLINE_STATES.items():
        mr = dr.table(machine)
        deadlines[machine] = {
            s: mr.number(s, _DEFAULT_DEADLINES[machine][s], minimum=0.001) for s in states
        }
        mr.done()
    rd = dr.table("run")
    defaults = RunDeadlines()
    run_deadlines = RunDeadlines(
        **{
            k: rd.number(k, getattr(defaults, k), minimum=0.001)
            for k in ("agents_connect", "rollout", "generate", "health", "trainers_start")
        }
    )
    if run_deadlines.health < SGLANG_HEALTH_S and any(e.backend == "sglang" for e in engines):
        raise rd.err(
            "health",
            f"{run_deadlines.health:g} s is shorter than a healthy SGLang engine takes to answer "
            "/health: SGLang's /health is a one-token generation answered no sooner than 1 s "
            "after the request, then on a once-a-second check (every probe would time out, "
            "and the engine be failed)",
            f"set health = {SGLANG_HEALTH_S:g} or more (default {RunDeadlines().health:g})",
        )
    rd.done()
    dr.done()

    tr = root.table("transport")
    controller = tr.get("controller", str, "tcp://127.0.0.1:5555")
    allow = tr.get("allow_non_loopback", bool, False)
    if (problem := endpoint_problem(controller)) is not None:
        raise tr.err(
            "controller",
            f"{controller[:80]!r} cannot be the controller's endpoint: {problem}",
            "give a shorter ipc:// path (e.g. under /tmp), or a tcp:// address"
            if controller.startswith("ipc://")
            else 'write e.g. controller = "tcp://127.0.0.1:5555" (or :* for any free port)',
        )
    if not allow and not is_loopback_endpoint(controller):
        raise tr.err(
            "controller",
            f"{controller} is not a loopback address",
            "bind to 127.0.0.1, or set allow_non_loopback = true with curve_keys",
        )
    keys = tr.fs_path("curve_keys", None)
    if keys is not None:  # an input, as the model and data: relative to the plan's folder
        keys = str(base / keys) if not Path(keys).is_absolute() else keys
    # "local" unless the plan gives keys: without CURVE a local process that reaches the
    # loopback port first holds a host's agent id, and with it the engines' API key, the
    # launch tokens and every prompt (an agent's hello carries no secret)
    curve = tr.get("curve", str, "off" if keys is not None or allow else "local")
    if curve not in ("off", "local"):
        raise tr.err(
            "curve",
            f"must be 'off' or 'local', got {curve!r}",
            'set curve = "local" (the default on loopback) or "off"; across machines give '
            "curve_keys",
        )
    if curve == "local" and (keys is not None or allow):
        raise tr.err(
            "curve",
            "local keys are made by the run for the agents it starts on this machine",
            "drop curve = 'local' and give curve_keys = DIR for a multi-host control plane",
        )
    if allow and keys is None:
        raise tr.err(
            "curve_keys",
            "a non-loopback control plane needs CURVE keys",
            "run `ehp-fsm keys DIR` and set curve_keys = DIR",
        )
    transport = Transport(
        controller=controller,
        allow_non_loopback=allow,
        curve_keys=keys,
        max_message_bytes=_message_bytes(tr),
        heartbeat_s=tr.number("heartbeat_s", 1.0, minimum=0.01, maximum=MAX_HEARTBEAT_S),
        curve=curve,
    )
    tr.done()
    simulate = _simulate(root, base, model, ehp)
    root.done()
    plan = Plan(
        name=name,
        seed=seed,
        log=log,
        hosts=tuple(hosts),
        core=core,
        engines=tuple(engines),
        rollout=Rollout(reserve=reserve, allowed_tp=allowed),
        grpo=grpo,
        ehp=ehp,
        deadlines=deadlines,
        transport=transport,
        model=model,
        data=data,
        reward=reward,
        revisions=revisions,
        samples=samples,
        run_deadlines=run_deadlines,
        sglang=sglang,
        simulate=simulate,
        source=file,
    )
    try:  # the planner's own checks, named by plan key: `check` then says what `run` would
        plan.planner_policy()
    except PlannerInputError as exc:
        field = exc.field.removeprefix("policy.")
        raise PlanError(_POLICY_KEYS.get(field, field), exc.why, exc.fix, path=file) from None
    return plan


def _sglang(root: _Reader, engines: list[EngineSpec]) -> SGLangSpec:
    """`[sglang] args`: strings, none that the launcher sets itself, and only when an engine is
    an SGLang engine (otherwise nothing would use them)."""
    if "sglang" not in root.doc:
        return SGLangSpec()
    sr = root.table("sglang")
    args = sr.get("args", list, [])
    refusal = extra_args_refusal(args)
    if refusal is not None:
        raise sr.err("args", *refusal)
    sr.done()
    if args and not any(e.backend == "sglang" for e in engines):
        raise sr.err(
            "args",
            "no engine has backend = 'sglang': nothing would be launched with them",
            "drop [sglang] or set backend = 'sglang' on the engines",
        )
    return SGLangSpec(args=tuple(args))


#: What `[model] generate` may name (the architectures `ehp-fsm init-model` writes).
GENERATED_ARCHS = ("qwen3", "llama")


def _model(root: _Reader, base: Path) -> ModelSpec | None:
    if "model" not in root.doc:
        return None
    mr = root.table("model")
    raw = Path(mr.fs_path("path"))
    try:
        path = raw if raw.is_absolute() else (base / raw).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop on the way
        raise mr.err(
            "path", f"{base / raw} cannot be resolved ({exc})", "point it at a real folder"
        ) from None
    generate = mr.get("generate", str, None)
    if generate is not None and generate not in GENERATED_ARCHS:
        raise mr.err(
            "generate",
            f"{generate!r} is not one of {list(GENERATED_ARCHS)}",
            "set generate to one of them, or drop it and point path at your model",
        )
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # no permission to look, a name the OS refuses
        raise mr.err(
            "path",
            f"{path} cannot be looked at ({exc.strerror})",
            "point it at a folder you can read",
        ) from None
    if generate is None and not is_dir:
        raise mr.err(
            "path",
            f"{path} is not a directory",
            'point at a Hugging Face model directory, or add generate = "qwen3" to have '
            "`ehp-fsm run` write a tiny one there",
        )
    dtype = mr.get("dtype", str, "float32")
    if dtype not in DTYPE_NAMES:
        raise mr.err(
            "dtype",
            f"{dtype!r} is not one of {list(DTYPE_NAMES)}",
            'set dtype to one of them (default "float32")',
        )
    spec = ModelSpec(
        path=str(path),
        generate=generate,
        dtype=dtype,
        max_prompt_len=mr.positive("max_prompt_len", 256),
        max_response_len=mr.positive("max_response_len", 256),
    )
    mr.done()
    return spec


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file."""
    p = Path(path)
    try:
        with p.open("rb") as fh:  # at most a bound: `check /dev/zero` filled the memory
            raw = fh.read(MAX_PLAN_BYTES + 1)
        if len(raw) > MAX_PLAN_BYTES:
            raise PlanError(
                "<file>",
                f"{p} holds more than {MAX_PLAN_BYTES} bytes, more than any plan",
                "give the plan's TOML file",
                path=str(p),
            )
        # as read_text; -sig: a byte-order mark, as Windows editors save one, is no part of
        # the plan (it was "not valid TOML (Invalid statement (at line 1, column 1))")
        text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8-sig").read()
    except OSError as exc:
        raise PlanError(
            "<file>",
            f"it cannot be read ({exc.strerror})",
            "check the path: give a plan's TOML file, one this user may read",
            path=str(p),
        ) from None
    except UnicodeDecodeError as exc:
        raise PlanError(
            "<file>", f"it is not UTF-8 text ({exc.reason})", "save it as UTF-8", path=str(p)
        ) from None
    except ValueError:  # the OS takes no path with a NUL byte
        raise PlanError(
            "<file>", f"{str(p)[:80]!r} holds a NUL byte", "check the path", path=str(p)
        ) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(
            "<toml>", f"it is not valid TOML ({exc})", "fix the syntax", path=str(p)
        ) from None
    except RecursionError:
        raise PlanError(
            "<toml>",
            "it nests arrays or tables too deeply to read",
            "a plan nests at most a few levels: fix the file",
            path=str(p),
        ) from None
    return parse_plan(doc, file=str(p))
