"""Publication and generation benchmark for the embedded rollout engine (Hugging Face models).

1. Publication: time to publish one revision of a generated Qwen3 model (~96 MiB of float32
   safetensors by default) to N embedded engines — `RevisionStore.save` (safetensors
   serialization, SHA-256 while writing, fsync, atomic rename) followed by every engine
   installing it via `/update_weights_from_disk` (manifest listing and sizes checked, tensors
   read through safetensors, `load_state_dict(assign=True)` into the module built on the
   warm-up revision), engines in parallel — against plain file I/O of the same bytes measured
   right after it: write + fsync once, then N parallel whole-file reads. Figure: the median over
   rounds of plain_io_time / publish_time (≥ 0.5 is the target).
2. Generation (reference): tokens/s of one embedded engine serving concurrent requests over
   HTTP, against the same per-sequence loop (prefill, then one token per forward with a KV cache)
   run in-process on the tiny default model (no HTTP, no scheduler).

Usage: python benchmarks/publication.py [--engines 2] [--hidden 512] [--intermediate 2216]
       [--layers 6] [--repeats 7] [--requests 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ehp_fsm.models.load import load_model
from ehp_fsm.models.revision_dir import revision_tensors
from ehp_fsm.models.tiny import TinyShape, init_model
from ehp_fsm.rollout import RevisionStore, SGLangClient, launch_engine, stop_engine


def plain_io(data: bytes, path: Path, readers: int) -> float:
    t0 = time.perf_counter()
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    with ThreadPoolExecutor(max_workers=readers) as pool:
        sizes = list(pool.map(lambda _: len(path.read_bytes()), range(readers)))
    elapsed = time.perf_counter() - t0
    assert all(s == len(data) for s in sizes)
    path.unlink()
    return elapsed


def bench_publication(args: argparse.Namespace, root: Path) -> None:
    shape = TinyShape(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    base = init_model(root / "base", seed=0, shape=shape)
    tensors = revision_tensors(load_model(base).model)
    store = RevisionStore(root / "revisions")
    handles = [launch_engine(deadline_s=120) for _ in range(args.engines)]
    clients = [SGLangClient(h.url, update_timeout_s=600) for h in handles]
    publish, save, install, plain = [], [], [], []
    nbytes = 0
    try:
        for r in range(1, args.repeats + 2):  # revision 1 is a warm-up: it builds each module
            state = {k: v + 1e-3 * r for k, v in tensors.items()}  # new bytes every round
            t0 = time.perf_counter()
            manifest = store.save(revision=r, step=r, state_dict=state, base=base)
            t1 = time.perf_counter()
            path = str(store.path(r))
            with ThreadPoolExecutor(max_workers=len(clients)) as pool:
                futures = [
                    pool.submit(c.update_weights_from_disk, path, weight_version=str(r))
                    for c in clients
                ]
                results = [f.result() for f in futures]
            t2 = time.perf_counter()
            assert all(res.success for res in results)
            assert all(c.weight_version() == str(r) for c in clients)
            nbytes = sum(e.bytes for e in manifest.files.values())
            data = (store.path(r) / "model.safetensors").read_bytes()
            baseline = plain_io(data, root / "plain.bin", len(clients))
            if r > 1:
                plain.append(baseline)
                publish.append(t2 - t0)
                save.append(t1 - t0)
                install.append(t2 - t1)
            for old in store.revisions()[:-1]:
                store.retire(old, referenced={r})
    finally:
        for c in clients:
            c.close()
        for h in handles:
            stop_engine(h)
    med = statistics.median
    print(
        f"publication: Qwen3 hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.layers} layers: {nbytes / 2**20:.1f} MiB per revision, {args.engines} engines, "
        f"{args.repeats} repeats (medians)"
    )
    print(
        f"  publish (save + all installs) {med(publish):.3f} s "
        f"= save {med(save):.3f} s + install {med(install):.3f} s"
    )
    print(f"  plain I/O (write+fsync + {args.engines} parallel reads) {med(plain):.3f} s")
    # each round's publish against the plain I/O measured right after it: fsync times drift
    # a lot on a shared VM, and two medians can come from different phases
    ratios = sorted(b / p for b, p in zip(plain, publish, strict=True))
    print(f"  rounds (plain I/O / publish): {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"  speed vs plain I/O: median of rounds {med(ratios):.2f}x  (target >= 0.5x)")


def bench_generation(args: argparse.Namespace, root: Path) -> None:
    from transformers import DynamicCache

    base = init_model(root / "gen-base", seed=0)
    loaded = load_model(base)
    store = RevisionStore(root / "gen-revisions")
    store.save(revision=1, step=1, state_dict=revision_tensors(loaded.model), base=base)
    new_tokens = 24
    prompt = [int(i) for i in loaded.tokenizer("12+34=").input_ids]
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
    handle = launch_engine(model_path=store.path(1), deadline_s=120)
    try:
        with SGLangClient(handle.url) as c:
            c.generate(input_ids=prompt, sampling_params=params)  # warm-up
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.requests) as pool:
                outs = list(
                    pool.map(
                        lambda s: c.generate(
                            input_ids=prompt, sampling_params={**params, "sampling_seed": s}
                        ),
                        range(args.requests),
                    )
                )
            served = time.perf_counter() - t0
    finally:
        stop_engine(handle)
    tokens = sum(len(o.output_ids) for o in outs)
    # in-process baseline: the same per-sequence prefill + cached decode loop, one thread
    torch.set_num_threads(1)
    model = loaded.model.eval()
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    base_tokens = 0
    with torch.inference_mode():
        for _ in range(args.requests):
            cache = DynamicCache(config=model.config)
            feed = list(prompt)
            for _ in range(new_tokens):
                logits = model(input_ids=torch.tensor([feed]), cache=cache).logits[0, -1]
                tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                feed = [tok]
                base_tokens += 1
    elapsed = time.perf_counter() - t0
    print(
        f"generation: {args.requests} concurrent requests x {new_tokens} tokens, "
        "tiny Qwen3 (init_model defaults)"
    )
    print(
        f"  embedded engine over HTTP {tokens / served:.0f} tok/s; "
        f"in-process loop {base_tokens / elapsed:.0f} tok/s; "
        f"ratio {(tokens / served) / (base_tokens / elapsed):.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=2216)  # with 6 layers: ~96 MiB
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--requests", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ehp-publication-") as tmp:
        bench_publication(args, Path(tmp))
        bench_generation(args, Path(tmp))


if __name__ == "__main__":
    main()
