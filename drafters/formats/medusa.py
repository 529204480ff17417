"""Medusa heads in the layouts their reference implementation publishes and vLLM serves: loaded
as :class:`drafters.medusa.MedusaHeads` (``drafter=medusa drafter.checkpoint=DIR``), and heads
trained here written out for vLLM (``specdec-export``).

Layouts (learnt from the projects' own loaders, FasterDecoding/Medusa ``medusa/model/medusa_model.py``
and vLLM ``vllm/model_executor/models/medusa.py`` with its ``MedusaConfig``):

- Medusa (``medusa`` dialect): config.json with ``medusa_num_heads``, ``medusa_num_layers`` and
  ``base_model_name_or_path``; the weights in ``medusa_lm_head.safetensors`` (what its training
  writes) or ``medusa_lm_head.pt`` (the pickled state dict its published heads ship, read only
  through ``torch.load(weights_only=True)``). Head k is ``{k}.{j}.linear.weight`` [H, H] and
  ``.bias`` [H] for its residual blocks j < L, then ``{k}.{L}.weight`` [V, H]: its own LM head over
  the whole vocabulary, without bias.
- vLLM (``vllm`` dialect): config.json with model_type ``medusa`` (architecture ``MedusaModel``),
  hidden_size, vocab_size, num_heads, num_hidden_layers, truncated_vocab_size, original_lm_head and
  medusa_fc_bias; ``*.safetensors`` with ``blocks.{k}.layers.{j}.weight`` (``.bias`` only when
  medusa_fc_bias), ``lm_heads.{k}.weight`` [D, H] (only ``lm_heads.0.weight`` when original_lm_head:
  one LM head for every head) and, when truncated_vocab_size D < vocab_size, ``token_map`` [D]: the
  target token id of each LM head row (every other token's logit is -inf). Keys may carry a
  ``medusa_heads.`` prefix.

Both compute head k as x <- x + SiLU(W_kj x + b_kj) for j < L from the target's final-norm feature,
then the head's LM head: MedusaHeads with ``num_layers`` = L and ``own_lm_heads``, over draft_ids =
token_map (the whole vocabulary without one). A head whose LM head rows all equal the target's is
loaded as a shared-LM-head one instead: the same function, on the target's kernels, and what our
export writes. Medusa's reference module repeats ONE block object L times, so its blocks share
weights while its state dict lists each under its own index; each index loads as its own block
here, as vLLM does, which computes the same function. Medusa's own loader trusts the weights over
``medusa_num_heads`` (some published configs understate it), so the weights decide K here too.

Tree: a published head has no measured accuracies, so it drafts the top-1 chain through its heads
(what vLLM drafts with them) unless ``drafter.tree`` gives the paths (drafters/medusa.py). Our
export keeps the measured accuracies and tree in a ``specdec`` block of config.json, which vLLM
ignores and the import restores.

Export (vLLM only: SGLang has no Medusa drafter). Our heads share the target's LM head over a
reduced draft vocabulary, which vLLM expresses exactly: ``original_lm_head`` with the target's rows
for draft_ids as the one LM head, draft_ids as token_map (truncated_vocab_size = D), so every token
outside the draft vocabulary gets -inf as in our drafter and vLLM's top-1 equals ours. (Medusa's own
layout has no such map: full-vocabulary LM heads would let tokens outside the draft vocabulary
compete, so it is not written.) The rows come from the target the heads were trained for, loaded
from its folder; they are written in float32, so the import recognises them as the target's at any
dtype the target runs in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from drafters.base import TargetSizes
from drafters.head_storage import read_weights, weight_shapes
from drafters.heads import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    check_checkpoint,
    check_export_folder,
    sizes_of,
    write_checkpoint,
)
from drafters.medusa import TARGET_FOLDER, MedusaConfig, MedusaHeads, parse_config
from specdec.assets import check_model_folder, model_loading_errors
from specdec.packaged_models import PACKAGED_MODELS, converted_path
from specdec.protocols import HeadTarget

MEDUSA_SAFETENSORS, MEDUSA_PICKLE = "medusa_lm_head.safetensors", "medusa_lm_head.pt"
EXTRA = "specdec"  # our block in an exported config.json: measured accuracies, tree, target
ENGINES = ("vllm", "sglang")

MEDUSA_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
MEDUSA_LM_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")
VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
VLLM_LM_HEAD = re.compile(r"lm_heads\.(\d+)\.weight")


@dataclass(frozen=True)
class PublishedHeads:
    """A published checkpoint's tensors, whichever the dialect."""

    weight: Tensor  # [K, L, H, H] block weights
    bias: Tensor  # [K, L, H] block biases (zeros where the layout has none)
    lm_heads: Tensor  # [K or 1, D, H] LM head rows (1: one LM head serves every head)
    token_map: Tensor | None  # [D] int64 target token id of each row; None: row i is token i
    vocab_size: int  # the vocabulary the heads draft for
    base_model: str  # what the checkpoint says it was trained for


def detect(directory: str | Path) -> bool:
    """Whether ``directory`` holds Medusa heads in a published layout (not ours)."""
    directory = Path(directory)
    if (directory / MEDUSA_SAFETENSORS).is_file() or (directory / MEDUSA_PICKLE).is_file():
        return True
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (_is_vllm(config) or "medusa_num_heads" in config)


def _is_vllm(config: dict) -> bool:
    return config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or [])


def check_published(directory: str | Path, target: TargetSizes) -> None:
    """What load_published refuses, found before the target loads: the layout read from config.json
    and the weight files' headers (meta tensors: no weight is read, but a pickled head is loaded,
    through torch.load(weights_only=True), to be refused here if it holds more than tensors)."""
    _read(Path(directory), target, meta=True)


def _read(directory: Path, target: TargetSizes, meta: bool) -> tuple[dict, PublishedHeads]:
    config = _read_config(directory)
    published = _read_vllm(directory, config, meta) if _is_vllm(config) else _read_medusa(directory, config, meta)
    _check_fits(directory, published, config.get(EXTRA) or {}, target)
    return config, published


def load_published(directory: str | Path, target: HeadTarget) -> MedusaHeads:
    """Medusa heads from a published layout, checked against ``target`` (hidden size, vocabulary)
    before anything decodes; clear errors for a missing, corrupt or mismatched checkpoint."""
    directory = Path(directory)
    config, published = _read(directory, sizes_of(target), meta=False)
    extra = config.get(EXTRA) or {}
    k, layers, h, _ = published.weight.shape
    rows = target.model.get_output_embeddings().weight.detach()  # [V, H]
    draft_ids = published.token_map if published.token_map is not None else torch.arange(published.vocab_size)
    target_rows = rows[draft_ids.to(rows.device)]  # [D, H]
    shared = all(torch.equal(lm.to(device=rows.device, dtype=rows.dtype), target_rows) for lm in published.lm_heads)
    measured = parse_config({"hidden_size": h, "vocab_size": target.vocab_size, "num_heads": k,
                             "draft_vocab_size": len(draft_ids), "target_num_layers": target.num_layers,
                             "target": extra.get("target") or published.base_model,
                             "accuracies": extra.get("accuracies", []), "tree": extra.get("tree", []),
                             "num_layers": layers, "own_lm_heads": not shared})
    heads = MedusaHeads(measured, draft_ids)
    state = {"weight": published.weight.reshape(k, layers * h, h), "bias": published.bias.reshape(k, layers * h),
             "draft_ids": draft_ids}
    if not shared:
        state["lm_heads"] = published.lm_heads.expand(k, -1, -1)
    heads.load_state_dict(state)
    return heads.to(device=target.device, dtype=target.dtype).eval()


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {CONFIG_FILE}; a published Medusa checkpoint ships one beside its weights")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); restore the checkpoint") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object; restore the checkpoint")
    return config


def _read_medusa(directory: Path, config: dict, meta: bool) -> PublishedHeads:
    """Medusa's layout: per head, L residual blocks then its own full-vocabulary LM head."""
    state = _read_medusa_weights(directory, meta)
    blocks, lm_heads = {}, {}
    for key, tensor in state.items():
        name = key.removeprefix("medusa_head.")
        if match := MEDUSA_BLOCK.fullmatch(name):
            blocks[int(match[1]), int(match[2]), match[3]] = tensor
        elif match := MEDUSA_LM_HEAD.fullmatch(name):
            lm_heads[int(match[1]), int(match[2])] = tensor
        else:
            raise ValueError(f"{directory}: unexpected tensor {key!r} in a Medusa head file (expected "
                             f"'<head>.<block>.linear.weight|bias' and '<head>.<L>.weight')")
    weight, bias = _stack_blocks(directory, blocks, bias_required=True)
    num_heads, num_layers = weight.shape[:2]
    if sorted(lm_heads) != [(head, num_layers) for head in range(num_heads)]:
        raise ValueError(f"{directory}: expected one LM head '<head>.{num_layers}.weight' after the {num_layers} "
                         f"block(s) of each of the {num_heads} heads; found {sorted(lm_heads)}")
    rows = torch.stack([lm_heads[head, num_layers] for head in range(num_heads)])  # [K, V, H]
    return PublishedHeads(weight, bias, rows, None, rows.shape[1], str(config.get("base_model_name_or_path", "")))


def _read_safetensors(path: Path, meta: bool) -> dict[str, Tensor]:
    """A safetensors file's tensors, or (meta) tensors of their shapes on the meta device, from its header."""
    try:
        if meta:
            return {name: torch.empty(shape, device="meta") for name, shape in weight_shapes(path).items()}
        return read_weights(path)
    except Exception as error:  # safetensors raises its own type for a corrupt header
        raise ValueError(f"{path} is corrupt ({error}); restore it") from error


def _read_medusa_weights(directory: Path, meta: bool) -> dict[str, Tensor]:
    if (directory / MEDUSA_SAFETENSORS).is_file():
        return _read_safetensors(directory / MEDUSA_SAFETENSORS, meta)
    path = directory / MEDUSA_PICKLE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no Medusa head weights ({MEDUSA_SAFETENSORS} or {MEDUSA_PICKLE}); "
                                f"heads saved inside a whole Medusa-2 model are not read")
    try:  # weights_only: a pickle may run code; only tensors and plain containers are accepted
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path} is not a plain state dict of tensors (torch.load(weights_only=True): {first}); "
                         f"convert it to {MEDUSA_SAFETENSORS} where it came from") from error
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a state dict of tensors; restore the checkpoint")
    return state


def _read_vllm(directory: Path, config: dict, meta: bool) -> PublishedHeads:
    """vLLM's layout: per head, L residual blocks (bias only with medusa_fc_bias); per-head LM heads or
    one (original_lm_head) over truncated_vocab_size rows, mapped to target ids by token_map."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors weights for its vLLM Medusa config")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(_read_safetensors(file, meta))
    blocks, lm_heads, token_map = {}, {}, None
    for key, tensor in state.items():
        name = key.removeprefix("medusa_heads.")
        if match := VLLM_BLOCK.fullmatch(name):
            blocks[int(match[1]), int(match[2]), match[3]] = tensor
        elif match := VLLM_LM_HEAD.fullmatch(name):
            lm_heads[int(match[1])] = tensor
        elif name == "lm_head.weight":  # vLLM's own name for the one LM head of original_lm_head
            lm_heads[0] = tensor
        elif name == "token_map":
            token_map = tensor.to(torch.int64)
        else:
            raise ValueError(f"{directory}: unexpected tensor {key!r} in a vLLM Medusa checkpoint")
    has_bias = any(kind == "bias" for _, _, kind in blocks)
    if has_bias and not config.get("medusa_fc_bias", False):
        raise ValueError(f"{directory}: the blocks have biases but config.json's medusa_fc_bias is not true, so vLLM "
                         f"would drop them; set medusa_fc_bias: true if they belong to the heads")
    weight, bias = _stack_blocks(directory, blocks, bias_required=bool(config.get("medusa_fc_bias", False)))
    num_heads = weight.shape[0]
    declared = _vllm_count(config, "heads")
    if declared is not None and declared != num_heads:
        raise ValueError(f"{directory}: config.json declares {declared} heads, the weights hold {num_heads}; fix the config")
    declared = _vllm_count(config, "layers")
    if declared is not None and declared != weight.shape[1]:
        raise ValueError(f"{directory}: config.json declares {declared} layers per head, the weights hold "
                         f"{weight.shape[1]}; fix the config")
    expected = [0] if config.get("original_lm_head", False) else list(range(num_heads))
    if sorted(lm_heads) != expected:
        raise ValueError(f"{directory}: expected LM heads lm_heads.{{{','.join(map(str, expected))}}}.weight "
                         f"(original_lm_head={bool(config.get('original_lm_head', False))}); found {sorted(lm_heads)}")
    rows = torch.stack([lm_heads[head] for head in expected])  # [K or 1, rows, H]
    vocab_size = int(config.get("vocab_size", rows.shape[1]))
    truncated = int(config.get("truncated_vocab_size") or vocab_size)
    if truncated < vocab_size:
        if token_map is None or token_map.shape != (truncated,):
            raise ValueError(f"{directory}: truncated_vocab_size {truncated} < vocab_size {vocab_size} needs a token_map "
                             f"of {truncated} token ids; found {None if token_map is None else tuple(token_map.shape)}")
        if rows.shape[1] > truncated:  # vLLM keeps the token_map rows of a full-vocabulary LM head
            rows = rows[:, token_map]
    else:
        token_map = None  # vLLM ignores it then: row i is token i
    if rows.shape[1] != truncated:
        raise ValueError(f"{directory}: the LM heads have {rows.shape[1]} rows, config.json's vocabulary "
                         f"(truncated_vocab_size) is {truncated}")
    if token_map is not None and not token_map.is_meta and (
            bool((token_map < 0).any()) or bool((token_map >= vocab_size).any()) or len(token_map.unique()) != len(token_map)):
        raise ValueError(f"{directory}: token_map must hold distinct token ids below vocab_size {vocab_size}")
    return PublishedHeads(weight, bias, rows, token_map, vocab_size, str(config.get("base_model_name_or_path", "")))


def _vllm_count(config: dict, what: str) -> int | None:
    """What vLLM's config reader takes as the number of heads or layers: any key naming 'num' and ``what``."""
    values = [v for key, v in config.items() if "num" in key and what in key and isinstance(v, int)]
    return values[-1] if values else None


def _stack_blocks(directory: Path, blocks: dict, bias_required: bool) -> tuple[Tensor, Tensor]:
    """{(head, block, 'weight'|'bias'): tensor} -> weight [K, L, H, H], bias [K, L, H]; every head
    must have the same L blocks, numbered from 0."""
    weights = sorted((head, block) for head, block, kind in blocks if kind == "weight")
    if not weights:
        raise ValueError(f"{directory}: no residual block weights found; is this a Medusa head checkpoint?")
    num_heads, num_layers = weights[-1][0] + 1, weights[-1][1] + 1
    grid = [(head, block) for head in range(num_heads) for block in range(num_layers)]
    if weights != grid:
        raise ValueError(f"{directory}: every head needs blocks 0..L-1; found {weights}")
    biases = sorted((head, block) for head, block, kind in blocks if kind == "bias")
    if biases != grid and (biases or bias_required):
        raise ValueError(f"{directory}: every block needs a bias; found biases for {biases}")
    weight = torch.stack([torch.stack([blocks[head, block, "weight"] for block in range(num_layers)])
                          for head in range(num_heads)])  # [K, L, H, H]
    if weight.shape[-1] != weight.shape[-2]:
        raise ValueError(f"{directory}: block weights must be square [H, H]; got {list(weight.shape[-2:])}")
    if biases:
        bias = torch.stack([torch.stack([blocks[head, block, "bias"] for block in range(num_layers)])
                            for head in range(num_heads)])  # [K, L, H]
    else:
        bias = torch.zeros(weight.shape[:3], dtype=weight.dtype)
    return weight, bias


def _check_fits(directory: Path, published: PublishedHeads, extra: dict, target: TargetSizes) -> None:
    """Refuse heads for another target, naming every size that differs."""
    hidden = published.weight.shape[-1]
    sizes = [("hidden size", hidden, target.hidden_size), ("vocabulary", published.vocab_size, target.vocab_size),
             ("LM head width", published.lm_heads.shape[-1], target.hidden_size)]
    if "target_num_layers" in extra:
        sizes.append(("layers", int(extra["target_num_layers"]), target.num_layers))
    mismatches = [f"{name}: heads {mine}, target {theirs}" for name, mine, theirs in sizes if mine != theirs]
    if mismatches:
        raise ValueError(
            f"the Medusa heads at {directory} (trained for {published.base_model or extra.get('target') or 'an unnamed model'}) "
            f"do not fit this target ({target.name}): " + "; ".join(mismatches)
        )


def export(checkpoint_dir: Path, out_dir: Path, engine: str, target_dir: Path | None = None) -> None:
    """Write our Medusa checkpoint at ``checkpoint_dir`` in the layout ``engine`` loads (vLLM only).
    The LM head rows come from the target's Hugging Face folder: ``target_dir``, else the
    fine-tuned target a Medusa-2 export holds, else the folder the checkpoint names."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if engine == "sglang":
        raise ValueError("SGLang has no Medusa drafter (its speculative algorithms are EAGLE, EAGLE3, MTP/NEXTN, "
                         "STANDALONE and NGRAM); export Medusa heads with engine=vllm")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    config, state = _read_native(checkpoint_dir)
    check_export_folder(out_dir)
    folder = _target_folder(checkpoint_dir, config, target_dir)
    lm_head = _target_lm_head(folder)  # [V, H] float32
    if tuple(lm_head.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"the target's LM head is {list(lm_head.shape)} but the Medusa checkpoint at {checkpoint_dir} was trained "
            f"for vocabulary {config.vocab_size}, hidden size {config.hidden_size}; pass the folder of its target"
        )
    tensors, out_config = vllm_layout(config, state, lm_head, str(folder))
    write_checkpoint(out_dir, out_config, tensors)


def serve_command(out_dir: Path, engine: str) -> str:
    """The vLLM command that serves the target with heads exported to ``out_dir`` (for the CLI to print)."""
    config = json.loads((Path(out_dir) / CONFIG_FILE).read_text())
    spec = {"method": "medusa", "model": str(out_dir), "num_speculative_tokens": config["num_heads"]}
    return f"vllm serve {config.get('base_model_name_or_path') or '<target>'} --speculative-config '{json.dumps(spec)}'"


def vllm_layout(config: MedusaConfig, state: dict[str, Tensor], lm_head: Tensor,
                base_model: str) -> tuple[dict[str, Tensor], dict]:
    """Our heads' state dict as vLLM's tensors and config.json (module docstring); ``lm_head`` [V, H]
    is the target's, from the folder ``base_model``."""
    k, layers, h = config.num_heads, config.num_layers, config.hidden_size
    weight, bias = state["weight"].view(k, layers, h, h), state["bias"].view(k, layers, h)
    draft_ids = state["draft_ids"]  # [D]
    truncated = config.draft_vocab_size < config.vocab_size
    tensors = {}
    for head in range(k):
        for layer in range(layers):
            tensors[f"blocks.{head}.layers.{layer}.weight"] = weight[head, layer].clone()
            tensors[f"blocks.{head}.layers.{layer}.bias"] = bias[head, layer].clone()
    if config.own_lm_heads:
        rows = state["lm_heads"]  # [K, D, H] in draft order
    else:
        rows = lm_head.float()[draft_ids][None]  # [1, D, H] the target's rows, float32 (module docstring)
    if truncated:
        tensors["token_map"] = draft_ids.clone()
    else:  # no token_map: vLLM reads row i as token i
        rows = torch.empty_like(rows).index_copy_(1, draft_ids, rows)
    for head in range(rows.shape[0]):
        tensors[f"lm_heads.{head}.weight"] = rows[head].clone()
    out_config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": h,
        "vocab_size": config.vocab_size,
        "num_heads": k,
        "num_hidden_layers": layers,
        "truncated_vocab_size": config.draft_vocab_size,
        "original_lm_head": not config.own_lm_heads,
        "medusa_fc_bias": True,
        "torch_dtype": str(weight.dtype).removeprefix("torch."),
        "base_model_name_or_path": base_model,
        EXTRA: {"target": config.target, "target_num_layers": config.target_num_layers,
                "accuracies": [list(row) for row in config.accuracies], "tree": [list(path) for path in config.tree]},
    }
    return tensors, out_config


def check_native(checkpoint_dir: Path) -> MedusaConfig:
    """A Medusa checkpoint written here, checked from its config and weight header before anything loads."""
    if detect(checkpoint_dir):
        raise ValueError(f"{checkpoint_dir} already holds Medusa heads in a published layout; export takes a "
                         f"checkpoint trained here (specdec-train train=medusa)")
    return check_checkpoint(checkpoint_dir, None, "medusa", parse_config, MedusaHeads, label="Medusa")


def _read_native(checkpoint_dir: Path) -> tuple[MedusaConfig, dict[str, Tensor]]:
    config = check_native(checkpoint_dir)
    try:
        state = read_weights(checkpoint_dir / WEIGHTS_FILE)
        MedusaHeads(config).load_state_dict(state)  # the tensors must fit the config before anything is written
    except Exception as error:
        raise ValueError(f"the Medusa checkpoint at {checkpoint_dir} is corrupt or incomplete: {error}") from error
    draft_ids = state["draft_ids"]
    if len(draft_ids.unique()) != len(draft_ids) or bool((draft_ids < 0).any()) or bool((draft_ids >= config.vocab_size).any()):
        raise ValueError(f"the Medusa checkpoint at {checkpoint_dir} is corrupt: draft_ids must be distinct token ids "
                         f"below {config.vocab_size}")
    return config, state


def _target_folder(checkpoint_dir: Path, config: MedusaConfig, target_dir: Path | None) -> Path:
    if target_dir is not None:
        return Path(target_dir)
    if (checkpoint_dir / TARGET_FOLDER).is_dir():  # Medusa-2: the heads draft for the target fine-tuned with them
        return checkpoint_dir / TARGET_FOLDER
    named = Path(config.target)
    if config.target and named.is_dir():
        return named
    for model in PACKAGED_MODELS.values():
        # a packaged target, as heads record it: by its key, or (heads trained before keys) by its
        # converted folder on the machine that trained them; here, wherever this machine's cache is
        if config.target == model.name or named.name == model.cache_name:
            return converted_path(model.name)
    raise ValueError(f"the Medusa checkpoint at {checkpoint_dir} was trained for {config.target or 'an unnamed target'}, "
                     f"which is not a folder here; pass the target's Hugging Face folder as target_dir")


def _target_lm_head(folder: Path) -> Tensor:  # [V, H] float32
    from transformers import AutoModelForCausalLM  # transformers: about 16 s to import, needed for export alone

    option = f"the target folder {folder}"
    check_model_folder(folder, option)
    with model_loading_errors(option, "pass the Hugging Face folder of the target the heads were trained for"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.get_output_embeddings().weight.detach()
