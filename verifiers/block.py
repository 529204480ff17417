"""Block verification of draft chains (Sun et al., "Block Verification Accelerates Speculative
Decoding", ICLR 2025): the whole chain is judged jointly, never worse than token by token.

Terms, for a chain x_1..x_n drafted after the committed prefix: P_i is the target's processed
distribution at position i (row i-1 of the target logits), Q_i the draft distribution x_i was drawn
from (``draft_probs``; a point mass on x_i for DETERMINISTIC chains and at temperature 0). Then

    w_0 = 1,   w_i = min(1, w_{i-1} P_i(x_i) / Q_i(x_i))                    (the block's weight)
    r_i = sum_x max(0, w_i P_{i+1}(x) - Q_{i+1}(x))                          (residual mass, i < n)
    h_i = r_i / (r_i + 1 - w_i) for i < n,   h_n = w_n                        (keep-probabilities)

The accepted length is the LARGEST i with u_i < h_i (0 if none): the scan runs from the end of the
chain, which is where the gain over token-by-token verification comes from (a rejection at i no
longer discards a later prefix that the joint test would keep). The next token is drawn from P_{n+1}
when the whole chain is kept, else from the residual max(0, w_i P_{i+1} - Q_{i+1}).

With n = 1 this is token-level verification exactly; at temperature 0 it is greedy decoding (w stays
1 while the chain matches the argmax and drops to 0 at the first mismatch). For point-mass drafts it
keeps as many tokens as token-level verification in expectation (no exact rule can keep x_1..x_i
more often than P(x_1)...P(x_i), which token-level attains): the gain needs drafts sampled from q.
Exactness is tested at sequence level like every verifier (tests/test_block_verifier.py), on
sampled and deterministic chains. Trees are refused: the joint rule here is for one path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.noise import VerifyNoise
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams, pairwise_sum, target_probabilities
from specdec.tree import DraftTree, SiblingMode
from verifiers.base import UnverifiableTreeError
from verifiers.reference import final_token


class NotAChainError(UnverifiableTreeError):
    """A branching tree reached the block verifier."""


def verify(
    tree: DraftTree,
    target_logits: Tensor,  # [B, N+1, V]
    sampling: SamplingParams,
    noise: VerifyNoise,
) -> VerifyResult:
    batch, num_slots = tree.tokens.shape
    device = target_logits.device
    valid = tree.node_valid()  # [B, N]
    slots = torch.arange(num_slots, device=device)
    if not tree.is_chain():
        raise NotAChainError(
            "verifier=block verifies chains (node i's parent is node i-1); this tree branches: "
            "use verifier=reference (or auto) for trees, or draft a chain (top_k=1)"
        )
    target_probs = target_probabilities(target_logits, sampling)  # [B, N+1, V] P_1 .. P_{N+1}
    tokens = tree.tokens.clamp(min=0)  # [B, N]
    draft = _draft_distributions(tree, tokens, sampling, target_probs.shape[-1])  # [B, N, V] Q_1 .. Q_N

    p_x = target_probs[:, :-1].gather(2, tokens[..., None])[..., 0]  # [B, N] P_i(x_i)
    q_x = draft.gather(2, tokens[..., None])[..., 0]  # [B, N] Q_i(x_i) > 0
    weights = _block_weights(p_x, q_x)  # [B, N+1] w_0 .. w_N

    # residual after keeping i tokens (i < N): max(0, w_i P_{i+1} - Q_{i+1}), Q_{i+1} = node i's q
    residuals = (weights[:, :-1, None] * target_probs[:, :-1] - draft).clamp(min=0.0)  # [B, N, V]
    mass = pairwise_sum(residuals)[..., 0]  # [B, N] r_0 .. r_{N-1}
    denominator = mass + 1.0 - weights[:, :-1]
    # 0 / 0 only when w_i = 1 and P_{i+1} = Q_{i+1}; the later tests then keep more than i tokens
    # with certainty, so the value is never used: 1 is the limit of r / (r + 0)
    keep = torch.where(denominator > 0, mass / denominator.clamp(min=torch.finfo(torch.float64).tiny), 1.0)
    num_nodes = tree.num_nodes.to(device)
    last = (num_nodes - 1).clamp(min=0)
    # h_i for i = 1..N sits at column i-1; the chain's own last test is w_n, not r_n / (...)
    keep = torch.cat([keep[:, 1:], torch.zeros(batch, 1, dtype=torch.float64, device=device)], dim=1)  # [B, N]
    keep = keep.scatter(1, last[:, None], weights.gather(1, num_nodes[:, None]))
    passed = valid & (noise.uniforms[:, :num_slots] < keep)  # [B, N]
    num_accepted = _kept_length(passed)  # [B]

    whole = num_accepted == num_nodes
    row = num_accepted.clamp(max=max(num_slots - 1, 0))
    rows = torch.arange(batch, device=device)
    residual = target_probs[rows, num_accepted]  # [B, V] P_{n+1} when the whole chain is kept
    if num_slots:
        # an empty residual has probability 0 (see above); the guard keeps rounding from drawing from it
        partial = residuals[rows, row]  # [B, V]
        use_partial = ~whole & (pairwise_sum(partial)[:, 0] > 0)
        residual = torch.where(use_partial[:, None], partial, residual)
    next_token = final_token(residual, sampling, noise)
    accepted_nodes = torch.where(slots < num_accepted[:, None], slots, -1)  # [B, N]
    return VerifyResult(accepted_nodes, num_accepted, next_token)


def _block_weights(p_x: Tensor, q_x: Tensor) -> Tensor:  # [B, N], [B, N] -> [B, N+1]
    """w_0 = 1, w_i = min(1, w_{i-1} P_i(x_i) / Q_i(x_i)): the running product is what makes the
    test joint (a ratio above 1 at one token pays for a ratio below 1 at an earlier one)."""
    weights = torch.ones(p_x.shape[0], p_x.shape[1] + 1, dtype=torch.float64, device=p_x.device)
    for i in range(p_x.shape[1]):
        weights[:, i + 1] = (weights[:, i] * p_x[:, i] / q_x[:, i]).clamp(max=1.0)
    return weights


def _kept_length(passed: Tensor) -> Tensor:  # [B, N] bool -> [B] int64
    """The largest i whose test passed (0 if none): the scan from the end of the chain."""
    lengths = torch.arange(1, passed.shape[1] + 1, device=passed.device)
    return torch.where(passed, lengths, 0).amax(dim=1) if passed.shape[1] else passed.sum(dim=1)


def _draft_distributions(tree: DraftTree, tokens: Tensor, sampling: SamplingParams, vocab_size: int) -> Tensor:
    """Q_i per node [B, N, V] float64: the drafter's q where the chain was sampled from it, else a
    point mass on the drafted token (DETERMINISTIC chains, temperature 0, or an x outside q's
    support, which therefore did not come from q: its choice never depends on the coins)."""
    point_mass = F.one_hot(tokens, vocab_size).double()
    if sampling.greedy or tree.mode is SiblingMode.DETERMINISTIC or tree.draft_probs is None:
        return point_mass
    q = tree.draft_probs.double()
    drawn = q.gather(2, tokens[..., None]) > 0  # [B, N, 1]
    return torch.where(drawn, q, point_mass)
