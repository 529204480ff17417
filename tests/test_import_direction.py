"""Imports point one way: experiments -> drafters, verifiers -> specdec, and no two experiments
packages import each other (an orchestrator such as bench may use run and analyze, which share
experiments.common). Read from the source with ``ast``, nothing imported, so an import inside a
function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec", "drafters", "verifiers", "experiments", "benchmarks")

# package -> the packages it may never import
FORBIDDEN = {
    "specdec": {"drafters", "verifiers", "experiments", "benchmarks"},
    "drafters": {"verifiers", "experiments", "benchmarks"},
    "verifiers": {"drafters", "experiments", "benchmarks"},
}
# experiments units (experiments.X) that must not import each other even one way
APART = (("run", "analyze"), ("analyze", "run"))
# the shared leaves of experiments: they import no experiments unit but experiments.common
LEAVES = ("common", "cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module ``source`` imports, anywhere in it: ``from a import b`` counts as a.b too (b may
    be a module), relative imports are resolved against ``module``, and a literal
    ``importlib.import_module("...")`` counts."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def import_map() -> dict[str, set[str]]:
    """Module -> the project modules (and packages) it imports, for every .py of PACKAGES."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            imports = imported_modules(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
            modules[name] = {i for i in imports if i.split(".")[0] in PACKAGES}
    return modules


def unit(module: str) -> str | None:
    """experiments.run.command -> run; experiments.cli -> cli; None outside experiments or for its __init__."""
    parts = module.split(".")
    return parts[1] if parts[0] == "experiments" and len(parts) > 1 else None


def violations(modules: dict[str, set[str]]) -> list[str]:
    found = []
    uses: dict[tuple[str, str], str] = {}  # (unit, other unit) -> an importing module, for the message
    for module, imports in sorted(modules.items()):
        top = module.split(".")[0]
        told = set()  # `from a import b` imports a and maybe a.b: one message for both
        for imported in sorted(imports):
            target = imported.split(".")[0]
            here, there = unit(module), unit(imported)
            reasons = []
            if target in FORBIDDEN.get(top, ()):
                reasons.append(f"{top} never imports {target}")
            if here and there and here != there:
                uses.setdefault((here, there), module)
                if (here, there) in APART:
                    reasons.append(f"experiments.{here} never imports experiments.{there}")
                if here in LEAVES and there != "common":
                    reasons.append(f"experiments.{here} is a shared leaf, it imports no experiments package but common")
            found += [f"{module} imports {imported}: {reason}" for reason in reasons if reason not in told]
            told.update(reasons)
    for (here, there), module in sorted(uses.items()):
        if here < there and (there, here) in uses and (here, there) not in APART and (there, here) not in APART:
            found.append(f"experiments.{here} and experiments.{there} import each other "
                         f"({module} -> {there}, {uses[there, here]} -> {here}); move what both need to experiments.common")
    return found


def test_imports_point_one_way():
    assert violations(import_map()) == []


def test_the_map_sees_every_package_and_nested_imports():
    modules = import_map()
    assert {module.split(".")[0] for module in modules} == set(PACKAGES)
    assert {"experiments.common", "experiments.run", "experiments.analyze", "experiments.bench"} <= {
        ".".join(m.split(".")[:2]) for m in modules
    }
    # bench imports run inside functions: the map must see it
    assert any(i.startswith("experiments.run") for i in modules["experiments.bench.command"])


def test_imports_inside_functions_relative_ones_and_import_module_are_seen():
    source = (
        "import os\n"
        "from . import sibling\n"
        "from ..other import thing\n"
        "def late():\n"
        "    from verifiers.reference import verify\n"
        "    importlib.import_module('experiments.run.command')\n"
    )
    assert imported_modules(source, "drafters.training.data", is_package=False) == {
        "os", "drafters.training", "drafters.training.sibling", "drafters.other", "drafters.other.thing",
        "verifiers.reference", "verifiers.reference.verify", "experiments.run.command",
    }


@pytest.mark.parametrize("modules, expected", [
    ({"specdec.decode": {"drafters.base"}}, "specdec never imports drafters"),
    ({"specdec.decode": {"benchmarks.bench_target"}}, "specdec never imports benchmarks"),
    ({"drafters.training.data": {"verifiers.reference"}}, "drafters never imports verifiers"),
    ({"drafters.base": {"experiments.cli"}}, "drafters never imports experiments"),
    ({"verifiers.select": {"drafters.base"}}, "verifiers never imports drafters"),
    ({"experiments.run.outputs": {"experiments.analyze.plots"}}, "experiments.run never imports experiments.analyze"),
    ({"experiments.analyze.tables": {"experiments.run.summary"}}, "experiments.analyze never imports experiments.run"),
    ({"experiments.common.sinks": {"experiments.run.schema"}}, "experiments.common is a shared leaf"),
    ({"experiments.cli": {"experiments.bench"}}, "experiments.cli is a shared leaf"),
    ({"experiments.common.outputs": {"experiments.cli"}}, "experiments.common is a shared leaf"),
    ({"experiments.bench.command": {"experiments.train"}, "experiments.train": {"experiments.bench.plan"}},
     "experiments.bench and experiments.train import each other"),
])
def test_each_kind_of_wrong_import_is_reported(modules, expected):
    (message,) = violations(modules)
    assert expected in message


def test_the_allowed_directions_pass():
    assert violations({
        "experiments.bench.command": {"experiments.run.command", "experiments.analyze.command", "experiments.common.sinks"},
        "experiments.run.command": {"experiments.common.sinks", "experiments.cli", "drafters.base", "verifiers.select"},
        "experiments.analyze.report": {"experiments.common.plots"},
        "experiments.common.sinks": {"experiments.common.outputs", "specdec.files"},
        "drafters.ngram": {"drafters.base", "specdec.tree"},
        "verifiers.block": {"verifiers.reference", "specdec.noise"},
        "experiments.cli": {"experiments.common.sinks"},
        "benchmarks.bench_target": {"experiments.cli", "drafters.base"},
    }) == []
