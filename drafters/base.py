"""The Drafter protocol and the registry that configs name drafters through.

Adding a drafter = one module here that calls ``register("name")`` on its factory, plus one YAML in
configs/drafter/. Nothing in the core or the verifiers dispatches on drafter names.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torch import Tensor, nn

from specdec.cpu_kernels import pack_linears
from specdec.protocols import DraftContext, Drafter, VerifyResult
from specdec.speedup import TreeShape
from specdec.tree import DraftTree, SiblingMode

__all__ = [
    "DraftContext", "DraftTree", "Drafter", "SiblingMode", "StatelessDrafter", "VerifyResult", "build",
    "catch_up_runs", "check_options", "draft_lm_head", "names", "register", "tree_shape", "use_target_kernels",
]

_REGISTRY: dict[str, Callable[..., Drafter]] = {}
# name: (the factory's options) -> the trees the drafter can build
_SHAPE: dict[str, Callable[..., TreeShape]] = {}


class StatelessDrafter:
    """Base for drafters that keep nothing per request between steps (everything they need is
    rebuilt from each DraftContext): starting, admitting, committing and dropping requests is free."""

    def reset(self, batch_size: int, max_length: int) -> None:
        pass

    def admit(self, count: int, max_length: int) -> None:
        pass

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def retain(self, rows) -> None:
        pass


def use_target_kernels(module: nn.Module, target) -> nn.Module:
    """A drafter's own linear layers on the CPU kernels its target chose (specdec.cpu_kernels):
    oneDNN's packed GEMM from the row count the target timed. A head runs as few rows as the target
    and is as wide as one of its layers, so the stock kernels cost it as much: on the AMD EPYC,
    where MKL's few-row kernels are slow, the union's drafting per step fell markedly in float32
    with them (docs/RESULTS.md, "Heads on the target's kernels"). A no-op for targets without packed
    GEMMs (a GPU, the synthetic target); training is unaffected (a packed layer takes the stock
    kernel under autograd)."""
    threshold = getattr(target, "packed_gemm_from", None)
    if threshold:
        pack_linears(module, threshold)
    return module


def draft_lm_head(target, draft_ids: Tensor) -> nn.Module:
    """The target's frozen LM head restricted to ``draft_ids`` [K] (a head's draft vocabulary), as
    a module [..., H] -> [..., K] on the target's kernels."""
    rows = target.model.get_output_embeddings().weight.detach()[draft_ids]  # [K, H]
    layer = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    layer.weight = nn.Parameter(rows, requires_grad=False)
    return use_target_kernels(nn.Sequential(layer), target)  # packing swaps a container's children


def catch_up_runs(counts: Sequence[int], prompt_rows: int = 32) -> list[slice]:
    """Contiguous runs of a batch whose requests bring ``counts`` new rows each, for a drafter that
    pads every request of one call to the call's longest: requests bringing more than
    ``prompt_rows`` rows (a prompt just admitted) and the others (a step's accepted rows) never
    share a run. One call over a batch with an admission computed the prompt's length for every
    request (B x L rows at batch B). SpecDecoder appends admitted requests, so a step with an
    admission has two runs; linear in B, since batches of thousands of requests go through it."""
    runs, start = [], 0
    for end in range(1, len(counts) + 1):
        if end == len(counts) or (counts[end] > prompt_rows) != (counts[start] > prompt_rows):
            runs.append(slice(start, end))
            start = end
    return runs


def register(
    name: str, shape: Callable[..., TreeShape] | None = None
) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    """``shape(**options)``, for tree drafters that cannot build every tree (an EAGLE-2 tree gives
    each node at most top_k children and expands only top_k nodes per depth): the TreeShape of
    the trees the factory's ``options`` build, which the tree-budget chooser keeps to."""

    def decorate(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"drafter {name!r} is registered twice")
        _REGISTRY[name] = factory
        if shape is not None:
            _SHAPE[name] = shape
        return factory

    return decorate


def _import_all() -> None:
    import drafters

    for module in pkgutil.iter_modules(drafters.__path__):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"drafters.{module.name}")


def names() -> list[str]:
    _import_all()
    return sorted(_REGISTRY)


# Options by these names name a folder on disk (a trained head, a datastore); a drafter whose
# factory takes `members` (drafter configs, as the union does) has each member checked too.
FOLDER_OPTIONS = ("checkpoint", "datastore")


def check_options(name: str, options: Mapping[str, object]) -> None:
    """Refuse options the drafter's factory does not take, by its signature, and folder options
    naming no folder: a typo in a drafter YAML or override fails before any model loads rather than
    when the drafter is built."""
    _import_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    parameters = list(_signature(_REGISTRY[name]).parameters.values())[1:]  # after the target
    known = [p.name for p in parameters]
    unknown = sorted(set(options) - set(known))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise ValueError(f"drafter {name!r} takes no option {', '.join(unknown)}; its options are {', '.join(known)}")
    for parameter in parameters:
        if parameter.name in options and not _fits(options[parameter.name], parameter.annotation):
            raise ValueError(
                f"drafter {name!r}: {parameter.name}={options[parameter.name]!r} is not a value of type "
                f"{_type_name(parameter.annotation)}"
            )
    for key in FOLDER_OPTIONS:
        folder = options.get(key)
        if isinstance(folder, (str, Path)) and not Path(folder).expanduser().is_dir():
            raise ValueError(f"drafter {name!r}: {key}={folder} is not a folder; give an existing folder, or null for the bundled one")
    members = options.get("members")
    if isinstance(members, Sequence) and not isinstance(members, str):
        for member in members:
            if isinstance(member, Mapping) and isinstance(member.get("name"), str):
                check_options(member["name"], {k: v for k, v in member.items() if k != "name"})


SCALARS = (int, float, str, bool, type(None))  # the option types a YAML value is checked against


def _signature(factory: Callable[..., Drafter]) -> inspect.Signature:
    try:
        return inspect.signature(factory, eval_str=True)
    except NameError:  # an annotation naming a type imported for type checkers only: options stay unchecked
        return inspect.signature(factory)


def _fits(value: object, annotation: object) -> bool:
    """Whether a config value fits a factory parameter annotated with scalars only (``int``,
    ``float | None``, ...); other annotations (paths, sequences, loaded objects) are the factory's to check."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
    if not members or not all(member in SCALARS for member in members):
        return True
    if isinstance(value, bool):
        return bool in members
    return isinstance(value, members) or (isinstance(value, int) and float in members)


def _type_name(annotation: object) -> str:
    return getattr(annotation, "__name__", None) or str(annotation)


def tree_shape(name: str, options: Mapping[str, object]) -> TreeShape:
    """The trees drafter ``name`` with ``options`` (the factory's, defaults filled in) can build;
    unbounded when its registration declares no shape."""
    check_options(name, options)
    if name not in _SHAPE:
        return TreeShape()
    defaults = {
        p.name: p.default
        for p in list(_signature(_REGISTRY[name]).parameters.values())[1:]
        if p.default is not p.empty
    }
    return _SHAPE[name](**{**defaults, **options})


def build(name: str, target, **kwargs) -> Drafter:
    """Build a registered drafter for ``target``; kwargs (tree shapes, checkpoints) go to its
    factory, whose first parameter is always the target (some drafters read its weights)."""
    check_options(name, kwargs)
    try:
        return _REGISTRY[name](target, **kwargs)
    except AttributeError as error:  # the Target protocol leaves a model's sizes and layers optional
        if error.obj is not target:
            raise
        raise ValueError(
            f"drafter {name!r} reads the target's {error.name}, which a {type(target).__name__} does not have; "
            f"use it on a model target (target=smollm2 or target=hf)"
        ) from None
