"""Stage a target and its training data for the lent GPU machine, in parts that back-to-back device calls carry.

    python3 -m scripts.device.stage slim                          # here: the bundled heads left out of the calls (slim.py)
    python3 -m scripts.device.stage stage                         # here: SmolLM2 + ShareGPT -> .gpu/manifest.json, .gpu/parts/part-NN
    python3 -m scripts.device.stage stage --target gemma3_270m    # another packaged target
    python3 -m scripts.device.stage plan                          # here: the device calls that carry them, sized for today's tree
    python3 -m scripts.device.stage check .gpu                    # there (scripts/gpu_train.sh): verify the parts, reassemble
    python3 -m scripts.device.stage unslim                        # here, after the calls: the heads back in git's index

This is our lent machine's transfer limit, not part of the product: a GPU user with the model and
ShareGPT at hand runs ``specdec-train schedule=gpu`` (configs/schedule/gpu.yaml) directly. A device
call carries the working tree plus at most 64 MiB in all, so the payload travels as parts of
``64 MiB - tree - margin``: one per call, each into the ignored folder .gpu/ of a machine that stays
warm between back-to-back calls. The payload is one tar.xz archive of

- target/NAME/: the model folder's files (config, tokenizer, licence notices) and its weights in
  ``encode_weights``' compact form (scripts/device/weights.py). A packaged target is the fp32
  dequantisation of a GGUF, so its matrices are blocks of small integer codes times scales: stored
  that way they are a fifth (SmolLM2) to a quarter (Gemma 3) of their fp32 size and decode to the
  same bits (checked by a digest of every tensor), where bf16 would be larger and not the target
  the CPU runs. Gemma 3's k-quant scales are read from its GGUF, assembled again for the staging.
  NAME is the target's key (smollm2), which target=hf takes from the folder's name.
- sequences.npz: ShareGPT's conversations tokenised as specdec-train tokenises them, and their
  opening prompts for the target to answer itself (experiments.train.sources.write_sequences: what
  specdec-train's data.sequences reads).

``check`` runs on the device: it verifies each part's sha256, and once all are there joins them,
verifies the archive, unpacks it and rebuilds the model folder (.gpu/target/NAME, fp32 safetensors
the weights digest vouches for); exit 0 then, 3 while parts are missing (it lists which). It imports
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
from pathlib import Path

from scripts.device.slim import SLIM, is_slim, slim, unslim
from scripts.device.weights import decode_weights, encode_weights, gguf_kquant_scales, read_weights, weights_digest

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one device call may carry: the working tree and the carried paths together
MARGIN = 2 * MIB  # for files the tree gains between staging and the calls
MANIFEST, PARTS, PAYLOAD, TARGET, SEQUENCES = "manifest.json", "parts", "payload", "target", "sequences.npz"
MISSING = 3  # check's exit status while parts are still to come


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


def stage(model_dir: Path, name: str, conversations, out: Path, part_bytes: int, max_length: int = 4096,
          kquants: dict | None = None) -> dict:
    """Everything ``check`` needs on the device, as parts in out/parts and out/manifest.json: the
    model folder as target/``name`` and ``conversations`` as specdec-train tokenises them (a chat
    model's through its chat template, a base model's as plain text) with their opening prompts;
    ``kquants``: the GGUF's k-quant scales (weights.gguf_kquant_scales)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from drafters.training.data import chat_sequences
    from experiments.common.answers import opening_prompts
    from experiments.train.sources import write_sequences

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = bool(getattr(tokenizer, "chat_template", None))
    state = read_weights(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".payload.", dir=out) as scratch:
        payload = Path(scratch)
        folder = payload / TARGET / name
        folder.mkdir(parents=True)
        for path in model_dir.iterdir():  # config, tokenizer, licence notices: all but the weights
            if path.is_file() and path.suffix not in (".safetensors", ".bin"):
                shutil.copy(path, folder / path.name)
        encoded = encode_weights(state, kquants)
        save_file(encoded, str(folder / "weights.safetensors"))
        sequences = chat_sequences(tokenizer, conversations, max_length, chat=chat)
        prompts = [ids for _, _, ids in opening_prompts(tokenizer, conversations, max_length, chat)]
        write_sequences(payload / SEQUENCES, sequences, prompts, AutoConfig.from_pretrained(model_dir).vocab_size)
        counts = {"sequences": len(sequences), "tokens": sum(map(len, sequences)), "prompts": len(prompts)}
        manifest = {"model": name, "weights_digest": weights_digest(state), "chat": chat, "max_length": max_length,
                    "data": counts,
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
    # specdec-train's settings for the staged target: target=hf takes its key from the folder's name
    command = f"bash scripts/gpu_train.sh target.path={relative / TARGET / manifest['model']}"
    command += "" if manifest["chat"] else " target.chat=false"
    calls = []
    for index, part in enumerate(manifest["parts"]):
        last = index == len(manifest["parts"]) - 1
        carry = json.dumps([str(relative / MANIFEST), str(relative / PARTS / part["name"])])
        calls.append(f'run(command="{command}", carry={carry}, timeout_s={600 if last else 60})')
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
    """Join the parts, verify and unpack the archive, rebuild the model folder; returns
    root/target/NAME. Done once per manifest: a later call finds it done (a marker holds the
    archive's sha256)."""
    manifest, missing = missing_parts(root)
    if missing:
        raise ValueError(f"{root}: parts {', '.join(missing)} are missing or damaged; carry them again")
    done = root / PAYLOAD / ".archive-sha256"
    model = root / TARGET / manifest["model"]
    if done.is_file() and done.read_text() == manifest["archive_sha256"] and (model / "config.json").is_file():
        return model
    archive = io.BytesIO(b"".join((root / PARTS / p["name"]).read_bytes() for p in manifest["parts"]))
    if hashlib.sha256(archive.getbuffer()).hexdigest() != manifest["archive_sha256"]:
        raise ValueError(f"{root}: the joined parts do not match the archive's sha256; stage again")
    for folder in (root / PAYLOAD, root / TARGET):
        shutil.rmtree(folder, ignore_errors=True)
    unpacked = Path(tempfile.mkdtemp(prefix=".payload.", dir=root))
    with tarfile.open(fileobj=archive, mode="r:xz") as tar:
        tar.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (root / TARGET).mkdir()
    _rebuild_model(unpacked / TARGET / manifest["model"], model, manifest["weights_digest"])
    (unpacked / done.name).write_text(manifest["archive_sha256"])
    os.replace(unpacked, root / PAYLOAD)
    return model


def _rebuild_model(encoded_dir: Path, model: Path, digest: str) -> None:
    from safetensors.torch import load_file, save_file

    state = decode_weights(load_file(str(encoded_dir / "weights.safetensors")))
    if weights_digest(state) != digest:
        raise ValueError("the decoded weights do not match the staged model's digest; stage again")
    folder = Path(tempfile.mkdtemp(prefix=".target.", dir=model.parent))
    for path in encoded_dir.iterdir():  # config, tokenizer, licence notices
        if path.is_file() and path.name != "weights.safetensors":
            shutil.copy(path, folder / path.name)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    os.replace(folder, model)


REPO = Path(__file__).resolve().parents[2]  # the repository root: what a device call carries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.device.stage", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    staging = commands.add_parser("stage", help="write .gpu/manifest.json and .gpu/parts (here)")
    chosen = staging.add_mutually_exclusive_group()
    chosen.add_argument("--target", default="smollm2", help="a packaged target: smollm2 (default) or gemma3_270m")
    chosen.add_argument("--model", type=Path, default=None, help="a model folder instead (weights of no block form travel as they are)")
    staging.add_argument("--out", type=Path, default=Path(".gpu"))
    staging.add_argument("--conversations", type=int, default=None, help="the first N ShareGPT conversations (default: all)")
    staging.add_argument("--max-length", type=int, default=4096, help="tokens per conversation, at most")
    staging.add_argument("--part-mib", type=float, default=None, help="part size (default: what the tree leaves of a call)")
    planning = commands.add_parser("plan", help="print the device calls for the staged parts (here)")
    planning.add_argument("--out", type=Path, default=Path(".gpu"))
    checking = commands.add_parser("check", help="verify the parts and reassemble (on the device)")
    checking.add_argument("root", type=Path, nargs="?", default=Path(".gpu"))
    slimming = commands.add_parser("slim", help="leave the bundled heads out of the device calls (here; before stage)")
    slimming.add_argument("--keep", nargs="*", default=[], help="head folders that stay in (e.g. eagle3-smollm2)")
    commands.add_parser("unslim", help="undo slim (here; after the calls, before any commit)")
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
            print(f"after the calls: python3 -m scripts.device.stage unslim ({SLIM} is out of git's index until then)")
        return 0
    from specdec import assets, packaged_models

    if args.model is None and args.target not in packaged_models.PACKAGED_MODELS:
        parser.error(f"--target {args.target}: no such packaged target; choose one of {', '.join(packaged_models.PACKAGED_MODELS)}, "
                     f"or pass --model DIR")
    for name, value, least in [("--max-length", args.max_length, 2), ("--conversations", args.conversations or 2, 2),
                               ("--part-mib", args.part_mib or 1, 0.01)]:
        if value < least:
            parser.error(f"{name} must be >= {least}; got {value}")
    part_bytes = int(args.part_mib * MIB) if args.part_mib else part_bytes_for(repo)
    kquants = None
    if args.model is None:
        model_dir = packaged_models.converted_path(args.target)
        with tempfile.TemporaryDirectory(prefix="specdec-gguf.") as scratch:
            kquants = gguf_kquant_scales(packaged_models.PACKAGED_MODELS[args.target].gguf(Path(scratch)))
    else:
        model_dir = args.model
    # the conversations specdec-train reads (those that open with a user turn)
    conversations = assets.load_sharegpt_conversations(args.conversations)
    manifest = stage(model_dir, args.target if args.model is None else model_dir.name, conversations, args.out,
                     part_bytes, args.max_length, kquants)
    print(json.dumps({k: manifest[k] for k in ("data", "tensors", "archive_bytes")}, indent=2))
    print(f"{len(manifest['parts'])} parts of up to {part_bytes / MIB:.1f} MiB; the calls, back to back "
          f"(the machine stays warm only 30 s after each):")
    print("\n".join(plan(args.out, repo)))
    if not is_slim(repo):
        print(f"(python3 -m scripts.device.stage slim before stage leaves {SLIM} behind: fewer, larger parts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
