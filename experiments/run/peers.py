"""Hugging Face transformers' own generation as peers: what a user of the model would otherwise run.

Terms, defined once:
    peer: a decoding method outside specdec, here ``model.generate`` of transformers, measured beside
        our drafters on the same model, prompts, answer length and seeds. ``PEERS`` registers them, each
        with its options class (``options``) and whether ``specdec-bench`` ranks it by default (``bench``):
        hf_generate       plain ``generate()`` (greedy or sampled)
        hf_prompt_lookup  prompt lookup decoding (``prompt_lookup_num_tokens``)
        hf_assisted       assisted generation with a separate draft model (``assistant_model``)
        hf_early_exit     self-speculation drafting with the model's first layers (``assistant_early_exit``)
    stock model: a transformers model whose modules are as transformers built them. HFTarget rewrites the
        model it wraps (packed linears, grouped-query attention), so a peer needs its own load of the
        target: ``load_stock_model``.
    options: a peer's settings, by name; each peer's frozen dataclass below lists them, with transformers'
        own defaults wherever it has one, so a peer run with no options is what a user gets from the
        documented call.

Outputs follow ``specdec.decode.SpecDecoder.generate``: the generated ids per prompt, prompt excluded,
ending at ``max_new_tokens`` or just after the first EOS (included). Greedy peers are therefore
comparable token for token with our plain decoding; sampled ones draw their own random numbers, so
they follow the same distribution without matching our samples.

Decoding is fixed by the call alone: while a peer decodes, the model's ``generation_config`` is a blank
one, early exit's draft settings aside (the checkpoint's generation_config.json could otherwise set sampling defaults, a repetition
penalty, extra EOS ids or suppressed tokens), and sampling is seeded per prompt in a forked RNG.
transformers' assisted generation takes one prompt at a time, so every peer decodes one prompt at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from drafters.draft_model import load_draft_model
from specdec.decode import check_prompts
from specdec.packaged_models import PACKAGED_MODELS
from specdec.registry import Registry
from specdec.sampling import SamplingParams
from specdec.target import decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class PeerOutput:
    outputs: list[list[int]]  # generated token ids per prompt (prompt excluded), as Generation.outputs


class Peer(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams,
        seeds: list[int],  # one per prompt
        eos_token_id: int | None,  # None = never stop before max_new_tokens
    ) -> PeerOutput: ...


def check_peer_options(name: str, options: dict) -> None:
    """Refuse an unknown peer, an option it does not take or a bad value, before any model loads."""
    _parse_options(name, options)


def _parse_options(name: str, options: dict):
    PEERS.check(name)
    kind = PEERS.trait(name, "options")
    known = [field.name for field in dataclasses.fields(kind)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"peer {name!r} takes no option {', '.join(unknown)}; its options are {', '.join(known) or 'none'}")
    return kind(**options)


def load_stock_model(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """A fresh load of a model for peers: an HF model folder, or "smollm2" for the bundled SmolLM2
    (what target=hf and target=smollm2 decode, before HFTarget rewrites their modules)."""
    return load_draft_model(str(path), dtype)


def build_peer(name: str, model: PreTrainedModel, options: dict) -> Peer:
    """Peer ``name`` decoding with ``model``, a stock model (see the module docstring) that peers may
    share: each installs its own generation_config only while it decodes."""
    parsed = _parse_options(name, options)
    return PEERS.get(name)(model, parsed)


def _require_count(options: object, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")


def _require_threshold(value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise ValueError(f"assistant_confidence_threshold must lie in [0, 1) (0 = off); got {value!r}")


@dataclass(frozen=True)
class GenerateOptions:
    pass


@dataclass(frozen=True)
class PromptLookupOptions:
    prompt_lookup_num_tokens: int = 10  # tokens copied after a match (transformers' default)
    max_matching_ngram_size: int = 2  # longest suffix n-gram looked up (transformers' default)

    def __post_init__(self) -> None:
        _require_count(self, "prompt_lookup_num_tokens", "max_matching_ngram_size")


@dataclass(frozen=True)
class AssistedOptions:
    model_path: str = "smollm2"  # an HF model folder sharing the target's tokenizer, or a packaged model
    dtype: str = "float32"
    # transformers' defaults: up to 20 drafted tokens, a draft ending early where the assistant's own
    # probability of its token falls below the threshold (which transformers retunes during each call
    # when scikit-learn is installed)
    num_assistant_tokens: int = 20
    assistant_confidence_threshold: float = 0.4

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not (self.model_path in PACKAGED_MODELS or Path(self.model_path).is_dir()):
            raise ValueError(f"model_path must be an HF model folder or a packaged model ({', '.join(PACKAGED_MODELS)}); "
                             f"got {self.model_path!r}")
        dtype = getattr(torch, str(self.dtype), None)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must name a torch floating-point dtype (float32, bfloat16, float16); got {self.dtype!r}")
        _require_count(self, "num_assistant_tokens")
        _require_threshold(self.assistant_confidence_threshold)


@dataclass(frozen=True)
class EarlyExitOptions:
    layers: int | None = None  # decoder layers the drafts run through; None = half the model's
    num_assistant_tokens: int = 20  # as AssistedOptions: transformers' defaults
    assistant_confidence_threshold: float = 0.4

    def __post_init__(self) -> None:
        if self.layers is not None:
            _require_count(self, "layers")
        _require_count(self, "num_assistant_tokens")
        _require_threshold(self.assistant_confidence_threshold)


# name -> builder(stock model, parsed options); traits: options (the options dataclass), bench (True:
# specdec-bench ranks it unless told otherwise; hf_assisted needs a draft model of the target's
# tokenizer, which a user names)
PEERS: Registry[Callable[[PreTrainedModel, Any], HFPeer]] = Registry("peer")


@PEERS.register("hf_generate", options=GenerateOptions, bench=True)
def _plain(model: PreTrainedModel, options: GenerateOptions) -> HFPeer:
    return HFPeer(model, {})


@PEERS.register("hf_prompt_lookup", options=PromptLookupOptions, bench=True)
def _prompt_lookup(model: PreTrainedModel, options: PromptLookupOptions) -> HFPeer:
    return HFPeer(model, dataclasses.asdict(options))


@PEERS.register("hf_assisted", options=AssistedOptions, bench=False)
def _assisted(model: PreTrainedModel, options: AssistedOptions) -> HFPeer:
    assistant = load_draft_model(options.model_path, options.dtype).to(model.device).eval()
    if _vocab_size(assistant) != _vocab_size(model):
        raise ValueError(
            f"the assistant at model_path={options.model_path} has {_vocab_size(assistant)} tokens but the "
            f"target has {_vocab_size(model)}; the assistant must share the target's tokenizer"
        )
    assistant.generation_config = _assistant_config(options.num_assistant_tokens, options.assistant_confidence_threshold)
    return HFPeer(model, {"assistant_model": assistant})


@PEERS.register("hf_early_exit", options=EarlyExitOptions, bench=True)
def _early_exit(model: PreTrainedModel, options: EarlyExitOptions) -> HFPeer:
    total = model.config.num_hidden_layers
    layers = total // 2 if options.layers is None else options.layers
    if not layers < total:
        raise ValueError(f"layers must be below the model's {total} decoder layers; got {layers}")
    if not _exits_early(model, layers):
        raise ValueError(
            f"{type(model).__name__} runs every decoder layer whatever its config says, so transformers' "
            f"assistant_early_exit would draft with the whole model; hf_early_exit needs a model whose "
            f"forward stops at config.num_hidden_layers (Llama, Qwen2, Mistral, Phi, Gemma do)"
        )
    # the early-exit assistant is the model itself, which reads its draft settings from its own config
    config = _assistant_config(options.num_assistant_tokens, options.assistant_confidence_threshold)
    return HFPeer(model, {"assistant_early_exit": layers}, config)


class HFPeer:
    """``model.generate`` with fixed extra arguments, one prompt at a time, seeded per prompt."""

    def __init__(self, model: PreTrainedModel, arguments: dict, generation_config: GenerationConfig | None = None) -> None:
        self.model = model.eval()
        self.arguments = arguments  # the peer's own generate() arguments (its assisted mode)
        self.generation_config = generation_config or GenerationConfig()  # the model's while this peer decodes

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams,
        seeds: list[int],
        eos_token_id: int | None,
    ) -> PeerOutput:
        checked = check_prompts(prompts, max_new_tokens, getattr(self.model.config, "max_position_embeddings", 1 << 30))
        if len(seeds) != len(checked):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(checked)} prompts; give one seed per prompt")
        arguments = {
            **self.arguments,
            **_sampling_arguments(sampling),
            "max_new_tokens": max_new_tokens,
            "eos_token_id": eos_token_id,
            "pad_token_id": eos_token_id,  # one prompt per call is never padded; transformers' own fallback
        }
        device = self.model.device
        outputs = []
        with self._installed(), _quiet():
            for prompt, seed in zip(checked, seeds):
                ids = prompt.to(device)[None]
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    torch.manual_seed(seed)
                    sequence = self.model.generate(ids, attention_mask=torch.ones_like(ids), **arguments)
                outputs.append(sequence[0, ids.shape[1] :].tolist())
        return PeerOutput(outputs)

    @contextlib.contextmanager
    def _installed(self) -> Iterator[None]:
        saved, self.model.generation_config = self.model.generation_config, self.generation_config
        try:
            yield
        finally:
            self.model.generation_config = saved


def _sampling_arguments(sampling: SamplingParams) -> dict:
    if sampling.greedy:
        return {"do_sample": False}
    # transformers applies temperature, then top-k, then top-p, as specdec.sampling.probabilities does;
    # top_k=0 and top_p=1 switch them off in both
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def _assistant_config(num_assistant_tokens: int, confidence_threshold: float) -> GenerationConfig:
    # "constant": the "heuristic" schedule carries the draft length from one call into the next, so a
    # prompt's timing would depend on the prompts decoded before it
    return GenerationConfig(
        num_assistant_tokens=num_assistant_tokens,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=confidence_threshold,
    )


def _vocab_size(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _exits_early(model: PreTrainedModel, layers: int) -> bool:
    """Whether lowering config.num_hidden_layers, as transformers' early exit does while drafting,
    keeps decoder layer ``layers`` (0-based) from running."""
    base = getattr(model, model.base_model_prefix)
    ran = []
    hook = decoder_layers(model)[layers].register_forward_hook(lambda *_: ran.append(True))
    total, base.config.num_hidden_layers = base.config.num_hidden_layers, layers
    try:
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.int64, device=model.device), use_cache=False)
    finally:
        base.config.num_hidden_layers = total
        hook.remove()
    return not ran


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' notices about its own internal calls (the assistant's generate passes a config and
    arguments together) would fill the console once per prompt."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
