"""Run by tests/test_extraction_ddp.py, under torchrun or alone: extracts the features of a tiny
Llama into a folder with extract_features, and records the shards it computed (calls-RANK.json)
and, on rank 0, its progress reports (progress.json), beside the folder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from tiny_models import tiny_model

from drafters.training.features import CacheMeta, extract_features
from drafters.training.trainer import init_distributed
from specdec.target import HFTarget

# 11 sequences in shards of 2: 6 shards, the last one short, so the two processes get unequal shares
LAYERS = (0, 1, 3)  # embeddings, block 1, final norm (labelled)
META = CacheMeta("tiny-llama", 64, 2, 128, LAYERS, 64, 2)


def sequences() -> list[list[int]]:
    data = torch.Generator().manual_seed(11)
    lengths = torch.randint(5, 40, (11,), generator=data).tolist()
    return [torch.randint(1, 128, (n,), generator=data).tolist() for n in lengths]


def extract(directory: Path, distributed: bool, stop_at: int = 0, drop_last: bool = False
            ) -> tuple[list[int], list[tuple[int, int]]]:
    """Extracts into ``directory``; returns the shards this process computed, in order, and its
    progress reports (tokens done, total). stop_at=k: the process dies, without any cleanup, when
    it starts computing its k-th shard. drop_last: it is given all sequences but the last."""
    target = HFTarget(tiny_model("llama"))
    computed, prefill = [], target.prefill
    data = sequences()[:-1] if drop_last else sequences()
    shard_of = {tuple(s): i // META.sequences_per_shard for i, s in enumerate(data)}

    def counting_prefill(prompts, layers):  # batch_size = sequences_per_shard: one call per shard
        computed.append(shard_of[tuple(prompts[0][:-1].tolist())])  # prompts carry a trailing dummy token
        if len(computed) == stop_at:
            os._exit(3)
        return prefill(prompts, layers)

    target.prefill = counting_prefill
    reports = []
    extract_features(target, data, directory, META, batch_size=2, distributed=distributed,
                     progress=lambda done, total, rate: reports.append((done, total)))
    return computed, reports


def main(directory: str, stop_at: int, rank_1_drops_last: bool) -> None:
    torch.set_num_threads(1)
    rank, world = init_distributed()
    computed, reports = extract(Path(directory), distributed=world > 1, stop_at=stop_at if rank == 1 else 0,
                                drop_last=rank_1_drops_last and rank == 1)
    Path(f"{directory}.calls-{rank}.json").write_text(json.dumps(computed))
    if rank == 0:
        Path(f"{directory}.progress.json").write_text(json.dumps(reports))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "drop-last")
