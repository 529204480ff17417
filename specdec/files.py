"""Writers that stage a file or folder beside its destination and rename it into place, so a reader
finds it absent, or whole (a killed writer leaves only a hidden temporary folder)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(destination: Path, write: Callable[[Path], None]) -> None:
    """Let `write` build a file or folder at a temporary path beside `destination`, then rename it there.

    A killed writer therefore never leaves a half-written `destination`, only a hidden temporary folder.
    """
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent))
    try:
        staged = staging / destination.name
        write(staged)
        try:
            os.replace(staged, destination)
        except OSError:
            # A concurrent writer published the same asset first (a folder cannot be replaced); keep theirs.
            if not destination.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def replace_folder(destination: Path, write: Callable[[Path], None]) -> None:
    """Let `write` create and fill a folder at a temporary path beside `destination`, then swap it
    in for whatever is there (write_atomically keeps the first writer's instead): a reader finds the
    old folder or the new one, whole, never a mix, and a failure between the two renames puts the
    old one back. A killed writer leaves only a hidden temporary folder."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent))
    staged, previous = staging / "new", staging / "previous"
    try:
        write(staged)
        if destination.exists():
            os.replace(destination, previous)
        os.replace(staged, destination)
    except BaseException:
        if previous.exists() and not destination.exists():
            os.replace(previous, destination)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
