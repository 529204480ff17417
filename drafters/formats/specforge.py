"""SpecForge's DFlash and Domino folders: the layout SpecForge trains and saves (``DFlashDraftModel``,
``DominoDraftModel``, learned from specforge/modeling/draft/dflash.py and domino.py), z-lab publishes
DFlash heads in, and SGLang's DFLASH algorithm loads. It is also how heads trained here are saved.

- config.json: a Qwen3 config (hidden_size, num_attention_heads, num_key_value_heads, head_dim,
  intermediate_size, num_hidden_layers, rms_norm_eps, the RoPE base, attention_bias, vocab_size,
  layer_types) plus ``block_size``, ``num_target_layers`` and ``dflash_config``: mask_token_id,
  target_layer_ids, projector_type ("domino" for Domino), and for Domino pure_draft_prefix_len,
  gru_hidden_dim, emb_dim, shift_label. ``architectures`` names the class.
- model.safetensors: layers.{i}.self_attn.{q,k,v,o}_proj, .{q,k}_norm, layers.{i}.mlp.{gate,up,down}_proj,
  layers.{i}.{input,post_attention}_layernorm, norm, fc, hidden_norm; Domino adds prefix_gru.weight_{ih,hh}_l0
  and embed_proj.{0,2}.weight. No embedding, no LM head: both are the target's.

Which target layers: SpecForge's ``target_layer_ids`` i reads the decode loop's
``output_hidden_states[i + 1]``, the output of block i + 1 (our HFTarget index i + 1), except for the
last block, whose entry in transformers' list is the final norm's output (our L + 1). Without the
field, SpecForge's default spread (block 1 to L - 3, in its numbering) applies.

Heads saved here add a ``specdec`` section (the target's name, for error messages) and, for a
declared draft vocabulary, a ``draft_ids`` tensor (no engine reads one: export refuses such heads).
Refused by name before any weight is read: sliding-window layers, a RoPE scaling other than
Llama-3's, an activation other than SiLU, a missing mask token.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch

from drafters.dflash import DFlashConfig, DFlashHead, check_fits, check_weight_names, spread_layer_ids, target_layer
from drafters.domino import DominoConfig, DominoHead
from drafters.head_storage import read_weights, weight_shapes
from drafters.heads import CONFIG_FILE, WEIGHTS_FILE, check_export_folder, sizes_of, write_checkpoint
from specdec.protocols import HeadTarget, TargetSizes

ARCHITECTURES = {"DFlashDraftModel": (DFlashConfig, DFlashHead), "DominoDraftModel": (DominoConfig, DominoHead)}
ENGINES = ("vllm", "sglang")  # vllm is refused with the format it reads instead (speculators)


def detect(directory: str | Path) -> bool:
    """Whether ``directory`` holds a SpecForge DFlash or Domino folder."""
    config = _read(Path(directory))
    return config is not None and _architecture(config) is not None


def check(directory: str | Path, target: TargetSizes) -> type[DFlashHead]:
    """What ``load`` refuses, from the config and the weight file's header alone (before the target
    loads); the class of the head the folder holds."""
    return _checked(Path(directory), target)[0]


def _checked(directory: Path, target: TargetSizes) -> tuple[type[DFlashHead], DFlashConfig]:
    """The head's class and config (its draft vocabulary's size from the weights), once the config
    fits ``target`` and the weight file's header names exactly the head's tensors."""
    where = f"the SpecForge head at {directory}"
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{directory} holds no SpecForge DFlash/Domino head (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    raw = _read(directory)
    if raw is None:
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    config_class, head_class = ARCHITECTURES[_require_architecture(raw, where)]
    config = parse_config(raw, config_class, where)
    check_fits(config, target, where)
    draft_ids = weight_shapes(directory / WEIGHTS_FILE).get("draft_ids")
    if draft_ids is not None:
        config = config_class(**{**_values(config), "draft_vocab_size": draft_ids[0]})
    with torch.device("meta"):
        check_weight_names(directory / WEIGHTS_FILE, head_class(config, None), ("draft_ids",), where)
    return head_class, config


def load(directory: str | Path, target: HeadTarget) -> DFlashHead:
    """The head in ``directory``, on the target's device and dtype; a folder that does not fit the
    target is refused in one line naming every mismatch."""
    directory = Path(directory)
    head_class, config = _checked(directory, sizes_of(target))
    try:
        state = read_weights(directory / WEIGHTS_FILE)
    except Exception as error:  # a truncated or foreign weights file
        raise ValueError(f"the SpecForge head at {directory}: {WEIGHTS_FILE} is unreadable: {error}") from error
    head = head_class(config, state.pop("draft_ids", None))
    head.load_state_dict({**state, "draft_ids": head.draft_ids})
    return head.to(device=target.device, dtype=target.dtype).eval()


def parse_config(raw: dict, config_class: type[DFlashConfig], where: str) -> DFlashConfig:
    """Our config from a SpecForge config.json, refusing what we do not compute."""
    options = raw.get("dflash_config") or {}
    refusals = []
    layer_types = raw.get("layer_types") or ["full_attention"]
    if any(kind != "full_attention" for kind in layer_types):
        refusals.append(f"layer_types {sorted(set(layer_types))} (only full_attention layers are supported)")
    scaling = raw.get("rope_scaling") or {k: v for k, v in (raw.get("rope_parameters") or {}).items() if k != "rope_theta"}
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ("default", "llama3"):
        refusals.append(f"rope scaling {scaling} (the default RoPE and llama3's are supported)")
    if raw.get("hidden_act", "silu") != "silu":
        refusals.append(f"hidden_act {raw['hidden_act']!r} (only silu)")
    if options.get("mask_token_id") is None:
        refusals.append("no dflash_config.mask_token_id")
    missing = [key for key in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                               "vocab_size", "num_target_layers", "block_size") if key not in raw]
    if missing:
        refusals.append(f"no {', '.join(missing)}")
    if refusals:
        raise ValueError(f"{where} cannot be loaded: " + "; ".join(refusals))
    layers, target_layers = raw["num_hidden_layers"], raw["num_target_layers"]
    layer_ids = options.get("target_layer_ids") or spread_layer_ids(target_layers, layers)
    heads = raw["num_attention_heads"]
    theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    settings = dict(
        hidden_size=raw["hidden_size"], num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, intermediate_size=raw["intermediate_size"],
        num_layers=layers, vocab_size=raw["vocab_size"], target_num_layers=target_layers,
        feature_layers=tuple(to_target_layer(i, target_layers) for i in layer_ids), block_size=raw["block_size"],
        mask_token_id=options["mask_token_id"], rope_theta=float(theta), rope_scaling=scaling if kind == "llama3" else None,
        rms_eps=raw.get("rms_norm_eps", 1e-6),
        attention_bias=bool(raw.get("attention_bias", False)), target=(raw.get("specdec") or {}).get("target", ""),
    )
    if config_class is DominoConfig:
        if "gru_hidden_dim" not in options or "emb_dim" not in options:
            raise ValueError(f"{where} cannot be loaded: a Domino dflash_config needs gru_hidden_dim and emb_dim")
        settings.update(gru_size=int(options["gru_hidden_dim"]), emb_dim=int(options["emb_dim"]),
                        pure_draft_prefix_len=int(options.get("pure_draft_prefix_len", 0)),
                        shift_label=bool(options.get("shift_label", False)))
    try:
        return config_class(**settings)
    except ValueError as error:
        raise ValueError(f"{where} cannot be loaded: {error}") from None


def to_target_layer(layer_id: int, num_target_layers: int) -> int:
    """SpecForge's layer id -> our HFTarget index (module docstring), refusing an id of no layer."""
    if not 0 <= layer_id < num_target_layers:
        raise ValueError(f"target_layer_ids holds {layer_id}, which is no layer of a {num_target_layers}-layer target")
    return target_layer(layer_id, num_target_layers)


def to_layer_id(layer: int, num_target_layers: int) -> int:
    """Our HFTarget index -> SpecForge's layer id; the embeddings and the last block's output before
    the final norm have none."""
    if layer == num_target_layers + 1:
        return num_target_layers - 1
    if not 1 <= layer < num_target_layers:
        raise ValueError(f"feature layer {layer} has no SpecForge target_layer_id (it reads blocks 1..L-1 and the "
                         f"final norm); train the head on other feature_layers")
    return layer - 1


def specforge_config(head: DFlashHead, extra: dict | None = None) -> dict:
    """The config.json SpecForge's classes (and SGLang) read for ``head``."""
    c = head.config
    domino = isinstance(c, DominoConfig)
    options = {"mask_token_id": c.mask_token_id,
               "target_layer_ids": [to_layer_id(layer, c.target_num_layers) for layer in c.feature_layers]}
    if domino:
        options.update(projector_type="domino", gru_hidden_dim=c.gru_size, emb_dim=c.emb_dim,
                       pure_draft_prefix_len=c.pure_draft_prefix_len, shift_label=c.shift_label)
    return {
        "architectures": ["DominoDraftModel" if domino else "DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": c.hidden_size, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "hidden_act": "silu", "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "attention_bias": c.attention_bias,
        "vocab_size": c.vocab_size, "layer_types": ["full_attention"] * c.num_layers, "tie_word_embeddings": False,
        "block_size": c.block_size, "num_target_layers": c.target_num_layers, "dflash_config": options,
        "specdec": {"target": c.target, **(extra or {})},
    }


def save(head: DFlashHead, directory: str | Path, extra: dict | None = None) -> None:
    """``head`` as a SpecForge folder (config.json + model.safetensors), swapped in whole; ``extra``
    goes into the ``specdec`` section."""
    if not head.config.qk_norm:
        raise ValueError("a head without q/k norm has no SpecForge layout (its Qwen3 layers always norm queries and keys)")
    state = {k: v for k, v in head.state_dict().items() if k != "draft_ids"}
    if head.config.draft_vocab_size != head.config.vocab_size:
        state["draft_ids"] = head.draft_ids
    write_checkpoint(directory, specforge_config(head, extra), state)


def export(checkpoint_dir: str | Path, out_dir: str | Path, engine: str) -> None:
    """A DFlash head saved here, for SGLang (``--speculative-algorithm DFLASH``). Domino and heads
    with a reduced draft vocabulary are refused: no engine runs Domino's refinement or reads a draft
    vocabulary in this layout."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    raw = _read(checkpoint_dir)
    where = f"the head at {checkpoint_dir}"
    if raw is None:
        raise ValueError(f"{where}: no {CONFIG_FILE}")
    architecture = _require_architecture(raw, where)
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if architecture == "DominoDraftModel":
        raise ValueError(f"{where} is a Domino head: no serving engine runs its GRU refinement (SGLang's DFLASH would "
                         f"drop it); its folder is already SpecForge's DominoDraftModel layout")
    if engine == "vllm":
        raise ValueError("vLLM loads DFlash heads in its speculators format, not SpecForge's: export with --engine speculators "
                         "(or --engine sglang for SGLang)")

    state = read_weights(checkpoint_dir / WEIGHTS_FILE)
    if "draft_ids" in state:
        raise ValueError(f"{where} drafts from a reduced vocabulary, which SGLang's DFLASH cannot read; train with the "
                         f"whole vocabulary (train.draft_vocab=null)")
    check_export_folder(out_dir)
    raw = {key: value for key, value in raw.items() if key != "specdec"}
    write_checkpoint(out_dir, raw, state)


def serve_command(out_dir: str | Path, engine: str) -> str:
    return (f"python -m sglang.launch_server --model-path <target> --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {out_dir}")


def _values(config: DFlashConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in fields(config)}


def _read(directory: Path) -> dict | None:
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def _architecture(raw: dict) -> str | None:
    names = [name for name in raw.get("architectures") or [] if name in ARCHITECTURES]
    if names:
        return names[0]
    options = raw.get("dflash_config")
    if isinstance(options, dict):
        return "DominoDraftModel" if options.get("projector_type") == "domino" else "DFlashDraftModel"
    return None


def _require_architecture(raw: dict, where: str) -> str:
    architecture = _architecture(raw)
    if architecture is None and isinstance(raw.get("domino"), dict):
        raise ValueError(f"{where} is a head of the miniature Domino, an architecture no longer run (removed after "
                         f"1111c9b); train one as published with `specdec-train train=domino`")
    if architecture is None:
        raise ValueError(f"{where} is no SpecForge DFlash/Domino folder (architectures {raw.get('architectures')}, "
                         f"no dflash_config)")
    return architecture


__all__ = ["detect", "export", "load", "parse_config", "save", "serve_command", "specforge_config"]
