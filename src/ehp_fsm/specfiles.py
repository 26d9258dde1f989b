"""Loads the machine specs from `specs/*.toml` and binds them to the implemented guards and
effects. The only module that reads spec files; the parsing and checking live in
`ehp_fsm.core.spec`."""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from pathlib import Path

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.spec import MachineSpec, parse_spec
from ehp_fsm.errors import SpecError

MACHINES = (
    "gpu",
    "rollout_engine",
    "hybrid_replica",
    "training_step",
    "revision",
    "request",
    "capacity",
)


def spec_dir() -> Path:
    """`specs/` of the source tree (editable install) or the copy shipped in the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "specs", here / "specs"):
        if (candidate / "gpu.toml").is_file():
            return candidate
    raise SpecError(
        "specs/",
        "gpu.toml",
        "the spec directory was not found",
        "run from a source checkout or reinstall the package",
    )


def load_spec_file(path: Path) -> MachineSpec:
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(
            str(path), "<toml>", f"it is not valid TOML ({exc})", "fix the syntax"
        ) from None
    spec = parse_spec(doc, file=str(path), guards=GUARDS.keys(), effects=EFFECTS.keys())
    if spec.name != path.stem:
        raise SpecError(
            str(path),
            "machine",
            f"machine {spec.name!r} is in file {path.name}",
            f"name the file {spec.name}.toml or the machine {path.stem!r}",
        )
    return spec


@functools.cache
def _load(directory: str) -> Mapping[str, MachineSpec]:
    root = Path(directory)
    specs = {}
    for name in MACHINES:
        path = root / f"{name}.toml"
        if not path.is_file():
            raise SpecError(
                str(path), "<file>", f"the spec of machine {name!r} is missing", f"restore {path}"
            )
        specs[name] = load_spec_file(path)
    return specs


def load_specs(directory: Path | None = None) -> Mapping[str, MachineSpec]:
    """Every machine spec, checked. Cached per directory: specs are immutable data."""
    return _load(str((directory or spec_dir()).resolve()))
