"""vLLM's speculators format (vllm-project/speculators 0.9) in and out, for EAGLE-3 and DFlash heads.

A speculators folder holds config.json and model.safetensors:

- ``speculators_model_type``: the algorithm (eagle3, dflash, mtp, peagle, ...); ``speculators_config``
  names it again with the proposal methods and the verifier (``name_or_path``, ``architectures``);
- ``transformer_layer_config``: a Hugging Face config of the draft's decoder layers (model_type llama
  or qwen3) whose ``vocab_size`` is the target's and ``hidden_size`` the draft's;
- eagle3: ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids`` (the target layers fused, each
  "the input of layer i" as vLLM captures it, which is our HFTarget index i; none = 2, L/2, L-3),
  and the switches that change the function: ``norm_before_residual`` (computed here),
  ``norm_before_fc``, ``fc_norm``, ``norm_output`` (refused by name: the head does not compute them);
- dflash: ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids`` (read as eagle3's),
  ``sample_from_anchor`` (refused when set: the anchor row would draft too) and
  ``sliding_window_non_causal``; its layers are always Qwen3-style (q/k norms), whatever the
  config's model_type;
- weights ``fc.weight``, the layers (eagle3: ``layers.0.{self_attn,mlp}.*``,
  ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``; dflash:
  ``layers.{i}.*`` as SpecForge names them, and ``hidden_norm.weight``), ``norm.weight``,
  ``lm_head.weight`` [draft vocab, H] (dflash: only for a reduced vocabulary, the target's rows),
  the ``d2t``/``t2d`` buffers when the draft vocabulary is reduced (as EAGLE-3's: draft id +
  d2t[id] = target id), often ``embed_tokens.weight`` (a copy of the target's).

So an EAGLE-3 head in this format is the EAGLE-3 layout of drafters.formats.eagle with ``midlayer.``
spelled ``layers.0.`` and its Llama fields under ``transformer_layer_config``: it loads into the
same PublishedEagleHead through the same checks (hidden size, vocabulary, layer ids refused before
decoding). A DFlash head is drafters.dflash's DFlashHead with its layer ids in our numbering and the
target's LM head. Heads trained here are written back with ``specdec-export --engine speculators``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from drafters.dflash import DFlashConfig, DFlashHead, check_fits, check_weight_names
from drafters.eagle import build_head, parse_eagle_config
from drafters.eagle_published import PublishedEagleHead
from drafters.formats import eagle
from drafters.formats.specforge import parse_config
from drafters.head_storage import read_weights, weight_shapes
from drafters.heads import CONFIG_FILE, WEIGHTS_FILE, check_export_folder, sizes_of, write_checkpoint
from specdec.protocols import HeadTarget, TargetSizes

ENGINE = "speculators"
VERSION = "0.9.0"  # the speculators release whose classes the tests load our exports with
LAYER = "layers.0."  # the speculators name of EAGLE-3's one decoder layer (EAGLE-3's own: midlayer.)
TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")  # the frozen target rows the trainer reads
# switches of Eagle3SpeculatorConfig that change the function and are refused when set
UNCOMPUTED = {
    "norm_before_fc": "one RMSNorm over the concatenated target layers before fc",
    "fc_norm": "an RMSNorm per target layer before fc",
    "norm_output": "the normed hidden state fed back between draft steps (EAGLE 3.1)",
}


def detect_config(raw: dict | None) -> bool:
    """Whether a parsed config.json is in the speculators format."""
    return isinstance(raw, dict) and "speculators_model_type" in raw


def detect(directory: str | Path) -> bool:
    return detect_config(eagle.read_config(Path(directory)))


def algorithm(raw: dict) -> str:
    return str(raw.get("speculators_model_type"))


def _elsewhere(kind: str) -> str:
    """Where a speculators algorithm loads instead, for a refusal."""
    return {"dflash": " (a dflash one loads with drafter=dflash)",
            "eagle3": " (an eagle3 one loads with drafter=eagle3)"}.get(kind, "")


def load_eagle3(directory: str | Path, target: HeadTarget, raw: dict, expected: str | None = None) -> PublishedEagleHead:
    """The speculators eagle3 head in ``directory`` (config ``raw``) as a PublishedEagleHead for
    ``target``; refused in one line, before any weight is used, for another algorithm, a switch the
    head does not compute, or a mismatch with the target."""
    check_eagle3(Path(directory), sizes_of(target), raw, expected)  # one-line refusals before the weights are read
    llama, label = _eagle3_fields(Path(directory), raw, expected)
    state = {_eagle3_name(k): v for k, v in eagle.read_weights(Path(directory)).items() if k not in TRAINING_ONLY}
    return eagle.published_head(llama, state, "eagle3", target, label)


def check_eagle3(directory: Path, target: TargetSizes, raw: dict, expected: str | None = None) -> None:
    """What ``load_eagle3`` refuses that the config and the weights' names tell, before the target loads."""
    llama, label = _eagle3_fields(directory, raw, expected)
    shapes = {_eagle3_name(k): shape for k, shape in eagle.weight_shapes(directory).items() if k not in TRAINING_ONLY}
    config = eagle.head_config(llama, set(shapes), "eagle3", target, label)
    eagle.check_weight_shapes(config, shapes, "eagle3", target, label)


def _eagle3_fields(directory: Path, raw: dict, expected: str | None) -> tuple[dict, str]:
    """The Llama fields of a speculators eagle3 config and how errors name the folder; refused in
    one line for another algorithm, another expected layout or a switch the head does not compute."""
    kind = algorithm(raw)
    label = f"the speculators {kind} checkpoint at {directory}"
    if kind != "eagle3":
        raise ValueError(f"{label} is not read by drafter=eagle / eagle2 / eagle3, which read speculators eagle3 "
                         f"heads{_elsewhere(kind)}")
    if expected not in (None, "eagle3"):
        raise ValueError(f"{directory} holds an eagle3 head (speculators format), not {expected}; "
                         f"set drafter.format=eagle3 or auto")
    return llama_fields(raw, label), label


def _eagle3_name(name: str) -> str:
    """A speculators eagle3 weight's name in EAGLE-3's own layout (its one layer is midlayer)."""
    return eagle.LAYER_PREFIX["eagle3"] + name[len(LAYER):] if name.startswith(LAYER) else name


# what a speculators dflash file holds beside the head's own parameters: the frozen rows its trainer
# reads, the target's embedding (shared), the draft vocabulary's maps and its LM head rows
NOT_HEAD = (*TRAINING_ONLY, "embed_tokens.weight", "d2t", "t2d", "lm_head.weight")


def _dflash_config(directory: Path, target: TargetSizes) -> tuple[dict, DFlashConfig, str]:
    raw = eagle.read_config(directory) or {}
    kind = algorithm(raw)
    label = f"the speculators {kind} checkpoint at {directory}"
    if kind != "dflash":
        raise ValueError(f"{label} is not read by drafter=dflash, which reads speculators dflash heads{_elsewhere(kind)}")
    if target.num_layers is None:
        raise ValueError(f"{label} drafts from a model target's hidden states, and {target.name} has none")
    config = dflash_config(raw, target.num_layers, label)
    check_fits(config, target, label)
    return raw, config, label


def check_dflash(directory: str | Path, target: TargetSizes) -> type[DFlashHead]:
    """What ``load_dflash`` refuses that the config and a safetensors header tell, before the target
    loads (a pickled state dict is read when the drafter is built)."""
    directory = Path(directory)
    _, config, label = _dflash_config(directory, target)
    if (directory / WEIGHTS_FILE).is_file():
        with torch.device("meta"):
            check_weight_names(directory / WEIGHTS_FILE, DFlashHead(config, None), NOT_HEAD, label)
    return DFlashHead


def load_dflash(directory: str | Path, target: HeadTarget) -> DFlashHead:
    """The speculators dflash head in ``directory`` as a DFlashHead for ``target``, on its device and
    dtype; refused in one line for another algorithm, what the head does not compute, or a
    mismatch with the target (a reduced vocabulary's LM head must be the target's rows: ours is)."""
    directory = Path(directory)
    raw, config, label = _dflash_config(directory, sizes_of(target))
    state = {k: v for k, v in eagle.read_weights(directory).items()
             if k not in (*TRAINING_ONLY, "embed_tokens.weight")}  # the target's embedding, shared
    draft_ids = eagle.read_draft_ids(raw, state, config, label)
    rows = state.pop("lm_head.weight", None)
    if rows is not None:
        targets = target.model.get_output_embeddings().weight.detach().to(device="cpu", dtype=rows.dtype)[draft_ids]
        if not torch.equal(rows, targets):
            raise ValueError(f"{label} has an lm_head of its own, not the target's rows for its draft vocabulary; "
                             f"drafter=dflash drafts through the target's LM head")
    head = DFlashHead(config, draft_ids)
    missing, unexpected = head.load_state_dict({**state, "draft_ids": draft_ids}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{label} does not have the dflash weights of its config: missing {sorted(missing) or 'none'}, "
                         f"unexpected {sorted(unexpected) or 'none'}")
    return head.to(device=target.device, dtype=target.dtype).eval()


def dflash_config(raw: dict, target_num_layers: int, label: str) -> DFlashConfig:
    """The DFlashConfig of a speculators dflash config.json, refusing what DFlashHead does not compute."""
    layers = layer_fields(raw, "qwen3", label)
    checks = [
        (bool(raw.get("sample_from_anchor")), "sample_from_anchor=true (the anchor row drafts a token too)"),
        ("sliding_attention" in (layers.get("layer_types") or []), "sliding-window layers (it attends to the whole context)"),
        (raw.get("mask_token_id") is None, "no mask_token_id (the block needs its mask token)"),
        (layers.get("hidden_act") != "silu", f"hidden_act={layers.get('hidden_act')!r} (its MLP is SwiGLU)"),
        (raw.get("target_hidden_size") not in (None, layers["hidden_size"]),
         f"target_hidden_size={raw.get('target_hidden_size')} (the target's features are the draft's width)"),
        (_rope_type(layers) != "default", f"RoPE type {_rope_type(layers)!r} (the default RoPE only)"),
    ]
    refusals = [text for bad, text in checks if bad]
    if refusals:
        raise ValueError(f"{label} is a variant drafter=dflash does not compute: {'; '.join(refusals)}")
    aux = raw.get("aux_hidden_state_layer_ids") or [2, target_num_layers // 2, target_num_layers - 3]
    rope = layers.get("rope_parameters") or {}
    heads = layers["num_attention_heads"]
    try:
        return DFlashConfig(
            hidden_size=layers["hidden_size"], num_heads=heads, num_kv_heads=layers.get("num_key_value_heads") or heads,
            head_dim=layers.get("head_dim") or layers["hidden_size"] // heads, intermediate_size=layers["intermediate_size"],
            num_layers=layers["num_hidden_layers"], vocab_size=layers["vocab_size"], target_num_layers=target_num_layers,
            feature_layers=tuple(int(i) for i in aux), block_size=int(raw.get("block_size", 8)),
            mask_token_id=int(raw["mask_token_id"]), rope_theta=float(layers.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rms_eps=float(layers.get("rms_norm_eps", 1e-6)), attention_bias=bool(layers.get("attention_bias", False)),
            qk_norm=True, draft_vocab_size=int(raw.get("draft_vocab_size") or layers["vocab_size"]),
            target=(raw.get("specdec") or {}).get("target") or _verifier(raw))
    except ValueError as error:
        raise ValueError(f"{label}: {error}") from None


def _rope_type(layers: dict) -> str:
    scaling = layers.get("rope_scaling") or layers.get("rope_parameters") or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _verifier(raw: dict) -> str:
    """The target the folder names (its verifier), for error messages."""
    return str(((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "")


def layer_fields(raw: dict, default_type: str, label: str) -> dict:
    """transformer_layer_config with the defaults speculators and vLLM fill in, as they build it
    (transformers' config class of its model_type)."""
    from transformers import AutoConfig  # transformers: about 16 s to import, needed only to read a speculators folder

    layers = raw.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise ValueError(f"{label} has no transformer_layer_config; the speculators format needs one")
    model_type = layers.get("model_type", default_type)
    try:
        config_class = type(AutoConfig.for_model(model_type))
        return config_class(**{k: v for k, v in layers.items() if k not in ("architectures", "model_type")}).to_dict()
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"{label}: transformer_layer_config is not a {model_type} config: {error}") from None


def llama_fields(raw: dict, label: str) -> dict:
    """The flat Llama config of an EAGLE-3 head (as drafters.formats.eagle reads EAGLE-3's own)."""
    layers = raw.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise ValueError(f"{label} has no transformer_layer_config; the speculators format needs one")
    set_switches = [f"{name}=true ({meaning})" for name, meaning in UNCOMPUTED.items() if raw.get(name)]
    model_type = layers.get("model_type", "llama")
    if model_type not in ("llama", "qwen3"):
        set_switches.append(f"transformer_layer_config.model_type={model_type!r} (the llama and qwen3 layers are computed)")
    if "sliding_attention" in (layers.get("layer_types") or []):
        set_switches.append("sliding-window attention in the draft layer")
    if set_switches:
        raise ValueError(f"{label} is a variant this loader does not compute ({'; '.join(set_switches)}); "
                         f"it reads one-layer Llama or Qwen3 EAGLE-3 heads with norm_before_residual either way")
    fields = layer_fields(raw, "llama", label)
    for key in ("draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "target_hidden_size"):
        if raw.get(key) is not None:
            fields[key] = raw[key]
    fields["specdec"] = raw.get("specdec") or {"target": _verifier(raw)}
    return fields


# -- export: a head trained here, as the speculators library saves one -----------------------------


def export(checkpoint_dir: str | Path, out_dir: str | Path, engine: str = ENGINE) -> None:
    """Write the EAGLE-3 or DFlash head saved here at ``checkpoint_dir`` into ``out_dir`` in the
    speculators format (config.json + model.safetensors, swapped in whole). Refused for heads no
    speculators algorithm computes (native or EAGLE-1 heads, Domino) or that it would read otherwise."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if engine != ENGINE:
        raise ValueError(f"engine={engine!r}: this layout is {ENGINE}")
    raw = eagle.read_config(checkpoint_dir)
    if raw is None or not ({"eagle", "dflash_config"} & set(raw)) or not (checkpoint_dir / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"{checkpoint_dir} holds no EAGLE or DFlash head saved here ({CONFIG_FILE} with an "
                                f"'eagle' section or a dflash_config, and {WEIGHTS_FILE})")
    tensors, config = eagle3_layout(_eagle_head(checkpoint_dir, raw)) if "eagle" in raw else \
        dflash_layout(_dflash_head(checkpoint_dir, raw))
    check_export_folder(out_dir)
    write_checkpoint(out_dir, config, tensors)


def _eagle_head(checkpoint_dir: Path, raw: dict) -> PublishedEagleHead:
    config = parse_eagle_config(raw["eagle"])
    if config.arch != "eagle3":
        raise ValueError(f"{checkpoint_dir} holds an EAGLE head of architecture {config.arch}; the speculators format "
                         f"holds EAGLE-3 heads: train one with `specdec-train train=eagle3 train.arch=eagle3`")
    state = read_weights(checkpoint_dir / WEIGHTS_FILE)
    head = build_head(config).to(state["fc.weight"].dtype)  # exported in the dtype it was saved in
    head.load_state_dict(state)
    return head


def _dflash_head(checkpoint_dir: Path, raw: dict) -> DFlashHead:
    where = f"the head at {checkpoint_dir}"
    if (raw.get("dflash_config") or {}).get("projector_type") == "domino":
        raise ValueError(f"{where} is a Domino head: speculators has no algorithm with its GRU refinement (its dflash "
                         f"would drop it)")
    state = read_weights(checkpoint_dir / WEIGHTS_FILE)
    if "draft_ids" in state:
        raise ValueError(f"{where} drafts from a reduced vocabulary through the target's LM head rows, which this "
                         f"folder does not hold; train with the whole vocabulary (train.draft_vocab=null)")
    head = DFlashHead(parse_config(raw, DFlashConfig, where)).to(state["fc.weight"].dtype)
    head.load_state_dict({**state, "draft_ids": head.draft_ids})
    return head


def _common(algorithm_name: str, speculative_tokens: int, target: str, layer_config: dict, dtype: str) -> dict:
    """The config.json fields every speculators algorithm has."""
    return {
        "architectures": [{"eagle3": "Eagle3DraftModel", "dflash": "DFlashDraftModel"}[algorithm_name]],
        "speculators_model_type": algorithm_name,
        "speculators_version": VERSION,
        "speculators_config": {
            "algorithm": algorithm_name,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            # a folder or hub id the verifier loads from (vllm serve DIR reads it); a class name is none
            "verifier": {"name_or_path": target if "/" in target else None, "architectures": []},
        },
        "transformer_layer_config": layer_config,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "specdec": {"target": target},
    }


def _check_layers(feature_layers: tuple[int, ...], num_layers: int, kind: str) -> None:
    bad = [k for k in feature_layers if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(f"cannot export this {kind} head for speculators: it reads target layers {bad} (HFTarget "
                         f"indices), and speculators' layer ids name the inputs of layers 0..{num_layers}")


def eagle3_layout(head: PublishedEagleHead) -> tuple[dict[str, Tensor], dict]:
    """(weights, config.json) of an EAGLE-3 head as speculators' Eagle3DraftModel saves one."""
    c = head.config
    _check_layers(c.feature_layers, c.target_num_layers, "eagle3")
    tensors, vllm = eagle.published_layout(head, "vllm")
    prefix = eagle.LAYER_PREFIX["eagle3"]
    tensors = {(LAYER + k[len(prefix):]) if k.startswith(prefix) else k: v for k, v in tensors.items()}
    if c.draft_vocab_size == c.vocab_size:  # speculators keeps no maps for a whole vocabulary
        tensors.pop("d2t"), tensors.pop("t2d")
    eagle3_fields = ("architectures", "draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "specdec")
    layer_config = {k: v for k, v in vllm.items() if k not in eagle3_fields}
    return tensors, {
        **_common("eagle3", 3, c.target, layer_config, vllm["torch_dtype"]),
        "draft_vocab_size": c.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),  # vLLM's reading, our indices
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
    }


def dflash_layout(head: DFlashHead) -> tuple[dict[str, Tensor], dict]:
    """(weights, config.json) of a whole-vocabulary DFlash head as speculators' DFlashDraftModel
    saves one (no embedding, no LM head: the target's)."""
    c = head.config
    _check_layers(c.feature_layers, c.target_num_layers, "dflash")
    if not c.qk_norm:
        raise ValueError("cannot export a DFlash head without q/k norms for speculators: its layers always norm them")
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items() if k != "draft_ids"}
    dtype = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    layer_config = {
        "model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_eps, "attention_bias": c.attention_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}, "vocab_size": c.vocab_size,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * c.num_layers,
    }
    return tensors, {
        **_common("dflash", c.block_size - 1, c.target, layer_config, dtype),
        "draft_vocab_size": c.vocab_size, "block_size": c.block_size, "mask_token_id": c.mask_token_id,
        "aux_hidden_state_layer_ids": list(c.feature_layers), "sample_from_anchor": False,
        "sliding_window_non_causal": False,
    }


def serve_command(out_dir: str | Path, engine: str = ENGINE) -> str:
    """vLLM's speculative options that load an exported speculators folder."""
    raw = json.loads((Path(out_dir) / CONFIG_FILE).read_text())
    tokens = raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    spec = {"method": raw["speculators_model_type"], "model": str(out_dir), "num_speculative_tokens": tokens}
    return f"vllm serve <target> --speculative-config '{json.dumps(spec)}'"
