"""What a component can do is declared where it registers (specdec.registry traits, Target.kind,
Target.key), never probed: no AttributeError caught to learn a target's type, no hasattr on our own
objects, no isinstance against a target class, no getattr(target, ..., None), no identity read from
transformers' private config fields (``_name_or_path``: a target is what its key says), no branch on a
registered name outside the component itself.
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
    "drafters/head_storage.py": "a damaged safetensors header is refused in one line",
    "experiments/run/machine_load.py": "os.sched_getaffinity is Linux only",
}
# (file, name) -> why a registered name may be compared with there
NAME_ALLOWED = {
    ("drafters/union.py", "union"): "a union refuses itself as a member",
}
# (file, field) -> why a private field of transformers' may be read there
PRIVATE_ALLOWED = {
    ("specdec/cpu_kernels.py", "_attn_implementation"): "transformers names the attention kernel a model runs only "
                                                        "there (set_attn_implementation writes it)",
    ("drafters/formats/eagle.py", "_name_or_path"): "a published checkpoint's config.json names its base model there "
                                                    "(a file's field, not a loaded model's identity)",
}
# what a value that holds a registered name is called: a comparison of one with a literal name is a branch on it
NAME_FIELDS = {"name", "model", "model_path", "target", "drafter", "method"}


def holds_a_name(node: ast.expr) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return isinstance(node.args[0], ast.Constant) and node.args[0].value in NAME_FIELDS
    return (isinstance(node, ast.Attribute) and node.attr in NAME_FIELDS) or (isinstance(node, ast.Name) and node.id in NAME_FIELDS)


def last_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def private_field(subject: ast.expr, field: object) -> bool:
    """A private field (one leading underscore) of a transformers config, or its ``_name_or_path``
    wherever it is read from."""
    if not isinstance(field, str) or field.startswith("__") or not field.startswith("_"):
        return False
    return field == "_name_or_path" or last_name(subject).endswith("config")


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
        if isinstance(node, ast.Attribute) and private_field(node.value, node.attr) and (path, node.attr) not in PRIVATE_ALLOWED:
            found.append(f"{where}: reads transformers' private {node.attr} (a target's identity is Target.key)")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            subject, field = node.args[0], node.args[1].value
            if private_field(subject, field) and (path, field) not in PRIVATE_ALLOWED:
                found.append(f"{where}: {node.func.id}(..., {field!r}) reads transformers' private field")
            if (node.func.id == "getattr" and len(node.args) == 3 and isinstance(node.args[2], ast.Constant)
                    and node.args[2].value is None and last_name(subject).endswith("target")):
                found.append(f"{where}: getattr({ast.unparse(subject)}, {field!r}, None) probes a target (declare it)")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "_name_or_path"
                and (path, "_name_or_path") not in PRIVATE_ALLOWED):
            found.append(f"{where}: reads a config's _name_or_path (a target's identity is Target.key)")
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
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            sides = [node.left, *node.comparators]
            named = any(holds_a_name(s) for s in sides)
            elements = [e for s in sides for e in (s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [s])]
            literals = [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]
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
    ("if args.model != 'smollm2':\n    pass\n", "registered name"),
    ("if options.get('name') in ('draft_model', 'x'):\n    pass\n", "registered name"),
    ("str(getattr(target.model.config, '_name_or_path', ''))\n", "private"),
    ("target.model.config._name_or_path = name\n", "private"),
    ("config._commit_hash\n", "private"),
    ("raw.get('_name_or_path', '')\n", "_name_or_path"),
    ("getattr(target, 'model', None)\n", "probes a target"),
    ("getattr(self.target, 'cache', None)\n", "probes a target"),
])
def test_each_probe_is_found(source, offence):
    found = offences("experiments/x.py", source, {"synthetic", "hf", "smollm2", "draft_model"})
    assert len(found) == 1 and offence in found[0]


def test_a_declared_check_is_not_an_offence():
    source = "if target.kind == 'model' and TARGETS.trait(name, 'kind') == 'synthetic':\n    pass\nhasattr(os, 'sched_getaffinity')\n"
    assert offences("experiments/run/build.py", source, {"synthetic", "model"}) == []
    # a key looked up among the packaged models, a config's public field, a private attribute of our own
    source = ("packaged = key if key in PACKAGED_MODELS else None\ngetattr(config, 'sliding_window', None)\n"
              "self._cache = None\ngetattr(target.model.config, 'pad_token_id', None)\n")
    assert offences("drafters/heads.py", source, {"smollm2", "synthetic"}) == []
