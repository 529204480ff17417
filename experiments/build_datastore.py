"""Build a datastore for ``drafter=retrieval`` from a JSONL corpus, or from the target's own answers.

    python -m experiments.build_datastore --tokenizer /models/my-model --jsonl corpus.jsonl --field text --out ds/my-corpus
    python -m experiments.build_datastore --target smollm2 --conversations 1000 --out ds/smollm2-self [--with-sharegpt]
    python -m experiments.build_datastore --target gemma3_270m --out ds/gemma3-self   # any packaged target
    specdec-run target=hf target.path=/models/my-model drafter=retrieval drafter.datastore=ds/my-corpus

With ``--jsonl`` each record's ``field`` is one document (matches and continuations never cross
documents). With ``--target`` (or its older spelling ``--generate``: a packaged target, ``smollm2`` or ``gemma3_270m``, or a Hugging Face
model folder; a model without a chat template, a base model, reads the turns as plain text) the target answers the opening user turns of the first ``--conversations`` ShareGPT conversations and
each answer is one document: text in the target's own style, which is what it will be asked to
continue. The answers are cached in ``<cache>/regenerated`` and a killed run resumes; in float32 the
cache is the one ``specdec-train data.regenerate=true`` reads, so a datastore and a self-distilled head
share one generation. ``--with-sharegpt`` adds the ShareGPT answers (the default datastore's text).
The SmolLM2 default (ShareGPT answers alone) needs no command: `drafter=retrieval` builds it on
first use.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from drafters.retrieval import Datastore, sharegpt_answer_ids
from experiments.common import prompt_sets
from experiments.common.answers import regenerated_answers
from specdec import assets
from specdec.sampling import SamplingParams
from specdec.target_loader import TargetConfig, open_target, target_argument

DTYPES = ("float32", "bfloat16")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--jsonl", help="the corpus, one JSON record a line (needs --tokenizer)")
    # --generate: its first name, which earlier recorded commands use
    source.add_argument("--target", "--generate", dest="generate", metavar="TARGET",
                        help="a packaged target (smollm2, gemma3_270m) or a Hugging Face model folder: index its own answers")
    parser.add_argument("--tokenizer", help="with --jsonl: a Hugging Face folder with the target's tokenizer")
    parser.add_argument("--field", default="text", help="with --jsonl: the record field holding a document's text")
    parser.add_argument("--conversations", type=int, default=1000, help="with --target: ShareGPT conversations to answer")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="with --target: the longest answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="with --target: 0 = greedy answers")
    parser.add_argument("--batch", type=int, default=32, help="with --target: requests decoded together")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="with --target: the target's dtype")
    parser.add_argument("--with-sharegpt", action="store_true", help="with --target: add the ShareGPT answers")
    parser.add_argument("--out", required=True, help="a new folder for the datastore")
    args = parser.parse_args(argv)
    if Path(args.out).exists():
        parser.error(f"--out {args.out} exists; remove it or choose another folder")
    if args.jsonl is not None and args.tokenizer is None:
        parser.error("--jsonl needs --tokenizer, the folder of the target's tokenizer")
    if args.generate is not None and (args.conversations < 1 or args.max_new_tokens < 1 or args.batch < 1):
        parser.error("--conversations, --max-new-tokens and --batch must be at least 1")
    if args.generate is not None and not (args.temperature >= 0 and math.isfinite(args.temperature)):
        parser.error(f"--temperature must be a finite number >= 0; got {args.temperature}")
    try:
        # packed_gemm_from as configs/target/ sets it for specdec-run and specdec-train
        target = target_argument("--target", args.generate, dtype=args.dtype, packed_gemm_from="auto") if args.generate else None
    except ValueError as error:
        parser.error(str(error))

    started = time.perf_counter()
    if args.jsonl is not None:
        from transformers import AutoTokenizer  # transformers: ~16 s cold; --help needs none of it

        try:
            texts = [prompt.text for prompt in prompt_sets.load_jsonl(args.jsonl, field=args.field, chat=False)]
        except (ValueError, FileNotFoundError) as error:
            parser.error(f"--jsonl: {error}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as error:  # no such folder, no tokenizer files, unreadable ones
            parser.error(f"--tokenizer {args.tokenizer}: cannot load a tokenizer from it ({' '.join(str(error).split())})")
        documents = tokenizer(texts, add_special_tokens=False)["input_ids"]
        vocab_size = len(tokenizer)
        meta = {"source": str(args.jsonl), "field": args.field, "tokenizer": str(args.tokenizer)}
    else:
        try:
            documents, vocab_size, meta = own_answers(args, target)
        except (ValueError, FileNotFoundError) as error:  # a target folder that is not a model, or not a chat model
            parser.error(f"--target: {' '.join(str(error).split())}")
    store = Datastore.build(documents, vocab_size, {**meta, "documents": len(documents)})
    store.save(args.out)
    print(f"{args.out}: {len(documents)} documents, {len(store)} tokens, {time.perf_counter() - started:.0f} s")


def own_answers(args: argparse.Namespace, config: TargetConfig) -> tuple[list[list[int]], int, dict]:
    """The target's answers to the first ShareGPT user turns (plus ShareGPT's own answers with
    --with-sharegpt), its vocabulary size, and what the datastore's meta.json records of them."""
    # experiments.train's schema and sources: Hydra (~0.4 s) and the training stack, for --target alone
    from experiments.train.schema import DataConfig
    from experiments.train.sources import regeneration_cache

    handle = open_target(config, with_tokenizer=True)
    target, tokenizer, label = handle.load(), handle.tokenizer, handle.cache_name
    chat = tokenizer.chat_template is not None  # a base model (Gemma 3) answers the turns as plain text
    data = DataConfig(regenerate=True, regenerate_tokens=args.max_new_tokens, regenerate_temperature=args.temperature)
    # float32 answers share specdec-train's cache; another dtype writes different answers, so its own file
    cache_file = regeneration_cache(label if args.dtype == "float32" else f"{label}-{args.dtype}", data, chat)
    print(f"answering {args.conversations} ShareGPT conversations with {label} ({args.dtype}) -> {cache_file} "
          f"(resumes where it stopped)")
    pairs = regenerated_answers(
        target, tokenizer, assets.load_sharegpt_conversations(args.conversations), data.max_length, cache_file,
        args.max_new_tokens, SamplingParams(args.temperature), args.batch,
        progress=lambda done, total: print(f"  {done}/{total} answers", end="\r", flush=True), chat=chat,
    )
    print()
    documents = [answer for _, answer in pairs if answer]
    meta = {"source": f"{label}'s own answers ({args.dtype}, T={args.temperature:g}) to the first "
                      f"{args.conversations} ShareGPT conversations", "tokenizer": label, "answers": len(documents)}
    if args.with_sharegpt:
        documents += sharegpt_answer_ids(tokenizer)
        meta["source"] += ", and the ShareGPT answers"
    return documents, target.vocab_size, meta


if __name__ == "__main__":
    main()
