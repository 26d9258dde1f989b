"""Process checks shared by the multi-process tests."""

from __future__ import annotations

from collections.abc import Iterable

import psutil


def still_running(pids: Iterable[int]) -> list[int]:
    """The pids among `pids` whose process still runs code: not gone and not a zombie (exited,
    not yet reaped). A process that exits while it is being looked at counts as gone."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out
