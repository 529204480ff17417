"""The real model: greedy equality of every drafter with plain decoding on short MT-bench prompts."""

from __future__ import annotations

import pytest

from drafters.base import build
from experiments.common.prompt_sets import encode_prompt, load_mtbench
from specdec.decode import SpecDecoder
from specdec.packaged_models import load_smollm2
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto", key="smollm2")  # the kernels configs/target/smollm2.yaml picks
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(2)]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 16, SamplingParams(0.0), eos_token_id=tokenizer.eos_token_id)
    return target, tokenizer, prompts, plain


@pytest.mark.parametrize(
    "name,options",
    [("ngram", {}), ("ngram", {"max_branches": 3}), ("draft_model", {"model_path": "smollm2", "num_draft": 2}),
     ("eagle", {}), ("eagle2", {"top_k": 3, "total_tokens": 8}), ("domino", {})],
)
def test_greedy_equals_plain_decoding(smollm2, name, options):
    target, tokenizer, prompts, plain = smollm2
    decoder = SpecDecoder(target, build(name, target, **options), reference.verify)
    out = decoder.generate(prompts, 16, SamplingParams(0.0), eos_token_id=tokenizer.eos_token_id)
    assert out.outputs == plain.outputs
    if name == "draft_model":  # the target drafting for itself accepts everything
        assert out.stats.per_depth_alpha[0] == 1.0
