"""Benchmark: what stop strings cost the embedded engine per generated token.

Workload: one request of `--tokens` output tokens (`ignore_eos`, seeded, temperature 1) on the
tiny Qwen3 model (`ehp_fsm.models.tiny`, its context raised to fit), in-process
(`EngineCore`), run three ways, interleaved, `--repeat` times each:

- baseline: no stop strings (the ratio's denominator);
- one stop string that never matches (`"#"` is outside the tiny vocabulary): every token is
  checked against it;
- `MAX_STOP_STRINGS` stop strings of 1–8 characters, none of which can match.

The stop check once decoded the whole output every token (quadratic in the output: 3,000
tokens took 4.8–6.2 s against 3.5–4.1 s without stop strings); it now decodes a bounded tail
(`rollout.stop_strings`). The table shows the best and the median of each and the ratio of
medians against the baseline measured in the same run.

    .venv/bin/python benchmarks/stop_strings.py [--tokens 3000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ehp_fsm.models.tiny import init_model
from ehp_fsm.rollout.engine import MAX_STOP_STRINGS, EngineCore, SamplingParams

PROMPT = [1, 4, 5, 13, 6, 16]  # "12+3=" under the tiny tokenizer, BOS first


def one_run(core: EngineCore, tokens: int, stop: tuple[str, ...]) -> float:
    params = SamplingParams(
        max_new_tokens=tokens, ignore_eos=True, temperature=1.0, sampling_seed=7, stop=stop
    )
    t0 = time.perf_counter()
    result = core.submit(input_ids=PROMPT, params=params).result(timeout=600)
    took = time.perf_counter() - t0
    got = result["meta_info"]["completion_tokens"]
    assert got == tokens, f"the request stopped after {got} of {tokens} tokens"
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    many = tuple("#" * (1 + i % 8) + str(i) for i in range(MAX_STOP_STRINGS))
    contenders = {"no stop strings": (), "1 stop string": ("#",), f"{len(many)} stop strings": many}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "tiny", seed=0)
        core = EngineCore(context_length=args.tokens + len(PROMPT) + 1)
        try:
            ok, message, _ = core.update_weights_from_disk(str(model))
            assert ok, message
            one_run(core, 50, ())  # warm-up
            for _ in range(args.repeat):
                for name, stop in contenders.items():
                    times[name].append(one_run(core, args.tokens, stop))
        finally:
            core.shutdown()
    base = statistics.median(times["no stop strings"])
    print(f"{args.tokens} output tokens, {args.repeat} runs each (seconds)")
    print(f"{'':>18} {'best':>7} {'median':>7} {'ratio':>6}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>18} {min(ts):7.2f} {med:7.2f} {med / base:6.2f}")


if __name__ == "__main__":
    main()
