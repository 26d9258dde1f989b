"""Installs that fail. One that got no answer (the client's timeout passed, the connection
dropped) may still be running on the server: its revision must not be retired and deleted under
the server's feet until a later install on that engine succeeds (the server installs one at a
time). One that fails again and again is retried with a back-off that stays a number.

What is faked: the engine, at the HTTP layer (`httpx.MockTransport`): a server that goes on
installing after its client gave up is the far edge, and a real one cannot be made to time out
on cue. Everything else is real: the machines, the publisher, the revision store on disk.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from ehp_fsm.rollout.publish import PublishConfig
from tests.rollout.hf import revision_state

from .test_bad_answers import FakeSGLang, Rig, good


class SlowInstallSGLang(FakeSGLang):
    """The install of weight version "2" outlives the client's timeout: the client is told
    `ReadTimeout` while the server keeps installing (until `finish_install`). Meanwhile every
    other install is refused as SGLang refuses one during an update."""

    def __init__(self) -> None:
        super().__init__(good, 0)
        self.installing: str | None = None
        self.gate = threading.Lock()
        self.refuse_all = False

    def finish_install(self) -> None:
        with self.gate:
            self.version, self.installing = self.installing, None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/update_weights_from_disk":
            version = json.loads(request.content)["weight_version"]
            with self.gate:
                if self.installing is not None or (self.refuse_all and version != "1"):
                    return httpx.Response(
                        400, json={"success": False, "message": "another update in progress"}
                    )
                if version == "2":
                    self.installing = version
                    raise httpx.ReadTimeout("client gave up; server goes on", request=request)
        return super().__call__(request)


def _publish(rig: Rig, revision: int) -> None:
    state = revision_state(rig.base, revision)
    out = rig.pub.save_and_publish(
        revision=revision, step=revision, state_dict=state, base=rig.base
    )
    assert out.accepted, out.reason


def test_a_revision_whose_install_went_unanswered_is_not_deleted(
    tmp_path: Path, tiny_model: Path
) -> None:
    fake = SlowInstallSGLang()
    rig = Rig(tmp_path, fake, base=tiny_model)
    try:
        store = rig.pub.store
        _publish(rig, 2)
        assert not rig.pub.wait_installed(timeout_s=0.3)  # r2: no answer, retries refused
        _publish(rig, 3)  # the engine now wants r3; the server still reads r2
        assert not rig.pub.wait_installed(timeout_s=0.3)
        assert rig.pub.retire_unreferenced() == []
        assert store.revisions() == [1, 2, 3]
        assert rig.loop.world.get("revision", "r2").state == "published"

        fake.finish_install()  # the server is done with r2; the r3 retry now succeeds
        assert rig.pub.wait_installed(timeout_s=5)
        assert fake.version == "3"
        rig.pub.retire_unreferenced()
        assert store.revisions() == [3]
        assert rig.loop.world.get("revision", "r2").state == "retired"
    finally:
        rig.close()


def test_an_install_failing_a_thousand_times_in_a_row_is_still_retried(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The back-off doubled as `retry_backoff_s * 2 ** failures`: after 1,024 failures in a row
    the product overflowed a float and `poll` raised OverflowError (seen with no back-off)."""
    fake = SlowInstallSGLang()
    fake.refuse_all = True
    rig = Rig(tmp_path, fake, base=tiny_model)
    try:
        rig.pub.config = PublishConfig(retry_backoff_s=0.0, max_backoff_s=0.0, give_up_after_s=1e6)
        _publish(rig, 2)
        deadline = time.monotonic() + 60
        while rig.pub.stats.install_failures < 1100:
            assert time.monotonic() < deadline, rig.pub.stats
            rig.pub.poll(timeout_s=0.05)
        assert rig.loop.world.get("rollout_engine", "e0").state == "installing"
    finally:
        rig.close()
