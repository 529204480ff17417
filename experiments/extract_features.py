"""Extract target features for drafter-head training into a resumable on-disk cache.

    python -m experiments.extract_features --out ~/.cache/specdec/features/smollm2 --conversations 2000
    python -m experiments.extract_features --target gemma3_270m --out ...   # any packaged target, or a model folder
    torchrun --nproc_per_node=4 -m experiments.extract_features --out ...   # 4 processes split the shards

Plain torch (no hydra/wandb/datasets at run time on a GPU image if --sequences is given), so the
same script runs on a bare GPU machine with the model folder and pre-tokenised sequences. Under
torchrun each process extracts its share of the shards into the same --out folder (shared by all
nodes), on its own GPU (cuda:LOCAL_RANK) or its share of the CPU threads; rank 0 prints the progress
and every process exits once the whole cache is on disk. A killed run resumes with any number of
processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from drafters.training.data import chat_sequences
from drafters.training.features import CacheMeta, default_layers, extract_features
from drafters.training.trainer import init_distributed
from specdec.assets import load_sharegpt_conversations
from specdec.target_loader import check_target_config, open_target, target_argument


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="cache folder (resumes if it exists)")
    parser.add_argument("--target", default="smollm2", help="a packaged target (smollm2, gemma3_270m) or a Hugging Face model folder")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="target layers to store (default: 2, L/2, L-3 and the final-norm output L+1)")
    parser.add_argument("--conversations", type=int, default=2000, help="ShareGPT conversations to tokenise")
    parser.add_argument("--sequences", default=None, help="JSON file with pre-tokenised sequences (lists of ids)")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--per-shard", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    # torchrun starts LOCAL_WORLD_SIZE processes per machine: each takes its share of the cores
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // local_world))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="'cuda' is each torchrun process's own GPU (cuda:LOCAL_RANK)")
    args = parser.parse_args(argv)
    for name in ("conversations", "max_length", "per_shard", "batch_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.sequences and not Path(args.sequences).is_file():
        parser.error(f"--sequences {args.sequences}: no such file")
    device = f"cuda:{local_rank}" if args.device == "cuda" else args.device
    try:
        target_config = target_argument("--target", args.target, device=device, packed_gemm_from="auto")
        check_target_config(target_config)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    if torch.cuda.is_available() and local_world > 1:
        torch.cuda.set_device(local_rank)  # NCCL's collectives run on the current device
    rank, world = init_distributed()

    handle = open_target(target_config, with_tokenizer=True)
    tokenizer = handle.tokenizer
    if args.sequences:
        with open(args.sequences) as f:
            sequences = [s[: args.max_length] for s in json.load(f)]
    else:
        # a base model (Gemma 3) has no chat template: its conversations as plain text, as specdec-train reads them
        sequences = chat_sequences(tokenizer, load_sharegpt_conversations(args.conversations), args.max_length,
                                   chat=tokenizer.chat_template is not None)
    target = handle.load()
    num_layers = target.num_layers
    layers = tuple(args.layers or default_layers(num_layers))
    # named as specdec-train names its caches, so either can extend the other's
    meta = CacheMeta(handle.cache_name, target.hidden_size, num_layers, target.vocab_size, layers, args.max_length, args.per_shard)

    def progress(done: int, total: int, rate: float) -> None:
        print(f"\r{done}/{total} tokens, {rate:.0f} tokens/s", end="", file=sys.stderr, flush=True)

    extract_features(target, sequences, args.out, meta, args.batch_size, progress if rank == 0 else None,
                     distributed=world > 1)
    if rank == 0:
        print(file=sys.stderr)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
