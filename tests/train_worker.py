"""Run by tests/test_train_cli.py under torchrun: specdec-train (argv after the first argument) on
TinyTrain's tiny target, recording how many shards this process's target computed
(<first argument>.calls-RANK.json)."""

from __future__ import annotations

import json
import os
import sys

from test_train_cli import MTBENCH, TinyTrain, conversations

from experiments import train
from experiments.common import prompt_sets
from experiments.train import sources
from specdec import assets


def main(record: str, argv: list[str]) -> None:
    tiny = TinyTrain(root=None, capsys=None)
    sources.open_target = tiny.open_target
    assets.load_sharegpt_conversations = lambda count: conversations()[:count]
    prompt_sets.load_mtbench = lambda: MTBENCH
    calls, prefill = [], tiny.target.prefill

    def counting_prefill(prompts, layers):  # data.per_shard sequences per call: one call per shard
        calls.append(len(prompts))
        return prefill(prompts, layers)

    tiny.target.prefill = counting_prefill
    sys.argv = ["specdec-train", *argv]
    train.main()
    with open(f"{record}.calls-{os.environ['RANK']}.json", "w") as f:
        json.dump(calls, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
