"""specdec-export: a drafter head trained here, in the layout a serving engine's speculative config loads.

    specdec-export outputs/train/eagle3/head exported/eagle3-vllm --engine vllm
    specdec-export outputs/train/eagle3/head exported/eagle3-sglang --engine sglang

EAGLE heads of the published architectures (specdec-train train=eagle3 train.arch=eagle3, or
train=eagle train.arch=eagle1) are written as EAGLE-3 / EAGLE checkpoints; Medusa heads as vLLM
Medusa checkpoints (--target DIR: the target's folder, whose LM head that layout holds). A head
whose architecture no engine runs is refused with the command that trains an exportable one. The
output folder must be new (or empty); it appears complete or not at all. On success it prints the
engine's options that serve the exported head.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from drafters.heads import CONFIG_FILE

ENGINES = ("vllm", "sglang")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a head folder written by specdec-train (its output=DIR)")
    parser.add_argument("out", type=Path, help="a new folder for the exported head")
    parser.add_argument("--engine", choices=ENGINES, required=True, help="the serving engine that will load it")
    parser.add_argument("--target", type=Path, default=None,
                        help="Medusa heads only: the target's Hugging Face folder, whose LM head vLLM's Medusa layout "
                             "holds (default: the folder the checkpoint names)")
    args = parser.parse_args(argv)
    config_path = args.checkpoint / CONFIG_FILE
    if not config_path.is_file():
        parser.error(f"{args.checkpoint}: no {CONFIG_FILE}; pass a head folder written by specdec-train")
    try:
        kinds = set(json.loads(config_path.read_text()))
    except json.JSONDecodeError as error:
        parser.error(f"{config_path} is not valid JSON: {error}")
    if "eagle" in kinds:
        from drafters.formats import eagle as layout
        options = {}
        if args.target is not None:
            parser.error("--target is for Medusa heads only (an EAGLE head's layout holds no target weights)")
    elif "dflash_config" in kinds:  # DFlash and Domino heads, saved as SpecForge folders
        from drafters.formats import specforge as layout
        options = {}
        if args.target is not None:
            parser.error("--target is for Medusa heads only (a DFlash head's layout holds no target weights)")
    elif "medusa" in kinds:
        from drafters.formats import medusa as layout
        options = {"target_dir": args.target}
    else:
        parser.error(f"{args.checkpoint} holds no EAGLE or Medusa head (its {CONFIG_FILE} has {', '.join(sorted(kinds))})")
    try:
        layout.export(args.checkpoint, args.out, args.engine, **options)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        sys.exit(f"specdec-export: {error}")
    print(f"wrote {args.out} for {args.engine}")
    print(f"serve it with: {layout.serve_command(args.out, args.engine)}")


if __name__ == "__main__":
    main()
