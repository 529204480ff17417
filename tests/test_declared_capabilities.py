"""What a component can do is declared where it registers (specdec.registry traits, Target.kind),
never probed: no AttributeError caught to learn a target's type, no hasattr on our own objects, no
isinstance against a target class, no branch on a registered name outside the component itself.
The source is read with ``ast``, so the test imports nothing and names each offence by file:line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "drafters", "verifiers", "experiments", "benchmarks")

# hasattr on what is not ours: a standard-library module or transformers' API, which vary by version
# and platform. (file, attribute) -> why
HASATTR_ALLOWED = {
    ("specdec/cpu_kernels.py", "set_attn_implementation"): "transformers versions differ",
    ("experiments/run/build.py", "sched_getaffinity"): "os: Linux only",
}
# files that catch AttributeError from what is not ours -> why
EXCEPT_ALLOWED = {
    "specdec/cpu_kernels.py": "torch builds without the mkldnn op",
    "drafters/heads.py": "a damaged safetensors header is refused in one line",
    "experiments/run/machine_load.py": "os.sched_getaffinity is Linux only",
}
# (file, name) -> why a registered name may be compared with there
NAME_ALLOWED = {
    ("drafters/union.py", "union"): "a union refuses itself as a member",
}


def registered_names() -> set[str]:
    from drafters.base import DRAFTERS
    from drafters.training.methods import METHODS
    from experiments.run.peers import PEERS
    from experiments.run.workloads import WORKLOADS
    from specdec.target_loader import TARGETS

    return {name for registry in (DRAFTERS, METHODS, PEERS, WORKLOADS, TARGETS) for name in registry.names()}


def offences(path: str, source: str, names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if (isinstance(node, ast.ExceptHandler) and "AttributeError" in ast.dump(node.type or ast.Constant(None))
                and path not in EXCEPT_ALLOWED):
            found.append(f"{where}: except AttributeError (declare the capability instead)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2:
            subject, second = node.args
            if node.func.id == "hasattr":
                attribute = second.value if isinstance(second, ast.Constant) else None
                if (path, attribute) not in HASATTR_ALLOWED:
                    found.append(f"{where}: hasattr(..., {attribute!r})")
            if node.func.id == "isinstance":
                classes = second.elts if isinstance(second, ast.Tuple) else [second]
                for cls in classes:
                    name = cls.id if isinstance(cls, ast.Name) else cls.attr if isinstance(cls, ast.Attribute) else ""
                    if name.endswith("Target"):
                        found.append(f"{where}: isinstance(..., {name}) (ask Target.kind)")
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            sides = [node.left, *node.comparators]
            named = any((isinstance(s, ast.Attribute) and s.attr == "name") or (isinstance(s, ast.Name) and s.id == "name")
                        for s in sides)
            literals = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            for literal in literals:
                if named and literal in names and (path, literal) not in NAME_ALLOWED:
                    found.append(f"{where}: name compared with the registered name {literal!r} (declare a trait)")
    return found


def test_no_capability_is_probed_or_read_from_a_name():
    names = registered_names()
    found = []
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            found += offences(path, file.read_text(), names)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, offence", [
    ("try:\n    t.model\nexcept AttributeError:\n    pass\n", "except AttributeError"),
    ("hasattr(method, 'prepare_on')\n", "hasattr"),
    ("isinstance(target, HFTarget)\n", "isinstance"),
    ("isinstance(t, (int, target.SyntheticTarget))\n", "isinstance"),
    ("if cfg.name == 'synthetic':\n    pass\n", "registered name"),
    ("if 'hf' != name:\n    pass\n", "registered name"),
])
def test_each_probe_is_found(source, offence):
    found = offences("experiments/x.py", source, {"synthetic", "hf"})
    assert len(found) == 1 and offence in found[0]


def test_a_declared_check_is_not_an_offence():
    source = "if target.kind == 'model' and TARGETS.trait(name, 'kind') == 'synthetic':\n    pass\nhasattr(os, 'sched_getaffinity')\n"
    assert offences("experiments/run/build.py", source, {"synthetic", "model"}) == []
