"""Prompts and rewards from files: what a run trains on when it is not the built-in task.

Layout:
    dataset.py  [data]: a JSONL file checked line by line, per-epoch deterministic shuffle
    rewards.py  [reward]: "module:callable" or a built-in (exact_match, math_answer), sync or
                async, failures raised or counted — never a silent zero
"""
