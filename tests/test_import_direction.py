"""Imports point one way: experiments -> drafters, verifiers -> specdec, and no two experiments
packages import each other (an orchestrator such as bench may use run and analyze, which share
experiments.common). Read from the source with ``ast``, nothing imported, so an import inside a
function counts as much as one at the top.

Inside drafters/ the layers are, from the bottom: the leaves (drafters.base, drafters.heads,
drafters.eagle_config, and the bundled heads' manifest and storage), which import no other drafters module but each other; the inference
modules (every other module directly in drafters/: a head, its drafter, its own checkpoint layout),
which import leaves and each other but never drafters.formats or drafters.training; drafters.formats
(published layouts, and drafters.formats.load, which picks a folder's layout and registers the
drafters whose heads load from any), which imports inference modules and leaves but never
drafters.training; drafters.training, which may import all of them. And no top-level package holds
a module cycle: ``from pkg import sub`` reaches pkg.sub, not pkg's __init__, unless it also names
something that is not a submodule."""

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
# the bottom of drafters/: they import no drafters module but each other
# (bundled and head_storage: the bundled heads' manifest and storage, which drafters.heads reads)
DRAFTER_LEAVES = ("drafters.base", "drafters.heads", "drafters.eagle_config", "drafters.bundled", "drafters.head_storage")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool, known: set[str] | None = None) -> set[str]:
    """Every module ``source`` imports, anywhere in it: ``from a import b`` counts as a.b too (b may
    be a module), relative imports are resolved against ``module``, and a literal
    ``importlib.import_module("...")`` counts. With ``known`` (every module's name), ``from a import
    b`` counts a itself only when some name it imports is not a known submodule."""
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
            names = {f"{base}.{alias.name}" for alias in node.names if alias.name != "*"}
            found.update(names)
            if known is None or len(names) < len(node.names) or not names <= known:
                found.add(base)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def import_map() -> dict[str, set[str]]:
    """Module -> the project modules (and packages) it imports, for every .py of PACKAGES."""
    paths = {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}
    modules = {}
    for name, path in paths.items():
        imports = imported_modules(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", set(paths))
        modules[name] = {i for i in imports if i.split(".")[0] in PACKAGES}
    return modules


def drafter_layer(module: str) -> str | None:
    """drafters.heads -> leaf, drafters.eagle -> inference, drafters.formats.eagle -> formats,
    drafters.training.data -> training; None outside drafters/ and for its __init__."""
    parts = module.split(".")
    if parts[0] != "drafters" or len(parts) == 1:
        return None
    if any(module == leaf or module.startswith(f"{leaf}.") for leaf in DRAFTER_LEAVES):  # a leaf or a name in one
        return "leaf"
    return parts[1] if parts[1] in ("formats", "training") else "inference"


# drafters layer -> the layers it may never import
DRAFTER_FORBIDDEN = {
    "leaf": {"inference", "formats", "training"},
    "inference": {"formats", "training"},
    "formats": {"training"},
}


def cycles(modules: dict[str, set[str]]) -> list[list[str]]:
    """The module cycles within each top-level package (Tarjan's strongly connected components)."""
    graph = {m: sorted(i for i in imports if i in modules and i != m and i.split(".")[0] == m.split(".")[0])
             for m, imports in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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
            layer, its = drafter_layer(module), drafter_layer(imported)
            if its in DRAFTER_FORBIDDEN.get(layer, ()):
                reasons.append(f"a drafters {layer} module never imports drafters {its} modules")
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
    found += [f"import cycle within {cycle[0].split('.')[0]}: {' <-> '.join(cycle)}" for cycle in cycles(modules)]
    return found


def test_imports_point_one_way():
    assert violations(import_map()) == []


def test_the_map_sees_every_package_and_nested_imports():
    modules = import_map()
    assert {module.split(".")[0] for module in modules} == set(PACKAGES)
    assert {"experiments.common", "experiments.run", "experiments.analyze", "experiments.bench"} <= {
        ".".join(m.split(".")[:2]) for m in modules
    }
    # bench imports run: the map must see it
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
    ({"drafters.eagle": {"drafters.formats.eagle"}}, "a drafters inference module never imports drafters formats"),
    ({"drafters.medusa": {"drafters.training.medusa_training"}}, "a drafters inference module never imports drafters training"),
    ({"drafters.formats.medusa": {"drafters.training.medusa2_training"}}, "a drafters formats module never imports drafters training"),
    ({"drafters.heads": {"drafters.eagle"}}, "a drafters leaf module never imports drafters inference"),
    ({"experiments.run.schema": {"experiments.run.rivals"}, "experiments.run.rivals": {"experiments.run.schema"}},
     "import cycle within experiments: experiments.run.rivals <-> experiments.run.schema"),
    ({"drafters.eagle": {"drafters.eagle_published"}, "drafters.eagle_published": {"drafters.dflash"},
      "drafters.dflash": {"drafters.eagle"}}, "import cycle within drafters: drafters.dflash <-> drafters.eagle <-> drafters.eagle_published"),
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
        "drafters.training.dflash_training": {"drafters.formats.load", "drafters.dflash", "drafters.base"},
        "drafters.formats.load": {"drafters.formats.eagle", "drafters.eagle", "drafters.heads"},
        "drafters.formats.eagle": {"drafters.eagle", "drafters.eagle_config"},
        "drafters.eagle": {"drafters.eagle_published", "drafters.eagle_config", "drafters.heads"},
        "drafters.heads": {"drafters.base"},
        "drafters.formats": {"drafters.formats.load"},
    }) == []


def test_a_submodule_imported_from_its_package_is_not_an_edge_to_the_package():
    """``from drafters.formats import eagle`` inside drafters.formats.load reaches drafters.formats.eagle,
    not drafters/formats/__init__.py, which imports load: no cycle."""
    known = {"drafters.formats", "drafters.formats.eagle", "drafters.formats.load"}
    assert imported_modules("from drafters.formats import eagle\n", "drafters.formats.load", False, known) == {
        "drafters.formats.eagle"}
    assert imported_modules("from drafters.formats import eagle, ENGINES\n", "drafters.formats.load", False, known) == {
        "drafters.formats", "drafters.formats.eagle", "drafters.formats.ENGINES"}
    assert cycles({"drafters.formats": {"drafters.formats.load"}, "drafters.formats.load": {"drafters.formats.eagle"},
                   "drafters.formats.eagle": set()}) == []
