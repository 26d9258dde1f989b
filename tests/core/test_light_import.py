"""The embedding API and the plan loader are light: a scheduler that embeds the orchestrator
does not pay for (or need) the control plane, torch, the rollout server or the plots.

A fresh interpreter imports them, loads the example plan and handles one event; none of the
heavy third-party modules may be in `sys.modules` afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEAVY = ("zmq", "torch", "psutil", "httpx", "fastapi", "uvicorn", "msgpack", "matplotlib")

SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from ehp_fsm import Event, Orchestrator, Plan, load_plan
import ehp_fsm.embedded, ehp_fsm.plan

plan = load_plan(sys.argv[2])
assert isinstance(plan, Plan)
orch = Orchestrator.from_plan(plan, log_path=sys.argv[3], check=True)
outcome = orch.handle(Event("rollout_engine", "e0", "drain", time=1.0))
orch.close()
print(json.dumps({
    "handled": type(outcome).__name__,
    "loaded": sorted({name.partition(".")[0] for name in sys.modules}),
}))
"""


def test_embedding_api_and_plan_loader_import_no_heavy_module(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(ROOT / "src"),
            str(ROOT / "examples" / "local.toml"),
            str(tmp_path / "t.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["handled"] in ("Accepted", "Rejected")
    heavy = sorted(set(HEAVY) & set(report["loaded"]))
    assert heavy == [], f"the light import path loaded {heavy}"


def test_the_command_reaches_its_main_before_the_embedding_api_is_imported() -> None:
    """Every `ehp-fsm` command imports `ehp_fsm.cli`, and so the package, before `main` runs
    and handles a Ctrl-C: the package imports its public names on first use, so that window
    is the interpreter's start and the command's parser (a Ctrl-C in it prints a traceback),
    not the embedding API's ~0.2 s too. The names still import from the package."""
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import ehp_fsm.cli; "
        "before = sorted(sys.modules); from ehp_fsm import Orchestrator, load_plan; "
        "print(json.dumps(before))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(ROOT / "src")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout))
    assert not {"ehp_fsm.embedded", "ehp_fsm.plan", "structlog", "msgspec"} & loaded
