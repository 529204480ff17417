"""LOSSY verification: Medusa's typical acceptance. Opt-in only, never a default, never ``auto``.

The output does NOT follow the target's distribution (tests/test_lossy.py measures how far it is);
it trades exactness for acceptance. Selected as ``verifier=typical_lossy``, the name that also marks
it in results.

Terms: p(.|row) is the target's processed distribution (temperature, top-k, top-p: the same
transform as the exact verifiers) at a row of the tree, H its entropy in nats. A node x whose parent
row is r *passes* when

    p(x | r) > min(epsilon, delta * exp(-H(p(. | r))))

i.e. a fixed probability floor epsilon, lowered where the target is uncertain. A node is *typical*
when it and all its ancestors pass. The accepted path ends at the deepest typical node (ties: the
path with the largest target log-likelihood, then the lowest index), as Medusa picks the candidate
with the longest accepted prefix. The token after it is the target's argmax there ("greedy on the
first token", as Medusa does); with ``sample_first`` it is drawn from p instead (an exact draw from
that row with the final uniform, as the exact verifiers draw). No coins are used for acceptance.

At temperature 0, p is one-hot and H = 0, so exactly the argmax passes: the rule is greedy
decoding, token for token. At temperature > 0 an accepted candidate is kept with probability 1
instead of p(x), and with ``sample_first=False`` the whole output is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from specdec.noise import VerifyNoise
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams, target_probabilities
from specdec.tree import DraftTree
from verifiers.reference import draw_from


@dataclass(frozen=True)
class TypicalAcceptanceLossy:
    """A Verifier (specdec.protocols) that is LOSSY: see the module docstring."""

    epsilon: float = 0.09  # probability floor (Medusa's default posterior threshold)
    delta: float = 0.3  # scale of the entropy-dependent threshold (Medusa's default)
    sample_first: bool = False  # False: the token after the accepted path is the argmax (Medusa)
    lossy: ClassVar[bool] = True  # for callers that report which verifiers are exact

    def __post_init__(self) -> None:
        if not (0 < self.epsilon <= 1 and 0 < self.delta):
            raise ValueError(f"typical acceptance needs 0 < epsilon <= 1 and delta > 0; got {self.epsilon}, {self.delta}")

    def __call__(
        self,
        tree: DraftTree,
        target_logits: Tensor,  # [B, N+1, V]; row 0 after the committed prefix, row i+1 after node i
        sampling: SamplingParams,
        noise: VerifyNoise,
    ) -> VerifyResult:
        batch, num_slots = tree.tokens.shape
        device = target_logits.device
        probs = target_probabilities(target_logits, sampling)  # [B, N+1, V]
        entropy = -torch.xlogy(probs, probs).sum(-1)  # [B, N+1], 0 log 0 = 0
        threshold = (self.delta * torch.exp(-entropy)).clamp(max=self.epsilon)  # [B, N+1]
        rows = torch.arange(batch, device=device)
        valid = tree.node_valid()  # [B, N]
        parent_rows = (tree.parents + 1).clamp(min=0, max=num_slots)  # [B, N] row of each node's parent
        p_node = probs[rows[:, None], parent_rows, tree.tokens.clamp(min=0, max=probs.shape[-1] - 1)]  # [B, N] p(x | parent)
        passes = valid & (p_node > threshold.gather(1, parent_rows))  # [B, N]

        typical = torch.zeros_like(passes)  # [B, N] the node and all its ancestors pass
        log_likelihood = torch.zeros_like(p_node)  # [B, N] sum of log p along the path
        for i in range(num_slots):  # parents precede children
            parent = tree.parents[:, i]
            has_parent = parent >= 0
            parent_index = parent.clamp(min=0, max=max(i - 1, 0))[:, None]
            parent_typical = torch.where(has_parent, typical.gather(1, parent_index)[:, 0], True)
            typical[:, i] = passes[:, i] & parent_typical
            parent_log = torch.where(has_parent, log_likelihood.gather(1, parent_index)[:, 0], 0.0)
            log_likelihood[:, i] = parent_log + p_node[:, i].log()

        depth = torch.where(typical, tree.depth, 0)  # [B, N]
        num_accepted = depth.max(1).values if num_slots else torch.zeros(batch, dtype=torch.int64, device=device)  # [B]
        deepest = typical & (depth == num_accepted[:, None])  # [B, N]
        chosen = torch.where(deepest, log_likelihood, -torch.inf).argmax(1) if num_slots else num_accepted  # [B]
        chosen = torch.where(num_accepted > 0, chosen, -1)  # [B] last accepted node, -1 = root

        accepted_nodes = torch.full((batch, num_slots), -1, dtype=torch.int64, device=device)
        node = chosen
        for d in range(int(num_accepted.max()) if num_slots else 0, 0, -1):  # walk up from the chosen node
            here = num_accepted >= d
            accepted_nodes[rows[here], d - 1] = node[here]
            node = torch.where(here, tree.parents.gather(1, node.clamp(min=0)[:, None])[:, 0], node)

        last_row = probs[rows, chosen + 1]  # [B, V] p after the accepted path
        if self.sample_first:
            next_token = draw_from(last_row, noise.final)
        else:
            next_token = last_row.argmax(-1)
        return VerifyResult(accepted_nodes, num_accepted, next_token)
