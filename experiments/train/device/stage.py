"""Stage a target and its training data for the GPU machine, in parts that back-to-back device calls carry.

    python -m experiments.train.device.stage stage        # here: SmolLM2 + ShareGPT -> .gpu/manifest.json, .gpu/parts/part-NN
    python -m experiments.train.device.stage stage --target gemma3_270m  # another packaged target
    python -m experiments.train.device.stage plan         # here: the device calls that carry them, sized for today's tree
    python -m experiments.train.device.stage slim|unslim  # here: leave the bundled checkpoints out of the calls, or not
    python3 -m experiments.train.device.stage check .gpu  # there (scripts/gpu_train.sh): verify the parts, reassemble

A device call carries the working tree plus at most 64 MiB in all, so the payload travels as parts of
``64 MiB - tree - margin``: one per call, each into the ignored folder .gpu/ of a machine that stays
warm between back-to-back calls. The bundled checkpoints are most of the tree and the device needs
none of them: ``slim`` (before ``stage``) takes them out of what the calls carry, so the parts are a
few large ones instead of many small ones, and ``unslim`` (after the calls) puts them back. The payload is one tar.xz archive of

- target/: the model folder's config (and licence notices) and its weights in ``encode_weights``'
  compact form (experiments/train/device/weights.py). A packaged target is the fp32 dequantisation
  of a GGUF, so its matrices are blocks of small integer codes times scales: stored that way they
  are a fifth (SmolLM2) to a quarter (Gemma 3) of their fp32 size and decode to the same bits
  (checked by a digest of every tensor), where bf16 would be larger and not the target the CPU
  runs. Gemma 3's k-quant scales are read from its GGUF, assembled again for the staging.
- data.npz: the training conversations (tokens, which tokens are an answer's), the last
  ``held_out`` conversations kept apart for evaluation, and opening prompts for the target to
  answer itself. A chat model's go through its chat template; a base model's (no template, as
  Gemma 3 270M) are their turns' text joined by blank lines, as specdec-train feeds a base model.

``check`` runs on the device: it verifies each part's sha256, and once all are there joins them,
verifies the archive, unpacks it and rebuilds the model folder (.gpu/target, fp32 safetensors the
weights digest vouches for); exit 0 then, 3 while parts are missing (it lists which). It imports
torch only to rebuild the model, so a call that only delivers a part returns in a second.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from experiments.train.device.slim import SLIM, is_slim, slim, unslim
from experiments.train.device.weights import decode_weights, encode_weights, gguf_kquant_scales, read_weights, weights_digest

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one device call may carry: the working tree and the carried paths together
MARGIN = 2 * MIB  # for files the tree gains between staging and the calls
MANIFEST, PARTS, PAYLOAD, TARGET = "manifest.json", "parts", "payload", "target"
MISSING = 3  # check's exit status while parts are still to come


# -- training data --


@dataclass(frozen=True)
class StagedData:
    tokens: list  # per conversation, the chat-template token ids (cut to max_length)
    answers: list  # per conversation, one bool per token: part of an answer (or the token that ends it)
    prompts: list  # opening prompts (system + first user turn, generation prompt added) for the target to answer
    unmatched: int  # answers not found in the rendered text (their tokens are not trained on)


def answer_mask(text: str, answers: list[str], spans: list[tuple[int, int]]) -> tuple[list[bool], int]:
    """Which tokens (character ``spans`` into ``text``) belong to one of ``answers`` (in order), and
    the token right after each, which ends the turn in chat templates; returns the mask and how
    many answers were not found in the text."""
    marked = [False] * len(spans)
    cursor, unmatched, token = 0, 0, 0
    for answer in answers:
        start = text.find(answer, cursor)
        if start < 0:  # a template that trims what it renders
            answer = answer.strip()
            start = text.find(answer, cursor)
        if not answer or start < 0:
            unmatched += 1
            continue
        end = cursor = start + len(answer)
        while token < len(spans) and spans[token][1] <= start:
            token += 1
        while token < len(spans) and spans[token][0] < end:
            marked[token] = True
            token += 1
        if token < len(spans):
            marked[token] = True
    return marked, unmatched


def stage_conversations(tokenizer, conversations, max_length: int, num_prompts: int, prompt_length: int,
                        held_out: int = 0, chat: bool = True) -> StagedData:
    """Each conversation (drafters.training.data.conversation_text) with its answers marked, and up to ``num_prompts`` opening
    prompts of at most ``prompt_length`` tokens, none from the last ``held_out`` conversations (the
    held-out ones: the target's own answers to them would be trained on). A chat template spells
    its special tokens in the text; a base model's text gets the tokenizer's own (its BOS)."""
    from drafters.training.data import conversation_ids, conversation_text  # imports torch, which `check` must not

    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("staging marks answers through token offsets, which only fast (Rust) tokenizers give")
    tokens, answers, prompts, unmatched = [], [], [], 0
    for index, conversation in enumerate(conversations):
        messages = [{"role": role, "content": text} for role, text in conversation.turns if text.strip()]
        if not messages:
            continue
        text = conversation_text(tokenizer, messages, chat)
        encoded = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
        said = [m["content"] for m in messages if m["role"] == "assistant"]
        marked, missed = answer_mask(text, said, encoded["offset_mapping"])
        unmatched += missed
        if len(encoded["input_ids"]) >= 2:
            tokens.append(encoded["input_ids"][:max_length])
            answers.append(marked[:max_length])
        opening = []
        for message in messages:
            opening.append(message)
            if message["role"] != "system":
                break
        if len(prompts) < num_prompts and opening[-1]["role"] == "user" and index < len(conversations) - held_out:
            ids = conversation_ids(tokenizer, opening, chat, add_generation_prompt=True)
            if len(ids) <= prompt_length:
                prompts.append(ids)
    if not tokens:
        raise ValueError(f"none of the {len(conversations)} conversations gave a sequence of 2 or more tokens")
    return StagedData(tokens, answers, prompts, unmatched)


def write_data(path: Path, data: StagedData, held_out: int, vocab_size: int) -> dict:
    """data.npz (tokens in uint16 where the vocabulary allows: half the bytes to carry); returns its counts."""
    import numpy as np

    if not 1 <= held_out < len(data.tokens):
        raise ValueError(f"--held-out {held_out}: keep 1 .. {len(data.tokens) - 1} of the {len(data.tokens)} conversations apart")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    lengths = np.array([len(t) for t in data.tokens], dtype=np.int64)
    trained = np.concatenate([np.array(a, dtype=bool) for a in data.answers])
    prompts = data.prompts or [[]]
    arrays = {
        "tokens": np.concatenate([np.array(t, dtype=dtype) for t in data.tokens]),
        "offsets": np.concatenate([[0], lengths.cumsum()]),
        "trained": np.packbits(trained),
        "held_out_from": np.array(len(data.tokens) - held_out),
        "prompt_tokens": np.concatenate([np.array(p, dtype=dtype) for p in prompts]),
        "prompt_offsets": np.concatenate([[0], np.cumsum([len(p) for p in data.prompts], dtype=np.int64)]),
    }
    with open(path, "wb") as file:
        np.savez(file, **arrays)
    split = int(arrays["offsets"][len(data.tokens) - held_out])
    return {"sequences": len(data.tokens) - held_out, "tokens": split, "answer_tokens": int(trained[:split].sum()),
            "held_out_sequences": held_out, "held_out_tokens": int(lengths.sum()) - split, "prompts": len(data.prompts),
            "unmatched_answers": data.unmatched}


def read_data(path: Path) -> dict:
    """data.npz as torch tensors: train and held_out (drafters.training.online.TokenSequences),
    prompts (lists of token ids)."""
    import numpy as np
    import torch

    from drafters.training.online import TokenSequences

    with np.load(path) as f:
        raw = {key: f[key] for key in f.files}
    tokens = torch.from_numpy(raw["tokens"].astype(np.int64))
    offsets = torch.from_numpy(raw["offsets"].astype(np.int64))
    trained = torch.from_numpy(np.unpackbits(raw["trained"])[: len(tokens)].astype(bool))
    every = TokenSequences(tokens, offsets, trained)
    split = int(raw["held_out_from"])
    prompt_tokens, prompt_offsets = raw["prompt_tokens"].astype(np.int64), raw["prompt_offsets"]
    prompts = [prompt_tokens[a:b].tolist() for a, b in zip(prompt_offsets[:-1], prompt_offsets[1:])]
    return {"train": every.select(torch.arange(split)), "held_out": every.select(torch.arange(split, len(every))),
            "prompts": prompts}


# -- the archive, its parts and the manifest --


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_bytes(root: Path) -> int:
    """What a device call carries before any carried path: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum(os.path.getsize(root / os.fsdecode(name)) for name in listed if name and (root / os.fsdecode(name)).is_file())


def part_bytes_for(root: Path) -> int:
    room = CALL_LIMIT - tree_bytes(root) - MARGIN
    if room < MIB:
        raise ValueError(f"the working tree leaves {room / MIB:.1f} MiB of a device call's {CALL_LIMIT // MIB} MiB for "
                         f"the parts; make the tree smaller (untracked files travel too) or pass --part-mib")
    return room


def write_parts(payload: Path, out: Path, part_bytes: int, manifest: dict) -> dict:
    """payload/ -> out/parts/part-NN (one tar.xz cut into pieces) and out/manifest.json, atomically."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".stage.", dir=out))
    try:
        archive = staging / "payload.tar.xz"
        with tarfile.open(archive, "w:xz", preset=6) as tar:
            for path in sorted(payload.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=str(path.relative_to(payload)))
        parts = staging / PARTS
        parts.mkdir()
        listed = []
        with open(archive, "rb") as file:
            for index, piece in enumerate(iter(lambda: file.read(part_bytes), b"")):
                name = f"part-{index:02d}"
                (parts / name).write_bytes(piece)
                listed.append({"name": name, "bytes": len(piece), "sha256": hashlib.sha256(piece).hexdigest()})
        manifest = {**manifest, "archive_sha256": sha256_file(archive), "archive_bytes": archive.stat().st_size,
                    "parts": listed}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        archive.unlink()
        # the manifest names the parts: it goes last, after the parts it describes are in place
        (out / MANIFEST).unlink(missing_ok=True)
        if (out / PARTS).exists():
            shutil.rmtree(out / PARTS)
        os.replace(parts, out / PARTS)
        os.replace(staging / MANIFEST, out / MANIFEST)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def stage(model_dir: Path, conversations, out: Path, part_bytes: int, max_length: int = 4096, held_out: int = 64,
          num_prompts: int = 2048, prompt_length: int = 512, kquants: dict | None = None,
          notices: tuple[str, ...] = ()) -> dict:
    """Everything ``check`` needs on the device, as parts in out/parts and out/manifest.json;
    ``kquants``: the GGUF's k-quant scales (weights.gguf_kquant_scales), ``notices``: files of the
    model folder that travel with its weights (licence terms)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = bool(getattr(tokenizer, "chat_template", None))
    config = AutoConfig.from_pretrained(model_dir)
    state = read_weights(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".payload.", dir=out) as scratch:
        payload = Path(scratch)
        (payload / TARGET).mkdir()
        for name in ("config.json", "generation_config.json", *notices):
            if (model_dir / name).is_file():
                shutil.copy(model_dir / name, payload / TARGET / name)
        from safetensors.torch import save_file

        encoded = encode_weights(state, kquants)
        save_file(encoded, str(payload / TARGET / "weights.safetensors"))
        staged = stage_conversations(tokenizer, conversations, max_length, num_prompts, prompt_length, held_out, chat)
        counts = write_data(payload / "data.npz", staged, held_out, config.vocab_size)
        manifest = {"model": str(model_dir), "weights_digest": weights_digest(state), "eos_token_id": tokenizer.eos_token_id,
                    "chat": chat, "max_length": max_length, "data": counts,
                    "tensors": dict(Counter(key.split("/")[0] for key in encoded if key.startswith("raw/") or key.endswith("/codes")))}
        return write_parts(payload, out, part_bytes, manifest)


def plan(out: Path, repo: Path) -> list[str]:
    """The device calls that deliver out/parts, one part each; the last one trains."""
    manifest = json.loads((out / MANIFEST).read_text())
    room = CALL_LIMIT - tree_bytes(repo)
    biggest = max(p["bytes"] for p in manifest["parts"]) + (out / MANIFEST).stat().st_size
    if biggest > room:
        raise ValueError(f"a part and the manifest take {biggest / MIB:.1f} MiB, and the working tree leaves "
                         f"{room / MIB:.1f} MiB of a call; stage again (the part size follows the tree)")
    relative = out.resolve().relative_to(repo.resolve())
    calls = []
    for index, part in enumerate(manifest["parts"]):
        last = index == len(manifest["parts"]) - 1
        carry = json.dumps([str(relative / MANIFEST), str(relative / PARTS / part["name"])])
        calls.append(f'run(command="bash scripts/gpu_train.sh", carry={carry}, timeout_s={600 if last else 60})')
    return calls


# -- the device side --


def missing_parts(root: Path) -> tuple[dict, list[str]]:
    """The manifest, and the parts absent or not matching their sha256."""
    manifest = json.loads((root / MANIFEST).read_text())
    missing = []
    for part in manifest["parts"]:
        path = root / PARTS / part["name"]
        if not path.is_file() or path.stat().st_size != part["bytes"] or sha256_file(path) != part["sha256"]:
            missing.append(part["name"])
    return manifest, missing


def assemble(root: Path) -> Path:
    """Join the parts, verify and unpack the archive, rebuild the model folder; returns root/target.
    Done once per manifest: a later call finds it done (a marker holds the archive's sha256)."""
    manifest, missing = missing_parts(root)
    if missing:
        raise ValueError(f"{root}: parts {', '.join(missing)} are missing or damaged; carry them again")
    done = root / PAYLOAD / ".archive-sha256"
    if done.is_file() and done.read_text() == manifest["archive_sha256"] and (root / TARGET / "config.json").is_file():
        return root / TARGET
    archive = io.BytesIO(b"".join((root / PARTS / p["name"]).read_bytes() for p in manifest["parts"]))
    if hashlib.sha256(archive.getbuffer()).hexdigest() != manifest["archive_sha256"]:
        raise ValueError(f"{root}: the joined parts do not match the archive's sha256; stage again")
    for folder in (root / PAYLOAD, root / TARGET):
        shutil.rmtree(folder, ignore_errors=True)
    unpacked = Path(tempfile.mkdtemp(prefix=".payload.", dir=root))
    with tarfile.open(fileobj=archive, mode="r:xz") as tar:
        tar.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    _rebuild_model(unpacked / TARGET, root, manifest["weights_digest"])
    (unpacked / done.name).write_text(manifest["archive_sha256"])
    os.replace(unpacked, root / PAYLOAD)
    return root / TARGET


def _rebuild_model(encoded_dir: Path, root: Path, digest: str) -> None:
    from safetensors.torch import load_file, save_file

    state = decode_weights(load_file(str(encoded_dir / "weights.safetensors")))
    if weights_digest(state) != digest:
        raise ValueError("the decoded weights do not match the staged model's digest; stage again")
    folder = Path(tempfile.mkdtemp(prefix=".target.", dir=root))
    for path in encoded_dir.iterdir():  # the config files and licence notices
        if path.is_file() and path.name != "weights.safetensors":
            shutil.copy(path, folder / path.name)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    os.replace(folder, root / TARGET)


REPO = Path(__file__).resolve().parents[3]  # the repository root: what a device call carries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.train.device.stage", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    staging = commands.add_parser("stage", help="write .gpu/manifest.json and .gpu/parts (here)")
    chosen = staging.add_mutually_exclusive_group()
    chosen.add_argument("--target", default="smollm2", help="a packaged target: smollm2 (default) or gemma3_270m")
    chosen.add_argument("--model", type=Path, default=None, help="a model folder instead (weights of no block form travel as they are)")
    staging.add_argument("--out", type=Path, default=Path(".gpu"))
    staging.add_argument("--conversations", type=int, default=None, help="the first N ShareGPT conversations (default: all)")
    staging.add_argument("--max-length", type=int, default=4096, help="tokens per conversation, at most")
    staging.add_argument("--held-out", type=int, default=64, help="last conversations kept for the evaluation")
    staging.add_argument("--prompts", type=int, default=2048, help="opening prompts for the target to answer")
    staging.add_argument("--part-mib", type=float, default=None, help="part size (default: what the tree leaves of a call)")
    slimming = commands.add_parser("slim", help="leave the bundled checkpoints out of the device calls (here; before stage)")
    slimming.add_argument("--keep", nargs="*", default=[], help="checkpoint folders that stay in (e.g. eagle3-smollm2)")
    commands.add_parser("unslim", help="undo slim (here; after the calls, before any commit)")
    planning = commands.add_parser("plan", help="print the device calls for the staged parts (here)")
    planning.add_argument("--out", type=Path, default=Path(".gpu"))
    checking = commands.add_parser("check", help="verify the parts and reassemble (on the device)")
    checking.add_argument("root", type=Path, nargs="?", default=Path(".gpu"))
    args = parser.parse_args(argv)
    repo = REPO
    if args.command == "check":
        if not (args.root / MANIFEST).is_file():
            print(f"no {args.root / MANIFEST}: carry it (and the parts) with the call", file=sys.stderr)
            return 2
        manifest, missing = missing_parts(args.root)
        present = [p["name"] for p in manifest["parts"] if p["name"] not in missing]
        print(f"parts here: {', '.join(present) or 'none'}; missing: {', '.join(missing) or 'none'}")
        if missing:
            return MISSING
        print(f"assembled: {assemble(args.root)}")
        return 0
    if args.command in ("slim", "unslim"):
        try:
            slim(repo, tuple(args.keep)) if args.command == "slim" else unslim(repo)
        except ValueError as error:
            parser.error(str(error))
        print(f"{SLIM} {'left out of' if is_slim(repo) else 'back in'} the device calls; the tree is now "
              f"{tree_bytes(repo) / MIB:.1f} MiB")
        return 0
    if args.command == "plan":
        print("\n".join(plan(args.out, repo)))
        if is_slim(repo):
            print(f"after the calls: python -m experiments.train.device.stage unslim ({SLIM} is out of git's index until then)")
        return 0
    from specdec import assets, packaged_models

    if args.model is None and args.target not in packaged_models.PACKAGED_MODELS:
        parser.error(f"--target {args.target}: no such packaged target; choose one of {', '.join(packaged_models.PACKAGED_MODELS)}, "
                     f"or pass --model DIR")
    for name, value, least in [("--max-length", args.max_length, 2), ("--prompts", args.prompts, 0),
                               ("--conversations", args.conversations or 2, 2), ("--held-out", args.held_out, 1),
                               ("--part-mib", args.part_mib or 1, 0.01)]:
        if value < least:
            parser.error(f"{name} must be >= {least}; got {value}")
    part_bytes = int(args.part_mib * MIB) if args.part_mib else part_bytes_for(repo)
    kquants, notices = None, ()
    if args.model is None:
        packaged = packaged_models.PACKAGED_MODELS[args.target]
        model_dir = packaged_models.converted_path(args.target)
        notices = tuple(Path(name).name for name in packaged.notices)
        with tempfile.TemporaryDirectory(prefix="specdec-gguf.") as scratch:
            kquants = gguf_kquant_scales(packaged.gguf(Path(scratch)))
    else:
        model_dir = args.model
    conversations = assets.load_sharegpt_conversations(args.conversations, user_first=False)
    manifest = stage(model_dir, conversations, args.out, part_bytes, args.max_length, args.held_out, args.prompts,
                     kquants=kquants, notices=notices)
    print(json.dumps({k: manifest[k] for k in ("data", "tensors", "archive_bytes")}, indent=2))
    print(f"{len(manifest['parts'])} parts of up to {part_bytes / MIB:.1f} MiB; the calls, back to back "
          f"(the machine stays warm only 30 s after each):")
    print("\n".join(plan(args.out, repo)))
    if not is_slim(repo):
        print(f"(python -m experiments.train.device.stage slim before stage leaves {SLIM} behind: fewer, larger parts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
