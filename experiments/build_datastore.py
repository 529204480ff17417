"""Build a datastore for ``drafter=retrieval`` from a JSONL corpus, under a target's tokenizer.

    python -m experiments.build_datastore --tokenizer /models/my-model --jsonl corpus.jsonl --field text --out ds/my-corpus
    specdec-run target=hf target.path=/models/my-model drafter=retrieval drafter.datastore=ds/my-corpus

Each record's ``field`` is one document (matches and continuations never cross documents). The
SmolLM2 default (ShareGPT answers) needs no command: `drafter=retrieval` builds it on first use.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from drafters.retrieval import Datastore
from specdec import assets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face folder with the target's tokenizer")
    parser.add_argument("--jsonl", required=True, help="the corpus, one JSON record a line")
    parser.add_argument("--field", default="text", help="the record field holding a document's text")
    parser.add_argument("--out", required=True, help="a new folder for the datastore")
    args = parser.parse_args(argv)
    if Path(args.out).exists():
        parser.error(f"--out {args.out} exists; remove it or choose another folder")

    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    texts = [prompt.text for prompt in assets.load_jsonl(args.jsonl, field=args.field, chat=False)]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    meta = {"source": str(args.jsonl), "field": args.field, "tokenizer": str(args.tokenizer), "documents": len(ids)}
    store = Datastore.build(ids, len(tokenizer), meta)
    store.save(args.out)
    print(f"{args.out}: {len(ids)} documents, {len(store)} tokens, {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
