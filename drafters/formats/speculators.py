"""vLLM's speculators format (vllm-project/speculators 0.9) in and out, for EAGLE-3 heads.

A speculators folder holds config.json and model.safetensors:

- ``speculators_model_type``: the algorithm (eagle3, dflash, mtp, peagle, ...); ``speculators_config``
  names it again with the proposal methods and the verifier (``name_or_path``, ``architectures``);
- ``transformer_layer_config``: a Hugging Face config of the draft's decoder layers (model_type llama
  or qwen3) whose ``vocab_size`` is the target's and ``hidden_size`` the draft's;
- eagle3: ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids`` (the target layers fused, each
  "the input of layer i" as vLLM captures it, which is our HFTarget index i; none = 2, L/2, L-3),
  and the switches that change the function: ``norm_before_residual`` (computed here),
  ``norm_before_fc``, ``fc_norm``, ``norm_output`` (refused by name: the head does not compute them);
- weights ``fc.weight``, ``layers.0.{self_attn,mlp}.*``, ``layers.0.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight`` [draft vocab, H], the
  ``d2t``/``t2d`` buffers when the draft vocabulary is reduced (as EAGLE-3's: draft id + d2t[id] =
  target id), usually ``embed_tokens.weight`` (a copy of the target's).

So an EAGLE-3 head in this format is the EAGLE-3 layout of drafters.formats.eagle with ``midlayer.``
spelled ``layers.0.`` and its Llama fields under ``transformer_layer_config``: it loads into the
same PublishedEagleHead through the same checks (hidden size, vocabulary, layer ids refused before
decoding), and a head trained here is written back (``specdec-export --engine speculators``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from drafters.eagle_published import PublishedEagleHead
from drafters.formats import eagle
from drafters.heads import CONFIG_FILE, WEIGHTS_FILE, check_export_folder, write_checkpoint
from specdec.protocols import HeadTarget

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


def algorithm(raw: dict) -> str:
    return str(raw.get("speculators_model_type"))


def load_eagle3(directory: str | Path, target: HeadTarget, raw: dict, expected: str | None = None) -> PublishedEagleHead:
    """The speculators eagle3 head in ``directory`` (config ``raw``) as a PublishedEagleHead for
    ``target``; refused in one line, before any weight is used, for another algorithm, a switch the
    head does not compute, or a mismatch with the target."""
    directory = Path(directory)
    kind = algorithm(raw)
    label = f"the speculators {kind} checkpoint at {directory}"
    if kind != "eagle3":
        raise ValueError(f"{label} is not read by drafter=eagle / eagle2 / eagle3, which read speculators eagle3 "
                         f"heads" + (" (a dflash one loads with drafter=dflash)" if kind == "dflash" else ""))
    if expected not in (None, "eagle3"):
        raise ValueError(f"{directory} holds an eagle3 head (speculators format), not {expected}; "
                         f"set drafter.format=eagle3 or auto")
    llama = llama_fields(raw, label)
    state = {(eagle.LAYER_PREFIX["eagle3"] + k[len(LAYER):]) if k.startswith(LAYER) else k: v
             for k, v in eagle.read_weights(directory).items() if k not in TRAINING_ONLY}
    return eagle.published_head(llama, state, "eagle3", target, label)


def llama_fields(raw: dict, label: str) -> dict:
    """The flat Llama config of an EAGLE-3 head (as drafters.formats.eagle reads EAGLE-3's own)."""
    layers = raw.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise ValueError(f"{label} has no transformer_layer_config; the speculators format needs one")
    set_switches = [f"{name}=true ({meaning})" for name, meaning in UNCOMPUTED.items() if raw.get(name)]
    model_type = layers.get("model_type", "llama")
    if model_type != "llama":
        set_switches.append(f"transformer_layer_config.model_type={model_type!r} "
                            f"({'per-head q/k norms' if model_type == 'qwen3' else 'another decoder layer'})")
    if "sliding_attention" in (layers.get("layer_types") or []):
        set_switches.append("sliding-window attention in the draft layer")
    if set_switches:
        raise ValueError(f"{label} is a variant this loader does not compute ({'; '.join(set_switches)}); "
                         f"it reads one-layer Llama EAGLE-3 heads with norm_before_residual either way")
    from transformers import LlamaConfig

    try:  # every field with the defaults speculators and vLLM fill in, as they build the layer's config
        fields = LlamaConfig(**{k: v for k, v in layers.items() if k not in ("architectures", "model_type")}).to_dict()
    except (TypeError, ValueError) as error:
        raise ValueError(f"{label}: transformer_layer_config is not a Llama config: {error}") from error
    for key in ("draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "target_hidden_size"):
        if raw.get(key) is not None:
            fields[key] = raw[key]
    fields["specdec"] = raw.get("specdec") or {"target": ((raw.get("speculators_config") or {}).get("verifier") or {})
                                                          .get("name_or_path") or ""}
    return fields


# -- export: a head trained here, as the speculators library saves one -----------------------------


def export(checkpoint_dir: str | Path, out_dir: str | Path, engine: str = ENGINE) -> None:
    """Write the EAGLE-3 head saved here at ``checkpoint_dir`` into ``out_dir`` in the speculators
    format (config.json + model.safetensors, swapped in whole). Refused for heads no speculators
    algorithm computes (native or EAGLE-1 heads)."""
    from safetensors.torch import load_file

    from drafters.eagle import build_head, parse_eagle_config

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if engine != ENGINE:
        raise ValueError(f"engine={engine!r}: this layout is {ENGINE}")
    raw = eagle.read_config(checkpoint_dir)
    if raw is None or "eagle" not in raw or not (checkpoint_dir / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"{checkpoint_dir} holds no EAGLE head saved here ({CONFIG_FILE} with an 'eagle' "
                                f"section and {WEIGHTS_FILE})")
    config = parse_eagle_config(raw["eagle"])
    if config.arch != "eagle3":
        raise ValueError(f"{checkpoint_dir} holds an EAGLE head of architecture {config.arch}; the speculators format "
                         f"holds EAGLE-3 heads: train one with `specdec-train train=eagle3 train.arch=eagle3`")
    state = load_file(str(checkpoint_dir / WEIGHTS_FILE))
    head = build_head(config).to(state["fc.weight"].dtype)
    head.load_state_dict(state)
    tensors, config_json = speculators_layout(head)
    check_export_folder(out_dir)
    write_checkpoint(out_dir, config_json, tensors)


def speculators_layout(head: PublishedEagleHead) -> tuple[dict[str, Tensor], dict]:
    """(weights, config.json) of an EAGLE-3 head as speculators' Eagle3DraftModel saves one."""
    c = head.config
    bad = [k for k in c.feature_layers if not 0 <= k <= c.target_num_layers]
    if bad:
        raise ValueError(f"cannot export this eagle3 head for speculators: it reads target layers {bad} (HFTarget "
                         f"indices), and speculators' layer ids name the inputs of layers 0..{c.target_num_layers}")
    tensors, vllm = eagle.published_layout(head, "vllm")
    prefix = eagle.LAYER_PREFIX["eagle3"]
    tensors = {(LAYER + k[len(prefix):]) if k.startswith(prefix) else k: v for k, v in tensors.items()}
    if c.draft_vocab_size == c.vocab_size:  # speculators keeps no maps for a whole vocabulary
        tensors.pop("d2t"), tensors.pop("t2d")
    dtype = vllm["torch_dtype"]
    eagle3_fields = ("architectures", "draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "specdec")
    layer_config = {k: v for k, v in vllm.items() if k not in eagle3_fields}
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            # a folder or hub id the verifier loads from (vllm serve DIR reads it); a class name is none
            "verifier": {"name_or_path": c.target if "/" in c.target else None, "architectures": []},
        },
        "transformer_layer_config": layer_config,
        "draft_vocab_size": c.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),  # vLLM's reading, our indices
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "specdec": vllm["specdec"],
    }
    return tensors, config


def serve_command(out_dir: str | Path, engine: str = ENGINE) -> str:
    """vLLM's speculative options that load an exported speculators folder."""
    algo = json.loads((Path(out_dir) / CONFIG_FILE).read_text())["speculators_model_type"]
    spec = {"method": algo, "model": str(out_dir), "num_speculative_tokens": 3}
    return f"vllm serve <target> --speculative-config '{json.dumps(spec)}'"
