"""Gumbel-top-k (sampled_wor) draws rank float64 keys: Gumbel noise rounded to float32 ties keys that
differ, so the draw would no longer follow the noise (a biased without-replacement draw)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from drafters.synthetic import SyntheticDrafter
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget

CLOSE = 1e-9  # far above float64's resolution near 1, far below float32's


class FixedGumbel:
    """Stands in for a RequestRNG whose next Gumbel draw is ``keys`` (one request)."""

    def __init__(self, keys: dict[int, float]) -> None:
        self.keys = keys

    def gumbel(self, *shape: int) -> torch.Tensor:  # [1, *shape] float64
        noise = torch.zeros(1, *shape, dtype=torch.float64)
        for token, key in self.keys.items():
            noise[..., token] = key
        return noise


def near_ties(a: int, b: int, winner: int) -> dict[int, float]:
    """Token 0 clearly first; a and b one float64 step of CLOSE apart, with ``winner`` ahead."""
    loser = b if winner == a else a
    return {0: 2.0, winner: 1.0 + CLOSE, loser: 1.0}


def test_float32_would_tie_the_keys():
    """The premise of the tests below: the two keys are equal in float32."""
    assert torch.tensor(1.0 + CLOSE, dtype=torch.float64).float() == torch.tensor(1.0).float()
    assert torch.tensor(1.0 + CLOSE, dtype=torch.float64) != 1.0


@pytest.mark.parametrize("winner", [3, 5])
def test_synthetic_wor_draw_follows_float64_keys(winner):
    drafter = SyntheticDrafter(SyntheticTarget(vocab_size=8), mode="sampled_wor")
    logits = torch.zeros(1, 1, 8)  # [B, F, V]: a uniform q, so the noise alone decides
    q = torch.softmax(logits, -1)
    ctx = SimpleNamespace(rng=FixedGumbel(near_ties(3, 5, winner)))
    children = drafter._children(logits, q, 2, ctx)  # [B, F, 2] in draw order
    assert children.tolist() == [[[0, winner]]]


@pytest.mark.parametrize("winner", [3, 5])
def test_eagle_wor_draw_follows_float64_keys(winner, monkeypatch):
    target = HFTarget(tiny_model("llama", vocab_size=16))
    head = EagleHead(EagleConfig.for_target(target)).eval()
    drafter = EagleDrafter(target, head, depth=2, top_k=2, total_tokens=4, sampling="sampled_wor")
    k = int(head.draft_ids.numel())
    monkeypatch.setattr(drafter, "draft_lm_head", nn.Identity())  # h = the logits: zeros, a uniform q
    ctx = SimpleNamespace(rng=FixedGumbel(near_ties(3, 5, winner)), sampling=SamplingParams(1.0))
    _, tokens, _ = drafter._children(torch.zeros(1, 1, k), ctx, sampled=True)  # tokens: [B, F, top_k]
    assert tokens.tolist() == [[head.draft_ids[[0, winner]].tolist()]]
