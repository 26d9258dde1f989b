"""Benchmark: peak extra memory of one Adam step — automatic foreach vs per-parameter stepping.

torch picks the foreach (multi-tensor) implementation automatically when `foreach`/`fused` are
unset and every parameter is on CUDA; on CPU its automatic choice is already the single-tensor
loop. So on this CPU machine "automatic foreach" is measured as `foreach=True` (exactly what torch
runs automatically on a GPU), beside torch's CPU automatic choice, our `AdamConfig()` default
(per-parameter temporaries) and `fused=True`. Each variant runs in a fresh process; the second
optimizer step is measured (the first allocates exp_avg/exp_avg_sq). Memory method: see
peak_memory.py.

    python benchmarks/adam_temporaries.py [--params 256] [--param-mib 1]
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
VARIANTS = {
    "foreach=True (torch auto on CUDA)": {"foreach": True},
    "torch auto on CPU": {},
    "ehp AdamConfig() per-parameter": "ehp",
    "fused=True": {"fused": True},
}


def child(variant: str, n: int, param_mib: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from ehp_fsm.training.adam import AdamConfig, build_adam

    params = [torch.ones(param_mib * MIB // 4) for _ in range(n)]
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    kw = VARIANTS[variant]
    if kw == "ehp":
        opt = build_adam(params, AdamConfig(lr=1e-3, weight_decay=0.01))
    else:
        assert isinstance(kw, dict)
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)
    opt.step()  # allocates the moments
    with peak_extra() as peak:
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
    g = opt.param_groups[0]
    return {
        "variant": variant,
        "peak_extra_bytes": peak.extra_bytes,
        "step_s": dt,
        "foreach": g.get("foreach"),
        "fused": g.get("fused"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=256)
    ap.add_argument("--param-mib", type=int, default=1)
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        v, n, m = a.child
        print(json.dumps(child(v, int(n), int(m))))
        return
    me = os.path.abspath(__file__)
    rows = [run_child(me, v, str(a.params), str(a.param_mib)) for v in VARIANTS]
    total = a.params * a.param_mib
    base = rows[0]["peak_extra_bytes"]
    print(
        f"# adam temporaries: {a.params} fp32 parameters × {a.param_mib} MiB = {total} MiB, "
        "AdamW, second step, fresh process each"
    )
    print(
        f"{'variant':>36} {'foreach':>8} {'fused':>6} {'peak extra MiB':>15} "
        f"{'vs foreach':>10} {'step s':>7}"
    )
    for r in rows:
        print(
            f"{r['variant']:>36} {r['foreach']!s:>8} {r['fused']!s:>6} "
            f"{r['peak_extra_bytes'] / MIB:>15.1f} {r['peak_extra_bytes'] / max(base, 1):>9.3f}x "
            f"{r['step_s']:>7.3f}"
        )


if __name__ == "__main__":
    main()
