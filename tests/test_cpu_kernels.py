"""specdec.cpu_kernels: packed-GEMM linears and grouped-query SDPA change kernels, not results;
an invariant target computes each row as it would be computed alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.cpu_kernels import (GROUPED_ATTENTION, INVARIANT_ATTENTION, INVARIANT_ROWS, PackedLinear, check_rows_invariant,
                                 pack_linears, packed_gemm_available)
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.protocols import VerifyResult
from specdec.tree import SiblingMode, empty_tree, tree_from_parents
from tiny_models import full_logits, tiny_model
from verifiers import reference

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch with oneDNN")


def test_packed_linear_switches_kernels_at_the_threshold_and_matches_f_linear():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80)
    packed = PackedLinear(linear, from_rows=3)
    with torch.no_grad():
        for rows in (1, 2, 3, 5):
            x = torch.randn(1, rows, 48)
            expected = F.linear(x, linear.weight, linear.bias)
            got = packed(x)
            assert got.shape == expected.shape
            if rows < 3:  # below the threshold: the stock kernel itself
                assert torch.equal(got, expected)
            else:
                assert torch.allclose(got, expected, atol=1e-5)
        linear.weight.mul_(2)  # a weight changed in place (an optimizer step) is packed again
        assert torch.equal(packed(torch.ones(1, 48)), F.linear(torch.ones(1, 48), linear.weight, linear.bias))
        assert torch.allclose(packed(torch.ones(3, 48)), F.linear(torch.ones(3, 48), linear.weight, linear.bias), atol=1e-5)
        linear.load_state_dict({"weight": torch.zeros(80, 48), "bias": linear.bias.clone()})
        assert torch.equal(packed(torch.ones(3, 48)), linear.bias.expand(3, -1))
    x = torch.randn(4, 48, requires_grad=True)  # training: always the differentiable stock kernel
    packed(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


def test_pack_linears_keeps_parameters_ties_and_state_dict():
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in SmolLM2
    keys = list(model.state_dict())
    assert pack_linears(model, 2) == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="from_rows must be >= 1"):
        pack_linears(tiny_model("llama"), 0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # both grouped-query (4 heads on 2)
@pytest.mark.parametrize("packed_gemm_from", [None, 2])
def test_tree_forward_matches_the_unchanged_model(family, packed_gemm_from):
    unchanged = tiny_model(family, sharpness=4.0)  # stock SDPA with repeated key/value heads
    target = HFTarget(tiny_model(family, sharpness=4.0), packed_gemm_from=packed_gemm_from)
    assert target.model.config._attn_implementation == GROUPED_ATTENTION
    assert unchanged.config._attn_implementation == "sdpa"
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    target.prefill([torch.tensor(p) for p in prompts], ())
    parents = [-1, -1, 0, 0, 2, 1]
    tokens = torch.randint(0, 128, (2, len(parents)), generator=torch.Generator().manual_seed(0))
    tree = tree_from_parents(tokens, parents, SiblingMode.DETERMINISTIC, num_nodes=torch.tensor([6, 4]))
    out = target.forward_tree(tree, ())
    for b, prompt in enumerate(prompts):
        for path in tree.paths()[b]:
            expected = full_logits(unchanged, prompt + tokens[b, path].tolist())[-len(path):]
            assert torch.allclose(out.logits[b, [i + 1 for i in path]], expected, atol=1e-4)


def test_grouped_attention_folds_a_trees_rows_and_leaves_a_prompts_to_transformers(monkeypatch):
    """grouped_sdpa folds 2 to FOLD_ROWS query rows under a shared mask; one row, or more rows (a
    prompt's, whose folded mask would cost more than folding saves), go to transformers' SDPA. Both
    compute what transformers' path does."""
    from transformers.integrations import sdpa_attention

    from specdec.cpu_kernels import FOLD_ROWS, grouped_sdpa

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    generator = torch.Generator().manual_seed(0)
    deferred = []
    stock = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **k: deferred.append(1) or stock(*a, **k))
    for rows, folds in [(1, False), (2, True), (FOLD_ROWS, True), (FOLD_ROWS + 1, False)]:
        query = torch.randn(1, 4, rows, 8, generator=generator)
        key, value = torch.randn(2, 1, 2, rows + 3, 8, generator=generator)
        mask = torch.rand(1, 1, rows, rows + 3, generator=generator) > 0.3
        mask[..., -1] = True  # every row sees a key
        deferred.clear()
        out, _ = grouped_sdpa(module, query, key, value, mask)
        assert bool(deferred) != folds, rows
        expected, _ = stock(module, query, key, value, mask)
        assert torch.allclose(out, expected, atol=1e-5), rows


def test_greedy_output_is_plain_decoding_with_packed_gemms():
    from drafters.ngram import NgramDrafter

    target = HFTarget(tiny_model("llama", sharpness=4.0), packed_gemm_from=2)
    prompts = [torch.tensor([1, 2, 3, 1, 2, 3, 1, 2]), torch.tensor([7, 8, 9])]
    greedy = SamplingParams(temperature=0.0)
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 24, greedy)
    spec = SpecDecoder(target, NgramDrafter(num_draft=3), reference.verify).generate(prompts, 24, greedy)
    assert spec.stats.tau > 1.2 and spec.outputs == plain.outputs


def test_drafter_heads_take_their_targets_kernels():
    """An EAGLE head and its draft LM head run the target's packed GEMMs (same results to float
    rounding), and are left on stock kernels for a target without them."""
    from drafters.eagle import EagleConfig, EagleDrafter, EagleHead

    torch.manual_seed(0)
    x = torch.randn(2, 3, 64)
    for packed_gemm_from, kind in ((1, PackedLinear), (None, torch.nn.Linear)):
        target = HFTarget(tiny_model("llama"), packed_gemm_from=packed_gemm_from)
        head = EagleHead(EagleConfig.for_target(target)).eval()
        with torch.no_grad():
            expected_block, expected_logits = head.qkv(x), x @ target.model.lm_head.weight.T
        drafter = EagleDrafter(target, head, depth=2, top_k=2)
        assert type(drafter.head.qkv) is kind and type(drafter.draft_lm_head[0]) is kind
        with torch.no_grad():
            assert torch.allclose(drafter.head.qkv(x), expected_block, atol=1e-5)
            assert torch.allclose(drafter.draft_lm_head(x), expected_logits, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: an 8-token sliding window
def test_the_wrapped_model_still_honours_padding_and_sliding_windows_when_called_directly(family):
    unchanged = tiny_model(family, sharpness=4.0)
    wrapped = HFTarget(tiny_model(family, sharpness=4.0)).model
    assert wrapped.config._attn_implementation == GROUPED_ATTENTION
    ids = torch.randint(1, 128, (2, 14), generator=torch.Generator().manual_seed(3))
    padding = torch.ones_like(ids)
    padding[1, :5] = 0  # left padding: request 1 holds 9 tokens
    with torch.no_grad():
        expected = unchanged(ids, attention_mask=padding).logits
        got = wrapped(ids, attention_mask=padding).logits
    assert torch.allclose(got[padding.bool()], expected[padding.bool()], atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576)])  # wider than 1024: AMD's one-row kernel differs
def test_an_invariant_linear_gives_a_row_the_same_bits_at_any_row_count(dtype, shape):
    """What make_invariant relies on, checked on the machine that runs it: oneDNN's packed GEMM in
    calls of at most INVARIANT_ROWS rows, a lone row padded to two where its own kernel drifts."""
    if not packed_gemm_available(dtype):
        pytest.skip(f"this CPU's oneDNN has no packed {dtype} GEMM")
    torch.manual_seed(0)
    plain = torch.nn.Linear(*shape, bias=False).to(dtype)
    pad_single = bool(check_rows_invariant(PackedLinear(plain, from_rows=1, call_rows=INVARIANT_ROWS)))
    linear = PackedLinear(plain, from_rows=1, call_rows=INVARIANT_ROWS, pad_single=pad_single)
    x = torch.randn(80, shape[0], dtype=dtype)
    with torch.no_grad():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(80)])
        for rows in (2, 5, 11, 17, 32, 33, 47, 80):
            assert torch.equal(linear(x[:rows]), alone[:rows]), rows
    assert check_rows_invariant(linear) == []


def test_make_invariant_refuses_kernels_that_drift_and_leaves_the_model_as_it_was(monkeypatch):
    import specdec.cpu_kernels as kernels

    model = tiny_model("llama").to(torch.bfloat16)
    monkeypatch.setattr(kernels, "check_rows_invariant", lambda linear: [5] if linear.in_features == 64 else [])
    with pytest.raises(ValueError, match="calls of \\[5\\] rows than alone.*invariant=false"):
        HFTarget(model, invariant=True)
    assert model.config._attn_implementation == "sdpa"
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    monkeypatch.setattr(kernels, "packed_gemm_available", lambda dtype: False)  # float16 on AMD's Zen 4
    with pytest.raises(ValueError, match="no packed GEMM for torch.bfloat16.*invariant=false"):
        HFTarget(model)
    assert HFTarget(model, invariant=False, packed_gemm_from=2).packed_linears == 0  # speed only: stock kernels


def smollm2_shaped(seed: int = 0):
    """SmolLM2's layer shapes (576 wide, 9 query heads on 3 key/value heads), 2 layers, random
    weights: kernels pick their algorithms by shape, and tiny models' shapes hide the drift."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512)
    return tf.LlamaForCausalLM(config).to(torch.bfloat16)


def decoded_alone(target: HFTarget, prompt: list[int], forced: list[int]) -> torch.Tensor:  # [V]
    """The logits after prompt + forced, as plain decoding computes them: the prompt prefilled alone,
    then one row per token."""
    target.prefill([torch.tensor(prompt)], ())
    nothing = empty_tree(1)
    for token in forced:
        target.forward_tree(nothing, ())
        target.commit(nothing, VerifyResult(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                            torch.tensor([token])))
    return target.forward_tree(nothing, ()).logits[0, 0]


def logits_alone_and_in_a_tree(invariant: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tree path's logits from one ragged tree forward (the prompts admitted together),
    beside the logits of the same text decoded alone."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (37, 3, 70)]
    batch = HFTarget(smollm2_shaped(), invariant=invariant)
    alone = HFTarget(smollm2_shaped(), invariant=invariant)
    batch.prefill([torch.tensor(p) for p in prompts], ())
    parents = [-1, -1, 0, 0, 2, 1, 4]
    tokens = torch.randint(0, 256, (3, len(parents)), generator=generator)
    tree = tree_from_parents(tokens, parents, SiblingMode.DETERMINISTIC, num_nodes=torch.tensor([7, 3, 5]))
    out = batch.forward_tree(tree, ())
    return [(out.logits[b, path[-1] + 1], decoded_alone(alone, prompt, tokens[b, path].tolist()))
            for b, prompt in enumerate(prompts) for path in tree.paths()[b]]


def test_an_invariant_bfloat16_target_computes_each_row_as_it_would_alone():
    invariant = logits_alone_and_in_a_tree(invariant=True)
    assert all(torch.equal(tree, alone) for tree, alone in invariant)
    # the negative control: stock kernels (grouped SDPA) drift by rounding steps here
    stock = logits_alone_and_in_a_tree(invariant=False)
    assert not all(torch.equal(tree, alone) for tree, alone in stock)
    assert all(torch.allclose(tree, alone, atol=0.1) for tree, alone in stock)


def test_an_invariant_target_prefills_each_prompt_with_fast_kernels_and_the_same_bits_in_any_company():
    """The prefill runs one forward per prompt on stock-speed kernels, so a prompt's cache is the same
    whether it is admitted alone or with others; the invariant decode rows would be slower."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=generator) for n in (50, 7, 90)]
    target = HFTarget(smollm2_shaped(), invariant=True)
    target.prefill(prompts, (1,))
    together = target.forward_tree(empty_tree(3), (1,))
    for b, prompt in enumerate(prompts):
        target.prefill([prompt], ())
        assert torch.equal(target.forward_tree(empty_tree(1), ()).logits[0], together.logits[b])
    calls = []
    real_linear = torch.ops.mkldnn._linear_pointwise
    with pytest.MonkeyPatch.context() as patch:  # a 90-token prompt is one GEMM per layer, not three chunks
        patch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *rest: calls.append(x.numel() // x.shape[-1]) or real_linear(x, *rest))
        target.prefill([prompts[2]], ())
    assert set(calls) == {89, 1}  # the layers' rows, and the LM head's last row


def test_invariance_is_on_for_half_precision_on_a_cpu_and_refused_where_it_cannot_hold():
    assert HFTarget(tiny_model("llama").to(torch.bfloat16)).invariant
    target = HFTarget(tiny_model("llama"))
    assert not target.invariant and target.model.config._attn_implementation == GROUPED_ATTENTION
    target = HFTarget(tiny_model("llama"), invariant=True)
    assert target.invariant and target.model.config._attn_implementation == INVARIANT_ATTENTION
    for family, reason in (("gpt2", "Conv1D"), ("gemma2", "attn_logit_softcapping")):
        with pytest.raises(ValueError, match=f"{reason}.*invariant=false"):
            HFTarget(tiny_model(family).to(torch.bfloat16))


def test_greedy_output_of_an_invariant_bfloat16_target_is_plain_decoding_in_ragged_batches():
    from drafters.ngram import NgramDrafter

    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 40, (n,), generator=generator) for n in (45, 9, 60, 30, 3)]
    greedy = SamplingParams(temperature=0.0)

    def equal_outputs(invariant: bool) -> int:
        target = HFTarget(smollm2_shaped(), invariant=invariant)
        plain = SpecDecoder(target, None, reference.verify).generate(prompts, 40, greedy)
        spec = SpecDecoder(target, NgramDrafter(num_draft=4, max_branches=3), reference.verify)
        return sum(a == b for a, b in zip(spec.generate(prompts, 40, greedy, max_batch=3).outputs, plain.outputs))

    assert equal_outputs(invariant=True) == len(prompts)
    assert equal_outputs(invariant=False) < len(prompts)  # the negative control: stock kernels drift


def test_the_auto_threshold_follows_which_kernel_is_faster_here(monkeypatch):
    import specdec.cpu_kernels as kernels

    clock = [0.0]  # a fake clock that each kernel call moves by its cost, so the choice is deterministic

    def costing(function, cost, input_at):
        def timed(*args, **kwargs):
            x = args[input_at]
            clock[0] += cost(x.numel() // x.shape[-1])
            return function(*args, **kwargs)
        return timed

    def threshold(stock_cost, packed_cost, max_rows=4):
        with monkeypatch.context() as patch:
            patch.setattr(kernels.time, "perf_counter", lambda: clock[0])
            patch.setattr(kernels.F, "linear", costing(F.linear, stock_cost, 0))
            patch.setattr(PackedLinear, "_gemm", costing(PackedLinear._gemm, packed_cost, 1))
            return kernels.fastest_packed_from(tiny_model("llama"), max_rows=max_rows, repeats=3)

    assert threshold(lambda rows: 2.0, lambda rows: 1.0) == 1  # the packed GEMM wins everywhere (AMD's EPYC)
    assert threshold(lambda rows: 1.0, lambda rows: 2.0) == 5  # the stock kernel wins up to max_rows
    assert threshold(lambda rows: float(rows), lambda rows: 2.5) == 3  # MKL's GEMV wins for 1-2 rows (the Xeon's 1-3)
    target = HFTarget(tiny_model("llama"), packed_gemm_from="auto")
    assert 1 <= target.packed_gemm_from <= 9 and target.packed_linears == 2 * 7 + 1
    assert HFTarget(tiny_model("llama")).packed_gemm_from is None
    with pytest.raises(ValueError, match="packed_gemm_from must be an integer >= 1, 'auto' or None; got 0"):
        HFTarget(tiny_model("llama"), packed_gemm_from=0)
