"""Bundle a trained head for a packaged target: drafters/checkpoints/<drafter>-<target>/ and its entry in
drafters/checkpoints/MANIFEST.json (drafters/bundled.py says what an entry holds).

    .venv/bin/python scripts/bundle_head.py outputs/train/eagle3-ft/head --target smollm2 --drafter eagle3 \\
        --command "specdec-train train=eagle3 ... output=outputs/train/eagle3-ft/head" --commit HEAD

The head's matrices are stored as int8 rows (drafters/head_storage.py) unless --storage saved; the
folder replaces the one there, whole. The entry's tau is the one tests/data/acceptance_tau.json records
for --drafter on --target: record it first (tests/test_acceptance_regression.py says how), then run
this again to carry it over, and commit the folder, the manifest and the record together. Run from
the checkout; --commit HEAD is resolved with git.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafters.bundled import BUNDLED, MANIFEST, BundledHead, file_record, read_manifest, write_manifest  # noqa: E402
from drafters.head_storage import INT8_ROWS, compact_int8_rows, read_weights, saved_dtype  # noqa: E402
from drafters.heads import CONFIG_FILE, WEIGHTS_FILE  # noqa: E402
from specdec.files import replace_folder  # noqa: E402

ACCEPTANCE = ROOT / "tests" / "data" / "acceptance_tau.json"
SAVED = "saved"


def recorded_tau(target: str, drafter: str) -> float | None:
    records = json.loads(ACCEPTANCE.read_text()) if ACCEPTANCE.is_file() else {}
    return records.get("tau", {}).get(target, {}).get(drafter)


def write_head(source: Path, folder: Path, storage: str) -> str:
    """Write the head at ``source`` into ``folder`` in ``storage``; returns the dtype it was saved in."""
    from safetensors.torch import save_file

    tensors = read_weights(source / WEIGHTS_FILE)
    try:
        dtype = saved_dtype(tensors)
    except ValueError as error:
        raise SystemExit(f"{source / WEIGHTS_FILE}: {error}") from None
    if storage == INT8_ROWS:
        stored, metadata = compact_int8_rows(tensors)
    else:
        stored, metadata = {k: v.contiguous() for k, v in tensors.items()}, {"format": "pt"}

    def write(staged: Path) -> None:
        staged.mkdir()
        shutil.copyfile(source / CONFIG_FILE, staged / CONFIG_FILE)
        save_file(stored, str(staged / WEIGHTS_FILE), metadata=metadata)

    replace_folder(folder, write)
    return dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the head's folder (config.json, model.safetensors)")
    parser.add_argument("--target", required=True, help="the packaged target's registered name, e.g. smollm2")
    parser.add_argument("--drafter", required=True, help="the drafter config that drafts with it, e.g. eagle3")
    parser.add_argument("--command", help="the specdec-train command that trained it (default: the manifest's)")
    parser.add_argument("--commit", help="the commit that bundles that training; HEAD is resolved (default: the manifest's)")
    parser.add_argument("--storage", choices=(INT8_ROWS, SAVED), default=INT8_ROWS)
    args = parser.parse_args()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (args.source / name).is_file():
            parser.exit(2, f"bundle_head: {args.source} holds no {name}; pass a head folder written by specdec-train\n")
    name = f"{args.drafter}-{args.target}"
    heads = read_manifest() if MANIFEST.is_file() else {}
    previous = heads.get(name)
    command = args.command or (previous and previous.command)
    commit = args.commit or (previous and previous.commit)
    if not command or not commit:
        parser.exit(2, f"bundle_head: {name} is new to the manifest; pass --command and --commit\n")
    if commit == "HEAD":
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                                text=True).stdout.strip()
    folder = BUNDLED / name
    dtype = write_head(args.source, folder, args.storage)
    files = {file: file_record(folder / file) for file in (CONFIG_FILE, WEIGHTS_FILE)}
    heads[name] = BundledHead(args.target, args.drafter, dtype, args.storage, files, command, commit,
                              recorded_tau(args.target, args.drafter))
    write_manifest(heads)
    print(f"bundled {folder} ({sum(f.bytes for f in files.values()) / 2**20:.1f} MiB, {args.storage}); tau "
          f"{heads[name].tau if heads[name].tau is not None else 'not recorded yet'}")


if __name__ == "__main__":
    main()
