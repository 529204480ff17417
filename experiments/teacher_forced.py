"""Does an EAGLE head draft in the loop as well as it predicts in training? A consistency check.

    python -m experiments.teacher_forced --checkpoint drafters/checkpoints/eagle3-smollm2 --prompts 40

Decodes the first MT-bench prompts greedily (plain), then measures the head's depth-1 top-1
accuracy teacher-forced on those answers (true target features, as in training: row t reads
f_t and x_{t+1} and predicts x_{t+2}) and, in the same process, its depth-1 acceptance inside
SpecDecoder on the same prompts. The two should agree up to which positions get drafted (after an
acceptance the loop skips a position); a large gap means the drafting path feeds the head
something other than what it was trained on. The accuracy on the training data
(train_results.json, metrics.jsonl) against this one separates overfitting from such a bug.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import Tensor

from drafters.eagle import EagleDrafter, load_head
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers.reference import verify


def head_logits(target: HFTarget, drafter: EagleDrafter, sequence: list[int]) -> Tensor:  # [T-1, draft vocab]
    """The head's depth-1 logits over its draft vocabulary at every position of ``sequence``,
    teacher-forced on the target's true features: row t reads f_t and x_{t+1} and predicts x_{t+2}."""
    head = drafter.head
    tokens = torch.tensor(sequence)
    # a trailing dummy token makes prefill return the features of every real token
    hidden = target.prefill([torch.tensor(sequence + [0])], head.config.feature_layers).hidden
    features = torch.cat([h[:, : len(sequence)] for h in hidden], -1)  # [1, T, n*H]
    with torch.no_grad():
        out = head.forward_sequence(features[:, :-1], drafter.embed(tokens[1:])[None])[0]
        return drafter.draft_lm_head(out)


def teacher_forced_accuracy(target: HFTarget, drafter: EagleDrafter, sequences: list[list[int]],
                            prompt_lengths: list[int]) -> tuple[float, int]:
    """Top-1 accuracy of the drafter's depth-1 prediction over the answer positions of each sequence,
    through the drafter's own embedding and draft-vocabulary LM head."""
    hits = total = 0
    for sequence, prompt_length in zip(sequences, prompt_lengths):
        tokens = torch.tensor(sequence)
        predicted = drafter.head.draft_ids[head_logits(target, drafter, sequence).argmax(-1)]  # [T-1], row t -> x_{t+2}
        # rows whose input token x_{t+1} is the target's own (the first answer token onwards)
        rows = torch.arange(prompt_length - 1, len(sequence) - 2)
        hits += int((predicted[rows] == tokens[rows + 2]).sum())
        total += len(rows)
    return hits / max(total, 1), total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="drafters/checkpoints/eagle3-smollm2", help="an EAGLE / EAGLE-3 head for SmolLM2")
    parser.add_argument("--prompts", type=int, default=40, help="first MT-bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tokenizer = assets.load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto")
    head = load_head(args.checkpoint, target).float()
    prompts = [assets.encode_prompt(tokenizer, p) for p in assets.load_mtbench()[: args.prompts]]
    greedy = SamplingParams(0.0)
    plain = SpecDecoder(target, None, verify).generate(prompts, args.max_new_tokens, greedy, eos_token_id=tokenizer.eos_token_id)
    drafter = EagleDrafter(target, head, depth=1)
    spec = SpecDecoder(target, drafter, verify).generate(prompts, args.max_new_tokens, greedy, eos_token_id=tokenizer.eos_token_id)
    sequences = [list(map(int, p)) + list(out) for p, out in zip(prompts, plain.outputs)]
    accuracy, positions = teacher_forced_accuracy(target, drafter, sequences, [len(p) for p in prompts])
    print(json.dumps({"checkpoint": args.checkpoint, "prompts": args.prompts, "teacher_forced_accuracy": accuracy,
                      "positions": positions, "loop_alpha_depth1": spec.stats.per_depth_alpha[0],
                      "greedy_equal": spec.outputs == plain.outputs}, indent=2))


if __name__ == "__main__":
    main()
