"""Long prompts that ship with Python itself, for workload=long_context: passages of the language
reference to summarize and standard-library modules to explain, so no download is needed."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from pydoc_data.topics import topics

from experiments.common.prompt_sets import Prompt
from specdec.assets import take_first

# tests, tools, and codec tables (dense in tokens: one table can fill a small model's whole window)
LONG_CONTEXT_EXCLUDED = {
    "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__", "encodings",
}
LONG_PROSE_TASK = "Summarize the passage above: what it defines and the rules it states."
LONG_CODE_TASK = "Explain what this Python module does, then describe its main classes and functions."


def load_long_context(num_prompts: int | None = None, min_chars: int = 9000, max_chars: int = 16000) -> list[Prompt]:
    """Long prompts that ship with Python itself, so they need no download: passages of the language
    reference (``pydoc_data.topics``) to summarize (category "summarize") and standard-library modules
    to explain (category "code"), alternating, each document between min_chars and max_chars.
    Modules are the hand-written ones: tests, tools, codecs and generated tables are left out.

    A reference topic longer than max_chars is cut at paragraph ends into passages; modules come in
    path order, tests and tools left out. The text is the running interpreter's, so the prompts change
    with the Python version (results.json records it).
    """
    if not 0 < min_chars <= max_chars:
        raise ValueError(f"long-context documents need 0 < min_chars <= max_chars; got {min_chars} and {max_chars}")
    prose = []
    for name in sorted(topics):
        for number, passage in enumerate(_passages(topics[name], max_chars)):
            if min_chars <= len(passage) <= max_chars:
                prose.append(Prompt(f"{passage}\n\n{LONG_PROSE_TASK}", "summarize", f"long-reference-{name}-{number}", True))
    root = Path(sysconfig.get_paths()["stdlib"])
    code = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if LONG_CONTEXT_EXCLUDED & set(relative.parts[:-1]):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        generated = "generated" in source[:300].lower()  # machine-made tables, not code a user asks about
        if min_chars <= len(source) <= max_chars and not generated:
            code.append(Prompt(f"```python\n{source}\n```\n\n{LONG_CODE_TASK}", "code", f"long-code-{relative.as_posix()}", True))
    mixed = [prompt for pair in zip(prose, code) for prompt in pair]
    mixed += prose[len(mixed) // 2 :] + code[len(mixed) // 2 :]
    return take_first(mixed, num_prompts, f"long-context prompts of {min_chars}-{max_chars} characters")


def _passages(text: str, max_chars: int) -> list[str]:
    """`text` cut at paragraph ends into pieces of at most max_chars (a longer paragraph is its own piece)."""
    pieces, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + 2 + len(paragraph) > max_chars:
            pieces.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    return pieces + [current] if current else pieces
