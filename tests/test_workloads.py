"""Workload families: a Spec-Bench-style question file, ShareGPT conversations with their history,
and the category filter every text workload shares; bad input is one line before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run_cli import forbid_model_loading, read_jsonl, run_in_process
from tiny_models import save_chat_model

from experiments import cli
from experiments.common import long_context, prompt_sets
from experiments.common.prompt_sets import Prompt
from experiments.run import schema, workloads
from specdec import assets, packaged_models

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
    {"question_id": 161, "category": "translation", "turns": ["Translate 'Guten Morgen' into English."]},
    {"question_id": 241, "category": "summarization", "turns": ["Summarize: the cat sat on the mat all day."]},
    {"question_id": 242, "category": "summarization", "turns": ["Summarize: rain fell; the river rose."]},
    {"question_id": "qa-1", "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 401, "category": "math_reasoning", "turns": ["Tom has 3 apples and buys 4 more. How many?"]},
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def question_file(tmp_path) -> Path:
    return write_lines(tmp_path / "question.jsonl", [json.dumps(q) for q in QUESTIONS])


def load(**options) -> list[Prompt] | None:
    return workloads.load_texts(schema.WorkloadConfig(**options))


def test_a_spec_bench_file_gives_first_turns_with_their_categories(question_file):
    prompts = load(name="specbench", path=str(question_file))
    assert [(p.id, p.category, p.text) for p in prompts] == [
        (f"specbench-{q['question_id']}", q["category"], q["turns"][0]) for q in QUESTIONS
    ]
    assert all(p.chat and p.history == () for p in prompts)
    assert [p.id for p in load(name="specbench", path=str(question_file), num_prompts=2)] == ["specbench-81", "specbench-161"]
    raw = load(name="specbench", path=str(question_file), chat=False)
    assert not any(p.chat for p in raw)


def test_categories_keep_the_first_prompts_of_those_categories_in_file_order(question_file):
    chosen = load(name="specbench", path=str(question_file), categories=["math_reasoning", "summarization"], num_prompts=2)
    # the first two of the chosen categories, not the chosen ones among the first two lines
    assert [p.id for p in chosen] == ["specbench-241", "specbench-242"]
    every = load(name="specbench", path=str(question_file), categories=["math_reasoning", "summarization"])
    assert [p.id for p in every] == ["specbench-241", "specbench-242", "specbench-401"]
    with pytest.raises(ValueError, match="asked for 4 prompts of categories qa"):
        load(name="specbench", path=str(question_file), categories=["qa"], num_prompts=4)
    # the same filter on a packaged workload: MT-bench's coding questions
    coding = load(name="mtbench", categories=["coding"], num_prompts=3)
    assert len(coding) == 3 and {p.category for p in coding} == {"coding"}
    assert coding == [p for p in prompt_sets.load_mtbench() if p.category == "coding"][:3]


def test_an_unknown_category_is_refused_naming_the_ones_present(tmp_path, monkeypatch, question_file):
    forbid_model_loading(monkeypatch)
    message = ("workload=specbench has no category 'math'; its categories are writing, translation, "
               "summarization, qa, math_reasoning$")
    with pytest.raises(cli.SpecdecUserError, match=message):
        run_in_process(tmp_path, ["workload=specbench", f"workload.path={question_file}", "workload.categories=[qa,math]"])


@pytest.mark.parametrize(
    "lines,message",
    [
        (None, "Spec-Bench question file {path} does not exist"),
        ([], "Spec-Bench question file {path} is empty"),
        ([json.dumps(QUESTIONS[0]), '{"question_id": 2, "turns": ["cut off'],
         "Spec-Bench question file {path} line 2 is not valid JSON"),
        ([json.dumps(QUESTIONS[0]), "", '{"question_id": 3, "category": "qa"}'],
         "Spec-Bench question file {path} line 3 has no turns"),
        (['{"question_id": 3, "category": "qa", "turns": []}'], "line 1 has no turns"),
        (['{"question_id": 3, "category": "qa", "turns": ["  "]}'], "line 1 has no turns"),
        (['{"question_id": 3, "category": "qa", "turns": "Who?"}'], "line 1 has no turns"),
        (['{"question_id": 3, "turns": ["Who?"]}'], "line 1 has no category"),
        (['{"category": "qa", "turns": ["Who?"]}'], "line 1 has no question_id"),
        ([json.dumps(QUESTIONS[0]), json.dumps({**QUESTIONS[1], "question_id": "81"})],
         "line 2 repeats question_id '81' of line 1"),
    ],
    ids=["missing", "empty", "bad json", "no turns", "empty turns", "blank turn", "turns a string", "no category",
         "no id", "repeated id"],
)
def test_a_bad_question_file_is_one_line_naming_file_and_line_before_loading(tmp_path, monkeypatch, lines, message):
    forbid_model_loading(monkeypatch)
    path = tmp_path / "question.jsonl"
    if lines is not None:
        write_lines(path, lines)
    with pytest.raises(cli.SpecdecUserError) as refused:
        run_in_process(tmp_path, ["workload=specbench", f"workload.path={path}"])
    assert message.format(path=path) in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["workload=specbench"], "workload=specbench needs a prompt file: workload.path=FILE"),
        (["workload=mtbench", "workload.categories=[]"], r"workload.categories=\[\] selects no prompt"),
        (["experiment=synthetic", "workload.categories=[a]"], "workload=synthetic has no categories to select"),
        (["workload=sharegpt_multiturn", "workload.max_chars=0"], "workload.max_chars must be >= 1 or null"),
    ],
)
def test_bad_workload_settings_are_refused_before_loading(tmp_path, monkeypatch, overrides, message):
    forbid_model_loading(monkeypatch)
    with pytest.raises(cli.SpecdecUserError, match=message):
        run_in_process(tmp_path, overrides)


def write_sharegpt(path: Path) -> None:
    """Conversations in ShareGPT's own shape: role names of several chat products, some damaged."""

    def conversation(id, *turns):
        return {"id": id, "conversations": [{"from": role, "value": text} for role, text in turns]}

    records = [
        conversation("long", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "answer two"), ("human", "q3"),
                     ("gpt", "a3")),
        conversation("single", ("human", "only one question"), ("gpt", "one answer")),
        conversation("split", ("human", "p1"), ("chatgpt", "b1"), ("human", "p2"), ("human", "p2 again"), ("gpt", "b2"),
                     ("human", "p3")),
        conversation("blank", ("human", "r1"), ("gpt", " "), ("human", "r2")),
        conversation("continued", ("gpt", "an answer whose question is in another record"), ("human", "s1"),
                     ("gpt", "t1"), ("human", "s2")),
        conversation("bing", ("user", "u1"), ("bing", "v1"), ("user", "u2")),
    ]
    path.write_text(json.dumps(records), encoding="utf-8")


@pytest.fixture
def sharegpt(tmp_path, monkeypatch) -> None:
    write_sharegpt(tmp_path / "sharegpt.json")
    monkeypatch.setattr(assets, "sharegpt_json_path", lambda: tmp_path / "sharegpt.json")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


def test_multiturn_prompts_end_on_the_last_user_turn_with_the_data_answers_as_history(sharegpt):
    prompts = load(name="sharegpt_multiturn")
    assert prompts == [
        Prompt(text="q3", category="sharegpt_multiturn", id="sharegpt-long-turn3", chat=True,
               history=(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "answer two"))),
        # two user turns in a row (a split conversation): the sound part before the break
        Prompt(text="p2", category="sharegpt_multiturn", id="sharegpt-split-turn2", chat=True,
               history=(("user", "p1"), ("assistant", "b1"))),
        Prompt(text="u2", category="sharegpt_multiturn", id="sharegpt-bing-turn2", chat=True,
               history=(("user", "u1"), ("assistant", "v1"))),
    ]
    # "single" has one user turn, "blank" a blank answer before its second, "continued" opens with an answer
    assert [p.id for p in load(name="sharegpt_multiturn", num_prompts=1)] == ["sharegpt-long-turn3"]


def test_max_chars_cuts_each_conversation_at_its_last_user_turn_that_fits(sharegpt):
    # "long": q1 a1 q2 = 6 characters; the answer after q2 takes it to 16, q3 to 18
    for max_chars, expected in [(17, ["sharegpt-long-turn2"]), (18, ["sharegpt-long-turn3"]), (5, [])]:
        prompts = load(name="sharegpt_multiturn", max_chars=max_chars)
        assert [p.id for p in prompts if p.id.startswith("sharegpt-long")] == expected
        assert all(len(p.text) + sum(len(text) for _, text in p.history) <= max_chars for p in prompts)
    assert load(name="sharegpt_multiturn", max_chars=17)[0].history == (("user", "q1"), ("assistant", "a1"))


def test_multiturn_prompts_refuse_raw_text_before_loading(tmp_path, monkeypatch, sharegpt):
    forbid_model_loading(monkeypatch)
    with pytest.raises(cli.SpecdecUserError, match="prompt sharegpt-long-turn3 continues a conversation of 4 earlier turns"):
        run_in_process(tmp_path, ["workload=sharegpt_multiturn", "workload.num_prompts=1", "workload.chat=false"])


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """The tiny character-level base model with a chat template that spells out each turn's role."""
    return save_chat_model(tmp_path_factory.mktemp("tiny-chat"), TEMPLATE)


def test_a_prompt_with_history_encodes_every_turn_through_the_chat_template(chat_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    prompt = Prompt(text="q2", category="c", id="0", chat=True, history=(("user", "q1"), ("assistant", "a1")))
    expected = tokenizer("<user>q1<assistant>a1<user>q2<assistant>", add_special_tokens=False)["input_ids"]
    assert prompt_sets.encode_prompt(tokenizer, prompt) == expected
    first_turn = prompt_sets.encode_prompt(tokenizer, Prompt(text="q2", category="c", id="0", chat=True))
    assert first_turn == tokenizer("<user>q2<assistant>", add_special_tokens=False)["input_ids"]


@pytest.mark.integration
def test_a_spec_bench_run_breaks_results_down_by_its_categories(tmp_path, question_file, chat_model_dir):
    overrides = ["target=hf", f"target.path={chat_model_dir}", "workload=specbench", f"workload.path={question_file}",
                 "workload.categories=[qa,translation]", "max_new_tokens=4", "drafter=ngram", "logger=none",
                 "repeats=1", "warmup_tokens=0"]
    results = run_in_process(tmp_path, overrides)
    assert results["greedy_equal"] is True
    rows = read_jsonl(tmp_path / "prompts.jsonl")
    assert [(row["id"], row["category"]) for row in rows] == [("specbench-161", "translation"), ("specbench-qa-1", "qa")]
    question = "<user>Translate 'Guten Morgen' into English.<assistant>"
    assert rows[0]["prompt_tokens"] == len(question)  # one token per character: the chat-encoded first turn


def test_per_category_takes_the_first_prompts_of_every_category():
    prompts = load(name="mtbench", per_category=1)
    assert len(prompts) == 8 and len({p.category for p in prompts}) == 8
    assert [p.id for p in load(name="mtbench", per_category=2, num_prompts=3)] == ["mtbench-81", "mtbench-82", "mtbench-91"]


def test_mtbench_second_turns_follow_the_first_and_wait_for_the_targets_answer():
    first, = load(name="mtbench", num_prompts=1)
    asked, = load(name="mtbench_turn2", num_prompts=1)
    assert asked.text == first.text and asked.follow_up and asked.follow_up != first.text
    turn2 = prompt_sets.followed_up(asked, "my answer")
    assert turn2.text == asked.follow_up and turn2.id == "mtbench-81-turn2" and turn2.category == asked.category
    assert turn2.history == (("user", first.text), ("assistant", "my answer")) and turn2.follow_up is None
    with pytest.raises(ValueError, match="only a chat template can encode"):
        load(name="mtbench_turn2", num_prompts=1, chat=False)


def test_the_target_answers_first_turns_once_and_the_answers_are_cached(chat_model_dir, tmp_path, monkeypatch):
    from rich.console import Console

    from specdec.decode import SpecDecoder
    from specdec.target_loader import TargetConfig, open_target
    from verifiers.select import select_verifier

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    handle = open_target(TargetConfig(name="hf", path=str(chat_model_dir)), with_tokenizer=True)
    target = handle.load()
    texts = [Prompt("ab", "c", "p0", True, follow_up="cd"), Prompt("ef", "c", "p1", True)]
    console, verifier = Console(quiet=True), select_verifier("reference")
    asked = workloads.answer_first_turns(texts, handle, target, verifier, "float32", 5, console)
    ids = prompt_sets.encode_prompt(handle.tokenizer, texts[0])
    plain = SpecDecoder(target, None, verifier).generate([ids], 5, workloads.SamplingParams(0.0)).outputs[0]
    answer = handle.tokenizer.decode(plain, skip_special_tokens=True).strip()
    assert asked[0] == prompt_sets.followed_up(texts[0], answer) and asked[1] == texts[1]
    cached, = (tmp_path / "answers").glob("*.json")
    assert json.loads(cached.read_text()) == {"p0": answer}

    def refuse(*args, **kwargs):
        raise AssertionError("a cached answer was made again")

    monkeypatch.setattr(SpecDecoder, "generate", refuse)
    assert workloads.answer_first_turns(texts, handle, target, verifier, "float32", 5, console) == asked


def test_long_context_alternates_prose_and_code_within_the_character_bounds():
    prompts = load(name="long_context", num_prompts=6, min_chars=9000, max_chars=16000)
    assert [p.category for p in prompts] == ["summarize", "code"] * 3
    assert all(9000 <= len(p.text) - len(long_context.LONG_PROSE_TASK if p.category == "summarize" else long_context.LONG_CODE_TASK)
               <= 16000 + 16 for p in prompts)
    assert len({p.id for p in load(name="long_context", min_chars=9000, max_chars=16000)}) >= 80
    assert not any("encodings/" in p.id or "stringprep" in p.id for p in load(name="long_context", min_chars=9000, max_chars=16000))
    with pytest.raises(ValueError, match="0 < min_chars <= max_chars"):
        load(name="long_context", min_chars=5, max_chars=4)


@pytest.mark.slow
def test_long_context_prompts_hold_at_least_2k_smollm2_tokens():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(packaged_models.smollm2_path())
    lengths = [len(prompt_sets.encode_prompt(tokenizer, p)) for p in load(name="long_context", min_chars=9000, max_chars=16000)]
    assert min(lengths) >= 2048 and max(lengths) <= 8192 - 1024  # room for 1024-token answers in SmolLM2's window
