"""Published EAGLE heads in, heads trained here out, in the layouts their projects publish.

Layouts (learned from SafeAILab/EAGLE cnets1.py / cnets.py, vLLM llama_eagle.py / llama_eagle3.py,
SGLang llama_eagle.py / llama_eagle3.py, SpecForge llama3_eagle.py):

- ``eagle`` (EAGLE-1/2): a Llama config.json (num_hidden_layers 1) and weights fc.weight, fc.bias,
  layers.0.{self_attn,mlp}.*, layers.0.post_attention_layernorm.weight (no input norm), usually
  embed_tokens.weight. The feature is the target's final-norm output; logits come from the
  target's LM head over the whole vocabulary.
- ``eagle3`` (EAGLE-3, SpecForge's exports): a ``LlamaForCausalLMEagle3`` config with
  draft_vocab_size, weights fc.weight (3 target layers -> hidden), midlayer.* (q/k/v read 2 x hidden),
  norm.weight, lm_head.weight [draft vocab, hidden] and d2t (draft id + d2t[id] = target id, as vLLM
  and SGLang read it) / t2d (target id -> in the draft vocabulary).

Which target layers an EAGLE-3 head fuses: vLLM reads ``eagle_aux_hidden_state_layer_ids`` (top level,
else under ``eagle_config``) as "the input of layer i" (our HFTarget index i); SGLang and SpecForge read
``eagle_config.eagle_aux_hidden_state_layer_ids`` as "the output of layer i" (our index i + 1). On import
a top-level list is read the vLLM way and an ``eagle_config`` one the SGLang way; with neither, both
engines (and EAGLE's own code) use the inputs of layers 2, L/2 and L-3. Export writes each engine
the list in its own convention.

The target's embedding: a published checkpoint may carry a copy of it. A copy equal to the target's
is dropped (the head embeds with the target's table, as both engines do); one that differs is kept
as the head's own table, since that is what the head was trained with and EAGLE's code drafts with.
Export writes no embedding (both engines share the target's) unless the head has its own.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from drafters.base import TargetSizes
from drafters.eagle import build_head, parse_eagle_config
from drafters.eagle_config import EagleConfig
from drafters.eagle_published import PublishedEagleHead
from drafters import head_storage
from drafters.heads import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    check_checkpoint,
    check_export_folder,
    sizes_of,
    write_checkpoint,
)
from specdec.protocols import HeadTarget

LAYOUTS = ("eagle", "eagle3")  # EAGLE-1/2 heads; EAGLE-3 heads (EAGLE-3's own and SpecForge's exports)
ENGINES = ("vllm", "sglang")
PICKLED_FILE = "pytorch_model.bin"
LAYER_PREFIX = {"eagle": "layers.0.", "eagle3": "midlayer."}
ARCH = {"eagle": "eagle1", "eagle3": "eagle3"}  # layout -> EagleConfig.arch
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
MLP = ("gate_proj", "up_proj", "down_proj")
TOP_LEVEL = ("fc", "norm", "lm_head", "embed_tokens")  # published names without a layer prefix


def detect(directory: str | Path) -> bool:
    """Whether ``directory`` holds a published EAGLE or EAGLE-3 head (not a head saved here)."""
    return layout(Path(directory)) is not None


def layout(directory: Path) -> str | None:
    """"eagle", "eagle3" (EAGLE-3's own layout or a speculators eagle3 folder), "speculators <algorithm>"
    (another speculators algorithm, refused on load) or None (no published EAGLE head), from the
    config and the weight names."""
    config = read_config(directory)
    if config is None or isinstance(config.get("eagle"), dict):  # ours: the head's config under "eagle"
        return None
    if "speculators_model_type" in config:  # vLLM's speculators format (drafters.formats.speculators)
        kind = config["speculators_model_type"]
        return "eagle3" if kind == "eagle3" else f"speculators {kind}"
    names = _weight_names(directory)
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle"
    return None


def load_published(directory: str | Path, target: HeadTarget, expected: str | None = None) -> PublishedEagleHead:
    """The head in ``directory``, in EAGLE's or EAGLE-3's own layout, as a PublishedEagleHead for
    ``target``, on its device and dtype (a speculators eagle3 folder: drafters.formats.load, which
    tells the two apart). Refused, before any weight is used, when the config or weights do not fit
    the target (hidden size, vocabulary, layer ids) or describe a variant the head does not compute."""
    directory = Path(directory)
    found = check_published(directory, sizes_of(target), expected)  # refusals before the weights load
    state = {k.removeprefix("model."): v for k, v in read_weights(directory).items()}
    return published_head(_unwrap(read_config(directory)), state, found, target, f"the {found} head at {directory}")


def check_published(directory: str | Path, target: TargetSizes, expected: str | None = None) -> str:
    """What load_published refuses, found before the target loads, from config.json and the weights'
    names and shapes (a safetensors header; a pickled head is loaded through
    torch.load(weights_only=True), so one holding more than tensors is refused here). Returns the
    layout."""
    directory = Path(directory)
    raw = read_config(directory)
    found = layout(directory)
    if found is None:
        raise ValueError(f"{directory} holds no published EAGLE or EAGLE-3 head (needs {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE} or {PICKLED_FILE} with fc and layers.0 / midlayer weights)")
    if expected is not None and found != expected:
        raise ValueError(f"{directory} holds an {found} head, not {expected}; set drafter.format={found} or auto")
    raw, label, shapes = _unwrap(raw), f"the {found} head at {directory}", weight_shapes(directory)
    check_weight_shapes(head_config(raw, set(shapes), found, target, label), shapes, found, target, label)
    return found


def check_weight_shapes(config: EagleConfig, shapes: dict[str, tuple[int, ...]], found: str, target: TargetSizes,
                        label: str) -> None:
    """The weights (published names less "model.", with their shapes) are exactly those of the head
    ``config`` describes in layout ``found``, besides the draft vocabulary's maps and an embedding of
    the target's shape."""
    with torch.device("meta"):  # shapes only: nothing is allocated
        wanted = {n: tuple(t.shape) for n, t in PublishedEagleHead(config).state_dict().items() if n != "draft_ids"}
    ours = {_ours(name, found): shape for name, shape in shapes.items() if name not in ("d2t", "t2d", "embed_tokens.weight")}
    missing = sorted(_theirs(n, found) for n in set(wanted) - set(ours))
    unexpected = sorted(_theirs(n, found) for n in set(ours) - set(wanted))
    if missing or unexpected:
        raise ValueError(f"{label} does not have the published {found} weights: "
                         f"missing {missing or 'none'}, unexpected {unexpected or 'none'}")
    wrong = [f"{_theirs(n, found)} is {list(ours[n])}, its config's {list(shape)}"
             for n, shape in wanted.items() if ours[n] != shape]
    embedding = shapes.get("embed_tokens.weight")
    if embedding is not None and embedding != (target.vocab_size, target.hidden_size):
        wrong.append(f"embed_tokens is {list(embedding)}, the target's embedding {[target.vocab_size, target.hidden_size]}")
    if wrong:
        raise ValueError(f"{label} does not match its {CONFIG_FILE}: {'; '.join(wrong)}")


def published_head(raw: dict, state: dict[str, Tensor], found: str, target: HeadTarget, label: str) -> PublishedEagleHead:
    """The head of a published Llama config ``raw`` and weights ``state`` (published names less
    "model.") in layout ``found``, checked against ``target``, on its device and dtype."""
    config = head_config(raw, set(state), found, sizes_of(target), label)
    draft_ids = read_draft_ids(raw, state, config, label)
    embedding = state.pop("embed_tokens.weight", None)
    if embedding is not None:
        if tuple(embedding.shape) != (target.vocab_size, target.hidden_size):
            raise ValueError(f"{label}: embed_tokens is {tuple(embedding.shape)}, the target's embedding "
                             f"{(target.vocab_size, target.hidden_size)}")
        targets = target.model.get_input_embeddings().weight.detach().to(device="cpu", dtype=embedding.dtype)
        if not torch.equal(embedding, targets):
            config = replace(config, own_embedding=True)
            state["embed_tokens.weight"] = embedding
    head = PublishedEagleHead(config, draft_ids)
    ours = {_ours(name, found): tensor for name, tensor in state.items()}
    missing = sorted(_theirs(n, found) for n in set(head.state_dict()) - set(ours) - {"draft_ids"})
    unexpected = sorted(_theirs(n, found) for n in set(ours) - set(head.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{label} does not have the published {found} weights: "
                         f"missing {missing or 'none'}, unexpected {unexpected or 'none'}")
    try:
        head.load_state_dict({**ours, "draft_ids": draft_ids})
    except RuntimeError as error:  # a weight of the wrong shape for the config
        raise ValueError(f"{label} does not match its {CONFIG_FILE}: {error}") from error
    return head.to(device=target.device, dtype=target.dtype).eval()


def head_config(raw: dict, names: set[str], found: str, target: TargetSizes, label: str) -> EagleConfig:
    """The EagleConfig of a published config.json, refusing what the head does not compute and what
    does not fit the target (``sizes_of`` a loaded one, or its sizes before it loads)."""
    unsupported = [
        f"{key}={raw[key]!r}" for key, fine in [
            ("num_hidden_layers", lambda v: v == 1), ("hidden_act", lambda v: v == "silu"),
            ("attention_bias", lambda v: not v), ("mlp_bias", lambda v: not v),
            ("fc_norm", lambda v: not v), ("use_aux_norm", lambda v: not v), ("norm_output", lambda v: v),
            ("target_hidden_size", lambda v: v == raw.get("hidden_size")),
        ] if key in raw and not fine(raw[key])
    ]
    rope = raw.get("rope_parameters") or {}  # transformers 5 writes RoPE's type and theta here
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ("default", "llama3"):
        unsupported.append(f"rope_scaling type {kind!r}")
    if unsupported:
        raise ValueError(f"{label} is a variant this loader does not compute ({', '.join(unsupported)}); "
                         f"it reads one-layer SiLU Llama heads with default or llama3 RoPE")
    theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    vocab, hidden = raw.get("vocab_size"), raw.get("hidden_size")
    layers = target.num_layers
    if found == "eagle3":
        feature_layers = _aux_layers(raw, layers)
    else:
        feature_layers = (layers + 1,)  # the final-norm output
    mismatches = [f"{name}: checkpoint {mine}, target {theirs}" for name, mine, theirs in [
        ("hidden size", hidden, target.hidden_size), ("vocabulary", vocab, target.vocab_size)] if mine != theirs]
    bad = [k for k in feature_layers if not 0 <= k <= layers + 1]
    if bad:
        mismatches.append(f"layer ids: the head reads target layers {list(feature_layers)} "
                          f"(HFTarget indices), the target has {layers} layers")
    if mismatches:
        raise ValueError(f"{label} was trained for another target, not for this one ({target.name}): "
                         + "; ".join(mismatches))
    heads = raw["num_attention_heads"]
    return EagleConfig(
        hidden_size=hidden, num_heads=heads, intermediate_size=raw["intermediate_size"], vocab_size=vocab,
        feature_layers=feature_layers,
        draft_vocab_size=(raw.get("draft_vocab_size") or vocab) if found == "eagle3" else vocab,
        target_num_layers=layers, rope_theta=theta, rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        target=str((raw.get("specdec") or {}).get("target") or raw.get("_name_or_path", "")), arch=ARCH[found],
        # 0 where the published value is the default, as heads built here store it
        num_kv_heads=0 if raw.get("num_key_value_heads", heads) == heads else raw["num_key_value_heads"],
        head_dim=0 if raw.get("head_dim", hidden // heads) in (None, hidden // heads) else raw["head_dim"],
        fc_bias="fc.bias" in names, norm_before_residual=bool(raw.get("norm_before_residual", False)),
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=int(raw.get("max_position_embeddings", 0) or 0),
        qk_norm=raw.get("model_type") == "qwen3",
    )


def _aux_layers(raw: dict, layers: int) -> tuple[int, ...]:
    """The three target layers an EAGLE-3 head fuses, as HFTarget indices (input of layer i = i)."""
    if raw.get("eagle_aux_hidden_state_layer_ids"):  # vLLM's reading: the input of layer i
        return tuple(int(i) for i in raw["eagle_aux_hidden_state_layer_ids"])
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:  # SGLang's and SpecForge's reading: the output of layer i
        return tuple(int(i) + 1 for i in nested)
    return (2, layers // 2, layers - 3)


def read_draft_ids(raw: dict, state: dict[str, Tensor], config: EagleConfig, label: str) -> Tensor:  # [K] int64
    """Target ids of the draft vocabulary from d2t (draft id + d2t[id] = target id), checked against
    t2d; both maps leave ``state``. ``config`` needs draft_vocab_size and vocab_size only: speculators
    dflash heads (a DFlashConfig) store the maps as EAGLE-3 heads do."""
    size, vocab = config.draft_vocab_size, config.vocab_size
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None:
        if size != vocab:
            raise ValueError(f"{label}: draft_vocab_size {size} < vocabulary {vocab} but the weights have no d2t map")
        return torch.arange(vocab)
    if tuple(d2t.shape) != (size,):
        raise ValueError(f"{label}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {size}")
    ids = torch.arange(size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(ids.unique()) != size:
        raise ValueError(f"{label}: d2t maps draft ids outside [0, {vocab}) or two onto one target id; "
                         f"the map is inconsistent")
    if t2d is not None:
        member = torch.zeros(vocab, dtype=torch.bool)
        member[ids] = True
        if tuple(t2d.shape) != (vocab,) or not torch.equal(t2d.bool(), member):
            raise ValueError(f"{label}: t2d does not mark exactly the target ids d2t maps to; the maps are inconsistent")
    return ids


def _ours(name: str, found: str) -> str:
    """Published weight name -> PublishedEagleHead parameter name."""
    prefix = LAYER_PREFIX[found]
    for part in (prefix + "self_attn.", prefix + "mlp.", prefix):
        if name.startswith(part):
            return name[len(part):]
    return name


def _theirs(name: str, found: str) -> str:
    """PublishedEagleHead parameter name -> published weight name."""
    module = name.split(".")[0]
    if module in TOP_LEVEL:
        return name
    prefix = LAYER_PREFIX[found]
    return prefix + ("self_attn." if module in ATTENTION else "mlp." if module in MLP else "") + name


# -- export: a head trained here, in the layout an engine loads ----------------------------------


def export(checkpoint_dir: Path, out_dir: Path, engine: str) -> None:
    """Write the head saved here at ``checkpoint_dir`` into ``out_dir`` (config.json +
    model.safetensors, written into a temp folder and renamed) in the layout ``engine`` loads.
    Refused for a native-architecture head (no engine computes it) and for what the engine would
    read differently from what the head computes."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: choose one of {', '.join(ENGINES)}")
    config = check_checkpoint(checkpoint_dir, None, "eagle", parse_eagle_config, build_head)  # before any weight loads
    check_export_folder(out_dir)
    if config.arch == "native":
        raise ValueError(
            f"{checkpoint_dir} holds a head of specdec's native EAGLE architecture, which vLLM and SGLang do not run; "
            f"train an exportable one with `specdec-train train=eagle3 train.arch=eagle3` (EAGLE-3) or "
            f"`specdec-train train=eagle train.arch=eagle1 train.draft_vocab=<vocabulary size>` (EAGLE-1)")
    state = head_storage.read_weights(checkpoint_dir / WEIGHTS_FILE)
    head = build_head(config).to(state["fc.weight"].dtype)  # exported in the dtype it was saved in
    head.load_state_dict(state)
    tensors, published = published_layout(head, engine)
    write_checkpoint(out_dir, published, tensors)


def published_layout(head: PublishedEagleHead, engine: str) -> tuple[dict[str, Tensor], dict]:
    """(weights, config.json) of ``head`` as ``engine`` loads it."""
    c = head.config
    found = "eagle3" if c.arch == "eagle3" else "eagle"
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    draft_ids = state.pop("draft_ids")
    problems = []
    if found == "eagle":
        if c.feature_layers != (c.target_num_layers + 1,):
            problems.append(f"EAGLE-1 heads read the target's final-norm output, this one layers {list(c.feature_layers)}")
        if c.draft_vocab_size != c.vocab_size:
            problems.append(f"EAGLE-1 layouts draft from the whole vocabulary ({c.vocab_size}), this head from "
                            f"{c.draft_vocab_size} tokens (train with train.draft_vocab={c.vocab_size})")
        bias = state.pop("fc.bias", None)
        if engine == "vllm" and bias is not None and bool(bias.any()):
            problems.append("vLLM's EAGLE-1 model has no fc bias and drops it, so it would compute another "
                            "function; export for sglang, or train with a zero bias")
        if engine == "sglang":  # SGLang's fc always has a bias: an absent one would stay uninitialised
            state["fc.bias"] = bias if bias is not None else torch.zeros(c.hidden_size, dtype=state["fc.weight"].dtype)
    else:
        lowest = 1 if engine == "sglang" else 0  # SGLang names a layer by its output: the embeddings have no id
        bad = [k for k in c.feature_layers if not lowest <= k <= c.target_num_layers - 1]
        if bad:
            problems.append(f"{engine} captures target layers {lowest}..{c.target_num_layers - 1} (HFTarget indices); "
                            f"this head reads {bad}")
        if c.norm_before_residual and engine == "sglang":
            problems.append("SGLang's EAGLE-3 model has no norm_before_residual; export for vllm")
        if c.qk_norm:  # these layouts name a Llama layer, which has no q/k norms
            problems.append("its decoder layer normalizes queries and keys per head (Qwen3), which no Llama EAGLE-3 "
                            "layout holds")
        order = draft_ids.argsort()  # ascending target ids, the order t2d-based readers assume
        draft_ids, state["lm_head.weight"] = draft_ids[order], state["lm_head.weight"][order]
        state["d2t"] = draft_ids - torch.arange(len(draft_ids))
        state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
    if problems:
        raise ValueError(f"cannot export this {c.arch} head for {engine}: " + "; ".join(problems))
    tensors = {_theirs(name, found) if name not in ("d2t", "t2d") else name: t for name, t in state.items()}
    return tensors, _published_config(c, found, engine, state["fc.weight"].dtype)


def _published_config(c: EagleConfig, found: str, engine: str, dtype: torch.dtype) -> dict:
    """The Llama config.json fields vLLM's and SGLang's EAGLE models read."""
    config = {
        "architectures": [{"eagle3": "LlamaForCausalLMEagle3", "eagle": "LlamaForCausalLM" if engine == "vllm"
                           else "LlamaForCausalLMEagle"}[found]],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.width,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings or 2048,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specdec": {"target": c.target, "target_num_layers": c.target_num_layers},
    }
    if found == "eagle":
        config["bias"] = engine == "sglang"
        return config
    config["draft_vocab_size"] = c.draft_vocab_size
    if c.norm_before_residual:
        config["norm_before_residual"] = True
    if engine == "vllm":
        config["eagle_aux_hidden_state_layer_ids"] = list(c.feature_layers)
    else:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in c.feature_layers],
                                  "use_aux_hidden_state": True}
    return config


# -- reading ----------------------------------------------------------------------------------


def read_config(directory: Path) -> dict | None:
    path = directory / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    return raw if isinstance(raw, dict) else None


def _unwrap(raw: dict) -> dict:
    """The Llama fields of a config: vLLM's older EAGLE configs nest them under "model"."""
    return {**raw["model"], **{k: v for k, v in raw.items() if k != "model"}} if isinstance(raw.get("model"), dict) else raw


def _weight_names(directory: Path) -> list[str]:
    return list(weight_shapes(directory))


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Weight name (less a ``model.`` prefix) -> shape: from a safetensors file's header, or a pickled
    state dict loaded through torch.load(weights_only=True); empty without weights."""
    if (directory / WEIGHTS_FILE).is_file():
        try:
            shapes = head_storage.weight_shapes(directory / WEIGHTS_FILE)
        except ValueError as error:
            raise ValueError(f"the weights in {directory} are corrupt: {error}") from None
    elif (directory / PICKLED_FILE).is_file():
        shapes = {k: tuple(v.shape) for k, v in read_weights(directory).items()}
    else:
        return {}
    return {k.removeprefix("model."): shape for k, shape in shapes.items()}


def read_weights(directory: Path) -> dict[str, Tensor]:
    """The weights: safetensors preferred, a pickled state dict only through torch.load(weights_only=True)."""
    try:
        if (directory / WEIGHTS_FILE).is_file():
            return head_storage.read_weights(directory / WEIGHTS_FILE)
        return torch.load(directory / PICKLED_FILE, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated files, pickles holding more than tensors
        raise ValueError(f"the weights in {directory} are corrupt or not a plain state dict: {error}") from error


def serve_command(out_dir: Path, engine: str) -> str:
    """The engine's speculative options that load an exported head (for the CLI to print)."""
    eagle3 = json.loads((Path(out_dir) / CONFIG_FILE).read_text())["architectures"][0].endswith("Eagle3")
    if engine == "vllm":
        spec = {"method": "eagle3" if eagle3 else "eagle", "model": str(out_dir), "num_speculative_tokens": 3}
        return f"vllm serve <target> --speculative-config '{json.dumps(spec)}'"
    return (f"python -m sglang.launch_server --model-path <target> --speculative-algorithm {'EAGLE3' if eagle3 else 'EAGLE'} "
            f"--speculative-draft-model-path {out_dir} --speculative-num-steps 3 --speculative-eagle-topk 4 "
            f"--speculative-num-draft-tokens 16")
