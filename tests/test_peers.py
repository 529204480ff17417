"""Hugging Face generate() as peers: greedy-equal to our plain decoding, EOS handled as ours, seeded
sampling reproducible, options refused before any model loads."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from transformers import GenerationConfig

from experiments.run.peers import PEERS, build_peer, check_peer_options
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference

GREEDY, SAMPLED = SamplingParams(0.0), SamplingParams(1.0, top_k=20, top_p=0.9)
# ragged prompts, some with repeats so prompt lookup finds matches
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10], [30, 31, 32, 33, 30, 31, 32, 33, 30]]
SEEDS = [101, 102, 103, 104]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def assistant_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("assistant")
    tiny_model("llama", seed=1, layers=1, sharpness=4.0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def peers(assistant_dir):
    """Every peer on one shared stock model whose own generation_config would change decoding if it were read."""
    model = tiny_model("llama", sharpness=4.0)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, repetition_penalty=2.0, eos_token_id=49)
    options = {"hf_assisted": {"model_path": assistant_dir, "num_assistant_tokens": 3}, "hf_early_exit": {"layers": 1, "num_assistant_tokens": 3}}
    return model, {name: build_peer(name, model, options.get(name, {})) for name in PEERS.names()}


@pytest.fixture(scope="module")
def plain():
    return SpecDecoder(HFTarget(tiny_model("llama", sharpness=4.0)), None, reference.verify)


def tier(names: set[str]) -> list:
    """The fast tier keeps ``names``; the other peers run with integration."""
    return [name if name in names else pytest.param(name, marks=pytest.mark.integration) for name in PEERS.names()]


@pytest.mark.parametrize("name", tier({"hf_assisted"}))
def test_greedy_peers_equal_plain_decoding(peers, plain, name):
    model, built = peers
    checkpoint_config = model.generation_config
    expected = plain.generate(PROMPTS, NEW_TOKENS, GREEDY, seeds=SEEDS).outputs
    assert built[name].generate(PROMPTS, NEW_TOKENS, GREEDY, SEEDS, eos_token_id=None).outputs == expected
    assert model.generation_config is checkpoint_config  # put back after decoding


@pytest.mark.parametrize("name", tier({"hf_prompt_lookup"}))
def test_peers_stop_after_the_first_eos_as_plain_decoding_does(peers, plain, name):
    free = plain.generate(PROMPTS, NEW_TOKENS, GREEDY, seeds=SEEDS).outputs
    eos = free[2][6]  # a token in the middle of one answer (and perhaps others)
    expected = plain.generate(PROMPTS, NEW_TOKENS, GREEDY, seeds=SEEDS, eos_token_id=eos).outputs
    assert len(expected[2]) < NEW_TOKENS and expected[2][-1] == eos  # the case under test happens
    assert peers[1][name].generate(PROMPTS, NEW_TOKENS, GREEDY, SEEDS, eos_token_id=eos).outputs == expected


@pytest.mark.integration
@pytest.mark.parametrize("name", PEERS.names())
def test_sampled_peers_reproduce_with_the_same_seeds(peers, name):
    peer = peers[1][name]
    rng_state = torch.get_rng_state()
    first = peer.generate(PROMPTS, NEW_TOKENS, SAMPLED, SEEDS, eos_token_id=None).outputs
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's random stream is left alone
    assert peer.generate(PROMPTS, NEW_TOKENS, SAMPLED, SEEDS, eos_token_id=None).outputs == first
    other_seeds = [seed + 1000 for seed in SEEDS]
    assert peer.generate(PROMPTS, NEW_TOKENS, SAMPLED, other_seeds, eos_token_id=None).outputs != first


def test_prompt_lookup_saves_forwards_on_a_repetitive_answer(peers):
    model, built = peers
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        counts = {}
        for name in ("hf_generate", "hf_prompt_lookup"):
            calls.clear()
            built[name].generate([PROMPTS[2]], NEW_TOKENS, GREEDY, [0], eos_token_id=None)  # answers 49 eleven times
            counts[name] = len(calls)
    finally:
        hook.remove()
    assert counts["hf_generate"] == NEW_TOKENS  # prefill + one forward per further token
    assert counts["hf_prompt_lookup"] < NEW_TOKENS


@pytest.mark.parametrize(
    "name,options,named",
    [
        ("hf_beam", {}, "hf_beam"),
        ("hf_generate", {"num_draft": 4}, "num_draft"),
        ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens"),
        ("hf_prompt_lookup", {"max_matching_ngram_size": 2.5}, "max_matching_ngram_size"),
        ("hf_assisted", {"model_path": "/no/such/folder"}, "model_path"),
        ("hf_assisted", {"dtype": "int8"}, "dtype"),
        ("hf_assisted", {"assistant_confidence_threshold": 1.5}, "assistant_confidence_threshold"),
        ("hf_early_exit", {"layers": 0}, "layers"),
        ("hf_early_exit", {"num_assistant_tokens": True}, "num_assistant_tokens"),
    ],
)
def test_bad_options_are_refused_naming_them(name, options, named):
    with pytest.raises(ValueError, match=named) as error:
        check_peer_options(name, options)
    assert "\n" not in str(error.value)


def test_early_exit_is_refused_where_the_model_would_run_every_layer():
    with pytest.raises(ValueError, match="every decoder layer"):
        build_peer("hf_early_exit", tiny_model("gpt2"), {"layers": 1})  # GPT-2's forward ignores num_hidden_layers
    with pytest.raises(ValueError, match="layers must be below the model's 2"):
        build_peer("hf_early_exit", tiny_model("llama"), {"layers": 2})


def test_an_assistant_with_another_vocabulary_is_refused(tmp_path):
    tiny_model("llama", vocab_size=96).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        build_peer("hf_assisted", tiny_model("llama"), {"model_path": str(tmp_path)})


@pytest.mark.slow
def test_smollm2_peers_equal_plain_decoding():
    from experiments.common.prompt_sets import encode_prompt, load_mtbench
    from experiments.run.peers import load_stock_model
    from specdec.packaged_models import load_smollm2

    model, tokenizer = load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto", key="smollm2")  # the kernels configs/target/smollm2.yaml picks
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(2)]
    eos = tokenizer.eos_token_id
    expected = SpecDecoder(target, None, reference.verify).generate(prompts, 16, GREEDY, eos_token_id=eos).outputs
    stock = load_stock_model("smollm2")
    for name in ("hf_generate", "hf_prompt_lookup"):
        assert build_peer(name, stock, {}).generate(prompts, 16, GREEDY, [0, 1], eos_token_id=eos).outputs == expected, name
