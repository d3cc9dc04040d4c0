"""The commands the README and docs/ give a reader still work as written: every `jrl bench`
line (the reproduce lines of docs/performance.md above all) names a stage that exists and
only flags that stage takes, and every `python -m jrl.train` line resolves to a valid run
config (its overrides name real fields with valid values). A renamed or dropped flag or
field fails here, not in a reader's terminal. The README's Python example and
docs/rollout.md's two examples (the quick start; generating from a trained run) run as written,
and docs/checkpoints.md's plain-Orbax reader does, in a process without jrl.
The references between the docs resolve: every relative link reaches a file (and its
anchor a heading), every section a doc points to (`docs/rl.md, "LoRA"`) is a heading of
that file, and every repository path named in backticks exists."""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from jrl import checkpoint, hf
from jrl.bench import STAGES, UNAVAILABLE
from jrl.bench.cli import stage_parser
from jrl.launch import build_parser, main, resolve_config
from jrl.rl.eval_cli import build_parser as eval_parser
from jrl.serve.cli import build_parser as serve_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCH = re.compile(r"(?:jrl bench|python -m jrl\.bench)\s+(.*)")
TRAIN = re.compile(r"(?:python -m jrl\.train|jrl train)(?=\s|$)(.*)")


def commands(text: str, command: re.Pattern) -> list[str]:
    """The argument text after each match of `command` in code blocks (continuation lines
    joined) and in inline code spans, cut at a comment, a pipe, the next shell command or
    a closing backtick."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "──>" not in line:  # a diagram, not a command
                found += [m.group(1) for m in command.finditer(line)]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        found += [m.group(1) for m in command.finditer(span)]
    return [re.split(r"\s(?:#|\||&&|;|2>&1|>)|`", f + " ")[0].strip() for f in found]


def words_of(args: str) -> list[str]:
    """The shell words of a command's arguments, optional parts in brackets included."""
    return shlex.split(args.replace("[", " ").replace("]", " "))


def flags_of(args: str) -> tuple[str, list[str]]:
    """(stage, the `--flags` it is given)."""
    words = words_of(args)
    return words[0], [w.split("=")[0] for w in words[1:] if w.startswith("--")]


def python_examples(doc: str) -> list[str]:
    """The ```python blocks of `doc` (a path below the repository root), in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)


def run_example(code: str, doc: str) -> dict:
    """Runs a doc's example as a reader pasting it would; returns its variables."""
    scope: dict = {}
    exec(compile(code, doc, "exec"), scope)  # noqa: S102 - the doc's own example
    return scope


CASES = [(path.name, args) for path in DOCS for args in commands(path.read_text(), BENCH)]


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


# Placeholder configs of the docs' examples, read as the shipped config they stand for.
PLACEHOLDERS = {"my.yaml": "configs/sft_arithmetic.yaml", "configs/X.yaml": "configs/sft_arithmetic.yaml",
                "my_task.yaml": "configs/grpo_jsonl_example.yaml"}


TRAIN_CASES = [(path.name, args) for path in DOCS for args in commands(path.read_text(), TRAIN)
               if "/models/" not in args]  # a model on the reader's disk: not here


def test_the_docs_give_train_commands_to_check():
    assert len(TRAIN_CASES) >= 15, TRAIN_CASES


@pytest.mark.parametrize("doc,args", TRAIN_CASES, ids=[f"{d}:{a[:50]}" for d, a in TRAIN_CASES])
def test_a_documented_train_command_resolves_to_a_valid_config(doc, args, monkeypatch):
    monkeypatch.chdir(ROOT)
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(args)]
    resolve_config(build_parser().parse_args(words))  # raises ConfigError naming the field


PARSERS = {"serve": serve_parser, "eval": eval_parser}
CLI_CASES = [(path.name, name, args) for path in DOCS for name in PARSERS
             for args in commands(path.read_text(), re.compile(rf"jrl {name}(?=\s|$)(.*)"))
             if args]  # a bare `jrl eval` names the command; it is not one to run


def test_the_docs_give_serve_and_eval_commands_to_check():
    assert {name for _, name, _ in CLI_CASES} == set(PARSERS)


@pytest.mark.parametrize("doc,name,args", CLI_CASES, ids=[f"{d}:{n} {a[:40]}" for d, n, a in CLI_CASES])
def test_a_documented_serve_or_eval_command_parses(doc, name, args, capsys):
    try:
        PARSERS[name]().parse_args(words_of(args))
    except SystemExit as e:  # argparse's exit on a flag or value it does not take
        pytest.fail(f"{doc}: `jrl {name} {args}`: {capsys.readouterr().err.strip().splitlines()[-1]} ({e})")


def test_the_readme_python_example_runs_as_written():
    (example,) = python_examples("README.md")
    scope = run_example(example, "README.md")
    assert scope["logits"].shape == (2, 12, scope["config"].vocab_size)


def test_the_rollout_quick_start_runs_as_written():
    scope = run_example(python_examples("docs/rollout.md")[0], "docs/rollout.md")
    assert scope["ack"].version == 1 and len(scope["outs"]) == 2


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A directory holding `runs/default`, one step of the default SFT config."""
    root = tmp_path_factory.mktemp("trained")
    assert main(["--config", str(ROOT / "configs" / "sft_arithmetic.yaml"), "steps=1", "--output-dir",
                 str(root / "runs" / "default"), "logging.progress=false", "logging.plot=false"]) == 0
    return root


# a few steps of a real config under its long warmup
@pytest.mark.filterwarnings("ignore:schedule.warmup_steps=.* is not shorter than the schedule:UserWarning")
def test_the_rollout_example_from_a_trained_run_runs_as_written(trained_run, monkeypatch):
    example = python_examples("docs/rollout.md")[1]
    assert "runs/default" in example
    monkeypatch.chdir(trained_run)
    scope = run_example(example, "docs/rollout.md")
    assert len(scope["outs"][0].tokens) >= 1


def test_the_hf_export_of_a_trained_run_runs_as_written_and_loads_back(trained_run, monkeypatch):
    example = python_examples("docs/hf.md")[1]
    assert "runs/default" in example
    monkeypatch.chdir(trained_run)
    scope = run_example(example, "docs/hf.md")
    config, params = hf.load_pretrained(str(trained_run / "out" / "default-hf"))
    assert config.hidden_size == scope["config"].model.hidden_size
    np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"]),
                                  np.asarray(scope["state"]["params"]["embed"]["embedding"]))


# The plain-Orbax reader of docs/checkpoints.md, run as a user without jrl would: jrl made
# unimportable, its variables' leaves written to an npz by their key paths.
PLAIN_ORBAX_READER = """
import sys
sys.modules["jrl"] = None  # `import jrl` raises: the example must do without it
import jax, numpy as np
scope = {}
exec(compile(sys.argv[1], "docs/checkpoints.md", "exec"), scope)
assert not [m for m in sys.modules if m.startswith("jrl.")]
leaves = jax.tree_util.tree_leaves_with_path(scope["state"])
np.savez(sys.argv[2], **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
print(len(jax.devices()), "device(s)")
"""


def test_the_plain_orbax_example_reads_a_multi_device_runs_checkpoint_on_one_device(tmp_path):
    """docs/checkpoints.md, "Reading a payload with plain Orbax": the example, run without jrl
    in a one-device process on the checkpoint of a `python -m jrl.train` run on 4 devices
    (`parallel: {data: 2, fsdp: 2}`), gives what `jrl.checkpoint.load` gives, bit for bit."""
    (example,) = [b for b in python_examples("docs/checkpoints.md") if "orbax" in b]
    assert "jrl" not in example and "runs/x/checkpoints/step_1200/state" in example
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    tiny = ["model.hidden_size=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8",
            "model.intermediate_size=32", "data.source=bundled:arithmetic:100", "data.seq_len=32",
            "data.batch_size=4", "data.micro_batches=1", "schedule.warmup_steps=0", "steps=1", "eval.every=0",
            "checkpoint.interval=1", "logging.progress=false", "logging.plot=false", "parallel={data: 2, fsdp: 2}"]
    made = subprocess.run([sys.executable, "-m", "jrl.train", "--config", str(ROOT / "configs" / "sft_arithmetic.yaml"),
                           "--output-dir", str(tmp_path / "runs" / "x"), *tiny],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    env["XLA_FLAGS"] = flags  # the reader has one device: the four the arrays were saved from are not there
    read = subprocess.run([sys.executable, "-c", PLAIN_ORBAX_READER, example.replace("step_1200", "step_1"),
                           str(tmp_path / "plain.npz")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    assert read.stdout.split()[0] == "1"

    state, meta = checkpoint.load(tmp_path / "runs" / "x" / "checkpoints", 1, verify=True)
    assert meta["encoded_leaves"] == [{"path": ["rng"], "as": "rng_key_data", "impl": "threefry2x32"}]
    state["rng"] = jax.random.key_data(state["rng"])  # the payload holds the key's data
    ours = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)}
    with np.load(tmp_path / "plain.npz") as plain:
        assert sorted(plain.files) == sorted(ours)
        for name, array in ours.items():
            assert (plain[name].dtype, plain[name].shape) == (array.dtype, array.shape), name
            assert plain[name].tobytes() == array.tobytes(), name
    assert "['params']['embed']['embedding']" in ours and "['opt_state']['inner_states']['hidden']" in " ".join(ours)


def test_the_cross_mesh_load_of_a_runs_checkpoint_fits_an_fp8_run(tmp_path, monkeypatch):
    """docs/parallel.md, "Checkpoints across meshes": the target built from the run's config
    fits the checkpoint of a run with fp8 delayed scaling (its state holds `fp8_history`)."""
    (example,) = [b for b in python_examples("docs/parallel.md") if "load_train_config" in b]
    tiny = ["model.hidden_size=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8",
            "model.intermediate_size=32", "data.source=bundled:arithmetic:100", "data.seq_len=32",
            "data.batch_size=4", "data.micro_batches=1", "schedule.warmup_steps=0", "steps=1", "eval.every=0",
            "checkpoint.interval=1", "logging.progress=false", "logging.plot=false", "model.dtype=bfloat16",
            "model.matmul_dtype=float8"]
    assert main(["--config", str(ROOT / "configs" / "sft_arithmetic.yaml"), "--output-dir",
                 str(tmp_path / "runs" / "x"), *tiny]) == 0
    monkeypatch.chdir(tmp_path)
    from jrl.parallel import ParallelConfig, make_mesh
    scope = {"mesh": make_mesh(ParallelConfig(data=1, fsdp=1, tensor=1))}  # the doc's "mesh" of one device
    exec(compile(example, "docs/parallel.md", "exec"), scope)  # noqa: S102 - the doc's own example
    stored, _ = checkpoint.load(tmp_path / "runs" / "x" / "checkpoints")
    state = scope["state"]
    for ours, theirs in ((state.params, stored["params"]), (state.fp8_history, stored["fp8_history"])):
        assert jax.tree.structure(ours) == jax.tree.structure(theirs)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_the_pretraining_config_of_the_training_doc_reads_a_corpus_as_written(tmp_path, monkeypatch):
    from jrl.launch import check_data

    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "training.md").read_text(), re.S)
                if b.startswith("# my_pretrain.yaml")]
    (tmp_path / "my_pretrain.yaml").write_text(block)
    (tmp_path / "corpus" / "books").mkdir(parents=True)
    for i in range(3):
        (tmp_path / "corpus" / "books" / f"book{i}.txt").write_text("A long book. " * 200)
    for shard in ("00", "01"):
        (tmp_path / "corpus" / f"web-{shard}.jsonl").write_text('{"text": "a short web page"}\n' * 100)
    monkeypatch.chdir(tmp_path)
    config = resolve_config(build_parser().parse_args(["--config", "my_pretrain.yaml"]))
    data, _ = check_data(config)
    assert data.startswith("train ") and "(5 files: [corpus/books/*.txt, corpus/web-*.jsonl])" in data


# --- Markdown code fences --------------------------------------------------------------

def unclosed_fences(text: str) -> list[str]:
    """Lines that open a code block inside an open one: a closing fence is ``` alone, so
    "``` Tested on 8 ..." runs the block on over the prose and headings after it."""
    found, open_at = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("```"):
            continue
        if open_at is None:
            open_at = number
        elif line.strip() == "```":
            open_at = None
        else:
            found.append(f"line {number}: {line.strip()!r} inside the block opened at line {open_at}")
    return found + ([f"line {open_at}: the block opened here is never closed"] if open_at else [])


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_code_block_closes_with_a_fence_of_its_own(doc):
    assert unclosed_fences(doc.read_text()) == [], doc.name


# --- references between the docs: links, anchors, named sections, named files ---------

def headings(path: pathlib.Path) -> list[str]:
    """The Markdown headings of `path` (code blocks left out: a `# comment` there is none)
    and its bold paragraph labels (`**Which log-probs anchor the ratio.**`), backticks off."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    found = [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]
    found += [label.rstrip(".:") for label in re.findall(r"^\*\*([^*\n]+)\*\*", text, re.M)]
    return [h.replace("`", "") for h in found]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def doc_file(name: str, doc: pathlib.Path) -> pathlib.Path:
    """The file a doc's `name` (`rl.md`, `docs/rl.md`, `../bench/x.md`) stands for."""
    for base in (doc.parent, ROOT, ROOT / "docs"):
        if (base / name).exists():
            return base / name
    return doc.parent / name


LINKS = [(path, target) for path in DOCS for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text())
         if not re.match(r"[a-z]+:", target)]  # a URL: not a file here


@pytest.mark.parametrize("doc,target", LINKS, ids=[f"{d.name}:{t}" for d, t in LINKS])
def test_a_relative_link_reaches_a_file_and_its_anchor_a_heading(doc, target):
    name, _, anchor = target.partition("#")
    path = (doc.parent / name) if name else doc
    assert path.exists(), f"{doc.name}: link to {target}: no file {path.relative_to(ROOT)}"
    if anchor:
        anchors = [slug(h) for h in headings(path)]
        assert anchor in anchors, f"{doc.name}: link to {target}: no such heading in {path.name}"


# `docs/rl.md, "LoRA"`, `rollout.md "fp8 weights"`, `(section "Exact log-probs")`: a
# heading (or its first words) of the file named, or of the doc itself after `section`
SECTION = re.compile(r"(?:([\w./-]+\.md)`?,?\s*\(?|section\s+)[\"“]([^\"”]{1,120})[\"”]")
PROSE = {path: re.sub(r"```.*?```", "", path.read_text(), flags=re.S) for path in DOCS}
SECTIONS = [(path, m.group(1) or "", " ".join(m.group(2).split()))
            for path, text in PROSE.items() for m in SECTION.finditer(text)
            if "git show" not in text[m.end():m.end() + 30]]  # a section of an older revision


def test_the_docs_name_sections_to_check():
    assert len(SECTIONS) >= 40, SECTIONS
    assert any(d.name == "README.md" and s == "Multi-turn environments and tools" for d, _, s in SECTIONS)


@pytest.mark.parametrize("doc,name,section", SECTIONS, ids=[f"{d.name}:{n} {s[:40]}" for d, n, s in SECTIONS])
def test_a_section_the_docs_point_to_is_there(doc, name, section):
    path = doc_file(name, doc) if name else doc
    assert path.exists(), f"{doc.name}: {name}, \"{section}\": no file {name}"
    wanted = section.replace("`", "")
    assert any(h.startswith(wanted) for h in headings(path)), \
        f"{doc.name}: {name or 'section'} \"{section}\": no heading of {path.name} starts so"


# repository paths in backticks (`docs/rl.md`, `configs/x.yaml`, `jrl/rl/`), placeholders
# (`<name>`, globs, `X`) and the files a doc names as gone (`... (now `jrl bench ...`)`) aside
PATH = re.compile(r"`((?:docs|configs|jrl|scripts|tests|bench|pallas_kernels)/[\w./-]*)[`\s]")
PATHS = sorted({(path, m.group(1)) for path in DOCS for m in PATH.finditer(path.read_text())
                if "(now" not in path.read_text()[m.end():m.end() + 120] and "/X." not in m.group(1)},
               key=lambda c: (c[0].name, c[1]))


def test_the_docs_name_paths_to_check():
    names = {p for d, p in PATHS if d.name == "README.md"}
    assert {"jrl/config.py", "jrl/rl/", "configs/grpo_addition.yaml", "tests/conftest.py"} <= names, names


@pytest.mark.parametrize("doc,name", PATHS, ids=[f"{d.name}:{p}" for d, p in PATHS])
def test_a_path_the_docs_name_exists(doc, name):
    assert (ROOT / name).exists() or (doc.parent / name).exists(), f"{doc.name}: `{name}` does not exist"
