"""A resume that cannot remove the revisions it must drop names the OS's reason: "revision 10
... could not be removed ... remove it by hand" hid "Permission denied" of a read-only
revisions folder (the infrastructure review). As root (CI runs so), permissions do not stop a
removal: the removal runs in a process without the capabilities that bypass them (`setpriv`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_DROP = """
import sys
from pathlib import Path
from ehp_fsm.errors import EhpError
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.run.resume import drop_revisions_after
try:
    drop_revisions_after(RevisionStore(Path(sys.argv[1])), 2)
except EhpError as exc:
    print(exc)
"""


def test_a_revision_that_cannot_be_removed_is_named_with_the_reason(tmp_path: Path) -> None:
    root = tmp_path / "revisions"
    for r in (1, 2, 3):
        (root / f"r{r:08d}").mkdir(parents=True)
        (root / f"r{r:08d}" / "config.json").write_text("{}")
    (root / "r00000002").chmod(0o555)  # its file cannot be unlinked
    argv = [sys.executable, "-c", _DROP, str(root)]
    if os.geteuid() == 0:
        argv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *argv]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        (root / "r00000002").chmod(0o755)
    assert out.returncode == 0, out.stderr
    assert "revision 2 (" in out.stdout and "could not be removed (" in out.stdout, out
    assert "config.json: Permission denied)" in out.stdout, out
