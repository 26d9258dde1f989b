"""Benchmark: peak extra memory of one Megatron-Core optimizer step — automatic foreach vs
per-parameter Adam temporaries (the Megatron path of `adam_temporaries.py`).

Megatron's optimizer factory builds torch AdamW with torch's automatic foreach/fused choice; the
backend turns the automatic choice into per-parameter temporaries (`foreach=False`). torch picks
foreach automatically only when every parameter is on CUDA; on CPU its automatic choice is the
single-tensor loop already. So, as in `adam_temporaries.py`, "automatic foreach" is measured as
an explicit `foreach=True` (exactly what torch runs automatically on a GPU, and what Megatron's
DistributedOptimizer ran there before the backend applied the rule), beside Megatron's optimizer
as built with torch's CPU automatic choice (the rule undone), the backend's default
`AdamConfig()` (per-parameter) and `fused=True`.

Each variant runs in a fresh process: a Gloo world of 1 with the CPU compatibility layer, a
local-spec GPTModel with BF16 parameters, Megatron DDP (FP32 grad buffer) and the
DistributedOptimizer (FP32 master weights). The FP32 grad buffer is filled with a constant and
`optimizer.step()` (Megatron's: torch AdamW on the master shards, then master -> BF16 params)
runs twice; the second step is measured (the first allocates exp_avg/exp_avg_sq). Memory method:
see peak_memory.py.

    python benchmarks/megatron_adam_temporaries.py [--layers 4] [--hidden 768]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peak_memory import peak_extra, run_child

MIB = 2**20
VARIANTS: dict[str, dict[str, bool] | str] = {
    "foreach=True (torch auto on CUDA)": {"foreach": True},
    "Megatron as built (torch auto on CPU)": "undo",
    "ehp AdamConfig() per-parameter": {},
    "fused=True": {"fused": True},
}


def child(variant: str, layers: int, hidden: int) -> dict:
    import socket

    import torch

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.simplefilter("ignore")  # Megatron warns that Apex/TE are missing
    from ehp_fsm.backends.megatron import cpu

    cpu.apply()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from ehp_fsm.backends.megatron import state as st
    from ehp_fsm.backends.megatron.backend import MegatronBackend, MegatronModelConfig
    from ehp_fsm.training.adam import AdamConfig
    from ehp_fsm.training.lane import LaneSpec

    kw = VARIANTS[variant]
    choice = kw if isinstance(kw, dict) else {}
    lane = MegatronBackend(
        MegatronModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8)
    )
    adam = AdamConfig(lr=1e-3, weight_decay=0.01, **choice)
    lane.build(LaneSpec(role="core", replica="core0", param_dtype=torch.bfloat16, adam=adam))
    inner = st.distributed_optimizer(lane.optimizer).optimizer
    if kw == "undo":  # the optimizer exactly as Megatron's factory built it
        for group in inner.param_groups:
            group["foreach"] = None
            group["fused"] = None
    params = [p for _, p in lane.named_parameters()]
    numel = sum(p.numel() for p in params)
    largest = max(p.numel() for p in params)

    def step() -> None:
        for p in params:
            p.main_grad.fill_(0.01)  # type: ignore[attr-defined]
        ok, _, _ = lane.optimizer.step()
        assert ok

    step()  # allocates the moments
    with peak_extra() as peak:
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
    groups = inner.param_groups
    torch.distributed.destroy_process_group()
    return {
        "variant": variant,
        "peak_extra_bytes": peak.extra_bytes,
        "step_s": dt,
        "foreach": sorted({str(g["foreach"]) for g in groups}),
        "fused": sorted({str(g["fused"]) for g in groups}),
        "numel": numel,
        "largest": largest,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        v, n, h = a.child
        print(json.dumps(child(v, int(n), int(h))))
        return
    me = os.path.abspath(__file__)
    rows = [run_child(me, v, str(a.layers), str(a.hidden)) for v in VARIANTS]
    numel, largest = rows[0]["numel"], rows[0]["largest"]
    base = rows[0]["peak_extra_bytes"]
    print(
        f"# Megatron adam temporaries: GPTModel {a.layers} layers, hidden {a.hidden}, "
        f"{numel / 1e6:.1f} M BF16 params (FP32 masters {numel * 4 / MIB:.0f} MiB, largest "
        f"parameter {largest * 4 / MIB:.1f} MiB in FP32), DP1 DistributedOptimizer, AdamW, "
        "second step, fresh process each"
    )
    print(
        f"{'variant':>38} {'foreach':>8} {'fused':>6} {'peak extra MiB':>15} "
        f"{'vs foreach':>10} {'step s':>7}"
    )
    for r in rows:
        print(
            f"{r['variant']:>38} {'/'.join(r['foreach']):>8} {'/'.join(r['fused']):>6} "
            f"{r['peak_extra_bytes'] / MIB:>15.1f} {r['peak_extra_bytes'] / max(base, 1):>9.3f}x "
            f"{r['step_s']:>7.3f}"
        )


if __name__ == "__main__":
    main()
