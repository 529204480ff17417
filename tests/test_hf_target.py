"""HFTarget on tiny random models of nine families: tree forward, ragged commits, greedy
equality of every HF drafter, and sequence-level exactness through the real KV-cache path."""

from __future__ import annotations

import pytest
import torch
from sequence_stats import ALPHA, required_samples, sequence_verdict
from tiny_models import full_logits, tiny_model
from torch.overrides import TorchFunctionMode

from drafters.draft_model import DraftModelDrafter
from drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from drafters.ngram import NgramDrafter
from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams, probabilities
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget
from specdec.tree import SiblingMode, empty_tree, tree_from_parents
from verifiers import reference, traversal

FAMILIES = ["llama", "qwen2", "gpt_neox", "gpt2", "opt", "phi", "gemma2", "gemma3", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_rows_equal_running_each_path_alone_across_ragged_commits(family):
    model = tiny_model(family, sharpness=4.0)
    target = HFTarget(model)
    prompts = [[5, 6, 7, 8, 9], [3], [10, 11, 12]]
    sequences = [list(p) for p in prompts]
    target.prefill([torch.tensor(p) for p in prompts], ())
    generator = torch.Generator().manual_seed(0)
    parents = [-1, -1, 0, 0, 2, 1]
    for step in range(4):
        tokens = torch.randint(0, 128, (3, len(parents)), generator=generator)
        num_nodes = torch.tensor([6, 3, 0]) if step % 2 else torch.tensor([6, 6, 4])
        tree = tree_from_parents(tokens, parents, SiblingMode.DETERMINISTIC, num_nodes=num_nodes)
        out = target.forward_tree(tree, ())
        for b, seq in enumerate(sequences):
            assert torch.allclose(out.logits[b, 0], full_logits(model, seq)[-1], atol=1e-5)
            for path in tree.paths()[b]:
                expected = full_logits(model, seq + tokens[b, path].tolist())[-len(path):]
                assert torch.allclose(out.logits[b, [i + 1 for i in path]], expected, atol=1e-5)
        # accept a different path per request, then a bonus token
        accepted = torch.full((3, len(parents)), -1)
        choices = [[0, 2, 4], [1], []] if step % 2 == 0 else [[0, 3], [], []]
        for b, path in enumerate(choices):
            path = [i for i in path if i < int(num_nodes[b])]
            choices[b] = path
            accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
        bonus = torch.randint(0, 128, (3,), generator=generator)
        target.commit(tree, VerifyResult(accepted, torch.tensor([len(c) for c in choices]), bonus))
        for b, path in enumerate(choices):
            sequences[b] += tokens[b, path].tolist() + [int(bonus[b])]


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_layers_read_only_the_columns_some_row_sees(family, monkeypatch):
    """Past the window (8 tokens here), a sliding layer's mask starts at the first column some row
    of the batch sees, and its attention reads only the columns the mask covers; every row still
    equals its path run alone, in a ragged batch and at one row (plain decoding)."""
    from specdec import cpu_kernels

    reads = []  # (mask columns, cache columns) of every attention call given a mask
    original = cpu_kernels.keys_under_mask

    def spy(mask, key, value):
        if mask is not None:
            reads.append((mask.shape[-1], key.shape[2]))
        return original(mask, key, value)

    monkeypatch.setattr(cpu_kernels, "keys_under_mask", spy)
    model = tiny_model(family, sharpness=4.0)
    target = HFTarget(model)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=generator) for n in (30, 12, 50)]
    target.prefill(prompts, ())
    parents = [-1, -1, 0, 0, 2, 1]
    tokens = torch.randint(0, 128, (3, len(parents)), generator=generator)
    tree = tree_from_parents(tokens, parents, SiblingMode.DETERMINISTIC, num_nodes=torch.tensor([6, 3, 6]))
    reads.clear()
    out = target.forward_tree(tree, ())
    columns = 49 + len(parents) + 1  # the widest request's cache, then the tree's rows
    first = 11 - 8 + 1  # the shortest request's root sees its last 7 cached columns
    assert (columns - first, columns) in reads and all(read in {(columns, columns), (columns - first, columns)} for read in reads)
    for b, prompt in enumerate(prompts):
        assert torch.allclose(out.logits[b, 0], full_logits(model, prompt.tolist())[-1], atol=1e-5)
        for path in tree.paths()[b]:
            expected = full_logits(model, prompt.tolist() + tokens[b, path].tolist())[-len(path):]
            assert torch.allclose(out.logits[b, [i + 1 for i in path]], expected, atol=1e-5)
    target.prefill(prompts[:1], ())
    reads.clear()
    step = target.forward_tree(empty_tree(1), ()).logits[0, 0]
    assert (8, 30) in reads and step.allclose(full_logits(model, prompts[0].tolist())[-1], atol=1e-5)


class ColumnCopies(TorchFunctionMode):
    """Records how many cache columns each scatter_ writes."""

    def __init__(self) -> None:
        super().__init__()
        self.columns: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.scatter_:
            self.columns.append(args[2].shape[2])  # the index [B, H, R, D]
        return func(*args, **(kwargs or {}))


def test_a_lone_requests_commit_copies_only_its_accepted_nodes():
    """At batch 1 a request's root row is written in its own column, so plain decoding's commit
    copies nothing, and a tree's copies the columns of its accepted path only (none when nothing
    was accepted); the next rows still see exactly the committed text."""
    model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(model)
    sequence = [5, 6, 7, 8, 9]
    target.prefill([torch.tensor(sequence)], ())
    steps = [(empty_tree(1), []), (tree_from_parents(torch.tensor([[40, 41, 42]]), [-1, 0, 0], SiblingMode.DETERMINISTIC), [0, 2]),
             (tree_from_parents(torch.tensor([[43, 44]]), [-1, -1], SiblingMode.DETERMINISTIC), [1]),
             (tree_from_parents(torch.tensor([[45, 46]]), [-1, 0], SiblingMode.DETERMINISTIC), []),
             (empty_tree(1), [])]
    for bonus, (tree, path) in enumerate(steps):
        out = target.forward_tree(tree, ())
        assert torch.allclose(out.logits[0, 0], full_logits(model, sequence)[-1], atol=1e-5)
        accepted = torch.full((1, tree.tokens.shape[1]), -1)
        accepted[0, : len(path)] = torch.tensor(path, dtype=torch.int64)
        with ColumnCopies() as copies:
            target.commit(tree, VerifyResult(accepted, torch.tensor([len(path)]), torch.tensor([50 + bonus])))
        assert set(copies.columns) <= {len(path)} and (len(copies.columns) > 0) == (len(path) > 0)
        sequence += tree.tokens[0, path].tolist() + [50 + bonus]
    assert target.forward_tree(empty_tree(1), ()).logits[0, 0].allclose(full_logits(model, sequence)[-1], atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_small_admissions_on_a_cpu_prefill_each_prompt_alone(family):
    """A prompt's cache is the same bits whether it is admitted alone or with others (no padding
    rows are computed for it); a large admission stays one forward."""
    from specdec.target import SOLO_ADMISSIONS

    target = HFTarget(tiny_model(family, sharpness=4.0))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=generator) for n in (30, 4, 61)]
    def cache(request: int, length: int) -> list[torch.Tensor]:  # the prompt's key/value columns
        return [t[request, :, :length] for layer in target._cache.layers for t in (layer.keys, layer.values)]

    target.prefill(prompts, ())
    together = [cache(b, len(prompt) - 1) for b, prompt in enumerate(prompts)]
    for b, prompt in enumerate(prompts):
        target.prefill([prompt], ())
        assert all(torch.equal(alone, mixed) for alone, mixed in zip(cache(0, len(prompt) - 1), together[b]))
    forwards = []
    target.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    target.prefill([prompts[1]] * SOLO_ADMISSIONS, ())
    assert len(forwards) == SOLO_ADMISSIONS
    target.prefill([prompts[1]] * (SOLO_ADMISSIONS + 1), ())
    assert len(forwards) == SOLO_ADMISSIONS + 1


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral", "gpt2"])
def test_a_lone_prompts_prefill_is_causal_without_a_mask(family):
    """One prompt has no padding, so its prefill hands the model no mask (SDPA's causal kernel, not a
    W x W float mask) and the model masks, and slides, on its own: the cache and the logits that
    follow match a prefill under the explicit mask of a padded admission, past the sliding window.
    So does the plain decoding step after it, where its row sees every cached column: unmasked too,
    unless the model slides (then its mask is cut to the window)."""
    from specdec.target import SOLO_ADMISSIONS

    target = HFTarget(tiny_model(family, sharpness=4.0))
    masks = []
    target.model.register_forward_pre_hook(lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")),
                                           with_kwargs=True)
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    target.prefill([prompt], ())
    alone = [t.clone() for layer in target._cache.layers for t in (layer.keys, layer.values)]
    after_alone = target.forward_tree(empty_tree(1), ()).logits[0, 0]
    assert len(masks) == 2 and masks[0] is None and (masks[1] is not None) == (target._window is not None)
    target.prefill([prompt] + [prompt[:5]] * SOLO_ADMISSIONS, ())  # one padded forward, explicitly masked
    assert masks[2] is not None
    padded = [t[:1, :, : len(prompt) - 1] for layer in target._cache.layers for t in (layer.keys, layer.values)]
    assert all(a.allclose(b, atol=1e-6) for a, b in zip(alone, padded))
    assert after_alone.allclose(full_logits(target.model, prompt.tolist())[-1], atol=1e-5)


def test_hidden_states_are_the_requested_layers():
    model = tiny_model("llama")
    target = HFTarget(model)
    prompt = [4, 5, 6, 7]
    prefill = target.prefill([torch.tensor(prompt)], (0, 1, 2, 3))
    with torch.no_grad():
        reference_states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert torch.allclose(prefill.hidden[0][0], reference_states[0][0, :-1], atol=1e-6)  # embeddings
    assert torch.allclose(prefill.hidden[1][0], reference_states[1][0, :-1], atol=1e-5)
    # the last layer is returned before the final norm (transformers' last entry is after it)
    assert not torch.allclose(prefill.hidden[2][0], reference_states[2][0, :-1], atol=1e-3)
    assert torch.allclose(prefill.hidden[3][0], reference_states[2][0, :-1], atol=1e-5)  # final norm
    with pytest.raises(ValueError, match="out of range"):
        target.prefill([torch.tensor(prompt)], (4,))


# the fast tier keeps Llama; the other families run with integration
@pytest.mark.parametrize("family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.integration) for f in FAMILIES])
@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.integration)])
def test_greedy_output_equals_plain_decoding_for_every_hf_drafter(family, temperature):
    target = HFTarget(tiny_model(family, sharpness=4.0))
    prompts = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10]]
    sampling = SamplingParams(temperature)
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 24, sampling, seed=1)
    drafters = [
        NgramDrafter(target, num_draft=4, max_branches=3),
        DraftModelDrafter(target, model=tiny_model(family, seed=1, layers=1, sharpness=4.0), num_draft=3),
        DraftModelDrafter(target, model=tiny_model(family, sharpness=4.0), num_draft=3),  # self-draft
    ]
    for drafter in drafters:
        out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 24, sampling, seed=1)
        if temperature == 0:
            assert out.outputs == plain.outputs, type(drafter).__name__
        else:
            assert [len(o) for o in out.outputs] == [24, 24, 24]
    assert out.stats.tau == 4.0  # the self-draft accepts everything, at any temperature


@pytest.mark.parametrize("family", ["gpt2", "opt", "phi", "gemma2", "gemma3"])
def test_every_head_kind_builds_on_other_families_and_stays_exact(family):
    """Heads mirror their target's shape; GPT-2 and OPT name their MLP width differently
    (n_inner, ffn_dim) and keep the RoPE base nowhere, Phi and Gemma in rope_parameters."""
    from drafters.domino import DominoConfig, DominoDrafter, DominoHead
    from drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
    from drafters.mtp import MTPConfig, MTPDrafter, MTPHead

    target = HFTarget(tiny_model(family, sharpness=4.0))
    torch.manual_seed(0)
    drafters = [
        EagleDrafter(target, random_head(target), depth=2),
        MTPDrafter(target, MTPHead(MTPConfig.for_target(target, 1, 2)).eval()),
        DominoDrafter(target, DominoHead(DominoConfig.for_target(target, block_size=2)).eval()),
        MedusaDrafter(target, MedusaHeads(MedusaConfig.for_target(target, 2)).eval(), [(0,), (1,), (0, 0)]),
    ]
    prompts = [[5, 6, 7, 8, 5, 6, 7], [3]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 12, SamplingParams(0.0))
    for drafter in drafters:
        out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 12, SamplingParams(0.0))
        assert out.outputs == plain.outputs, type(drafter).__name__
    assert drafters[0].head.config.intermediate_size > 0


def test_draft_model_with_another_vocabulary_is_refused():
    target = HFTarget(tiny_model("llama"))
    with pytest.raises(ValueError, match="vocabulary has 64 tokens but the target's has 128"):
        DraftModelDrafter(target, model=tiny_model("llama", vocab_size=64))


def test_models_whose_masks_or_states_hftarget_cannot_serve_are_refused():
    import transformers as tf

    bloom = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=128, hidden_size=64, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match="ALiBi"):
        HFTarget(bloom)
    chunked = tiny_model("qwen2")
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"\['chunked_attention'\] layers"):
        HFTarget(chunked)
    projected = tf.OPTForCausalLM(tf.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=1,
                                               num_attention_heads=4, word_embed_proj_dim=32))
    with pytest.raises(TypeError, match="project_out"):
        HFTarget(projected)


def test_tree_past_the_context_window_is_refused():
    target = HFTarget(tiny_model("llama"), max_length=8)
    with pytest.raises(ValueError, match="context window"):
        SpecDecoder(target, None, reference.verify).generate([[1] * 6], 3, SamplingParams(0.0))


def test_a_tree_reaching_past_the_context_window_is_refused_before_the_forward():
    """forward_tree checks positions exactly when a tree could reach the window's end (past + N):
    a chain one node too deep is refused, a bush of the same width is not."""
    target = HFTarget(tiny_model("llama"), max_length=8)
    tokens = torch.tensor([[3, 4, 5, 6]])
    for parents, refused in [([-1, 0, 1, 2], True), ([-1, -1, -1, -1], False)]:
        target.prefill([torch.tensor([1, 2, 3, 4, 5])], ())  # 4 cached columns, the root at position 4
        tree = tree_from_parents(tokens, parents, SiblingMode.DETERMINISTIC)
        if refused:  # the chain's last node would sit at position 8
            with pytest.raises(ValueError, match="reaches position 8, past the target's context window of 8"):
                target.forward_tree(tree, ())
        else:
            assert target.forward_tree(tree, ()).logits.shape == (1, 5, target.vocab_size)


def random_head(target: HFTarget) -> EagleHead:
    torch.manual_seed(11)  # an untrained head: any q is fine for exactness, it only has to be the one drawn from
    return EagleHead(EagleConfig.for_target(target)).eval()


def exact_hf_distribution(model, prompt: list[int], length: int, sampling: SamplingParams) -> torch.Tensor:
    vocab = model.get_output_embeddings().weight.shape[0]
    prefixes = torch.tensor([prompt])
    probs = torch.ones(1, dtype=torch.float64)
    for _ in range(length):
        with torch.no_grad():
            logits = model(prefixes).logits[:, -1].float()
        probs = (probs[:, None] * probabilities(logits, sampling).double()).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(len(prefixes))[:, None]], 1)
    return probs


# the i.i.d. twins of the WOR cases, the synthetic WOR tree and the static shapes under traversal run in CI
# after the default suite (-m slow); traversal's exactness runs by default in tests/test_traversal_verifier.py
@pytest.mark.parametrize(
    "name,make_drafter",
    [
        ("iid-tree", lambda t: SyntheticDrafter(SyntheticTarget(vocab_size=8, seed=5), (2, 2), "sampled_iid", 0.5)),
        pytest.param("wor-tree", lambda t: SyntheticDrafter(SyntheticTarget(vocab_size=8, seed=5), (3, 2), "sampled_wor", 0.5),
                     marks=pytest.mark.slow),
        ("draft-model-chain", lambda t: DraftModelDrafter(t, model=tiny_model("llama", 8, seed=1, layers=1, sharpness=6.0), num_draft=2)),
        # sampled EAGLE trees: whole sibling groups kept or dropped by their parents' draft scores
        pytest.param("eagle-iid-tree",
                     lambda t: EagleDrafter(t, random_head(t), depth=3, top_k=2, total_tokens=4, sampling="sampled_iid"),
                     marks=pytest.mark.slow),
        ("eagle-wor-tree", lambda t: EagleDrafter(t, random_head(t), depth=3, top_k=2, total_tokens=6, sampling="sampled_wor")),
        # static shapes under traversal verification (the whole tree judged leaf to root)
        pytest.param("eagle-iid-static-traversal",
                     lambda t: EagleDrafter(t, random_head(t), depth=3, top_k=2, total_tokens=4, sampling="sampled_iid", shape="static"),
                     marks=pytest.mark.slow),
        pytest.param("eagle-wor-static-traversal",
                     lambda t: EagleDrafter(t, random_head(t), depth=3, top_k=2, total_tokens=6, sampling="sampled_wor",
                                            shape="static"),
                     marks=pytest.mark.slow),
    ],
)
@pytest.mark.statistical  # the fast tier's greedy tests (above) see position, mask and commit bugs too
def test_sampled_speculative_decoding_through_the_kv_cache_is_exact(name, make_drafter):
    """Position, mask or cache-commit bugs change the sequence distribution; chi-square finds them.
    TV 0.03 keeps the batch affordable on 2 cores; such bugs move TV far more than that."""
    model = tiny_model("llama", vocab_size=8, sharpness=6.0)
    target = HFTarget(model)
    prompt, length, sampling = [1, 2, 3], 3, SamplingParams(1.0)
    exact = exact_hf_distribution(model, prompt, length, sampling)
    samples = required_samples(8**length, tv=0.03)
    verifier = traversal.verify if "traversal" in name else reference.verify
    decoder = SpecDecoder(target, make_drafter(target), verifier)
    verdict = sequence_verdict(decoder, exact, prompt, length, 8, sampling, samples, seed=3)
    print(name, verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict
