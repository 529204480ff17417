"""Every command docs/RESULTS.md names still parses against today's configs and parsers, without
running it or loading a model: specdec-run and specdec-train overrides compose against configs/
(experiments.cli.check_overrides, what the commands check before they load anything), the arguments
of specdec-bench, -analyze and -export pass their argparse parsers (and specdec-bench's overrides
compose as specdec-run's), and every `python -m MODULE` (or `torchrun ... -m MODULE`) names a module
that exists; pytest's test files must exist too.

Where commands are found: code blocks (fenced, or indented by 4+ spaces after a blank line; a line
ending in a backslash continues) and code spans. A command starts at a program's name, after an
optional path such as .venv/bin/, and ends at the end of its block line or span, a `#` comment or a
shell operator (|, ;, &&, a parenthesis, a redirection). What the doc leaves to the reader is given
one concrete value: PLACEHOLDERS below, `$(seq A B)`, and shell variables, which must be assigned in
the doc or in scripts/figures.sh (the doc names it as where they are spelled out).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from experiments import analyze, bench, export
from experiments.cli import CommandLineError, check_overrides
from experiments.run.schema import CONFIG_DIR as RUN_CONFIG_DIR
from experiments.train.command import CONFIG_DIR as TRAIN_CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "RESULTS.md"
FIGURES = ROOT / "scripts" / "figures.sh"

START = re.compile(  # a program's name at a word's start, after an optional path
    r"(?<![\w/.-])(?:[\w.-]*/)*"
    r"(?P<program>specdec-(?:run|train|bench|analyze|export)(?![\w-])|python3?(?= -m )|torchrun(?= ))"
)
OPERATORS = set(";&|()<>")
ASSIGNMENT = re.compile(r"^\s*([A-Z][A-Z0-9_]*)='([^']*)'\s*$", re.MULTILINE)
VARIABLE = re.compile(r"\$\{?([A-Z][A-Z0-9_]*)\}?")
SEQ = re.compile(r"\$\(seq (\d+) (\d+)\)")
REDIRECTION = re.compile(r"\s\d*>&\d+")

# A value the doc leaves to the reader, and the one it is checked with.
PLACEHOLDERS = {
    "<run dir>": "RUN_DIR",  # specdec-analyze outputs/results/<run dir>
    "sampling.temperature=T ": "sampling.temperature=1.0 ",  # study (b): one run per temperature
    "drafter_quant=SCHEME ": "drafter_quant=int8 ",  # study (e): one run per scheme
    "workload.min_chars=LOW ": "workload.min_chars=1000 ",  # study (c): one run per length band
    "workload.max_chars=HIGH ": "workload.max_chars=2000 ",
}
# Commands the doc runs in a checkout of an older commit, as its text says beside them, whose code
# is gone today (git show COMMIT:PATH brings it back): a command whose text holds the key. Each must
# still be in the doc and still fail today (test_older_checkouts_are_still_needed).
OLDER_CHECKOUTS = {
    "experiments.first_side_cost": "74e041a",  # the probe, deleted after that commit
    "experiments.bench_prefill": "74e041a",
    "--variants both padded-rows": "61e6e83",  # the variant, reverted after that commit
    "train.base_weight_start": "8c179b3",  # the miniature Domino's training recipe, removed in bcd76ab
    "drafter=domino_mini": "1111c9b",  # the miniature Domino drafter, removed after that commit
}
# `python -m` of an entry point's module is that entry point
ENTRY_MODULES = {
    "experiments.run": "specdec-run",
    "experiments.train": "specdec-train",
    "experiments.bench": "specdec-bench",
    "experiments.analyze": "specdec-analyze",
    "experiments.export": "specdec-export",
}


@dataclass(frozen=True)
class Command:
    line: int  # where it starts in the doc, 1-based
    program: str  # specdec-run ... or python -m
    argv: tuple[str, ...]  # after the program's name, placeholders and variables filled in
    text: str  # as the doc writes it

    def __str__(self) -> str:
        return f"RESULTS.md line {self.line}: {self.text}"


def chunks(markdown: str) -> list[tuple[int, str]]:
    """(line, text) of every code block line (continuations joined) and every code span."""
    lines = markdown.splitlines()
    found, prose, fenced, previous_blank, previous_code = [], [], False, True, False
    index = 0
    while index < len(lines):
        line, number = lines[index], index + 1
        index += 1
        if line.lstrip().startswith("```"):
            fenced, previous_code = not fenced, True
            prose.append((number, ""))
            continue
        indented = line.startswith("    ") and line.strip() and (previous_blank or previous_code)
        if fenced or indented:
            text = line.strip()
            while text.endswith("\\") and index < len(lines):
                text, index = text[:-1] + " " + lines[index].strip(), index + 1
            found.append((number, text))
            prose.append((number, ""))
            previous_code, previous_blank = True, False
            continue
        previous_code, previous_blank = False, not line.strip()
        prose.append((number, line))
    paragraph: list[tuple[int, str]] = []
    for number, line in [*prose, (len(lines) + 1, "")]:
        if line.strip():
            paragraph.append((number, line))
            continue
        text = "\n".join(part for _, part in paragraph)
        for span in re.finditer(r"`([^`]+)`", text):
            first = paragraph[0][0] + text.count("\n", 0, span.start())
            found.append((first, " ".join(span.group(1).split())))
        paragraph = []
    return found


def variables(*sources: str) -> dict[str, str]:
    """Shell variables assigned in single quotes (NG='{name: ngram, ...}'), the first assignment winning."""
    assigned: dict[str, str] = {}
    for source in sources:
        for name, value in ASSIGNMENT.findall(source):
            assigned.setdefault(name, value)
    return assigned


def fill(text: str, assigned: dict[str, str]) -> str:
    """The command with placeholders, $(seq A B) and shell variables filled in; ValueError names an
    unassigned variable."""
    text = REDIRECTION.sub(" ", text + " ")
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    text = SEQ.sub(lambda m: " ".join(str(i) for i in range(int(m[1]), int(m[2]) + 1)), text)
    unknown = sorted({name for name in VARIABLE.findall(text) if name not in assigned})
    if unknown:
        raise ValueError(f"${unknown[0]} is assigned neither in {DOC.name} nor in {FIGURES.name}")
    return VARIABLE.sub(lambda m: assigned[m[1]], text)


def words(text: str) -> list[str]:
    """Shell words up to the first operator or comment."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="".join(sorted(OPERATORS)))
    lexer.whitespace_split = True
    lexer.commenters = "#"
    found = []
    for word in lexer:
        if set(word) <= OPERATORS:
            break
        found.append(word)
    return found


def commands(markdown: str, assigned: dict[str, str]) -> list[Command]:
    found = []
    for line, chunk in chunks(markdown):
        starts = list(START.finditer(chunk))
        ends = [following.start() for following in starts[1:]] + [len(chunk)]
        for start, end in zip(starts, ends):
            program = "python -m" if start["program"].startswith("python") else start["program"]
            try:
                argv = tuple(words(fill(chunk[start.end():end], assigned)))
            except ValueError as error:  # an unassigned variable, an unclosed quote
                argv = ("!", str(error))
            found.append(Command(line, program, argv, chunk[start.start():end].strip()))
    return found


class Parsed(BaseException):
    """Raised right after a parser accepts its arguments, so that an entry point stops before it works
    (a BaseException, so that the entry points' handlers of bad input let it through)."""

    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def parsed_arguments(main, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The namespace an argparse entry point's parser makes of argv; SystemExit where it refuses them."""
    with monkeypatch.context() as patch:
        for method in ("parse_args", "parse_intermixed_args"):
            original = getattr(argparse.ArgumentParser, method)

            def stop(self, *args, _original=original, **kwargs):
                raise Parsed(_original(self, *args, **kwargs))

            patch.setattr(argparse.ArgumentParser, method, stop)
        try:
            main(argv)
        except Parsed as parsed:
            return parsed.namespace
    raise AssertionError("the entry point returned without parsing its arguments")


def module_problem(argv: list[str], monkeypatch) -> str | None:
    if "-m" not in argv[:-1]:
        return "names no module after -m"
    module, rest = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2:]
    if module in ENTRY_MODULES:
        return problem(ENTRY_MODULES[module], rest, monkeypatch)
    if module == "pytest":
        missing = [arg for arg in rest if arg.startswith("tests/") and not (ROOT / arg.split("::")[0]).exists()]
        return f"no test file {missing[0]}" if missing else None
    monkeypatch.syspath_prepend(str(ROOT))  # python -m runs from the repository root
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            module = f"{module}.__main__"
            spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return f"no module {module}"
    # a probe runs as it is imported (scripts/probes/: loads a model, times it): only a module with a
    # main() has a parser to check, and only such a module is imported
    source = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in source.body):
        return None
    main = getattr(importlib.import_module(module), "main", None)
    return parser_problem(main, rest, monkeypatch) if callable(main) else None


def parser_problem(main, argv: list[str], monkeypatch) -> str | None:
    """What an argparse entry point's parser says of argv, or None; then specdec-run's overrides among
    them (specdec-bench's) must compose."""
    with contextlib.redirect_stderr(io.StringIO()) as errors:
        try:
            namespace = parsed_arguments(main, argv, monkeypatch)
        except SystemExit:
            return errors.getvalue().strip() or "its parser refused the arguments"
    check_overrides(list(getattr(namespace, "overrides", [])), RUN_CONFIG_DIR, "config")
    return None


def problem(program: str, argv: list[str], monkeypatch) -> str | None:
    """Why the command no longer parses, or None."""
    if argv[:1] == ["!"]:
        return argv[1]
    try:
        if program == "specdec-run":
            check_overrides(argv, RUN_CONFIG_DIR, "config")
        elif program == "specdec-train":
            check_overrides(argv, TRAIN_CONFIG_DIR, "train")
        elif program in ("python -m", "torchrun"):
            return module_problem(argv, monkeypatch)
        else:
            mains = {"specdec-bench": bench.main, "specdec-analyze": analyze.main, "specdec-export": export.main}
            return parser_problem(mains[program], argv, monkeypatch)
    except CommandLineError as error:
        return str(error)
    return None


DOC_TEXT = DOC.read_text()
DOC_COMMANDS = commands(DOC_TEXT, variables(DOC_TEXT, FIGURES.read_text()))


def test_the_doc_names_commands_of_every_kind():
    """The extraction finds the doc's commands (an extraction that found none would pass everything)."""
    programs = {command.program for command in DOC_COMMANDS}
    assert {"specdec-run", "specdec-train", "specdec-bench", "specdec-analyze", "python -m"} <= programs
    assert len(DOC_COMMANDS) > 50


def older_checkout(command: Command) -> str | None:
    return next((commit for key, commit in OLDER_CHECKOUTS.items() if key in command.text), None)


def checked_today() -> list[Command]:
    """The doc's commands but those of OLDER_CHECKOUTS, each once (where it first appears)."""
    first: dict[tuple, Command] = {}
    for command in DOC_COMMANDS:
        if not older_checkout(command):
            first.setdefault((command.program, command.argv), command)
    return list(first.values())


# every command of the doc, one test each: integration's (CI runs it); the fast tier keeps the checker's own tests
@pytest.mark.integration
@pytest.mark.parametrize("command", checked_today(), ids=lambda c: f"L{c.line}-{c.program.replace(' ', '')}")
def test_command_still_parses(command, monkeypatch):
    found = problem(command.program, list(command.argv), monkeypatch)
    assert found is None, f"{command}\n-> {found}"


def test_older_checkouts_are_still_needed(monkeypatch):
    """Each exception names commands the doc still holds, with its commit, that fail today; else remove it."""
    for key, commit in OLDER_CHECKOUTS.items():
        matched = [command for command in DOC_COMMANDS if key in command.text]
        assert matched, f"no command in {DOC.name} holds {key!r}: remove it from OLDER_CHECKOUTS"
        assert commit in DOC_TEXT, f"{DOC.name} no longer names {commit}, where {key!r} ran"
        for command in matched:
            assert problem(command.program, list(command.argv), monkeypatch), (
                f"{command} parses today: remove {key!r} from OLDER_CHECKOUTS")


BROKEN = """
Prose with a span `specdec-run drafter=no_such_drafter` and good ones, `specdec-run max_new_tokens=8`
and one across a line break, `specdec-run
max_new_tokens=9`.

```sh
specdec-run drafter=ngram \\
  max_new_tokens=10  # a comment
```

    .venv/bin/specdec-train loop.no_such_key=3
    specdec-bench --no-such-flag
    specdec-bench studies --out x no_such_key=1
    specdec-analyze
    specdec-export a b --engine no_such_engine
    python -m experiments.no_such_probe --x 1
    .venv/bin/python -m benchmarks.bench_target --no-such-flag 2>&1 | tail -1
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_no_such_file.py -q
    specdec-run "rivals=[$UNASSIGNED]"
"""


def test_broken_commands_are_reported(monkeypatch):
    """The negative control: every broken command of a small document is found and refused, the
    good one passes."""
    verdicts = {" ".join(command.argv): problem(command.program, list(command.argv), monkeypatch)
                for command in commands(BROKEN, {})}
    for good in ("max_new_tokens=8", "max_new_tokens=9", "drafter=ngram max_new_tokens=10"):
        assert verdicts.pop(good) is None
    assert len(verdicts) == 10 and all(verdicts.values()), verdicts
