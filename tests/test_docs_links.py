"""Links between the docs land: every relative link in README.md and docs/*.md names a file that
exists and, with a #fragment, a heading (GitHub's anchor of it) or an id in that file. NOTES.md and
history.md point at each other's sections by anchor, so a renamed heading would otherwise leave a
reader at the top of a 2,000-line file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    text = CODE.sub("", text)
    return {anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)} | set(re.findall(r'id="([^"]+)"', text))


def broken_links(doc: Path) -> list[str]:
    broken = []
    for link in LINK.findall(CODE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        target, _, fragment = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path.read_text()):
            broken.append(f"{link}: no heading with that anchor in {path.name}")
    return broken


def test_every_relative_link_in_the_docs_lands():
    broken = {doc.name: found for doc in DOCS if (found := broken_links(doc))}
    assert not broken, broken


def test_a_renamed_heading_or_a_missing_file_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Its section, renamed\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n\n## Here (1)\n\n[a](other.md#other) [b](other.md#its-section) [c](#here-1) [d](gone.md) "
                   "[e](https://example.org/x#y) `[f](in-code.md)`\n")
    assert [b.split(":")[0] for b in broken_links(doc)] == ["other.md#its-section", "gone.md"]


def test_the_notes_contents_list_every_section():
    text = (ROOT / "docs" / "NOTES.md").read_text()
    contents = text.split("\n## Contents\n")[1].split("\n## ")[0]
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    sections = [h for h in re.findall(r"^#{2,3} (.*)$", CODE.sub("", text), re.MULTILINE) if h != "Contents"]
    assert [h for h in sections if anchor(h) not in listed] == [], "add these to NOTES.md's Contents"
    assert len(listed) == len(sections), "NOTES.md's Contents lists a section twice or one that is gone"


def layout_names(readme: str) -> list[tuple[str, str]]:
    """(package, name) for every file or folder README's Layout bullets name in backticks: a
    bullet's names live under the folder it opens with, or are paths from the repository root."""
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    found = []
    for bullet in re.split(r"\n(?=- `)", section.split("\n\nWhere new things go", 1)[0]):
        opening = re.match(r"- `([\w/]+/)`", bullet)
        if opening is None:
            continue
        for name in re.findall(r"`([\w./]+(?:\.py|\.sh|/))`", bullet):
            found.append((opening.group(1), name))
    return found


def missing_from_layout(readme: str) -> list[str]:
    missing = []
    for package, name in layout_names(readme):
        plain = name.rstrip("/")
        if (ROOT / plain).exists() or (ROOT / package / plain).exists():
            continue
        if not any(path.relative_to(ROOT / package).as_posix().endswith(plain) for path in (ROOT / package).rglob(Path(plain).name)):
            missing.append(f"{package} {name}")
    return missing


def test_every_file_the_readme_layout_names_exists():
    readme = (ROOT / "README.md").read_text()
    assert len(layout_names(readme)) >= 40
    assert missing_from_layout(readme) == []
    stale = readme.replace("`target_loader.py`", "`targets.py`", 1)  # the control: a renamed module
    assert missing_from_layout(stale) == ["specdec/ targets.py"]
