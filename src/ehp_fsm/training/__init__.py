"""Training on torch: everything between "these groups are yours" and "the optimizer stepped".

Layout (one module per concern):
    policy.py     the built-in tiny policy (a small transformer) and its vocabulary
    task.py       the built-in arithmetic task: questions, scoring, batches
    grpo.py       group-normalised advantages, GRPO loss, synthetic groups
    objective.py  the field's GRPO objective (ρ vs behaviour, clip-higher, k3 KL, aggregations)
    reduction.py  Σ (nᵢ/B)·ḡᵢ over Gloo in fixed-size buckets; local weighted sum
    snapshot.py   owned asynchronous CPU snapshots of live gradient buffers
    layout.py     flat per-buffer DP-zero layout (padding, shards, pieces)
    adam.py       Adam/AdamW with per-parameter temporaries when foreach is automatic
    lane.py       one training lane (Core DP rank or DP1 Hybrid): master weights, Adam, capture
    dpzero.py     DP-zero gather/scatter between layouts (Megatron-Core format)
    collect.py    the shell around the pure delivery ledger (logs rejections with structlog)
    backend.py    the TrainingBackend Protocol and TorchBackend
    worker.py     one trainer process (a Core rank or a warm Hybrid worker) of a pool
    pool.py       the coordinator: lockstep steps, state load into warm workers, revisions
    pool_protocol.py, pool_channel.py   the pool's config, wire encodings and ZeroMQ channel
    verify.py     record a run's batches, repeat it Core-only, compare states tensor by tensor

The pure partition and ledger live in `ehp_fsm.core.batch`; this package never decides which
delivery counts, it only computes, reduces and applies.
"""
