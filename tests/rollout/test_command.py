"""The engine command line (`engine_command.engine_argv`) against the option names of the SGLang
version the `sglang` extra pins, and the embedded engine's side of the same launch contract.

Pure and fast: no process is started (the launch tests in `test_launch.py` start one)."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from ehp_fsm.engine_command import (
    MODULES,
    EngineCommand,
    EngineLaunchConfig,
    engine_argv,
    engine_env,
    extra_args_problem,
)
from ehp_fsm.rollout import launch, server

ROOT = Path(__file__).resolve().parents[2]

#: The `--option` names `sglang.launch_server` accepts in sglang 0.5.3 (the extra's floor):
#: every `parser.add_argument` name in `ServerArgs.add_cli_args`, file
#: `python/sglang/srt/server_args.py` of the `sglang-0.5.3-py3-none-any.whl` on PyPI, copied
#: with `ast` (254 names, aliases included). 0.5.3 is the first release with all of what the run
#: uses: `--weight-version` (0.5.1), `/pause_generation` (0.4.9), `sampling_seed` in the sampling
#: params the dispatcher sends, and `--enable-deterministic-inference` (both 0.5.3).
SGLANG_0_5_3_OPTIONS = frozenset(
    [
        "--allow-auto-truncate",
        "--api-key",
        "--attention-backend",
        "--base-gpu-id",
        "--bucket-e2e-request-latency",
        "--bucket-inter-token-latency",
        "--bucket-time-to-first-token",
        "--chat-template",
        "--chunked-prefill-size",
        "--collect-tokens-histogram",
        "--completion-template",
        "--config",
        "--constrained-json-whitespace-pattern",
        "--context-length",
        "--cpu-offload-gb",
        "--crash-dump-folder",
        "--cuda-graph-bs",
        "--cuda-graph-max-bs",
        "--custom-weight-loader",
        "--data-parallel-size",
        "--debug-tensor-dump-inject",
        "--debug-tensor-dump-input-file",
        "--debug-tensor-dump-output-folder",
        "--debug-tensor-dump-prefill-only",
        "--decode-attention-backend",
        "--decode-log-interval",
        "--deepep-config",
        "--deepep-mode",
        "--delete-ckpt-after-loading",
        "--device",
        "--disable-chunked-prefix-cache",
        "--disable-cuda-graph",
        "--disable-cuda-graph-padding",
        "--disable-custom-all-reduce",
        "--disable-fast-image-processor",
        "--disable-flashinfer-cutlass-moe-fp4-allgather",
        "--disable-hybrid-swa-memory",
        "--disable-outlines-disk-cache",
        "--disable-overlap-schedule",
        "--disable-radix-cache",
        "--disable-shared-experts-fusion",
        "--disaggregation-bootstrap-port",
        "--disaggregation-decode-dp",
        "--disaggregation-decode-enable-offload-kvcache",
        "--disaggregation-decode-polling-interval",
        "--disaggregation-decode-tp",
        "--disaggregation-ib-device",
        "--disaggregation-mode",
        "--disaggregation-prefill-pp",
        "--disaggregation-transfer-backend",
        "--dist-init-addr",
        "--dist-timeout",
        "--download-dir",
        "--dp-size",
        "--ds-channel-config-path",
        "--ds-heavy-channel-num",
        "--ds-heavy-channel-type",
        "--ds-heavy-token-num",
        "--ds-sparse-decode-threshold",
        "--dtype",
        "--dynamic-batch-tokenizer-batch-size",
        "--dynamic-batch-tokenizer-batch-timeout",
        "--enable-cache-report",
        "--enable-cudagraph-gc",
        "--enable-custom-logit-processor",
        "--enable-deepep-moe",
        "--enable-deterministic-inference",
        "--enable-double-sparsity",
        "--enable-dp-attention",
        "--enable-dp-lm-head",
        "--enable-dynamic-batch-tokenizer",
        "--enable-ep-moe",
        "--enable-eplb",
        "--enable-expert-distribution-metrics",
        "--enable-flashinfer-allreduce-fusion",
        "--enable-flashinfer-cutedsl-moe",
        "--enable-flashinfer-cutlass-moe",
        "--enable-flashinfer-mxfp4-moe",
        "--enable-flashinfer-trtllm-moe",
        "--enable-fp32-lm-head",
        "--enable-hierarchical-cache",
        "--enable-lmcache",
        "--enable-lora",
        "--enable-memory-saver",
        "--enable-metrics",
        "--enable-metrics-for-all-schedulers",
        "--enable-mixed-chunk",
        "--enable-mscclpp",
        "--enable-multimodal",
        "--enable-nan-detection",
        "--enable-nccl-nvls",
        "--enable-p2p-check",
        "--enable-pdmux",
        "--enable-priority-scheduling",
        "--enable-profile-cuda-graph",
        "--enable-request-time-stats-logging",
        "--enable-return-hidden-states",
        "--enable-single-batch-overlap",
        "--enable-symm-mem",
        "--enable-tokenizer-batch-encode",
        "--enable-torch-compile",
        "--enable-torch-symm-mem",
        "--enable-trace",
        "--enable-triton-kernel-moe",
        "--enable-two-batch-overlap",
        "--enable-weights-cpu-backup",
        "--ep",
        "--ep-dispatch-algorithm",
        "--ep-num-redundant-experts",
        "--ep-size",
        "--eplb-algorithm",
        "--eplb-min-rebalancing-utilization-threshold",
        "--eplb-rebalance-layers-per-chunk",
        "--eplb-rebalance-num-iterations",
        "--expert-distribution-recorder-buffer-size",
        "--expert-distribution-recorder-mode",
        "--expert-parallel-size",
        "--file-storage-path",
        "--flashinfer-mla-disable-ragged",
        "--flashinfer-mxfp4-moe-precision",
        "--gc-warning-threshold-secs",
        "--generation-tokens-buckets",
        "--gpu-id-step",
        "--grammar-backend",
        "--hicache-io-backend",
        "--hicache-mem-layout",
        "--hicache-ratio",
        "--hicache-size",
        "--hicache-storage-backend",
        "--hicache-storage-backend-extra-config",
        "--hicache-storage-prefetch-policy",
        "--hicache-write-policy",
        "--host",
        "--hybrid-kvcache-ratio",
        "--init-expert-location",
        "--is-embedding",
        "--json-model-override-args",
        "--keep-mm-feature-on-device",
        "--kv-cache-dtype",
        "--kv-events-config",
        "--load-balance-method",
        "--load-format",
        "--load-watch-interval",
        "--log-level",
        "--log-level-http",
        "--log-requests",
        "--log-requests-level",
        "--lora-backend",
        "--lora-paths",
        "--lora-target-modules",
        "--mamba-ssm-dtype",
        "--max-loaded-loras",
        "--max-lora-chunk-size",
        "--max-lora-rank",
        "--max-loras-per-batch",
        "--max-mamba-cache-size",
        "--max-micro-batch-size",
        "--max-prefill-tokens",
        "--max-queued-requests",
        "--max-running-requests",
        "--max-total-tokens",
        "--mem-fraction-static",
        "--mm-attention-backend",
        "--model",
        "--model-impl",
        "--model-loader-extra-config",
        "--model-path",
        "--moe-a2a-backend",
        "--moe-dense-tp-size",
        "--moe-runner-backend",
        "--nccl-init-addr",
        "--nccl-port",
        "--nnodes",
        "--node-rank",
        "--nsa-decode",
        "--nsa-prefill",
        "--num-continuous-decode-steps",
        "--num-reserved-decode-tokens",
        "--numa-node",
        "--offload-group-size",
        "--offload-mode",
        "--offload-num-in-group",
        "--offload-prefetch-step",
        "--oltp-traces-endpoint",
        "--page-size",
        "--pipeline-parallel-size",
        "--port",
        "--pp-size",
        "--preferred-sampling-params",
        "--prefill-attention-backend",
        "--prefill-round-robin-balance",
        "--priority-scheduling-preemption-threshold",
        "--prompt-tokens-buckets",
        "--quantization",
        "--quantization-param-path",
        "--radix-eviction-policy",
        "--random-seed",
        "--reasoning-parser",
        "--remote-instance-weight-loader-seed-instance-ip",
        "--remote-instance-weight-loader-seed-instance-service-port",
        "--remote-instance-weight-loader-send-weights-group-ports",
        "--revision",
        "--sampling-backend",
        "--schedule-conservativeness",
        "--schedule-low-priority-values-first",
        "--schedule-policy",
        "--scheduler-recv-interval",
        "--served-model-name",
        "--show-time-cost",
        "--skip-server-warmup",
        "--skip-tokenizer-init",
        "--sleep-on-idle",
        "--sm-group-num",
        "--speculative-accept-threshold-acc",
        "--speculative-accept-threshold-single",
        "--speculative-algorithm",
        "--speculative-attention-mode",
        "--speculative-draft-model",
        "--speculative-draft-model-path",
        "--speculative-draft-model-revision",
        "--speculative-eagle-topk",
        "--speculative-ngram-branch-length",
        "--speculative-ngram-capacity",
        "--speculative-ngram-match-type",
        "--speculative-ngram-max-bfs-breadth",
        "--speculative-ngram-max-match-window-size",
        "--speculative-ngram-min-bfs-breadth",
        "--speculative-ngram-min-match-window-size",
        "--speculative-num-draft-tokens",
        "--speculative-num-steps",
        "--speculative-token-map",
        "--stream-interval",
        "--stream-output",
        "--swa-full-tokens-ratio",
        "--tbo-token-distribution-threshold",
        "--tensor-parallel-size",
        "--tokenizer-metrics-allowed-custom-labels",
        "--tokenizer-metrics-custom-labels-header",
        "--tokenizer-mode",
        "--tokenizer-path",
        "--tokenizer-worker-num",
        "--tool-call-parser",
        "--tool-server",
        "--torch-compile-max-bs",
        "--torchao-config",
        "--tp-size",
        "--triton-attention-num-kv-splits",
        "--triton-attention-reduce-in-fp32",
        "--triton-attention-split-tile-size",
        "--trust-remote-code",
        "--warmups",
        "--watchdog-timeout",
        "--weight-loader-disable-mmap",
        "--weight-version",
    ]
)

FULL = EngineCommand(
    model_path="/runs/x/revisions/r00000007",
    weight_version="7",
    host="10.0.0.3",
    port=30001,
    tp_size=4,
    memory_saver=True,
    deterministic=True,
    extra_args=("--mem-fraction-static", "0.8", "--chunked-prefill-size=4096"),
)


def _options(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv[3:] if a.startswith("--")]


def test_the_extra_pins_the_version_whose_options_the_test_holds() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["sglang"] == ["sglang>=0.5.3"]
    assert len(SGLANG_0_5_3_OPTIONS) == 254


def test_every_option_built_is_one_sglang_0_5_3_accepts() -> None:
    argv = engine_argv(FULL, backend="sglang", python="/usr/bin/python3")
    assert argv[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    built = _options(argv)
    assert set(built) >= {
        "--model-path",
        "--tp-size",
        "--host",
        "--port",
        "--weight-version",
        "--enable-memory-saver",
        "--enable-deterministic-inference",
    }
    assert set(built) <= SGLANG_0_5_3_OPTIONS, set(built) - SGLANG_0_5_3_OPTIONS
    values = dict(itertools.pairwise(argv))
    assert values["--model-path"] == FULL.model_path
    assert values["--tp-size"] == "4"
    assert values["--port"] == "30001"
    assert values["--weight-version"] == "7"
    assert argv[-3:] == ["--mem-fraction-static", "0.8", "--chunked-prefill-size=4096"]


def test_the_flags_the_run_does_not_need_are_left_out() -> None:
    plain = EngineCommand(model_path="/m", weight_version=None, host="h", port=1)
    options = _options(engine_argv(plain, backend="sglang"))
    assert options == ["--model-path", "--tp-size", "--host", "--port"]


def test_the_embedded_line_differs_only_in_the_module() -> None:
    sglang = engine_argv(FULL, backend="sglang")
    embedded = engine_argv(FULL, backend="embedded")
    assert embedded[2] == MODULES["embedded"] == "ehp_fsm.rollout.server"
    assert embedded[:2] + embedded[3:] == sglang[:2] + sglang[3:]


def test_an_sglang_engine_needs_a_model_path() -> None:
    empty = EngineCommand(model_path=None, weight_version=None, host="h", port=1)
    with pytest.raises(ValueError, match="model path"):
        engine_argv(empty, backend="sglang")
    assert "--model-path" not in engine_argv(empty, backend="embedded")


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--tp-size", "2"], "--tp-size"),
        (["--tensor-parallel-size=2"], "--tp-size"),
        (["--tp", "2"], "--tp-size"),  # argparse would take the prefix
        (["--model", "/other"], "--model-path"),
        (["--weight-version", "9"], "--weight-version"),
        (["--port=1"], "--port"),
        (["--enable-deterministic-inference"], "--enable-deterministic-inference"),
        (["--dp-size", "2"], "GPUs or nodes"),
        (["--base-gpu-id", "3"], "GPUs or nodes"),
        ([3], "not a string"),
        # a user's finds: a YAML of any options, another device, a word that is no option
        (["--config", "/x.yaml"], "reads more options from a file, which nothing checks"),
        (["--config=/x.yaml"], "reads more options from a file"),
        (["--device", "cpu"], "another device than the GPUs the ledger gave it"),
        (["mem-fraction-static", "0.8"], "neither an option (--name) nor the value of one"),
        (["--mem-fraction-static=0.8", "0.8"], "neither an option"),
    ],
)
def test_extra_args_that_collide_with_the_launcher_are_refused(
    args: list[object], why: str
) -> None:
    problem = extra_args_problem(args)
    assert problem is not None and why in problem
    with pytest.raises(ValueError, match=re.escape(why)):
        EngineCommand(model_path="/m", weight_version=None, host="h", port=1, extra_args=args)  # type: ignore[arg-type]


def test_extra_args_that_only_tune_the_engine_pass() -> None:
    tuning = ["--mem-fraction-static", "0.8", "--cuda-graph-max-bs", "64", "--model-impl", "sglang"]
    assert extra_args_problem(tuning) is None
    # a flag, a value given with `=`, and a negative value are options and values too
    assert extra_args_problem(["--enable-torch-compile", "--chunked-prefill-size=-1"]) is None
    assert extra_args_problem(["--chunked-prefill-size", "-1"]) is None
    assert set(_options(["python", "-m", "sglang.launch_server", *tuning])) <= SGLANG_0_5_3_OPTIONS


@pytest.mark.parametrize(
    ("config", "command_line"),
    [
        (
            EngineLaunchConfig(
                backend="sglang",
                revisions="/r",
                extra_args=("--mem-fraction-static", "0.8"),
                deterministic=True,
            ),
            "--engine-backend sglang --revisions /r "
            """--engine-args '["--mem-fraction-static", "0.8"]' --engine-deterministic""",
        ),
        (
            EngineLaunchConfig(revisions="/r", base_model="/m"),
            "--engine-backend embedded --revisions /r --engine-base-model /m",
        ),
        (
            EngineLaunchConfig(api_key_file="/k/engine-api-key"),
            "--engine-backend embedded --engine-api-key-file /k/engine-api-key",
        ),
    ],
)
def test_the_agent_flags_carry_the_launch_config(
    config: EngineLaunchConfig, command_line: str
) -> None:
    assert shlex.join(config.agent_flags()) == command_line


def test_a_launch_config_without_its_revision_store_is_refused() -> None:
    with pytest.raises(ValueError, match="revision store"):
        EngineLaunchConfig(backend="sglang")
    with pytest.raises(ValueError, match="revision store too"):
        EngineLaunchConfig(base_model="/m")


def test_the_api_key_goes_to_sglang_as_its_option_and_to_the_embedded_engine_by_environment() -> (
    None
):
    cmd = dataclasses.replace(FULL, api_key="s3cret")
    sglang = engine_argv(cmd, backend="sglang")
    assert sglang[sglang.index("--api-key") + 1] == "s3cret"  # SGLang takes no other way
    assert "s3cret" not in engine_env(cmd, backend="sglang").values()
    embedded = engine_argv(cmd, backend="embedded")
    assert "--api-key" not in embedded and "s3cret" not in embedded  # `ps` shows argv
    assert engine_env(cmd, backend="embedded") == {"EHP_ENGINE_API_KEY": "s3cret"}
    assert "s3cret" not in repr(cmd)
    with pytest.raises(ValueError, match="api_key is empty"):
        dataclasses.replace(FULL, api_key=" ")
    # the plan cannot set it: the run's key is the launcher's
    assert "launcher sets itself" in (extra_args_problem(["--api-key", "mine"]) or "")


def test_the_embedded_engine_takes_every_option_the_builder_sets() -> None:
    argv = engine_argv(FULL, backend="embedded")
    args, extra = server._parser().parse_known_args(argv[3:])
    assert extra == ["--mem-fraction-static", "0.8", "--chunked-prefill-size=4096"]
    assert (args.model_path, args.tp_size, args.host, args.port) == (
        FULL.model_path,
        4,
        "10.0.0.3",
        30001,
    )
    assert args.weight_version == "7"
    assert args.enable_memory_saver and args.enable_deterministic_inference
    assert set(server.SGLANG_OPTIONS) <= SGLANG_0_5_3_OPTIONS


def test_the_embedded_engine_refuses_the_sglang_options_it_lacks_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = server.main(["--port", "30000", "--mem-fraction-static", "0.8", "--tp=2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "does not support --mem-fraction-static, --tp" in err
    assert "--model-path" in err  # and says what it takes


class _Started(Exception):
    """Raised by the fake `Popen`: the launch got as far as starting the process."""


def test_an_sglang_engine_returns_tempered_logprobs_whatever_the_launcher_exports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # SGLANG_RETURN_ORIGINAL_LOGPROB=1 (RETURN_ORIGINAL_LOGPROB before the rename) makes SGLang
    # sample from softmax(logits / T) but return log softmax(logits): at T ≠ 1 the behaviour
    # log-probs the ratio divides by were not the sampled distribution's. The engine inherited
    # it from the agent's environment; it is now set off in every SGLang engine's.
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    monkeypatch.setenv("RETURN_ORIGINAL_LOGPROB", "true")
    seen: dict[str, str] = {}

    def popen(argv: list[str], **kwargs: object) -> None:
        env = kwargs["env"]
        assert isinstance(env, dict)
        seen.update(env)
        raise _Started

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    with pytest.raises(_Started):
        launch.launch_engine(
            backend="sglang", model_path=tmp_path, port=1, log_path=tmp_path / "engine.log"
        )
    # SGLang's get_bool_env_var: true for "1"/"true", false for "0"/"false"
    assert seen["SGLANG_RETURN_ORIGINAL_LOGPROB"].lower() in ("0", "false")
    assert seen["RETURN_ORIGINAL_LOGPROB"].lower() in ("0", "false")
    assert engine_env(FULL, backend="sglang")["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
