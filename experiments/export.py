"""specdec-export: a drafter head trained here, in the layout a serving engine's speculative config loads.

    specdec-export outputs/train/eagle3/head exported/eagle3-vllm --engine vllm
    specdec-export outputs/train/eagle3/head exported/eagle3-sglang --engine sglang
    specdec-export outputs/train/eagle3/head exported/eagle3-speculators --engine speculators

EAGLE heads of the published architectures (specdec-train train=eagle3 train.arch=eagle3, or
train=eagle train.arch=eagle1) are written as EAGLE-3 / EAGLE checkpoints; Medusa heads as vLLM
Medusa checkpoints (--target DIR: the target's folder, whose LM head that layout holds);
--engine speculators writes EAGLE-3 and DFlash heads in vLLM's speculators format. A head
whose architecture no engine runs is refused with the command that trains an exportable one. The
output folder must be new (or empty); it appears complete or not at all. On success it prints the
engine's options that serve the exported head.

Bad input (the head, the target folder, the output location) ends in one line and exit status 2,
found from the files' configs and headers before any weight loads. Two exports into one folder
do not run at once (a lock file beside it), and the temporary folder a killed export left there is
removed, and named, by the next export into it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from drafters.formats import eagle, medusa, specforge, speculators
from drafters.heads import CONFIG_FILE
from experiments.cli import ArgumentParser, SpecdecUserError, check_writable, exit_codes, hold_lock, user_errors

ENGINES = ("vllm", "sglang", "speculators")  # speculators: vLLM's speculators format


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="specdec-export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a head folder written by specdec-train (its output=DIR)")
    parser.add_argument("out", type=Path, help="a new folder for the exported head")
    parser.add_argument("--engine", choices=ENGINES, required=True, help="the serving engine that will load it")
    parser.add_argument("--target", type=Path, default=None,
                        help="Medusa heads only: the target's Hugging Face folder, whose LM head vLLM's Medusa layout "
                             "holds (default: the folder the checkpoint names)")
    args = parser.parse_args(argv)
    with exit_codes("specdec-export", (SpecdecUserError,)), user_errors():
        layout, options = _layout(args)
        check_writable(args.out, "the output folder")
        out = args.out
        with hold_lock(out.parent / f".{out.name}.lock", f"the output folder {out}",
                       "wait for that export to end, or choose another folder"):
            for left in sorted(out.parent.glob(f".{out.name}.*.tmp")):  # staged by replace_folder; its writer was killed
                shutil.rmtree(left, ignore_errors=True)
                print(f"specdec-export: removed {left}, the half-written folder of an export that did not finish")
            try:
                layout.export(args.checkpoint, out, args.engine, **options)
            except FileExistsError as error:
                raise SpecdecUserError(str(error)) from None
    print(f"wrote {args.out} for {args.engine}")
    print(f"serve it with: {layout.serve_command(args.out, args.engine)}")


def _layout(args: argparse.Namespace) -> tuple[ModuleType, dict[str, Any]]:
    """The format module that exports the head in args.checkpoint, and its options."""
    config_path = args.checkpoint / CONFIG_FILE
    if not config_path.is_file():
        raise SpecdecUserError(f"{args.checkpoint}: no {CONFIG_FILE}; pass a head folder written by specdec-train")
    try:
        kinds = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SpecdecUserError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(kinds, dict):
        raise SpecdecUserError(f"{config_path} is not a JSON object; pass a head folder written by specdec-train")
    if "eagle" in kinds or "dflash_config" in kinds:  # DFlash and Domino heads are saved as SpecForge folders
        if args.target is not None:
            raise SpecdecUserError("--target is for Medusa heads only (an EAGLE or DFlash head's layout holds no "
                                   "target weights)")
        if args.engine == "speculators":
            return speculators, {}
        return (eagle if "eagle" in kinds else specforge), {}
    if "medusa" in kinds and args.engine == "speculators":
        raise SpecdecUserError("the speculators format has no Medusa heads; export them with --engine vllm")
    if "medusa" in kinds:
        return medusa, {"target_dir": args.target}
    raise SpecdecUserError(f"{args.checkpoint} holds no EAGLE or Medusa head (its {CONFIG_FILE} has "
                           f"{', '.join(sorted(kinds)) or 'no sections'})")


if __name__ == "__main__":
    main()
