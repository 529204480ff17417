"""Domino block drafting (arXiv 2605.29707; SpecForge's DominoDraftModel): the DFlash backbone
(drafters/dflash.py: one forward drafts a block from the whole prefix's target features) plus a
cheap causal refinement of each position's logits from the tokens drafted before it.

Refinement. A GRU (no biases) reads the target's embeddings of the block's prefix: the root x_r,
then each drafted token. For the token at depth j (position r+j), its state after x_r..x_{r+j-1}
and the backbone row that predicts it go through ``Linear -> SiLU -> Linear`` onto the draft
vocabulary, and that correction is added to the row's base logits (the target's LM head on the
row). The first ``pure_draft_prefix_len`` depths keep their base logits: the backbone alone is
trusted where it is best. Only the GRU step and the correction run position by position.

``shift_label`` (both ways, as SpecForge trains them): false, block row j predicts position r+j
(rows 1..B-1: B-1 tokens, as DFlash); true, row j predicts position r+j+1 (rows 0..B-1: B tokens,
the root's row included). Either way the correction of depth j reads the GRU state after
x_r..x_{r+j-1}, so the refinement is causal in the drafted path: with ``sampled=True`` each node's
q depends only on the path to it, as the p/q test requires.

``drafter=domino`` without a checkpoint runs the head bundled for the target
(drafters/checkpoints/domino-<packaged target>, a SpecForge DominoDraftModel folder).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from drafters.dflash import DFlashConfig, DFlashDrafter, DFlashHead


@dataclass(frozen=True)
class DominoConfig(DFlashConfig):
    gru_size: int = 512  # the prefix GRU's state (SpecForge: gru_hidden_dim)
    emb_dim: int = 256  # the correction MLP's width
    pure_draft_prefix_len: int = 1  # depths left to the backbone alone
    shift_label: bool = False  # row j predicts position r+j+1 instead of r+j

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("gru_size", "emb_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"DominoConfig {name} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.pure_draft_prefix_len < self.block_size:
            raise ValueError(f"pure_draft_prefix_len must lie in [0, block_size); got {self.pure_draft_prefix_len}")


class DominoHead(DFlashHead):
    """The DFlash backbone, a prefix GRU and the correction MLP (parameter names as SpecForge's)."""

    refines = True

    def __init__(self, config: DominoConfig, draft_ids: Tensor | None = None) -> None:
        super().__init__(config, draft_ids)
        c = config
        self.label_shift = int(c.shift_label)
        self.prefix_gru = nn.GRU(c.hidden_size, c.gru_size, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(c.hidden_size + c.gru_size, c.emb_dim, bias=False), nn.SiLU(),
                                        nn.Linear(c.emb_dim, c.draft_vocab_size, bias=False))

    def start(self, batch: int, like: Tensor) -> Tensor:
        return like.new_zeros(1, batch, self.config.gru_size)  # [1, N, G], nn.GRU's layout

    def refine(self, depth: int, row: Tensor, base: Tensor, previous: Tensor | None,
               state: Tensor | None) -> tuple[Tensor, Tensor]:
        _, state = self.prefix_gru(previous[:, None], state)  # now after x_r..x_{r+depth-1}
        if depth <= self.config.pure_draft_prefix_len:
            return base, state
        return base + self.embed_proj(torch.cat([row, state[0]], -1)), state

    def backbone(self, whole_vocabulary: bool = False) -> DFlashHead:
        """A DFlash head holding a copy of this head's backbone: what ``specdec-train train=dflash
        init=<Domino folder>`` trains further. With this head's draft vocabulary its base logits are
        this head's before the refinement (it drafts as this head with the correction switched off);
        ``whole_vocabulary`` drafts over the target's whole LM head instead, as published DFlash heads
        do (the backbone has no weights of its own per token, so only what it drafts from changes)."""
        c = self.config
        if c.shift_label:
            raise ValueError("init: this Domino head has shift_label=true, so its rows predict one position "
                             "further than a DFlash head's; train it with train=domino instead")
        sizes = {f.name: getattr(c, f.name) for f in fields(DFlashConfig)}
        if whole_vocabulary:
            sizes["draft_vocab_size"] = c.vocab_size
        head = DFlashHead(DFlashConfig(**sizes), None if whole_vocabulary else self.draft_ids)
        mine = self.state_dict()  # every backbone weight by the same name; the vocabulary is the new head's
        head.load_state_dict({name: value if name == "draft_ids" else mine[name] for name, value in head.state_dict().items()})
        return head

    def correction_inputs(
        self,
        rows: Tensor,  # [N, K, H] backbone rows of N blocks
        prefix: Tensor,  # [N, K, H] embeddings of x_r..x_{r+K-1}, each block's prefix (teacher-forced)
    ) -> tuple[Tensor, Tensor]:  # [N, K, H+G] embed_proj's input per row, [K] bool: the row is corrected
        """Training: every row's refinement input at once (the GRU over the known prefix); row i
        drafts depth i + label_shift, whose state is the one after x_r..x_{r+i+label_shift-1}."""
        k = rows.shape[1]
        states = self.prefix_gru(prefix)[0]  # [N, K, G] state after x_r..x_{r+i}
        depth = torch.arange(k, device=rows.device) + self.label_shift
        # a row drafting nothing (depth 0) is never corrected; state 0 only fills its place
        inputs = torch.cat([rows, states[:, (depth - 1).clamp(min=0)]], -1)
        return inputs, depth > self.config.pure_draft_prefix_len


DominoDrafter = DFlashDrafter  # one drafter for both heads: DFlashHead.refine is where they differ
