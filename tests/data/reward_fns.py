"""Reward functions the reward tests import by "module:callable" (as a user's module would be)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping
from typing import Any

NOT_CALLABLE = 3


def length(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
    return float(len(completion)) + float(metadata.get("bonus", 0))


async def async_match(
    prompt: str, completion: str, label: str, metadata: Mapping[str, Any]
) -> float:
    loop = asyncio.get_running_loop()
    turn = loop.create_future()
    loop.call_soon(turn.set_result, None)
    await turn  # suspends once and resumes on the loop's next turn: a real coroutine
    return 1.0 if completion == label else 0.0


def raises(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
    raise ZeroDivisionError("the reward divided by zero")


def exits(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
    sys.exit(0)  # a leftover of debugging: it ended `ehp-fsm run` with exit 0 at step 0


def os_exits(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
    os._exit(0)  # it ended `ehp-fsm run` with exit 0 and no summary


def interrupts(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
    raise KeyboardInterrupt  # it ended `ehp-fsm run` with exit 130 and no error line


def returns(value: Any):
    def fn(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> Any:
        return value

    return fn


class Scorers:
    @staticmethod
    def nested(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
        return 0.5


def two_args(prompt: str, completion: str) -> float:
    return 1.0


HANG = __import__("threading").Event()  # set by a test to let the hanging calls end


def hangs(prompt: str, completion: str, label: str, metadata: Mapping[str, Any]) -> float:
    HANG.wait(30)
    return 1.0
