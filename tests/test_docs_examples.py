"""The commands the README and docs/ give a reader still work as written: every `jrl bench`
line (the reproduce lines of docs/performance.md above all) names a stage that exists and
only flags that stage takes, and every `python -m jrl.train` line resolves to a valid run
config (its overrides name real fields with valid values). A renamed or dropped flag or
field fails here, not in a reader's terminal. The README's Python example and
docs/rollout.md's two examples (the quick start; generating from a trained run) run as written,
and docs/checkpoints.md's plain-Orbax reader does, in a process without jrl. So do the other
Python examples (checkpoints, Hugging Face import/export and tokenizers, the model API,
kernels, a custom strategy and callback, the Trainer API, the engine, several devices),
the names they leave to the reader filled in; every YAML section resolves in the config it
is written for; and "Bring your own task" trains and is scored as written.
The references between the docs resolve: every relative link reaches a file (and its
anchor a heading), every section a doc points to (`docs/rl.md, "LoRA"`) is a heading of
that file, and every repository path named in backticks exists."""

from __future__ import annotations

import importlib
import json
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
from jrl.train.trainer import SkippedUpdateWarning

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


def run_example_with(code: str, doc: str, **names) -> dict:
    """Runs a doc's example with `names` defined, as the reader's own code around it would."""
    scope = dict(names)
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


def test_the_serve_flag_table_lists_every_flag_jrl_serve_takes():
    """docs/serve.md's table of flags against `jrl serve`'s parser, both ways (it lacked
    `--log-level`)."""
    table = (ROOT / "docs" / "serve.md").read_text().split("## Start it", 1)[1].split("**Start-up.**", 1)[0]
    documented = {flag for row in re.findall(r"^\| ([^|]+)\|", table, re.M) for flag in re.findall(r"--[a-z-]+", row)}
    taken = {flag for flag in serve_parser()._option_string_actions if flag.startswith("--") and flag != "--help"}
    assert sorted(taken - documented) == [] and sorted(documented - taken) == []


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
    # this small corpus (202 records) fills fewer rows than a batch and holds out none at 1%: said as the run says it
    with pytest.warns(UserWarning) as caught:
        data, _ = check_data(config)
    assert data.startswith("train ") and "(5 files: [corpus/books/*.txt, corpus/web-*.jsonl])" in data
    sources = "[corpus/books/*.txt, corpus/web-*.jsonl]"
    assert [str(w.message) for w in caught] == [
        f"data: {sources} packs into 22 rows of data.seq_len=512, fewer than data.batch_size=32: every batch repeats rows",
        f"data: data.eval_fraction=0.01 holds out none of the records of {sources}, so the run evaluates nothing "
        f"(eval.every=0); raise it or give data.eval_source"]


# --- the other Python examples, run with the names they leave to the reader filled in ---

def example_with(doc: str, marker: str) -> str:
    """The one ```python block of `doc` that contains `marker`."""
    (example,) = [b for b in python_examples(doc) if marker in b]
    return example


def test_the_checkpoint_api_examples_run_as_written(tmp_path, monkeypatch):
    """docs/checkpoints.md: save / load / latest_step / all_steps, step_problem and set_aside,
    the async saver and the metrics log's resume, on a small state."""
    import jax.numpy as jnp

    import jrl.checkpoint as ckpt
    from jrl.metrics_log import MetricsLog, read_metrics

    monkeypatch.chdir(tmp_path)
    state = {"params": {"w": jnp.arange(12.0).reshape(3, 4)}, "step": 1200, "policy_version": 7,
             "rng": jax.random.key(0)}
    scope = run_example_with(example_with("docs/checkpoints.md", "ckpt.all_steps"), "docs/checkpoints.md",
                             step=1200, state=state, config_dict={"lr": 1e-3}, npz_bytes=b"npz", initial_state=state)
    meta = scope["meta"]
    assert (meta["step"], meta["policy_version"], meta["config"], meta["verification"]) == (1200, 7, {"lr": 1e-3},
                                                                                          "passed")
    assert (pathlib.Path(meta["path"]) / "source_state.npz").read_bytes() == b"npz"
    assert np.asarray(scope["state"]["params"]["w"]).tolist() == np.arange(12.0).reshape(3, 4).tolist()
    assert ckpt.latest_step("runs/x/checkpoints") == 1200 and ckpt.all_steps("runs/x/checkpoints") == [1200]

    assert ckpt.step_problem("runs/x/checkpoints", 1200) is None
    run_example_with(example_with("docs/checkpoints.md", "ckpt.set_aside"), "docs/checkpoints.md", ckpt=ckpt,
                     root="runs/x/checkpoints", step=1200)
    assert ckpt.all_steps("runs/x/checkpoints") == []
    assert [p.name.startswith(".step_1200.corrupt-") for p in pathlib.Path("runs/x/checkpoints").glob(".step_*")] == [True]

    log = MetricsLog("runs/y/metrics.jsonl")
    saver = example_with("docs/checkpoints.md", "AsyncCheckpointer").replace("for step in ...:",
                                                                           "for step in range(0, 301, 50):")
    run_example_with(saver, "docs/checkpoints.md", ckpt=ckpt, ckpt_dir="runs/y/checkpoints", state=state, batch=None,
                     train_step=lambda s, b: s, meta={"run": "y"}, log=log)
    assert ckpt.all_steps("runs/y/checkpoints") == [0, 100, 200, 300]

    run_dir = pathlib.Path("runs/z")
    ckpt.save(run_dir / "checkpoints", 4, state)
    (run_dir / "metrics.jsonl").write_text('{"step": 4}\n{"step": 5}\n')  # step 5's checkpoint never published
    run_example_with(example_with("docs/checkpoints.md", "MetricsLog"), "docs/checkpoints.md", ckpt=ckpt,
                     run_dir=run_dir, ckpt_dir=run_dir / "checkpoints", initial_state=state, version=8, loss=0.5)
    assert read_metrics(run_dir / "metrics.jsonl") == [{"step": 4}, {"step": 4, "policy_version": 8, "loss": 0.5}]


HF_FIXTURE = str(ROOT / "tests" / "fixtures" / "hf" / "qwen2")


def test_the_hf_load_and_save_example_runs_on_a_checkpoint_as_written(tmp_path, monkeypatch):
    """docs/hf.md, "Loading and saving models", on the tiny qwen2 fixture in place of the
    model directory; the export loads back to the same params."""
    example = example_with("docs/hf.md", "load_pretrained").replace("/models/Qwen2.5-0.5B-Instruct", HF_FIXTURE)
    monkeypatch.chdir(tmp_path)
    scope = run_example_with(example, "docs/hf.md", tokens=np.zeros((2, 8), np.int32))
    assert scope["logits"].shape == (2, 8, scope["config"].vocab_size)
    config, params = hf.load_pretrained("out/qwen-sft", dtype="bfloat16")
    assert config == scope["config"]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(scope["params"])):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_the_tokenizer_example_runs_as_written():
    scope = run_example(example_with("docs/hf.md", "tok.encode"), "docs/hf.md")
    assert scope["ids"] == list("héllo".encode()) and scope["text"] == "héllo"
    assert scope["prompt"] == "<bos><|user|>\nHi<eos><|assistant|>\n"  # DEFAULT_CHAT_TEMPLATE, as the doc shows it


TINY_MODEL = "vocab_size=320, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128"


def test_the_model_examples_run_as_written():
    """docs/model.md: the functional API (at a tiny size: the doc's is ~1B parameters),
    LoRA's pytree operations and the fused projections' round trip."""
    import dataclasses

    from jrl import models

    first = python_examples("docs/model.md")[0]
    sized = re.sub(r"ModelConfig\(.*?\)\n", f"ModelConfig({TINY_MODEL})\n", first, flags=re.S)
    assert sized != first
    scope = run_example(sized, "docs/model.md")
    config, params = scope["config"], scope["params"]
    assert scope["logits"].shape == (2, 16, 320) and scope["logits"].dtype == np.float32

    lora_config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, rank=4))
    lora = run_example_with(example_with("docs/model.md", "merge_lora"), "docs/model.md", config=lora_config,
                            params=models.init_params(lora_config, jax.random.key(0)))
    assert lora["base_config"].lora.rank == 0
    assert jax.tree.structure(lora["merged"]) == jax.tree.structure(models.init_params(lora["base_config"],
                                                                                     jax.random.key(0)))

    positions = np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16))
    fused = run_example_with(example_with("docs/model.md", "fuse_projections"), "docs/model.md", config=config,
                             params=params, forward=models.forward, tokens=scope["tokens"], positions=positions,
                             backend=models.dense_attention(np.ones((2, 16), np.int32)))
    assert fused["out"].hidden.shape == (2, 16, config.hidden_size)
    for a, b in zip(jax.tree.leaves(fused["params_again"]), jax.tree.leaves(params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_the_kernel_examples_run_on_the_references():
    """docs/kernels.md's three examples (bf16 buffers, fp8 buffers, a staged prefill) on
    small buffers: off Hopper the dispatch runs the references."""
    import jax.numpy as jnp

    L, S, Hkv, D, Hq = 2, 128, 2, 16, 4
    names = dict(layer=jnp.int32(1), slots=jnp.arange(8, dtype=jnp.int32), head_dim=D, s=D ** -0.5,
                 k_new=jnp.ones((8, Hkv, D), jnp.bfloat16), v_new=jnp.ones((8, Hkv, D), jnp.bfloat16),
                 cu_q_lens=jnp.array([0, 5, 8], jnp.int32), kv_lens=jnp.array([5, 3], jnp.int32),
                 page_table=jnp.array([[0, 1], [2, 3]], jnp.int32), shape=(L, S, Hkv, D),
                 k_buf=jnp.zeros((L, S, Hkv, D), jnp.bfloat16), v_buf=jnp.zeros((L, S, Hkv, D), jnp.bfloat16))
    first = python_examples("docs/kernels.md")[0]
    # the decode call's q is one token a request: [B, Hq, D] where prefill's is [T, Hq, D]
    scope = run_example_with(first.replace("out = ragged_decode(q,", "out = ragged_decode(q[:2],"), "docs/kernels.md",
                             q=jnp.ones((8, Hq, D), jnp.bfloat16), **names)
    assert scope["out"].shape == (2, Hq, D)
    fp8 = "from pallas_kernels import ragged_decode, write_kv\n" + example_with("docs/kernels.md", "quantized.zeros")
    scope = run_example_with(fp8, "docs/kernels.md", q=jnp.ones((2, Hq, D), jnp.bfloat16), **names)
    assert scope["out"].shape == (2, Hq, D) and bool(jnp.isfinite(scope["out"]).all())
    scope = run_example_with(example_with("docs/kernels.md", "stage_layout"), "docs/kernels.md",
                             q=jnp.ones((8, Hq, D), jnp.bfloat16), **names)
    assert scope["out"].shape == (8, Hq, D)


TINY_RUN = ["model.hidden_size=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8",
            "model.intermediate_size=32", "data.seq_len=16", "data.batch_size=4", "data.micro_batches=1",
            "schedule.warmup_steps=0", "eval.every=0", "logging.progress=false", "logging.plot=false"]


def test_the_strategy_protocol_and_callback_examples_train(tmp_path, monkeypatch, capsys):
    """docs/training.md, "Strategy protocol" and "Callbacks": the strategy declared as the
    doc declares it (its loss body, which the doc leaves to the reader, filled in) trains
    through a Trainer given a source, with the doc's callback printing and logging."""
    import dataclasses

    from jrl.config import load_train_config
    from jrl.train.logprobs import target_logprobs

    @dataclasses.dataclass(frozen=True)
    class MyOptions:
        scale: float = 1.0

    body = ('    lp = target_logprobs(config, params, batch["tokens"], batch["targets"], batch["positions"],\n'
            '                         batch["segment_ids"], chunk_size=ctx.chunk_size)\n'
            '    mask = batch["loss_mask"]\n'
            '    loss_sum = -(lp * mask * batch["advantages"]).sum() * ctx.options.scale\n'
            '    n_units, kl = mask.sum(), -lp\n')
    strategy = example_with("docs/training.md", "register_strategy(Strategy(")
    filled = re.sub(r"    \.\.\. .*\n", body, strategy, count=1)
    assert filled != strategy
    run_example_with(filled.replace("register_strategy(Strategy(", "register_strategy(replace=True, strategy=Strategy("),
                     "docs/training.md", MyOptions=MyOptions, target_logprobs=target_logprobs)

    class Source:
        def next_batch(self, state):
            tokens = np.random.default_rng(int(state.step)).integers(0, 200, (4, 16)).astype(np.int32)
            ones = np.ones((4, 16), np.float32)
            return dict(tokens=tokens, targets=np.roll(tokens, -1, 1), loss_mask=ones, advantages=ones,
                        positions=np.tile(np.arange(16, dtype=np.int32), (4, 1)), segment_ids=ones.astype(np.int32))

    monkeypatch.chdir(tmp_path)
    config = load_train_config(str(ROOT / "configs" / "sft_arithmetic.yaml"),
                               ["strategy={name: mine}", "steps=2", "eval.at_end=false", "output_dir=runs/mine", *TINY_RUN])
    callback = example_with("docs/training.md", "class PrintVersion(Callback)")
    run_example_with(callback.replace("Trainer(config, callbacks=[PrintVersion()])",
                                      "Trainer(config, callbacks=[PrintVersion()], train_source=Source())"),
                     "docs/training.md", config=config, Source=Source)
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()[:2]] == [["1", "1"], ["2", "2"]]
    rows = [json.loads(line) for line in open("runs/mine/metrics.jsonl")]
    assert [(r["step"], r["my_stat"], "kl" in r) for r in rows] == [(1, 1.0, True), (2, 1.0, True)]


def test_the_trainer_python_api_example_runs_as_written(tmp_path, monkeypatch):
    """docs/training.md, "Python API" (a few tiny steps; the doc's callbacks=[...] left empty)."""
    monkeypatch.chdir(ROOT)  # the example names configs/sft_arithmetic.yaml
    example = example_with("docs/training.md", "trainer.evaluate()")
    tiny = repr(["steps=2", *TINY_RUN])
    example = (example.replace('["steps=100"]', tiny).replace("callbacks=[...]", "callbacks=[]")
               .replace('"runs/x"', repr(str(tmp_path / "runs" / "x"))))
    with pytest.warns(UserWarning, match="holds no checkpoint yet; starting a fresh run"):  # the doc's resume=True
        scope = run_example(example, "docs/training.md")
    assert int(scope["state"].step) == 2 and set(scope["metrics"]) >= {"step", "policy_version", "eval_loss"}


def test_the_engine_examples_run_as_written():
    """docs/rollout.md: warmup then a generation that compiles nothing new, a tuning
    override, and an engine serving fp8 weights re-quantized on update."""
    from jrl.config import ModelConfig
    from jrl.models import init_params
    from jrl.rollout import Engine, EngineConfig, SamplingParams

    cfg = ModelConfig(vocab_size=64, hidden_size=32, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=8,
                      intermediate_size=64, max_position_embeddings=64)
    params = init_params(cfg, jax.random.key(0))
    names = dict(cfg=cfg, model_config=cfg, params=params, prompts=[[1, 2, 3], [4, 5]], Engine=Engine,
                 SamplingParams=SamplingParams, engine_config=EngineConfig(page_size=16, n_pages=64, max_batch=4))
    warm = example_with("docs/rollout.md", "engine.warmup(").replace("max_new_tokens=256", "max_new_tokens=4")
    warm = warm.replace("engine.warmup(SamplingParams(temperature=1.0))",
                        "engine.warmup(SamplingParams(temperature=1.0), progress=False)")
    scope = run_example_with(warm, "docs/rollout.md", **names)
    traces = scope["engine"].step_function.traces
    assert len(scope["outs"]) == 2 and traces >= 1
    scope["engine"].generate([[7, 8, 9, 10, 11]], SamplingParams(temperature=1.0), max_new_tokens=4)
    assert scope["engine"].step_function.traces == traces  # "compiles nothing"
    scope = run_example_with(example_with("docs/rollout.md", "TuningOverrides("), "docs/rollout.md", **names)
    assert scope["engine"].tuning.decode_steps_per_call == 1
    scope = run_example_with(example_with("docs/rollout.md", 'weight_dtype="float8_e4m3fn"'), "docs/rollout.md",
                             new_params=init_params(cfg, jax.random.key(1)), **names)
    assert scope["ack"].version == 1


# docs/parallel.md's examples in a process of 8 CPU devices: the sharded train step of its
# first example (the reader's model config and train_step filled in), the per-device memory
# of a sharded init, and a checkpoint saved from that mesh loaded onto another
PARALLEL_EXAMPLES = """
import json, sys
import jax, numpy as np
from jrl.models import apply
first, memory, across = json.loads(sys.argv[1])
def train_step(state, tokens):
    loss, grads = jax.value_and_grad(lambda p: apply(scope["config"], p, tokens).mean())(state["params"])
    return {**state, "step": state["step"] + 1}, loss
scope = {"train_step": train_step, "tokens": np.zeros((8, 16), np.int32)}
exec(compile(first, "docs/parallel.md", "exec"), scope)
assert dict(scope["mesh"].shape) == {"data": 1, "fsdp": 4, "tensor": 2}, scope["mesh"].shape
assert np.isfinite(float(scope["loss"])) and int(scope["state"]["step"]) == 1
exec(compile("from jrl.parallel import sharded_init_fn\\n" + memory, "docs/parallel.md", "exec"), scope)
assert scope["stats"].output_size_in_bytes > 0
from jrl.models import init_params
from jrl.parallel import ParallelConfig, make_mesh, param_shardings, state_shardings, with_shardings
from jrl.train.state import init_train_state
scope.update(step=3, state=init_train_state(init_params(scope["config"], jax.random.key(0)), scope["optimizer"],
                                            jax.random.key(0)), ParallelConfig=ParallelConfig, make_mesh=make_mesh,
             param_shardings=param_shardings, state_shardings=state_shardings, with_shardings=with_shardings)
saved = scope["state"]
exec(compile(across, "docs/parallel.md", "exec"), scope)
embedding = scope["state"].params["embed"]["embedding"]
assert dict(embedding.sharding.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
assert np.asarray(embedding).tobytes() == np.asarray(saved.params["embed"]["embedding"]).tobytes()
print("ok")
"""


def test_the_parallel_examples_run_on_eight_devices(tmp_path):
    examples = [python_examples("docs/parallel.md")[0], example_with("docs/parallel.md", "memory_analysis()"),
                example_with("docs/parallel.md", "ckpt.save(")]
    assert "config = ModelConfig(...)" in examples[0]
    examples[0] = examples[0].replace("ModelConfig(...)", f"ModelConfig({TINY_MODEL})")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    run = subprocess.run([sys.executable, "-c", PARALLEL_EXAMPLES, json.dumps(examples)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split()[-1] == "ok", run.stderr[-3000:]


# --- the docs' YAML sections, each in the config it is written for ---------------------

def yaml_blocks() -> list[tuple[str, int, str]]:
    return [(path.name, path.read_text()[:m.start()].count("\n") + 1, m.group(1)) for path in DOCS
            for m in re.finditer(r"```yaml\n(.*?)```", path.read_text(), re.S)]


def merged(base: dict, given: dict) -> dict:
    out = dict(base)
    for key, value in given.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


YAML_CASES = [c for c in yaml_blocks() if not c[2].startswith("# my_pretrain.yaml")]  # that one: a test above


def test_the_docs_give_yaml_sections_to_check():
    assert len(YAML_CASES) >= 15 and {d for d, _, _ in YAML_CASES} >= {"rl.md", "training.md", "parallel.md"}


@pytest.mark.parametrize("doc,line,block", YAML_CASES, ids=[f"{d}:{n}" for d, n, _ in YAML_CASES])
def test_a_documented_yaml_section_resolves_in_its_config(doc, line, block, tmp_path, monkeypatch):
    """Each YAML section of the docs, its placeholders (`...`, a model directory) filled in,
    resolves as `python -m jrl.train` resolves it: a whole config as it is, a section in a
    shipped config of its kind (GRPO options in configs/grpo_addition.yaml, others in
    configs/sft_arithmetic.yaml), with the files and modules it names made up."""
    import textwrap

    from jrl.config import yaml_dump, yaml_load

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    record = {"messages": [{"role": "user", "content": "Spell 'ycjl' backwards."}], "prompt": "ycjl>",
              "answer": "ljcy", "response": "ljcy", "word": "ycjl", "question": "q"}
    (tmp_path / "data").mkdir()
    for split in ("train", "val", "test"):
        (tmp_path / "data" / f"{split}.jsonl").write_text((json.dumps(record) + "\n") * 20)
    (tmp_path / "my_rewards.py").write_text("def reversed_word(prompt, completion, answer, example):\n    return 0.0\n")
    for package, module, source in (
            ("my_project", "rewards", "def brevity(prompt, completion, answer, limit=8):\n    return 0.0\n"),
            ("my_pkg", "tools", 'def calc(expression: str) -> str:\n    """Evaluate."""\n    return expression\n\n'
                                'def lookup(key: str) -> str:\n    """Look up."""\n    return key\n')):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / f"{module}.py").write_text(source)
    text = (textwrap.dedent(block).replace(", ...}", "}").replace("{..., ", "{").replace("{...}", "{}")
            .replace("hf:/models/Qwen2.5-0.5B-Instruct", "null").replace("/models/Qwen2.5-0.5B-Instruct", "bytes"))
    given = yaml_load(text)
    if set(given) in ({"rewards"}, {"task"}):  # a part of strategy.options
        given = {"strategy": {"name": "grpo", "options": given}}
    if "steps" in given:  # a whole config file
        config = given
    else:
        rl = given.get("strategy", {}).get("name") == "grpo"
        config = yaml_load((ROOT / "configs" / ("grpo_addition.yaml" if rl else "sft_arithmetic.yaml")).read_text())
        if "task" in given.get("strategy", {}).get("options", {}):
            config["strategy"]["options"].pop("task")  # the section's task, not a mix of the two
        config = merged(config, given)
    # a section for another model's context (1280 tokens of an 8B run) in the tiny shipped model
    config.setdefault("model", {})["max_position_embeddings"] = max(config.get("data", {}).get("seq_len", 0), 512)
    (tmp_path / "c.yaml").write_text(yaml_dump(config))
    resolve_config(build_parser().parse_args(["--config", "c.yaml"]))


def test_the_bring_your_own_task_example_trains_and_scores(tmp_path, monkeypatch):
    """docs/rl.md, "Bring your own task": the reward module and my_task.yaml as written, on
    files of the doc's records, the model directory replaced by a tiny byte-level model and
    the run shortened; then the doc's `jrl eval` command on its checkpoints."""
    from jrl.cli import main as jrl

    section = (ROOT / "docs" / "rl.md").read_text().split("## Bring your own task", 1)[1]
    reward = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    config = re.findall(r"```yaml\n(.*?)```", section, re.S)[0]
    assert reward.startswith("# my_rewards.py") and "my_rewards:reversed_word" in config
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rewards.py").write_text(reward)
    tiny = "{hidden_size: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, head_dim: 16, intermediate_size: 64}"
    (tmp_path / "my_task.yaml").write_text(
        config.replace("hf:/models/Qwen2.5-0.5B-Instruct", "null").replace("model: {...}", f"model: {tiny}")
        .replace("/models/Qwen2.5-0.5B-Instruct", "bytes").replace("seq_len: 512", "seq_len: 96"))
    (tmp_path / "data").mkdir()
    words = ["ycjl", "ngbf", "abcd", "qrst", "wxyz", "lmno", "hijk", "efgh", "pqrs", "tuvw", "bcde", "fghi"]
    for split, chosen in (("train", words[:8]), ("test", words[8:10]), ("val", words[10:])):
        (tmp_path / "data" / f"{split}.jsonl").write_text("".join(json.dumps(
            {"messages": [{"role": "user", "content": f"Spell '{w}' backwards."}], "answer": w[::-1],
             "response": w[::-1], "word": w}) + "\n" for w in chosen))
    # the shortened run: 8 demonstrations pack into fewer rows than a batch, and one GRPO step
    # of an untrained tiny model samples no group with different rewards
    with pytest.warns(UserWarning, match="fewer than strategy.options.warm_start.batch_size=16: every batch repeats "
                                         "rows"), \
            pytest.warns(SkippedUpdateWarning, match="step 1: the batch has no loss weight"):
        assert main(["--config", "my_task.yaml", "steps=1", "strategy.options.prompts_per_step=8",
                     "strategy.options.warm_start.max_steps=1", "logging.progress=false", "logging.plot=false"]) == 0
    assert checkpoint.all_steps("runs/my_task/checkpoints") == [1]
    command = commands(section, re.compile(r"jrl eval(?=\s)(.*)"))[0]  # the section's own, not the next's
    assert jrl(["eval", *shlex.split(command), "--json", "eval.json"]) == 0
    summary = json.loads(pathlib.Path("eval.json").read_text())
    assert (summary["n"], summary["k"], summary["step"]) == (2, 8, 1)


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
