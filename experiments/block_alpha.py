"""A block drafter's acceptance per depth, drafted and teacher-forced on the same text.

    python -m experiments.block_alpha --drafter dflash --target smollm2

Decodes MT-bench prompts greedily with the bundled DFlash or Domino head of a packaged target
(``--per-category`` prompts of each category, fed as configs/target/<target>.yaml's ``chat`` says),
which gives the decode loop's per-depth alpha and, since greedy output is the target's own text,
the text on which training's teacher-forced figures (drafters/training/dflash_training.py's
``depth_metrics``) mean the same thing: every position of the answers as a block's root, the
target's choices as labels, through the training loss itself (``BlockLoss``). accuracy_j is what
training logs as its top-1; alpha_j, top-1 given depths 1..j-1 right, is what the decode loop
accepts. The two alphas differ only in which roots they see (the decode loop drafts only after
each verification); a gap between accuracy_j and alpha_j is the head's, not the drafting path's.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from drafters import base as drafter_registry
from drafters.training.dflash_training import BlockBatch, BlockLoss, Objective
from drafters.training.online import target_features
from experiments.common import prompt_sets
from specdec import packaged_models
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers.reference import verify


def teacher_forced(target: HFTarget, head, prompts: list[list[int]], answers: list[list[int]]) -> dict[str, float]:
    """BlockLoss's metrics with every answer position (and the prompt's last token) as a root."""
    lengths = [len(p) + len(a) for p, a in zip(prompts, answers)]
    tokens = torch.zeros(len(prompts), max(lengths), dtype=torch.int64)  # right-padded: causal rows ignore the padding
    valid = torch.zeros_like(tokens, dtype=torch.bool)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        tokens[row, : lengths[row]] = torch.tensor(prompt + answer)
        valid[row, len(prompt) - 1 : lengths[row]] = True  # labels: the target's choices after each of these
    layers = head.config.feature_layers
    captured, choices = target_features(target, tokens.to(target.device), layers)
    features = torch.cat([captured[layer].float() for layer in layers], -1)
    model = target.model
    loss = BlockLoss(head, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                     Objective(num_anchors=int(valid.sum(1).max())))
    with torch.no_grad():
        _, metrics = loss(BlockBatch(features, tokens, choices, valid.to(target.device), step=0))
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="dflash", choices=["dflash", "domino"])
    parser.add_argument("--target", default="smollm2", choices=sorted(packaged_models.PACKAGED_MODELS))
    parser.add_argument("--depth", type=int, default=2, help="depths drafted (and reported)")
    parser.add_argument("--per-category", type=int, default=2, help="MT-bench prompts of each of its 8 categories")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("depth", "per_category", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    torch.set_num_threads(args.threads)

    chat = prompt_sets.packaged_target_chat(args.target)
    model, tokenizer = packaged_models.load_packaged(args.target)
    target = HFTarget(model, key=args.target)
    drafter = drafter_registry.build(args.drafter, target, depth=args.depth)  # the bundled head, or a one-line refusal
    questions = prompt_sets.first_of_each_category(prompt_sets.load_mtbench(), args.per_category)
    prompts = [prompt_sets.encode_prompt(tokenizer, dataclasses.replace(q, chat=chat)) for q in questions]
    out = SpecDecoder(target, drafter, verify).generate(prompts, args.max_new_tokens, SamplingParams(0.0))
    forced = teacher_forced(target, drafter.head, prompts, [list(answer) for answer in out.outputs])
    print(f"{args.drafter} on {args.target}: {len(prompts)} MT-bench prompts x {args.max_new_tokens} tokens, greedy, "
          f"tau {out.stats.tau:.3f}")
    print("depth | drafted alpha (attempts) | teacher-forced alpha | teacher-forced accuracy")
    for j in range(1, args.depth + 1):
        print(f"{j} | {out.stats.per_depth_alpha[j - 1]:.3f} ({out.stats.per_depth_attempts[j - 1]}) | "
              f"{forced[f'alpha_{j}']:.3f} | {forced[f'accuracy_{j}']:.3f}")


if __name__ == "__main__":
    main()
