"""Every `jrl bench` command the README and docs/ give a reader (the reproduce lines of
docs/performance.md above all) names a stage that exists and only flags that stage takes:
a renamed or dropped flag fails here, not in a reader's terminal."""

from __future__ import annotations

import importlib
import pathlib
import re
import shlex

import pytest

from jrl.bench import STAGES, UNAVAILABLE
from jrl.bench.cli import stage_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:jrl bench|python -m jrl\.bench)\s+(.*)")


def bench_commands(text: str) -> list[str]:
    """The argument text after each `jrl bench` in code blocks (continuation lines joined)
    and in inline code spans, cut at a comment, a pipe, the next shell command or a closing
    backtick."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found += [m.group(1) for m in COMMAND.finditer(line)]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        found += [m.group(1) for m in COMMAND.finditer(span)]
    return [re.split(r"\s(?:#|\||&&|;|2>&1|>)|`", f + " ")[0].strip() for f in found]


def flags_of(args: str) -> tuple[str, list[str]]:
    """(stage, the `--flags` it is given), optional parts in brackets included."""
    words = shlex.split(args.replace("[", " ").replace("]", " "))
    return words[0], [w.split("=")[0] for w in words[1:] if w.startswith("--")]


CASES = [(path.name, args) for path in DOCS for args in bench_commands(path.read_text())]


def test_the_docs_give_bench_commands_to_check():
    assert len(CASES) >= 50, CASES  # the extraction still finds the reproduce lines
    assert {"decode", "train", "kernels", "grpo", "generate"} <= {flags_of(a)[0] for _, a in CASES}


@pytest.mark.parametrize("doc,args", CASES, ids=[f"{d}:{a[:50]}" for d, a in CASES])
def test_a_documented_bench_command_uses_a_real_stage_and_its_flags(doc, args):
    stage, flags = flags_of(args)
    if stage.startswith("{"):  # a usage line lists the stages: all of them
        assert set(stage.strip("{}").split(",")) == set(STAGES), f"{doc}: `jrl bench {args}` against {list(STAGES)}"
        return
    if stage.startswith("-") or stage in ("STAGE", "<stage>"):  # `jrl bench --help`, a placeholder
        return
    assert stage in STAGES or stage in UNAVAILABLE, f"{doc}: unknown stage {stage!r} in `jrl bench {args}`"
    if stage in UNAVAILABLE:
        return
    known = stage_parser(stage, importlib.import_module(f"jrl.bench.{stage}"))._option_string_actions
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{doc}: `jrl bench {args}` gives {stage} flags it does not take: {unknown}"
