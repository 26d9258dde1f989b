"""Rollout shell: revisions on disk, the embedded CPU engine, the engine launcher and the SGLang
client.

Layout:
    revisions.py  RevisionStore — atomic, checksummed, strictly increasing revisions (HF
                  directories written by `models.revision_dir`); retire
    engine.py     EngineCore — a Hugging Face causal LM behind a scheduler thread: KV cache per
                  request, sampling, pause modes, installs (no HTTP)
    server.py     the embedded engine process: SGLang's HTTP API over EngineCore (FastAPI)
    http_limits.py  what that server refuses to read (bodies over a size) or to wait for
                  (a request that takes too long to arrive)
    launch.py     launch_engine / stop_engine / EngineHandle (pid + start time + launch token);
                  the command line comes from `ehp_fsm.engine_command` (SGLang's or, with the
                  module swapped, the embedded engine's)
    client.py     SGLangClient — one method per SGLang verb; drives embedded and real SGLang
    errors.py     RolloutError and its subclasses (tree in that module's docstring)

The rollout *machines* (engine lifecycle, publication, request lifecycle) are not here: they
live in the functional core and drive these adapters through their effects.
"""

from ehp_fsm.rollout.client import GenerateResult, ModelInfo, SGLangClient, UpdateResult
from ehp_fsm.rollout.errors import (
    EngineError,
    EngineLaunchError,
    EngineRequestFailed,
    EngineUnreachable,
    RevisionCorrupt,
    RevisionError,
    RevisionInUse,
    RevisionNotFound,
    RevisionNotIncreasing,
    RolloutError,
    WeightUpdateFailed,
)
from ehp_fsm.rollout.launch import EngineHandle, free_port, launch_engine, stop_engine
from ehp_fsm.rollout.revisions import RevisionStore

__all__ = [
    "EngineError",
    "EngineHandle",
    "EngineLaunchError",
    "EngineRequestFailed",
    "EngineUnreachable",
    "GenerateResult",
    "ModelInfo",
    "RevisionCorrupt",
    "RevisionError",
    "RevisionInUse",
    "RevisionNotFound",
    "RevisionNotIncreasing",
    "RevisionStore",
    "RolloutError",
    "SGLangClient",
    "UpdateResult",
    "WeightUpdateFailed",
    "free_port",
    "launch_engine",
    "stop_engine",
]
