"""Errors raised by the rollout shell: the revision store, the engine launcher and the client.

They hang under `ehp_fsm.errors.EhpError` like this:

    EhpError
    └── RolloutError                  anything the rollout shell raises on purpose
        ├── RevisionError             the revision store refused or found damage
        │   ├── RevisionNotIncreasing     save(r) with r ≤ the newest revision on disk
        │   ├── RevisionNotFound          no revision r in the store (or retired)
        │   ├── RevisionCorrupt           manifest unreadable or checksum mismatch
        │   └── RevisionInUse             retire(r) of a referenced or the newest revision
        ├── EngineLaunchError         the server process died or never became ready
        └── EngineError               an HTTP call to an engine (embedded or SGLang) failed
            ├── EngineUnreachable         connect error or timeout (no answer at all)
            ├── EngineRequestFailed       the engine answered with a non-2xx status
            └── WeightUpdateFailed        /update_weights_from_disk answered success=false

Every `EngineError` carries the endpoint and, where the engine answered, its status code and
response text, so a failure on a real SGLang server reads the same as one on the embedded engine.
"""

from __future__ import annotations

from ehp_fsm.errors import EhpError, printable


class RolloutError(EhpError):
    """Base of the rollout shell's errors."""


class RevisionError(RolloutError):
    """The revision store refused an operation or found a damaged revision."""


class RevisionNotIncreasing(RevisionError):
    def __init__(self, revision: int, latest: int) -> None:
        self.revision, self.latest = revision, latest
        super().__init__(
            f"cannot save revision {revision}",
            f"revisions are strictly increasing and revision {latest} already exists",
            f"save revision {latest + 1} or higher",
        )


class RevisionNotFound(RevisionError):
    def __init__(self, revision: int, root: str) -> None:
        self.revision = revision
        super().__init__(
            f"revision {revision} is not in the store at {root}",
            "it was never saved, or it was retired",
            "call RevisionStore.revisions() to see what is available",
        )


class RevisionCorrupt(RevisionError):
    def __init__(self, path: str, why: str) -> None:
        self.path = path
        super().__init__(
            f"revision at {printable(path)} cannot be used",  # a file name may hold a newline
            why,
            "re-publish the revision from the trainer; never install a damaged one",
        )


class RevisionInUse(RevisionError):
    def __init__(self, revision: int, why: str) -> None:
        self.revision = revision
        super().__init__(
            f"cannot retire revision {revision}",
            why,
            "retire it only after no engine has it installed and no request refers to it",
        )


class EngineLaunchError(RolloutError):
    """The engine process exited early or did not become ready before its deadline."""

    def __init__(self, what: str, why: str, log_tail: str = "") -> None:
        self.log_tail = log_tail
        fix = "read the engine log" + (f"; its last lines:\n{log_tail}" if log_tail else "")
        super().__init__(what, why, fix)


class EngineError(RolloutError):
    """An HTTP call to a rollout engine failed. `endpoint` is the path, e.g. `/generate`."""

    def __init__(
        self,
        what: str,
        why: str,
        fix: str,
        *,
        endpoint: str,
        status_code: int | None = None,
        response_text: str = "",
    ) -> None:
        self.endpoint, self.status_code, self.response_text = endpoint, status_code, response_text
        super().__init__(what, why, fix)


class EngineUnreachable(EngineError):
    """`timed_out`: the call's timeout passed with no whole answer (a frozen or overloaded
    process), as opposed to a connection that could not be made or was cut."""

    def __init__(self, url: str, endpoint: str, why: str, *, timed_out: bool = False) -> None:
        self.url, self.timed_out = url, timed_out
        super().__init__(
            f"engine at {url} did not answer {endpoint}",
            why,
            "check that the engine process is alive (launcher handle) and raise the timeout if "
            "the call is legitimately slow",
            endpoint=endpoint,
        )


class EngineRequestFailed(EngineError):
    def __init__(self, url: str, endpoint: str, status_code: int, response_text: str) -> None:
        self.url = url
        super().__init__(
            f"engine at {url} refused {endpoint} with HTTP {status_code}",
            f"the engine answered: {response_text.strip()[:2000]!s}",
            "read the engine's answer above; the engine state it names must change first",
            endpoint=endpoint,
            status_code=status_code,
            response_text=response_text,
        )


class WeightUpdateFailed(EngineError):
    def __init__(
        self, url: str, model_path: str, message: str, status_code: int, num_paused_requests: int
    ) -> None:
        self.url, self.model_path, self.message = url, model_path, message
        self.num_paused_requests = num_paused_requests
        super().__init__(
            f"engine at {url} failed to install weights from {model_path}",
            f"the engine answered: {message}",
            "keep the engine out of routing and reload a good revision",
            endpoint="/update_weights_from_disk",
            status_code=status_code,
            response_text=message,
        )
