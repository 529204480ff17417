"""The heads bundled for the packaged targets, and the manifest that vouches for them.

drafters/checkpoints/<drafter>-<target>/ holds one head trained here for a packaged target (config.json
and model.safetensors, as ``save_head`` or SpecForge's layout writes them). MANIFEST.json beside them
lists every one: its target and drafter, the dtype it was saved in and how its weights are stored
(drafters/head_storage.py), each file's bytes and sha256, the command and commit that trained it, and
the tau at T = 0 it is held to (tests/data/acceptance_tau.json, which tests/test_bundled_heads.py keeps
equal). A bundled head whose files are not the manifest's is refused before any target loads.

scripts/bundle_head.py writes a head into drafters/checkpoints and its entry into the manifest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.files import write_atomically

BUNDLED = Path(__file__).resolve().parent / "checkpoints"
MANIFEST = BUNDLED / "MANIFEST.json"


@dataclass(frozen=True)
class FileRecord:
    bytes: int
    sha256: str


@dataclass(frozen=True)
class BundledHead:
    """One bundled head, as the manifest records it."""

    target: str  # the packaged target's registered name (configs/target/<target>.yaml)
    drafter: str  # the drafter config that drafts with it by default (configs/drafter/<drafter>.yaml)
    dtype: str  # the dtype it was trained and saved in
    storage: str  # how model.safetensors holds it: "saved" (as written) or head_storage.INT8_ROWS
    files: Mapping[str, FileRecord]  # file name in the head's folder -> its size and digest
    command: str  # the specdec-train command that trained it last (config.json's training.init names its start)
    commit: str  # the commit that bundled that training
    tau: float | None  # tau at T = 0 in tests/data/acceptance_tau.json's setting, with the stored weights


def file_record(path: Path) -> FileRecord:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return FileRecord(path.stat().st_size, digest.hexdigest())


def read_manifest() -> dict[str, BundledHead]:
    """Folder name -> its entry. ValueError naming the file when it is missing or does not read."""
    path = MANIFEST
    try:
        heads = dict(json.loads(path.read_text())["heads"])
        return {name: BundledHead(**{**entry, "files": {file: FileRecord(**record) for file, record in dict(entry["files"]).items()}})
                for name, entry in heads.items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} does not read ({error}); reinstall specdec, or restore the file from git") from None


def write_manifest(heads: Mapping[str, BundledHead]) -> None:
    text = json.dumps({"heads": {name: asdict(heads[name]) for name in sorted(heads)}}, indent=2) + "\n"
    write_atomically(MANIFEST, lambda staged: staged.write_text(text))


def verified(folder: Path) -> Path:
    """``folder``, a head under drafters/checkpoints, once its files are the ones the manifest lists;
    a ValueError in one line naming the first that is not."""
    entry = read_manifest().get(folder.name)
    if entry is None:
        raise ValueError(f"{folder} is not in {MANIFEST}: bundle heads with scripts/bundle_head.py, "
                         f"or pass the folder as drafter.checkpoint=")
    for name, record in entry.files.items():
        path = folder / name
        if not path.is_file() or file_record(path) != record:
            raise ValueError(f"{path} is not the bundled file {MANIFEST.name} lists (sha256 {record.sha256[:12]}..., "
                             f"{record.bytes} bytes): reinstall specdec or restore it from git")
    return folder
