"""Retrieval drafting: the suffix-array datastore finds exactly an n-gram's occurrences, drafts
follow the corpus's most frequent continuations within the thresholds, datastores save and load
atomically with clear errors, and the drafter is greedy-equal to plain decoding."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from drafters import retrieval
from drafters.base import TargetSizes, build, check_options
from drafters.heads import sizes_of
from drafters.retrieval import SEPARATOR, SORT_DEPTH, Datastore, RetrievalDrafter, sort_suffixes
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.noise import RequestRNG
from specdec.protocols import DraftContext
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from tiny_models import save_base_model, tiny_model
from transformers import AutoModelForCausalLM
from verifiers import reference


def random_documents(rng: random.Random, vocab: int, alphabet: int, count: int = 40) -> list[list[int]]:
    # few distinct tokens, so n-grams repeat; spread over the vocabulary so large ids are exercised
    symbols = [rng.randrange(vocab) for _ in range(alphabet)]
    return [[rng.choice(symbols) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def occurrences(tokens: list[int], ngram: list[int]) -> list[int]:
    n = len(ngram)
    return [p for p in range(len(tokens) - n + 1) if tokens[p : p + n] == ngram]


@pytest.mark.parametrize("vocab", [7, 49152, 150000])  # 21, 4 and 3 tokens per packed key
def test_find_returns_exactly_the_occurrences(vocab):
    rng = random.Random(vocab)
    store = Datastore.build(random_documents(rng, vocab, alphabet=3), vocab)
    tokens = store.tokens.tolist()
    for _ in range(300):
        n = rng.randrange(1, 11)
        if rng.random() < 0.7:  # an n-gram of the corpus (it may cross a separator: then none)
            start = rng.randrange(len(tokens) - n)
            ngram = tokens[start : start + n]
            if SEPARATOR in ngram:
                continue
        else:  # anything, mostly absent
            ngram = [rng.randrange(vocab) for _ in range(n)]
        lo, hi = store.find(ngram)
        assert sorted(store.suffixes[lo:hi].tolist()) == occurrences(tokens, ngram), ngram


def test_suffixes_are_sorted_by_their_first_sort_depth_tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 3, 500).astype(np.int32)
    tokens[rng.integers(0, 500, 20)] = SEPARATOR
    order = sort_suffixes(tokens)
    keys = [tuple(int(t) + 1 for t in tokens[p : p + SORT_DEPTH]) for p in order]  # SEPARATOR and the end first
    assert sorted(order.tolist()) == list(range(500))
    assert keys == sorted(keys)


def test_drafts_follow_the_most_frequent_continuations():
    corpus = [[1, 2, 3, 4, 5]] * 6 + [[1, 2, 3, 7]] * 3 + [[9, 2, 3, 8]] + [[2, 3]]
    store = Datastore.build(corpus, 16)
    drafter = RetrievalDrafter(None, store, num_draft=3, min_ngram=1, max_ngram=4, min_count=1, min_fraction=0.0, max_nodes=8)
    paths, confidence = drafter.drafts([0, 1, 2, 3])
    # the longest match is "1 2 3" (9 occurrences): 4 5 six times, 7 three times; document ends stop a draft
    assert paths == [[4], [4, 5], [7]]
    shrink = lambda occ: occ / (occ + 3)
    flat = [c for path in confidence for c in path]
    assert flat == pytest.approx([6 / 9 * shrink(6)] * 3 + [3 / 9 * shrink(3)])
    # "2 3" only (11 occurrences: 6 x 4, 3 x 7, 1 x 8, one at a document's end)
    assert drafter.drafts([5, 2, 3])[0] == [[4], [4, 5], [7], [8]]
    strict = RetrievalDrafter(None, store, num_draft=3, min_ngram=1, max_ngram=4, min_count=4, min_fraction=0.5)
    assert strict.drafts([0, 1, 2, 3])[0] == [[4], [4, 5]]
    assert RetrievalDrafter(None, store, min_ngram=1, max_nodes=1, min_fraction=0.0).drafts([1, 2, 3])[0] == [[4]]
    assert drafter.drafts([11, 12]) == ([], [])  # no match


def test_sampled_occurrences_are_spread_over_the_range():
    corpus = [[1, 5]] * 30 + [[1, 6]] * 10
    store = Datastore.build(corpus, 8)
    drafter = RetrievalDrafter(None, store, num_draft=1, min_ngram=1, max_matches=4, min_count=1, min_fraction=0.0)
    paths, confidence = drafter.drafts([1])
    assert paths == [[5], [6]]  # 3 of 4 evenly spaced samples of the sorted range say 5
    assert confidence[0][0] == pytest.approx(0.75 * 30 / 33)


def test_a_datastore_saves_and_loads_with_clear_errors(tmp_path):
    store = Datastore.build([[1, 2, 3], [3, 2, 1]], 8, {"tokenizer": "toy"})
    store.save(tmp_path / "ds")
    loaded = Datastore.load(tmp_path / "ds")
    assert loaded.tokens.tolist() == store.tokens.tolist() and loaded.suffixes.tolist() == store.suffixes.tolist()
    assert loaded.meta["tokenizer"] == "toy" and loaded.find([3, 2]) == store.find([3, 2])
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no staging folder left behind
    with pytest.raises(FileExistsError, match="exists"):
        store.save(tmp_path / "ds")
    with pytest.raises(FileNotFoundError, match="build_datastore"):
        Datastore.load(tmp_path / "nothing")
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    (tmp_path / "ds" / "meta.json").write_text(json.dumps({**meta, "format": 0}))
    with pytest.raises(ValueError, match="rebuild"):
        Datastore.load(tmp_path / "ds")
    with pytest.raises(ValueError, match="non-empty document"):
        Datastore.build([[], []], 8)
    with pytest.raises(ValueError, match="must lie in"):
        Datastore.build([[1, 9]], 8)


def test_bad_options_and_a_foreign_vocabulary_are_refused(tmp_path, monkeypatch):
    Datastore.build([[1, 2, 3]], 100000).save(tmp_path / "big")
    target = HFTarget(tiny_model("llama"))
    with pytest.raises(ValueError, match="target's tokenizer"):
        build("retrieval", target, datastore=str(tmp_path / "big"))
    with pytest.raises(ValueError, match="target's tokenizer"):  # the same, before a target loads
        check_options("retrieval", {"datastore": str(tmp_path / "big")}, sizes_of(target))
    # the default datastore is in the target's own tokens: a model built in memory has no tokenizer folder
    with pytest.raises(ValueError, match="no tokenizer folder; build one .* drafter.datastore=FOLDER"):
        build("retrieval", target)
    with pytest.raises(ValueError, match="no tokenizer folder"):
        check_options("retrieval", {}, TargetSizes("the synthetic target", 32, None, None, kind="synthetic"))
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        RetrievalDrafter(None, str(tmp_path / "big"), min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="min_fraction"):
        RetrievalDrafter(None, str(tmp_path / "big"), min_fraction=1.5)


def test_greedy_retrieval_equals_plain_decoding(tmp_path):
    """A datastore of the tiny target's own greedy continuations: drafts get accepted, and every
    output is plain decoding's, with requests of different lengths in flight together."""
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    greedy = SamplingParams(0.0)
    plain = SpecDecoder(target, None, reference.verify)
    seeds = [[5, 6, 7], [3, 9], [11, 4, 4, 2], [8]]
    corpus = [list(s) + out for s, out in zip(seeds, plain.generate(seeds, 24, greedy).outputs)]
    Datastore.build(corpus, target.vocab_size).save(tmp_path / "ds")
    drafter = build("retrieval", target, datastore=str(tmp_path / "ds"), min_ngram=1, min_count=1)
    prompts = [[5, 6, 7], [3, 9], [11, 4], [8, 8, 8, 1]]  # two of them continue texts in the datastore
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 20, greedy, max_batch=3)
    assert out.outputs == plain.generate(prompts, 20, greedy).outputs
    assert out.stats.tau > 1.2
    # the trees carry a confidence per node, for a budgeted union
    ctx = DraftContext(torch.tensor([corpus[0][:6]]), torch.tensor([6]), (), torch.zeros(1, dtype=torch.int64), greedy,
                       RequestRNG(torch.tensor([0])))
    proposed = drafter.propose(ctx)
    assert proposed.confidence is not None and proposed.confidence.shape == proposed.tokens.shape
    assert int(proposed.num_nodes[0]) > 0 and bool((proposed.confidence[0, : int(proposed.num_nodes[0])] > 0).all())


def test_build_datastore_generate_indexes_the_targets_own_answers(tmp_path, monkeypatch, capsys):
    """--generate: the target answers the opening user turns, each answer is one document, the
    answers are cached where specdec-train's regeneration looks for them, and bad options are refused."""
    from experiments import build_datastore
    from specdec import assets
    from specdec.assets import Conversation
    from specdec.target_loader import TargetHandle
    from test_training import WordTokenizer

    target = HFTarget(tiny_model("llama", sharpness=4.0))
    conversations = [
        Conversation("a", (("user", "tell me about cats"), ("assistant", "cats are ..."))),
        Conversation("b", (("system", "be brief"), ("user", "why is the sky blue"))),
    ]
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    handle = TargetHandle("tiny", "hf", "tiny", target.vocab_size, target.max_length, WordTokenizer(), None, lambda: target)
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # a model folder, as --generate checks one
    monkeypatch.setattr(build_datastore, "open_target", lambda cfg, with_tokenizer: handle)
    monkeypatch.setattr(assets, "load_sharegpt_conversations", lambda count: conversations[:count])
    build_datastore.main(["--generate", str(folder), "--conversations", "2", "--max-new-tokens", "6", "--batch", "2",
                          "--out", str(tmp_path / "ds")])

    tokenizer = WordTokenizer()
    prompts = [tokenizer(tokenizer.apply_chat_template(m, add_generation_prompt=True))["input_ids"]
               for m in ([{"role": "user", "content": "tell me about cats"}],
                         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why is the sky blue"}])]
    answers = SpecDecoder(target, None, reference.verify).generate(prompts, 6, SamplingParams(0.0)).outputs
    store = Datastore.load(tmp_path / "ds")
    assert store.tokens.tolist() == Datastore.build(answers, target.vocab_size).tokens.tolist()
    assert store.meta["answers"] == 2 and "own answers" in store.meta["source"]
    assert (tmp_path / "cache" / "regenerated" / "tiny-sharegpt-regen6-T0.jsonl").is_file()  # specdec-train's name
    assert "2 documents" in capsys.readouterr().out

    for argv, message in [
        (["--generate", "tiny", "--out", str(tmp_path / "ds")], "exists"),
        (["--jsonl", "x.jsonl", "--out", str(tmp_path / "new")], "needs --tokenizer"),
        (["--generate", "tiny", "--batch", "0", "--out", str(tmp_path / "new")], "at least 1"),
        (["--out", str(tmp_path / "new")], "one of the arguments --jsonl --target/--generate is required"),
    ]:
        with pytest.raises(SystemExit):
            build_datastore.main(argv)
        assert message in capsys.readouterr().err


def test_the_default_datastore_is_built_once_per_target_in_its_own_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    answers = [assets.Conversation("a", (("user", "hi"), ("assistant", "abcabcabd"))),
               assets.Conversation("b", (("user", "yo"), ("assistant", "  ")))]
    monkeypatch.setattr(retrieval.assets, "load_sharegpt_conversations", lambda user_first: answers)
    targets = []
    for name in ("one", "two"):
        save_base_model(tmp_path / name)
        targets.append(HFTarget(AutoModelForCausalLM.from_pretrained(tmp_path / name), folder=tmp_path / name))
    drafter = build("retrieval", targets[0], min_count=1)
    assert drafter.store.meta["tokenizer"] == str((tmp_path / "one").resolve()) and drafter.store.meta["documents"] == 1
    assert drafter.store.vocab_size == targets[0].vocab_size
    folders = sorted(p.name for p in (tmp_path / "cache" / "datastores").iterdir())
    build("retrieval", targets[0])  # cached: no second folder
    build("retrieval", targets[1])  # another folder, its own datastore
    assert len(folders) == 1 and len(list((tmp_path / "cache" / "datastores").iterdir())) == 2
    # the answer in save_base_model's character tokens (a = 65): the blank one is left out
    assert [int(t) for t in drafter.store.tokens if t != SEPARATOR] == [65, 66, 67, 65, 66, 67, 65, 66, 68]

