"""Probe: does an EAGLE head draft in the loop as well as it predicts in training? A consistency check.

    python -m scripts.probes.teacher_forced --checkpoint drafters/checkpoints/eagle3-smollm2 --prompts 40

Decodes the first MT-bench prompts greedily (plain), then measures the head's depth-1 top-1
accuracy teacher-forced on those answers (drafters.training.eagle_training.teacher_forced_accuracy: true target
features, as in training) and, in the same process, its depth-1 acceptance inside SpecDecoder on
the same prompts. The two should agree up to which positions get drafted (after an acceptance the
loop skips a position); a large gap means the drafting path feeds the head something other than
what it was trained on. The accuracy on the training data (train_results.json, metrics.jsonl)
against this one separates overfitting from such a bug.
Untested (scripts/probes/ is not part of the package); tests/test_training.py checks the two agree
on a trained toy head. Findings: docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from drafters.eagle import EagleDrafter, load_head
from drafters.training.eagle_training import teacher_forced_accuracy
from experiments.common import prompt_sets
from specdec import packaged_models
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers.reference import verify


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="drafters/checkpoints/eagle3-smollm2", help="an EAGLE / EAGLE-3 head for SmolLM2")
    parser.add_argument("--prompts", type=int, default=40, help="first MT-bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tokenizer = packaged_models.load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto", key="smollm2")
    head = load_head(args.checkpoint, target).float()
    prompts = [prompt_sets.encode_prompt(tokenizer, p) for p in prompt_sets.load_mtbench()[: args.prompts]]
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
