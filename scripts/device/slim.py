"""A slimmer working tree for the GPU training calls (``python3 -m scripts.device.stage slim|unslim``).

A device call carries git's tracked and untracked-not-ignored files, 64 MiB at most with what it
carries besides. The whole tree fits (tests/test_bundled_heads.py holds it under that), so the check
calls (scripts/gpu_check.sh) carry it as it is; but the training calls carry the staged target and
data beside it, and the bundled heads are most of the tree and nothing those calls read. ``slim``
takes them out of git's index and ignores them (the files stay on disk), so the staged parts can be
that much larger and fewer; ``unslim`` puts the index back as it was. ``slim --keep`` leaves named
heads in.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

SLIM = "drafters/checkpoints"  # the bundled heads: most of the tree, and nothing the device calls read
SLIM_NOTE = "# scripts.device.stage slim: run `python3 -m scripts.device.stage unslim` before committing"
SLIM_END = "# (end of scripts.device.stage slim)"


def _git(repo: Path, *arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=repo, capture_output=True, text=True, check=True).stdout


def _exclude_file(repo: Path) -> Path:
    return repo / _git(repo, "rev-parse", "--git-path", "info/exclude").strip()


def is_slim(repo: Path) -> bool:
    exclude = _exclude_file(repo)
    return exclude.is_file() and SLIM_NOTE in exclude.read_text().splitlines()


def slim(repo: Path, keep: tuple[str, ...] = ()) -> None:
    """Take the bundled checkpoints out of git's index and ignore them, so that a device call, which
    carries the tracked and untracked-not-ignored files, leaves them behind and its parts can be
    that much larger (a few calls instead of one per few MiB). ``keep`` names checkpoint folders
    (``eagle3-smollm2``) that stay in the calls.
    The files stay on disk; ``unslim`` puts the index back as it was. Refused while the index holds
    staged changes, which a commit made in between would otherwise mix with the checkpoints' removal."""
    if is_slim(repo):
        return
    staged = _git(repo, "diff", "--cached", "--name-only").split()
    if staged:
        raise ValueError(f"the index holds staged changes ({', '.join(staged[:3])}...); commit or unstage them "
                         f"before slim, so that unslim restores exactly the index it found")
    folders = sorted({Path(path).parts[2] for path in _git(repo, "ls-files", "--", SLIM).split()})
    unknown = sorted(set(keep) - set(folders))
    if unknown:
        raise ValueError(f"--keep {', '.join(unknown)}: no such folder in {SLIM} (it has {', '.join(folders)})")
    left = [f"{SLIM}/{folder}" for folder in folders if folder not in keep]
    if left:
        _git(repo, "rm", "-r", "--cached", "--quiet", "--", *left)
    exclude = _exclude_file(repo)
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.is_file() else ""
    lines = [SLIM_NOTE, *(f"/{path}" for path in left), SLIM_END]
    exclude.write_text(text + ("" if not text or text.endswith("\n") else "\n") + "".join(f"{line}\n" for line in lines))


def unslim(repo: Path) -> None:
    """Undo ``slim``: the checkpoints back in the index (as HEAD has them) and no longer ignored."""
    if not is_slim(repo):
        return
    exclude = _exclude_file(repo)
    lines = exclude.read_text().splitlines()
    start, end = lines.index(SLIM_NOTE), lines.index(SLIM_END)
    exclude.write_text("".join(f"{line}\n" for line in lines[:start] + lines[end + 1:]))
    _git(repo, "reset", "--quiet", "--", SLIM)
