"""A trained head from whichever layout its folder holds, and the drafters registered on such heads.

``checkpoint=DIR`` of drafter=eagle / eagle2 / eagle3, dflash, domino and medusa takes a head saved
here or one in a published layout (EAGLE's, SpecForge's, Medusa's, vLLM's speculators); the
functions below tell them apart by their files and hand each to its layout's module. They sit above
every layout module and the head modules: a head module (drafters.eagle, drafters.dflash,
drafters.medusa ...) knows no layout but its own, so loading a published head never makes it import
drafters.formats (tests/test_import_direction.py holds the layers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from drafters.base import BudgetKnobs, DrafterBase, TargetSizes, register
from drafters.dflash import DFlashDrafter, DFlashHead
from drafters.domino import DominoDrafter, DominoHead
from drafters.eagle import EagleDrafter, EagleHead, build_head, load_head, parse_eagle_config
from drafters.eagle_published import PublishedEagleHead
from drafters.formats import eagle as published_eagle
from drafters.formats import medusa as published_medusa
from drafters.formats import specforge, speculators
from drafters.heads import bundled_checkpoint, check_checkpoint, target_name
from drafters.medusa import MedusaDrafter, MedusaHeads, check_measured, load_heads, parse_config, tree_for
from specdec.protocols import HeadTarget
from specdec.speedup import TreeShape

# -- EAGLE: ours (format=specdec), EAGLE's and EAGLE-3's own, SpecForge's, vLLM's speculators eagle3 --


def load_published_eagle(directory: str | Path, target: HeadTarget, expected: str | None = None) -> PublishedEagleHead:
    """The published head in ``directory`` as a PublishedEagleHead for ``target``, on its device and
    dtype. Refused, before any weight is used, when the config or weights do not fit the target
    (hidden size, vocabulary, layer ids) or describe a variant the head does not compute."""
    directory = Path(directory)
    raw = published_eagle.read_config(directory)
    if speculators.detect_config(raw):
        return speculators.load_eagle3(directory, target, raw, expected)
    return published_eagle.load_published(directory, target, expected)


def check_published_eagle(directory: str | Path, target: TargetSizes, expected: str | None = None) -> str:
    """What load_published_eagle refuses, found before the target loads; returns the layout
    ("eagle3" for a speculators folder, checked by drafters.formats.speculators)."""
    directory = Path(directory)
    raw = published_eagle.read_config(directory)
    if speculators.detect_config(raw):
        speculators.check_eagle3(directory, target, raw, expected)
        return "eagle3"
    return published_eagle.check_published(directory, target, expected)


def _head_source(checkpoint: str | None, format: str, bundled: str, method: str, target: str) -> tuple[Path, str | None]:
    """The head's folder and layout: specdec (saved here), a published one, None (published, either)."""
    directory = Path(checkpoint) if checkpoint else bundled_checkpoint(bundled, method, target)
    if format not in ("auto", "specdec", *published_eagle.LAYOUTS):
        raise ValueError(f"drafter.format={format!r}: choose auto, specdec or {', '.join(published_eagle.LAYOUTS)}")
    if format == "auto":
        return directory, None if published_eagle.detect(directory) else "specdec"
    return directory, format


def load_any_head(checkpoint: str | None, format: str, bundled: str, method: str,
                  target: HeadTarget) -> EagleHead | PublishedEagleHead:
    """A head saved here (format specdec) or published by EAGLE, EAGLE-3 or SpecForge (eagle,
    eagle3; drafters.formats.eagle); auto tells them apart by their files. Default: a bundled head."""
    directory, layout = _head_source(checkpoint, format, bundled, method, target_name(target))
    return load_head(directory, target) if layout == "specdec" else load_published_eagle(directory, target, layout)


def head_check(bundled: str, method: str) -> Callable[[Mapping[str, Any], TargetSizes], None]:
    """What load_any_head refuses, found before the target loads (drafters.base.register's check)."""
    def check(options: Mapping[str, Any], target: TargetSizes) -> None:
        directory, layout = _head_source(options.get("checkpoint"), options.get("format", "auto"), bundled, method,
                                         target.name)
        if layout == "specdec":
            check_checkpoint(directory, target, "eagle", parse_eagle_config, build_head)
        else:
            check_published_eagle(directory, target, layout)

    return check


@register("eagle", needs="model", budget=BudgetKnobs(depth="depth"), check=head_check("eagle", "eagle"))
def eagle(target: HeadTarget, checkpoint: str | None = None, depth: int = 4, sampling: str = "deterministic",
          format: str = "auto") -> EagleDrafter:
    """EAGLE-1 chain drafting with a trained head (default: the bundled SmolLM2 head)."""
    head = load_any_head(checkpoint, format, "eagle", "eagle", target)
    return EagleDrafter(target, head, depth, 1, sampling=sampling)


def dynamic_tree_shape(top_k: int, **_) -> TreeShape:
    """EAGLE-2 trees: the top_k children of each of the top_k frontier nodes at every depth."""
    return TreeShape(children=top_k, parents=top_k)


@register("eagle2", needs="model", shape=dynamic_tree_shape, budget=BudgetKnobs(depth="depth", nodes="total_tokens"),
          check=head_check("eagle", "eagle"))
def eagle2(target: HeadTarget, checkpoint: str | None = None, depth: int = 4, top_k: int = 4, total_tokens: int = 16,
           sampling: str = "deterministic", shape: str = "dynamic", format: str = "auto") -> EagleDrafter:
    """EAGLE-2 dynamic tree over the same kind of head."""
    head = load_any_head(checkpoint, format, "eagle", "eagle", target)
    return EagleDrafter(target, head, depth, top_k, total_tokens, sampling, shape)


@register("eagle3", needs="model", shape=dynamic_tree_shape, budget=BudgetKnobs(depth="depth", nodes="total_tokens"),
          check=head_check("eagle3", "eagle3"))
def eagle3(target: HeadTarget, checkpoint: str | None = None, depth: int = 4, top_k: int = 4, total_tokens: int = 16,
           sampling: str = "deterministic", shape: str = "dynamic", format: str = "auto") -> EagleDrafter:
    """EAGLE-3: a head over fused low/mid/high target layers (trained with specdec-train train=eagle3)."""
    head = load_any_head(checkpoint, format, "eagle3", "eagle3", target)
    return EagleDrafter(target, head, depth, top_k, total_tokens, sampling, shape)


# -- DFlash and Domino: SpecForge's layout (also ours), vLLM's speculators dflash ---------------------


def save_dflash(head: DFlashHead, directory: str | Path, extra: dict | None = None) -> None:
    """A SpecForge folder (config.json + model.safetensors) that SpecForge's classes load; ``extra``
    (training records) goes into config.json's ``specdec`` section."""
    specforge.save(head, directory, extra)


def check_dflash(directory: str | Path, target: TargetSizes) -> type[DFlashHead]:
    """What ``load_dflash`` refuses, read from the folder's config and weight header alone, before
    the target loads; the class of the head it holds."""
    if speculators.detect(directory):
        return speculators.check_dflash(directory, target)
    return specforge.check(directory, target)


def check_dflash_options(options: Mapping[str, Any], target: TargetSizes) -> None:
    """What ``load_dflash`` refuses, before the target loads (null checkpoint: the bundled head)."""
    check_dflash(options.get("checkpoint") or bundled_checkpoint("dflash", "dflash", target.name), target)


def load_dflash(directory: str | Path, target: HeadTarget) -> DFlashHead:
    """A SpecForge DFlash or Domino folder (or one ``save_dflash`` wrote), or a speculators dflash
    folder (drafters.formats.speculators), checked against ``target``."""
    if speculators.detect(directory):
        return speculators.load_dflash(directory, target)
    return specforge.load(directory, target)


@register("dflash", needs="model", budget=BudgetKnobs(depth="depth", bounded=True), check=check_dflash_options)
def dflash(target: HeadTarget, checkpoint: str | None = None, depth: int | None = None, sampled: bool = False) -> DFlashDrafter:
    """DFlash block drafting with a trained head: ``checkpoint`` = a SpecForge DFlashDraftModel folder,
    a vLLM speculators dflash folder, or one ``specdec-train train=dflash`` wrote, null the head
    bundled for the target; depth null = the whole block; sampled=true draws each position from q
    at T > 0 (exact p/q test)."""
    directory = checkpoint or bundled_checkpoint("dflash", "dflash", target_name(target))
    return DFlashDrafter(target, load_dflash(directory, target), depth, sampled)


def save_domino(head: DominoHead, directory: str | Path, extra: dict | None = None) -> None:
    save_dflash(head, directory, extra)


def not_domino(directory: str | Path) -> str:
    return f"{directory} holds a DFlash head, not a Domino one; use drafter=dflash"


def load_domino(directory: str | Path, target: HeadTarget) -> DominoHead:
    head = load_dflash(directory, target)
    if not isinstance(head, DominoHead):
        raise ValueError(not_domino(directory))
    return head


def check_domino_options(options: Mapping[str, Any], target: TargetSizes) -> None:
    """What ``load_domino`` refuses, before the target loads (null checkpoint: the bundled head)."""
    checkpoint = options.get("checkpoint") or bundled_checkpoint("domino", "domino", target.name)
    if not issubclass(check_dflash(checkpoint, target), DominoHead):
        raise ValueError(not_domino(checkpoint))


@register("domino", needs="model", budget=BudgetKnobs(depth="depth", bounded=True), check=check_domino_options)
def domino(target: HeadTarget, checkpoint: str | None = None, depth: int | None = None, sampled: bool = False) -> DrafterBase:
    """Domino with a trained head: ``checkpoint`` = a SpecForge DominoDraftModel folder or one
    ``specdec-train train=domino`` wrote; null = the head bundled for the target. depth null = the
    whole block; sampled=true draws each position from the refined q at T > 0 (exact p/q test)."""
    directory = checkpoint or bundled_checkpoint("domino", "domino", target_name(target))
    return DominoDrafter(target, load_domino(directory, target), depth, sampled)


# -- Medusa: ours, Medusa's own, vLLM's ---------------------------------------------------------------


def check_any_heads(options: Mapping[str, Any], target: TargetSizes) -> None:
    """What load_any_heads refuses, found before the target loads (drafters.base.register's check)."""
    checkpoint = options.get("checkpoint")
    if checkpoint is not None and published_medusa.detect(checkpoint):
        published_medusa.check_published(checkpoint, target)
        return
    directory = checkpoint or bundled_checkpoint("medusa", "medusa", target.name)
    check_measured(check_checkpoint(directory, target, "medusa", parse_config, MedusaHeads, label="Medusa"), directory)


@register("medusa", needs="model", budget=BudgetKnobs(depth="depth", nodes="total_tokens", bounded=True), check=check_any_heads)
def medusa(target: HeadTarget, checkpoint: str | None = None, total_tokens: int | None = None, depth: int | None = None,
           tree: list[list[int]] | None = None) -> MedusaDrafter:
    """Medusa-1 heads (default: the bundled SmolLM2 heads; ``checkpoint`` also takes the layouts
    Medusa and vLLM publish) with their measured static tree; total_tokens / depth rebuild the tree
    from the stored accuracies for another budget; ``tree`` gives the rank paths directly."""
    heads = load_any_heads(checkpoint, target)
    return MedusaDrafter(target, heads, tree_for(heads.config, total_tokens, depth, tree))


def load_any_heads(checkpoint: str | Path | None, target: HeadTarget) -> MedusaHeads:
    """Heads from ``checkpoint`` in our layout or a published one (the bundled heads for None)."""
    if checkpoint is None:
        return load_heads(bundled_checkpoint("medusa", "medusa", target_name(target)), target)
    if published_medusa.detect(checkpoint):
        return published_medusa.load_published(checkpoint, target)
    return load_heads(checkpoint, target)
