"""Every specdec-run example in the README and docs/usage.md runs (1 prompt, 4 tokens) on the
bundled model: a changed default once left an example drafting a tree that its verifier refuses.
The README's Python example runs as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from test_run_cli import run_in_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = (README, ROOT / "docs" / "usage.md")
# examples that need what a fresh machine lacks (a local model folder, a head folder of the user's or
# of a training run)
# or a launcher (sweeps)
NEEDS_MORE = ("target.path=/models", "checkpoint=DIR", "/RUN/", " -m ")


def examples() -> list[str]:
    lines = [line for doc in DOCS
             for line in re.findall(r"^    \.venv/bin/specdec-run(.*)$", doc.read_text(), flags=re.MULTILINE)]
    runnable = [line.split("#")[0].strip() for line in lines if not any(skip in line for skip in NEEDS_MORE)]
    return list(dict.fromkeys(runnable))  # the README's few examples recur in the full list


@pytest.mark.parametrize("example", examples())
def test_readme_example_runs(example, tmp_path):
    prompts = tmp_path / "my_prompts.jsonl"
    prompts.write_text('{"prompt": "Name three colours."}\n')
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(f'{{"question_id": {i}, "category": "{c}", "turns": ["Name three colours."]}}\n'
                                 for i, c in enumerate(["writing", "translation", "qa"])))
    overrides = [o.replace("my_prompts.jsonl", str(prompts)).replace("question.jsonl", str(questions))
                 for o in shlex.split(example)]
    # no check against generate() (a second load of the model per example; tests/test_baseline_check.py)
    results = run_in_process(tmp_path / "run", [*overrides, "workload.num_prompts=1", "max_new_tokens=4",
                                                "logger=none", "warmup_tokens=0", "baseline_check_tokens=0"])
    assert results["tau"] >= 1


def test_the_readme_has_examples():
    assert len(examples()) >= 15


def test_the_readme_python_example_runs(capsys):
    (code,) = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)
    exec(compile(code, str(README), "exec"), {})
    tau = float(capsys.readouterr().out.split()[0])
    assert tau >= 1
