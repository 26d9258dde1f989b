"""Peak-memory measurement for the CPU benchmarks: Linux peak RSS of a fresh process.

Method: each measured variant runs in a fresh Python subprocess started with
MALLOC_MMAP_THRESHOLD_=131072 (glibc then serves every allocation of 128 KiB or more with its own
mmap and returns it to the kernel on free, so RSS follows live tensor memory instead of staying
at an old high-water mark). Right before the measured operation the process writes "5" to
/proc/self/clear_refs, which resets VmHWM (the peak resident set size) to the current RSS; the
figure reported is VmHWM − VmRSS(before), i.e. the extra memory the operation touched at its
peak. `calibrate()` checks the method on a known allocation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status (Linux only)")


@dataclass
class Peak:
    extra_bytes: int = 0


@contextmanager
def peak_extra() -> Iterator[Peak]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    peak = Peak()
    try:
        yield peak
    finally:
        peak.extra_bytes = (_status_kib("VmHWM") - before) * 1024


def run_child(script: str, *args: str) -> dict[str, Any]:
    """Run `script --child args…` in a fresh process; it prints one JSON line last."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, script, "--child", *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def calibrate(alloc: Callable[[int], Any], nbytes: int) -> int:
    """Measured extra bytes of allocating (and touching) `nbytes`; should be ≈ nbytes."""
    with peak_extra() as p:
        t = alloc(nbytes)
        del t
    return p.extra_bytes
