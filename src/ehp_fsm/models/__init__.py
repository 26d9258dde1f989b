"""Hugging Face models: tiny ones for CPU runs, loading, and revisions as HF directories.

Layout:
    tiny.py          init_model: a real architecture's config, seeded weights, a char tokenizer
    load.py          load_model / check_model_dir, and ModelError (what is missing, what to do)
    revision_dir.py  a revision as an HF directory + manifest.json (atomic write, mmap reader,
                     verify by content hash)

`transformers` is imported inside the functions that need it: importing this package is cheap.
"""
