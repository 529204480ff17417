"""The edge: the Hydra entry points (specdec-run, -train, -bench, -analyze, -export) and the data tools.

specdec installs five top-level packages: specdec, drafters, verifiers, experiments and benchmarks.
Another distribution that installs one of those names (the registry has a ``drafters``) would shadow
ours or mix its files with them, and the failure would surface far from its cause; so the first
import of this package checks, by location alone (nothing is imported), that each sits beside it.
"""

import importlib.util
from pathlib import Path


def _check_own_packages() -> None:
    home = Path(__file__).resolve().parent.parent
    for name in ("specdec", "drafters", "verifiers", "benchmarks"):
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or Path(origin).resolve().parent.parent != home:
            raise ImportError(f"the package {name!r} here is not specdec's (found at {origin or 'nowhere'}, expected in "
                              f"{home / name}): another distribution installs that name; install specdec in a "
                              f"virtual environment of its own (docs/NOTES.md, 'Installed package names')")


_check_own_packages()
