"""Prompts and rewards from files: what a run trains on.

Layout:
    dataset.py  [data]: a JSONL file checked line by line, per-epoch deterministic shuffle
    rewards.py  [reward]: "module:callable" or a built-in (exact_match, math_answer), sync or
                async, failures raised or counted — never a silent zero
    task.py     DatasetTask: the run's prompts, sampling, scoring and batches from the above
"""
