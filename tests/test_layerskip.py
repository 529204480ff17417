"""Self-speculation with the target's own layers: exactness, the drafts themselves, the KV it borrows
from the target, and the cached skip-set search."""

from __future__ import annotations

import json

import pytest
import torch

from drafters.base import build
from drafters.layerskip import LayerSkipDrafter, calibration_text, search_skip_set
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget, layer_subset
from tiny_models import tiny_model
from verifiers import reference

PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 11, 12]]


@pytest.fixture(scope="module")
def target():
    return HFTarget(tiny_model("llama", layers=4, sharpness=4.0))


@pytest.fixture(scope="module")
def plain(target):
    return SpecDecoder(target, None, reference.verify).generate(PROMPTS, 20, SamplingParams(0.0))


class CheckedDrafter(LayerSkipDrafter):
    """Checks every proposal: the target's cache is left bitwise as it was, and the chain equals
    greedy decoding of the reduced model run from scratch on the committed text (no cache)."""

    def propose(self, ctx):
        layers = self.target.kv_cache.layers
        before = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
        tree = super().propose(ctx)
        for (keys, values), layer in zip(before, layers):
            assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
        reduced = layer_subset(self.target.model, self.kept)
        for b, length in enumerate(ctx.lengths.tolist()):
            sequence = ctx.tokens[b, :length].tolist()
            for _ in range(self.num_draft):
                with torch.no_grad():
                    sequence.append(int(reduced(torch.tensor([sequence])).logits[0, -1].argmax()))
            assert tree.tokens[b].tolist() == sequence[length:]
        return tree


# (0,): early exit, every layer shared; (0, 1, 3): layers 0-1 shared, layer 3 own KV;
# (0, 2, 3): only layer 0 shared; all four: the drafter is the target
@pytest.mark.parametrize("kept", [(0,), (0, 2, 3), (0, 1, 2, 3)])
@pytest.mark.parametrize("prompts", [pytest.param(PROMPTS[:1], marks=pytest.mark.integration), PROMPTS], ids=["batch1", "ragged3"])
def test_greedy_equals_plain_decoding(target, plain, kept, prompts):
    drafter = LayerSkipDrafter(target, kept, num_draft=3)
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 20, SamplingParams(0.0))
    assert out.outputs == plain.outputs[: len(prompts)]
    if kept == (0, 1, 2, 3):
        assert out.stats.tau == 4.0  # the full model drafting for itself accepts everything


@pytest.mark.parametrize("kept,temperature", [((0, 1, 3), 0.0), pytest.param((0, 1, 3), 1.0, marks=pytest.mark.integration),
                                              pytest.param((0,), 1.0, marks=pytest.mark.integration)])
def test_drafts_are_the_reduced_model_and_the_target_cache_is_untouched(target, plain, kept, temperature):
    drafter = CheckedDrafter(target, kept, num_draft=3)
    out = SpecDecoder(target, drafter, reference.verify).generate(PROMPTS, 12, SamplingParams(temperature), seed=2)
    assert [len(o) for o in out.outputs] == [12, 12, 12]
    if temperature == 0.0:
        assert out.outputs == [o[:12] for o in plain.outputs]
        assert out.stats.per_depth_alpha[-1] > 0  # some chains were accepted whole: the catch-up ran


def test_admitted_requests_catch_up_and_stay_exact(target, plain):
    """Continuous batching: with two rows for three prompts, the third is admitted when the second
    stops early at an EOS, and its own-layer KV is caught up from its prompt."""
    eos = plain.outputs[1][3]
    expected = SpecDecoder(target, None, reference.verify).generate(PROMPTS, 12, SamplingParams(0.0), eos_token_id=eos)
    drafter = CheckedDrafter(target, (0, 1, 3), num_draft=2)
    out = SpecDecoder(target, drafter, reference.verify).generate(
        PROMPTS, 12, SamplingParams(0.0), eos_token_id=eos, max_batch=2
    )
    assert out.outputs == expected.outputs


def test_factory_variants_and_errors(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert build("layerskip", target, variant="early_exit").kept == (0, 1)  # two thirds of 4 layers
    assert build("layerskip", target, variant="early_exit", exit_layer=3).kept == (0, 1, 2)
    assert build("layerskip", target, skip=[2]).kept == (0, 1, 3)
    with pytest.raises(ValueError, match=r"exit_layer must lie in \[1, 4\]"):
        build("layerskip", target, variant="early_exit", exit_layer=5)
    with pytest.raises(ValueError, match="exit_layer belongs to variant=early_exit"):
        build("layerskip", target, exit_layer=2)
    with pytest.raises(ValueError, match="layer 0 is always kept"):
        build("layerskip", target, variant="skip", skip=[0])
    with pytest.raises(ValueError, match="either skip"):
        build("layerskip", target, variant="skip", skip=[1], num_skip=1)
    with pytest.raises(ValueError, match="variant must be"):
        build("layerskip", target, variant="middle")
    with pytest.raises(ValueError, match="HeadTarget"):
        build("layerskip", SyntheticTarget(vocab_size=8))


def test_search_grows_the_skip_set_by_the_best_agreement(target):
    sequences = calibration_text(target, prompts=2, tokens=12, seed=0)
    assert sequences.shape == (2, 13)
    found = search_skip_set(target, 2, sequences)
    assert len(set(found.skip)) == 2 and 0 not in found.skip
    assert found.agreement[0] >= found.agreement[1]  # a subset of the second round's candidates

    def agreement(kept):
        full = layer_subset(target.model, range(4))(sequences).logits.argmax(-1)
        return float((layer_subset(target.model, kept)(sequences).logits.argmax(-1) == full).float().mean())

    with torch.no_grad():
        first_round = {layer: agreement(tuple(i for i in range(4) if i != layer)) for layer in (1, 2, 3)}
    assert found.agreement[0] == max(first_round.values()) == first_round[found.skip[0]]


def test_searched_skip_set_is_cached(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    options = dict(variant="skip", num_skip=1, calibration_prompts=2, calibration_tokens=8)
    first = build("layerskip", target, **options)
    [path] = (tmp_path / "layerskip").glob("skip-*.json")
    stored = json.loads(path.read_text())
    assert first.kept == tuple(i for i in range(4) if i not in stored["skip"])
    stored["skip"] = [3 if stored["skip"] != [3] else 2]  # a different result proves the file is read
    path.write_text(json.dumps(stored))
    assert build("layerskip", target, **options).kept == tuple(i for i in range(4) if i not in stored["skip"])
    build("layerskip", target, **{**options, "seed": 1})  # other settings: another file
    assert len(list((tmp_path / "layerskip").glob("skip-*.json"))) == 2


@pytest.fixture(scope="module")
def smollm2():
    from experiments.common.prompt_sets import encode_prompt, load_mtbench
    from specdec.packaged_models import load_smollm2

    model, tokenizer = load_smollm2()
    target = HFTarget(model, key="smollm2")
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(2)]
    eos = tokenizer.eos_token_id
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 16, SamplingParams(0.0), eos_token_id=eos)
    return target, prompts, eos, plain.outputs


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"variant": "early_exit", "exit_layer": 20}, {"skip": [13, 17]}])
def test_smollm2_greedy_equals_plain_decoding(smollm2, options):
    target, prompts, eos, plain = smollm2
    drafter = build("layerskip", target, **options)
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 16, SamplingParams(0.0), eos_token_id=eos)
    assert out.outputs == plain
    assert out.stats.per_depth_alpha[0] > 0


# the fast tier keeps Gemma-2 (each layer's attention kind by its place); the others run with integration
@pytest.mark.parametrize("family", [f if f == "gemma2" else pytest.param(f, marks=pytest.mark.integration)
                                    for f in ["gpt2", "opt", "phi", "gemma2", "mistral"]])
def test_other_layouts_skip_the_right_layers_and_stay_exact(family):
    """OPT keeps its blocks two levels down (model.decoder.layers), Gemma-2 looks each layer's
    attention kind (sliding or global) up by its place in the list: the view must equal the full
    model with the skipped layer turned into an identity, and drafting with it stays exact."""
    from specdec.target import decoder_layers

    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    skipped = tiny_model(family, layers=4, sharpness=4.0)
    decoder_layers(skipped)[1].forward = lambda hidden_states, *args, **kwargs: hidden_states
    target = HFTarget(tiny_model(family, layers=4, sharpness=4.0))
    with torch.no_grad():
        view = layer_subset(target.model, (0, 2, 3))(ids).logits
        assert torch.allclose(view, skipped(ids).logits, atol=1e-4)
    prompts = [p * 3 for p in PROMPTS]  # past the 8-token windows of gemma2 and mistral
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 12, SamplingParams(0.0))
    out = SpecDecoder(target, CheckedDrafter(target, (0, 2, 3), num_draft=3), reference.verify).generate(
        prompts, 12, SamplingParams(0.0)
    )
    assert out.outputs == plain.outputs
