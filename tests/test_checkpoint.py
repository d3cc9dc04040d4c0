"""Checkpoints: round trip, Orbax compatibility, publication, corruption, legacy, retention.

Everything runs on the real file system under pytest's tmp_path. The crash-consistency
test (SIGKILL at random moments) is in test_checkpoint_crash.py.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jrl.checkpoint as ckpt
from jrl.checkpoint import layout
from jrl.config import ModelConfig
from jrl.metrics_log import MetricsLog, read_metrics
from jrl.models import init_params
from unprivileged import unprivileged_prefix


@flax.struct.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    step: jax.Array
    policy_version: int
    rng: jax.Array
    data_cursor: dict


@functools.cache
def train_state() -> TrainState:
    """A real train state: the model's bf16 param tree, an AdamW state, a typed key.

    Built once per process with numpy-filled values (running init_params and optax
    eagerly would spend seconds compiling tiny ops; the tree is what matters here).
    """
    config = ModelConfig(param_dtype="bfloat16")
    rng = np.random.default_rng(0)

    def fill(s):
        if jnp.issubdtype(s.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 100, s.shape).astype(s.dtype))
        return jnp.asarray(rng.standard_normal(s.shape).astype(s.dtype))

    param_shapes = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    params = jax.tree.map(fill, param_shapes)
    opt_state = jax.tree.map(fill, jax.eval_shape(optax.adamw(1e-2).init, params))
    return TrainState(
        params=params,
        opt_state=opt_state,
        step=jnp.int32(2),
        policy_version=2,
        rng=jax.random.key(100),
        data_cursor={"epoch": 2, "index": 12345, "shard": np.int64(3)},
    )


def blank_like(state):
    """A concrete restore target with the same structure, dtypes and key impls, other values."""

    def blank(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key(0, impl=jax.random.key_impl(x))
        if isinstance(x, jax.Array):
            return jnp.asarray(np.zeros(x.shape, x.dtype))
        return type(x)(0)

    return jax.tree.map(blank, state)


def small_state(value: float = 1.0) -> dict:
    return {"w": jnp.full((4, 3), value, jnp.float32), "step": 1}


def assert_bitwise_equal(actual, expected) -> None:
    """Same tree structure, same leaf types, dtypes, shapes and bytes."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert type(a) is type(e) or (isinstance(a, jax.Array) and isinstance(e, jax.Array))
        if isinstance(e, (int, float, bool)):
            assert a == e
            continue
        if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
            assert a.dtype == e.dtype
            assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(e))
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        assert a.tobytes() == e.tobytes()


def payload_files(step_dir) -> list[str]:
    """Orbax array-data files of a checkpoint, largest last."""
    files = []
    for dirpath, _, names in os.walk(step_dir / "state"):
        for name in names:
            path = os.path.join(dirpath, name)
            files.append((os.path.getsize(path), os.path.relpath(path, step_dir)))
    return [rel for _, rel in sorted(files)]


# ---------------------------------------------------------------- round trip


def test_round_trip_into_concrete_target_is_bitwise_exact(tmp_path):
    state = train_state()
    ckpt.save(tmp_path, 2, state)
    restored, meta = ckpt.load(tmp_path, target=blank_like(state), verify=True)
    assert_bitwise_equal(restored, state)
    assert meta["verification"] == "passed"


def test_relative_root_saves_and_loads(tmp_path, monkeypatch):
    # `python -m jrl.train` writes under runs/<name>: a path relative to the working dir.
    monkeypatch.chdir(tmp_path)
    state = train_state()
    ckpt.save("runs/x/checkpoints", 1, state)
    restored, meta = ckpt.load("runs/x/checkpoints", target=blank_like(state), verify=True)
    assert_bitwise_equal(restored, state)
    assert ckpt.all_steps("runs/x/checkpoints") == [1]


def test_round_trip_into_abstract_target_is_bitwise_exact(tmp_path):
    state = train_state()
    ckpt.save(tmp_path, 2, state)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, state
    )
    restored, _ = ckpt.load(tmp_path, target=abstract)
    assert_bitwise_equal(restored, state)


def test_bf16_params_keep_their_dtype(tmp_path):
    state = train_state()
    ckpt.save(tmp_path, 1, state)
    restored, _ = ckpt.load(tmp_path, target=state)
    dtypes = {x.dtype for x in jax.tree.leaves(restored.params)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}


def test_load_without_target_gives_orbax_structure_with_exact_values(tmp_path):
    state = train_state()
    ckpt.save(tmp_path, 1, state)
    restored, _ = ckpt.load(tmp_path)
    assert isinstance(restored, dict)
    adam = restored["opt_state"][0]  # the ScaleByAdamState namedtuple comes back as a dict
    assert_bitwise_equal(adam["mu"], state.opt_state[0].mu)
    assert_bitwise_equal(restored["params"], state.params)
    assert_bitwise_equal(restored["rng"], state.rng)
    assert restored["data_cursor"] == {"epoch": 2, "index": 12345, "shard": np.int64(3)}
    assert type(restored["data_cursor"]["shard"]) is np.int64


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_key_arrays_round_trip_with_their_impl(tmp_path, impl):
    keys = jax.random.split(jax.random.key(5, impl=impl), 3)
    ckpt.save(tmp_path, 0, {"keys": keys})
    restored, _ = ckpt.load(tmp_path)
    assert_bitwise_equal(restored["keys"], keys)
    follow_up = jax.random.normal(restored["keys"][1], (4,))
    assert np.array_equal(follow_up, jax.random.normal(keys[1], (4,)))


def test_plain_orbax_restores_the_payload(tmp_path):
    state = train_state()
    path = ckpt.save(tmp_path, 1, state)
    # The short form docs/checkpoints.md names (one device saved, one here; the example
    # itself runs in tests/test_docs_examples.py).
    raw = ocp.StandardCheckpointer().restore(path / "state")
    assert_bitwise_equal(raw["params"], state.params)
    assert np.array_equal(raw["rng"], jax.random.key_data(state.rng))
    assert raw["rng"].dtype == jnp.uint32
    assert raw["policy_version"] == 2 and raw["data_cursor"]["index"] == 12345


def test_checkpoint_directory_layout(tmp_path):
    path = ckpt.save(tmp_path, 12, small_state())
    assert path == tmp_path / "step_12"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "meta.json", "state"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 1
    on_disk = sorted(
        os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/")
        for d, _, fs in os.walk(path) for f in fs if f != "manifest.json"
    )
    assert sorted(manifest["files"]) == on_disk
    meta_entry = manifest["files"]["meta.json"]
    assert meta_entry["size"] == (path / "meta.json").stat().st_size
    assert len(meta_entry["sha256"]) == 64


# ---------------------------------------------------------------- meta


def test_extra_files_are_published_with_the_step_and_covered_by_the_manifest(tmp_path):
    path = ckpt.save(tmp_path, 3, small_state(), files={"source_state.npz": b"rows"})
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "meta.json", "source_state.npz", "state"]
    assert (path / "source_state.npz").read_bytes() == b"rows"
    assert "source_state.npz" in json.loads((path / "manifest.json").read_text())["files"]
    _, meta = ckpt.load(tmp_path, 3, verify=True)
    assert meta["path"] == str(path)
    (path / "source_state.npz").write_bytes(b"rowz")
    with pytest.raises(ckpt.CheckpointCorruptError, match="source_state.npz"):
        ckpt.verify_checkpoint(tmp_path, 3)


@pytest.mark.parametrize("name", ["meta.json", "manifest.json", "state", ".hidden", "a/b", ""])
def test_extra_file_names_that_would_clash_or_escape_are_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="files: .* is not allowed"):
        ckpt.save(tmp_path, 1, small_state(), files={name: b"x"})
    assert ckpt.all_steps(tmp_path) == []


def test_meta_records_step_policy_version_config_versions_and_time(tmp_path):
    state = train_state()
    ckpt.save(tmp_path, 3, state, meta={"config": {"model": {"hidden_size": 64}}})
    meta = json.loads((tmp_path / "step_3" / "meta.json").read_text())
    assert meta["step"] == 3
    assert meta["policy_version"] == 2
    assert meta["config"] == {"model": {"hidden_size": 64}}
    assert meta["versions"]["jax"] == jax.__version__
    assert meta["versions"]["orbax-checkpoint"] == ocp.__version__
    assert isinstance(meta["wall_time"], float) and meta["wall_time_utc"].endswith("+00:00")
    _, loaded = ckpt.load(tmp_path)
    assert loaded["config"] == meta["config"] and loaded["step"] == 3
    assert loaded["layout"] == "jrl" and loaded["verification"] == "skipped"
    assert loaded["path"] == str(tmp_path / "step_3")


def test_policy_version_can_come_from_meta_when_state_has_none(tmp_path):
    ckpt.save(tmp_path, 1, small_state(), meta={"policy_version": 8})
    assert ckpt.load(tmp_path)[1]["policy_version"] == 8


def test_meta_policy_version_contradicting_state_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="policy_version=5 contradicts state.policy_version=2"):
        ckpt.save(tmp_path, 1, train_state(), meta={"policy_version": 5})


@pytest.mark.parametrize("key", ["step", "versions", "encoded_leaves", "path", "layout", "verification"])
def test_reserved_meta_keys_are_rejected(tmp_path, key):
    with pytest.raises(ValueError, match=f"meta key '{key}' is reserved"):
        ckpt.save(tmp_path, 1, small_state(), meta={key: 1})


def test_meta_that_is_not_json_is_rejected_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="meta must be JSON-serializable"):
        ckpt.save(tmp_path, 1, small_state(), meta={"bad": object()})
    assert not tmp_path.joinpath("step_1").exists()


def test_a_meta_value_json_cannot_hold_is_named_by_its_key_path(tmp_path):
    # e.g. a numpy integer in a train source's state_dict(), which a trainer saves as meta['data']
    meta = {"config": {"steps": 4}, "data": {"shards": [{"offset": 3}, {"offset": np.int64(5)}]}}
    with pytest.raises(ValueError) as e:
        ckpt.save(tmp_path, 1, small_state(), meta=meta)
    assert str(e.value) == ("meta must be JSON-serializable: meta['data']['shards'][1]['offset']: Object of "
                            "type int64 is not JSON serializable")
    with pytest.raises(ValueError) as e:
        ckpt.save(tmp_path, 1, small_state(), meta={"data": {("a", 1): 0}})
    assert str(e.value) == ("meta must be JSON-serializable: meta['data']: keys must be str, int, float, bool "
                            "or None, not tuple")
    assert not tmp_path.joinpath("step_1").exists()


# ---------------------------------------------------------------- bad input


def test_unsupported_leaf_type_is_named_by_path(tmp_path):
    state = {"params": {"w": jnp.ones(2)}, "cursor": {"name": "train.jsonl"}}
    with pytest.raises(TypeError, match="leaf 'cursor/name' has unsupported type str"):
        ckpt.save(tmp_path, 1, state)


def test_bare_array_state_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="must be a pytree container"):
        ckpt.save(tmp_path, 1, jnp.ones(3))


@pytest.mark.parametrize("step", [-1, 1.0, True, "3", jnp.float32(3), jnp.array([3]), jnp.bool_(True)])
def test_step_must_be_a_nonnegative_int(tmp_path, step):
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ckpt.save(tmp_path, step, small_state())


def test_a_step_given_as_a_jax_or_numpy_scalar_is_taken_as_its_int(tmp_path):
    # ckpt.save(root, state.step, state) in a notebook: a TrainState's step is a JAX scalar
    assert ckpt.save(tmp_path, jnp.int32(3), small_state()).name == "step_3"
    assert ckpt.save(tmp_path, np.array(4), small_state()).name == "step_4"
    assert ckpt.load(tmp_path, jnp.int32(3))[1]["step"] == 3


@pytest.mark.parametrize("field,value", [("keep_last", 0), ("keep_every", -2), ("keep_last", 1.5)])
def test_retention_arguments_are_validated(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field} must be None or an int >= 1"):
        ckpt.save(tmp_path, 1, small_state(), **{field: value})


def test_saving_into_a_step_directory_is_refused_and_leaves_it_verifying(tmp_path):
    published = ckpt.save(tmp_path, 5, small_state())
    with pytest.raises(ValueError, match=rf"{published} is a checkpoint \(a step_<N> directory\), not a "
                                         rf"checkpoint root; save into {tmp_path}$"):
        ckpt.save(published, 1, small_state())
    assert sorted(p.name for p in published.iterdir()) == ["manifest.json", "meta.json", "state"]
    assert ckpt.verify_checkpoint(tmp_path, 5)


def test_saving_into_a_file_is_refused_and_leaves_it_as_it_was(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'notes.txt'}: the checkpoint root is a file, not a directory$"):
        ckpt.save(tmp_path / "notes.txt", 1, small_state())
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_root_that_is_a_symlink_to_nothing_is_named_as_one(tmp_path):
    root, target = tmp_path / "checkpoints", tmp_path / "unmounted" / "checkpoints"  # a disk not mounted
    root.symlink_to(target)
    with pytest.raises(FileNotFoundError) as e:
        ckpt.save(root, 1, small_state())
    assert str(e.value) == f"{root}: the checkpoint root is a symlink to {target}, which does not exist"
    with pytest.raises(FileNotFoundError) as e:
        ckpt.load(root)
    assert str(e.value) == (f"no checkpoints (step_<N> directories) in {root}: it is a symlink to {target}, "
                            f"which does not exist")
    assert not (tmp_path / "unmounted").exists()


def test_load_from_an_empty_root_says_there_is_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        ckpt.load(tmp_path)


def test_load_from_a_step_or_run_directory_says_which_root_to_pass(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    published = ckpt.save(root, 5, small_state())
    with pytest.raises(FileNotFoundError, match=rf"in {published}: it is a checkpoint itself \(a step_<N> "
                                                rf"directory\); pass its parent {root} as root, with step=5$"):
        ckpt.load(published)
    with pytest.raises(FileNotFoundError, match=rf"in {tmp_path / 'run'}: it is a run directory; its "
                                                rf"checkpoints are in {root}$"):
        ckpt.load(tmp_path / "run")


def test_load_of_a_missing_step_lists_the_available_ones(tmp_path):
    ckpt.save(tmp_path, 4, small_state())
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 5 .*available steps: \[4\]"):
        ckpt.load(tmp_path, 5)


# ---------------------------------------------------------------- listing


def test_latest_and_all_steps_see_only_published_step_dirs(tmp_path):
    for step in (2, 10, 7):
        ckpt.save(tmp_path, step, small_state())
    (tmp_path / ".step_11.staging-0123abcd").mkdir()
    (tmp_path / "step_012").mkdir()  # padded: not one of ours
    (tmp_path / "step_13").write_text("a file, not a directory")
    assert ckpt.all_steps(tmp_path) == [2, 7, 10]
    assert ckpt.latest_step(tmp_path) == 10


def test_listing_a_missing_root_is_empty(tmp_path):
    assert ckpt.all_steps(tmp_path / "nope") == []
    assert ckpt.latest_step(tmp_path / "nope") is None


def test_load_picks_the_newest_step_by_number(tmp_path):
    ckpt.save(tmp_path, 10, small_state(10.0))
    ckpt.save(tmp_path, 9, small_state(9.0))
    restored, meta = ckpt.load(tmp_path)
    assert meta["step"] == 10 and float(restored["w"][0, 0]) == 10.0


# ---------------------------------------------------------------- re-publish and leftovers


def test_republishing_a_step_replaces_it_and_leaves_nothing_hidden(tmp_path):
    ckpt.save(tmp_path, 5, small_state(1.0), meta={"run": "first"})
    ckpt.save(tmp_path, 5, small_state(2.0), meta={"run": "second"})
    restored, meta = ckpt.load(tmp_path, 5, verify=True)
    assert float(restored["w"][0, 0]) == 2.0 and meta["run"] == "second"
    assert layout.hidden_leftovers(tmp_path) == []
    assert ckpt.all_steps(tmp_path) == [5]


def test_republish_without_atomic_exchange_uses_a_retired_copy(tmp_path):
    ckpt.save(tmp_path, 5, small_state(1.0))
    staging = tmp_path / ".step_5.staging-feed"
    shutil.copytree(ckpt.save(tmp_path / "other", 5, small_state(3.0)), staging)
    layout.publish(tmp_path, staging, 5, use_exchange=False)
    restored, _ = ckpt.load(tmp_path, 5, verify=True)
    assert float(restored["w"][0, 0]) == 3.0
    assert layout.hidden_leftovers(tmp_path) == []


def test_next_writer_removes_abandoned_staging_and_deleting_dirs(tmp_path):
    ckpt.save(tmp_path, 1, small_state())
    (tmp_path / ".step_2.staging-aa11").mkdir()
    (tmp_path / ".step_2.staging-aa11" / "state").mkdir()
    (tmp_path / ".step_0.deleting-bb22").mkdir()
    ckpt.save(tmp_path, 2, small_state())
    assert layout.hidden_leftovers(tmp_path) == []
    assert ckpt.all_steps(tmp_path) == [1, 2]


def test_next_writer_restores_a_retired_copy_whose_step_vanished(tmp_path):
    # A re-publish without atomic exchange that died between its two renames leaves
    # the complete old checkpoint under a retired name and no visible step_3.
    ckpt.save(tmp_path, 3, small_state(3.0))
    os.rename(tmp_path / "step_3", tmp_path / ".step_3.retired-cc33")
    assert ckpt.all_steps(tmp_path) == []
    ckpt.save(tmp_path, 4, small_state(4.0))
    assert ckpt.all_steps(tmp_path) == [3, 4]
    restored, _ = ckpt.load(tmp_path, 3, verify=True)
    assert float(restored["w"][0, 0]) == 3.0
    assert layout.hidden_leftovers(tmp_path) == []


def test_a_save_that_fails_early_leaves_no_staging_and_releases_the_lock(tmp_path):
    ckpt.save(tmp_path, 1, small_state())
    with pytest.raises(TypeError):
        ckpt.save(tmp_path, 2, {"w": jnp.ones(2), "bad": object()})
    assert layout.hidden_leftovers(tmp_path) == []
    ckpt.save(tmp_path, 2, small_state())
    assert ckpt.all_steps(tmp_path) == [1, 2]


def big_state(value: float) -> dict:
    return {"w": jnp.full((1 << 18,), value, jnp.float32) + jnp.arange(1 << 18, dtype=jnp.float32)}


def test_a_save_that_fails_while_writing_publishes_nothing(tmp_path, file_size_limit):
    ckpt.save(tmp_path, 1, big_state(1.0))
    file_size_limit(64 << 10)
    with pytest.raises(Exception, match="File too large|EFBIG|errno 27|too large"):
        ckpt.save(tmp_path, 2, big_state(2.0))
    assert ckpt.all_steps(tmp_path) == [1]
    assert layout.hidden_leftovers(tmp_path) == []
    assert ckpt.verify_checkpoint(tmp_path, 1)


def test_writes_that_land_after_a_failed_save_leave_no_staging_and_keep_its_error(tmp_path, monkeypatch):
    # Orbax reports a save's first failed write while tensorstore's other writes are still in
    # flight: they land afterwards and recreate the directories they write into
    from jrl.checkpoint import payload

    def save_payload_that_fails_with_writes_in_flight(checkpointer, directory, encoded):
        def late_writes():
            for i in range(80):
                with contextlib.suppress(OSError):  # the directory removed between the two calls
                    (directory / "d").mkdir(parents=True, exist_ok=True)
                    (directory / "d" / f"shard_{i}").write_bytes(b"x" * 64)
                time.sleep(0.005)
        threading.Thread(target=late_writes).start()
        raise OSError(errno.EFBIG, "File too large")

    ckpt.save(tmp_path, 1, small_state())
    monkeypatch.setattr(payload, "save_payload", save_payload_that_fails_with_writes_in_flight)
    with pytest.raises(OSError, match="File too large"):
        ckpt.save(tmp_path, 2, small_state())
    assert layout.hidden_leftovers(tmp_path) == []
    monkeypatch.undo()
    ckpt.save(tmp_path, 2, small_state())  # the writer lock was released
    assert ckpt.all_steps(tmp_path) == [1, 2]


# ---------------------------------------------------------------- async


def test_async_save_is_unaffected_by_donating_the_state_right_after(tmp_path):
    state = big_state(1.0)
    expected = np.asarray(state["w"]).copy()
    update = jax.jit(lambda s: {"w": s["w"] * 0 - 7.0}, donate_argnums=0)
    with ckpt.AsyncCheckpointer(tmp_path) as saver:
        saver.save(1, state)
        state = update(state)  # the saved buffers are donated and overwritten
        assert saver.wait() == tmp_path / "step_1"
    restored, _ = ckpt.load(tmp_path, verify=True)
    assert np.array_equal(np.asarray(restored["w"]), expected)
    assert float(state["w"][0]) == -7.0


def test_async_saves_publish_in_order_with_retention(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    with ckpt.AsyncCheckpointer(tmp_path / "ckpt", keep_last=2) as saver:
        for step in range(1, 5):
            log.append({"step": step, "loss": 1.0 / step})
            saver.save(step, small_state(float(step)), metrics_log=log)
    assert ckpt.all_steps(tmp_path / "ckpt") == [3, 4]
    restored, _ = ckpt.load(tmp_path / "ckpt", verify=True)
    assert float(restored["w"][0, 0]) == 4.0


def test_a_failed_background_save_raises_on_the_next_call(tmp_path, file_size_limit):
    saver = ckpt.AsyncCheckpointer(tmp_path)
    saver.save(1, big_state(1.0))
    saver.wait()
    file_size_limit(64 << 10)
    saver.save(2, big_state(2.0))  # the large array is written in the background
    with pytest.raises(ckpt.CheckpointSaveError, match="background save of step 2") as failure:
        saver.save(3, small_state())
    assert failure.value.__cause__ is not None
    assert ckpt.all_steps(tmp_path) == [1]
    assert saver.wait() == tmp_path / "step_1"  # the error is reported once


# ---------------------------------------------------------------- corruption


def corrupt(path, how: str) -> None:
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "delete":
        path.unlink()


@pytest.mark.parametrize(
    "how,reason",
    [("flip", "SHA-256 does not match"), ("truncate", "size .* bytes, manifest says"), ("delete", "missing")],
)
def test_verify_names_the_damaged_array_file(tmp_path, how, reason):
    state = {"w": np.random.default_rng(0).random(50_000, dtype=np.float32), "step": 1}
    step_dir = ckpt.save(tmp_path, 1, state)
    damaged = payload_files(step_dir)[-1]
    corrupt(step_dir / damaged, how)
    with pytest.raises(ckpt.CheckpointCorruptError, match=reason) as error:
        ckpt.load(tmp_path, verify=True)
    assert error.value.relpath == damaged
    assert damaged in str(error.value)
    with pytest.raises(ckpt.CheckpointCorruptError):
        ckpt.verify_checkpoint(tmp_path)


def test_verify_reports_the_first_damaged_file_in_sorted_order(tmp_path):
    step_dir = ckpt.save(tmp_path, 1, small_state())
    corrupt(step_dir / "state" / "_METADATA", "flip")
    corrupt(step_dir / "meta.json", "delete")
    with pytest.raises(ckpt.CheckpointCorruptError) as error:
        ckpt.verify_checkpoint(tmp_path)
    assert error.value.relpath == "meta.json"


def test_verify_rejects_a_file_the_manifest_does_not_list(tmp_path):
    step_dir = ckpt.save(tmp_path, 1, small_state())
    (step_dir / "state" / "extra").write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointCorruptError, match="not listed in the manifest") as error:
        ckpt.verify_checkpoint(tmp_path)
    assert error.value.relpath == "state/extra"


def test_an_unreadable_manifest_is_reported_as_corrupt_even_without_verify(tmp_path):
    step_dir = ckpt.save(tmp_path, 1, small_state())
    (step_dir / "manifest.json").write_text('{"format": 1, "files": ')
    with pytest.raises(ckpt.CheckpointCorruptError, match="manifest.json: unreadable"):
        ckpt.load(tmp_path)


def test_an_unreadable_meta_json_is_reported_as_corrupt_even_without_verify(tmp_path):
    step_dir = ckpt.save(tmp_path, 1, small_state())
    size = (step_dir / "meta.json").stat().st_size
    (step_dir / "meta.json").write_bytes(b"{" * size)  # listed size kept: only parsing can tell
    with pytest.raises(ckpt.CheckpointCorruptError, match="meta.json: unreadable"):
        ckpt.load(tmp_path)


@pytest.mark.parametrize("how,reason", [("truncate", r"size \d+ bytes, manifest says \d+"), ("delete", "missing")])
def test_without_verify_a_cut_or_missing_payload_file_is_named_before_orbax_reads(tmp_path, how, reason):
    step_dir = ckpt.save(tmp_path, 1, {"w": np.random.default_rng(0).random(50_000, dtype=np.float32), "step": 1})
    damaged = payload_files(step_dir)[-1]
    corrupt(step_dir / damaged, how)
    with pytest.raises(ckpt.CheckpointCorruptError, match=f"{damaged}: {reason}$") as error:
        ckpt.load(tmp_path)
    assert error.value.relpath == damaged


def test_an_unknown_manifest_format_is_refused_by_number(tmp_path):
    step_dir = ckpt.save(tmp_path, 1, small_state())
    (step_dir / "manifest.json").write_text('{"format": 2, "files": {}}')
    with pytest.raises(ValueError, match="manifest format 2 is not supported"):
        ckpt.load(tmp_path)


CHECK_UNPRIVILEGED = """
import sys
import jrl.checkpoint as ckpt
try:
    getattr(ckpt, sys.argv[1])(sys.argv[2], 1)
except ckpt.CheckpointCorruptError as e:
    print(f"{e.relpath}: {e.reason}")
"""


def check_without_root_powers(what, root, call):
    """`ckpt.<call>(root, 1)` in a process that file permissions bind; prints the
    CheckpointCorruptError's relpath and reason."""
    done = subprocess.run([*unprivileged_prefix(what), sys.executable, "-c", CHECK_UNPRIVILEGED, call, str(root)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_verify_names_files_behind_a_directory_that_may_not_be_searched_unreadable_not_missing(tmp_path):
    # before: "state/_CHECKPOINT_METADATA: missing", which made a permission problem look like lost files
    ckpt.save(tmp_path, 1, {"w": np.arange(4, dtype=np.float32)})
    (tmp_path / "step_1" / "state").chmod(0o600)
    try:
        out = check_without_root_powers("searches a mode-600 directory", tmp_path, "verify_checkpoint")
    finally:
        (tmp_path / "step_1" / "state").chmod(0o755)
    state_dir = tmp_path / "step_1" / "state"
    assert out == f"state/_CHECKPOINT_METADATA: unreadable ([Errno 13] Permission denied: '{state_dir}/_CHECKPOINT_METADATA')\n"


def test_without_verify_a_flipped_array_byte_loads_silently_with_wrong_values(tmp_path):
    # Documented behaviour of verify=False: no checksums are read, so damage inside
    # uncompressible array data goes unnoticed; this is why resume should verify.
    values = np.random.default_rng(0).random(50_000, dtype=np.float32)
    step_dir = ckpt.save(tmp_path, 1, {"w": values, "step": 1})
    corrupt(step_dir / payload_files(step_dir)[-1], "flip")
    restored, meta = ckpt.load(tmp_path)
    assert meta["verification"] == "skipped"
    assert not np.array_equal(np.asarray(restored["w"]), values)


# ---------------------------------------------------------------- legacy layouts


def test_a_step_dir_without_manifest_loads_with_verification_unavailable(tmp_path):
    state = train_state()
    step_dir = ckpt.save(tmp_path, 1, state)
    (step_dir / "manifest.json").unlink()
    restored, meta = ckpt.load(tmp_path, target=state)
    assert_bitwise_equal(restored, state)
    assert meta["layout"] == "legacy" and meta["verification"] == "unavailable"


def test_verify_checkpoint_of_a_jrl_step_dir_whose_manifest_is_missing_names_it(tmp_path):
    # as load(verify=True) and resume do: it said False ("legacy, cannot be verified")
    step_dir = ckpt.save(tmp_path, 1, train_state())
    (step_dir / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointCorruptError) as e:
        ckpt.verify_checkpoint(tmp_path, 1)
    assert (e.value.relpath, e.value.reason) == ("manifest.json", "missing (jrl writes it last; an interrupted copy?)")


def test_verify_checkpoint_of_a_plain_orbax_payload_is_false(tmp_path):
    (tmp_path / "step_4").mkdir()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "step_4" / "state", {"w": jnp.arange(6, dtype=jnp.float32)})
    assert ckpt.verify_checkpoint(tmp_path) is False


def test_verifying_a_jrl_step_dir_whose_manifest_is_missing_names_it(tmp_path):
    # jrl writes the manifest with every checkpoint: without it the directory is likely an
    # interrupted copy, which resume and init_from refuse; an explicit verify=True loaded it
    step_dir = ckpt.save(tmp_path, 1, train_state())
    (step_dir / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointCorruptError) as e:
        ckpt.load(tmp_path, verify=True)
    assert (e.value.relpath, e.value.reason) == ("manifest.json", "missing (jrl writes it last; an interrupted copy?)")


def test_verifying_a_plain_orbax_payload_warns_that_it_cannot(tmp_path):
    state = {"params": {"w": jnp.arange(6, dtype=jnp.bfloat16)}, "step": 4}
    (tmp_path / "step_4").mkdir()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "step_4" / "state", state)
    with pytest.warns(UserWarning, match="no manifest.json; loading it unverified"):
        restored, meta = ckpt.load(tmp_path, verify=True)
    assert meta["layout"] == "legacy" and meta["verification"] == "unavailable"


@pytest.mark.parametrize("payload_subdir", ["", "state", "default"])
def test_a_plain_orbax_payload_in_a_step_dir_loads(tmp_path, payload_subdir):
    state = {"params": {"w": jnp.arange(6, dtype=jnp.bfloat16)}, "step": 4}
    destination = tmp_path / "step_4" / payload_subdir if payload_subdir else tmp_path / "step_4"
    destination.parent.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(destination, state)
    restored, meta = ckpt.load(tmp_path, target=state)
    assert_bitwise_equal(restored, state)
    assert meta == {"layout": "legacy", "verification": "unavailable", "step": 4,
                    "path": str(tmp_path / "step_4")}


def test_a_legacy_orbax_payload_with_native_typed_keys_loads_into_a_typed_target(tmp_path):
    state = {"rng": jax.random.key(3), "step": 1}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "step_1" / "state", state)
    restored, _ = ckpt.load(tmp_path, target=state)
    assert_bitwise_equal(restored, state)


def test_a_step_dir_without_any_payload_is_reported(tmp_path):
    (tmp_path / "step_1").mkdir()
    with pytest.raises(FileNotFoundError, match="neither manifest.json nor an Orbax payload"):
        ckpt.load(tmp_path)


def test_verify_checkpoint_of_a_step_dir_without_any_payload_is_reported(tmp_path):
    # it returned False, the answer for a legacy payload that loads unverified
    (tmp_path / "step_1").mkdir()
    with pytest.raises(FileNotFoundError, match=r"step_1 has neither manifest.json nor an Orbax payload"):
        ckpt.verify_checkpoint(tmp_path, 1)


# ---------------------------------------------------------------- retention


def test_keep_last_keeps_the_newest_steps(tmp_path):
    for step in range(1, 7):
        ckpt.save(tmp_path, step, small_state(), keep_last=2)
    assert ckpt.all_steps(tmp_path) == [5, 6]
    assert layout.hidden_leftovers(tmp_path) == []


def test_keep_every_also_keeps_the_multiples(tmp_path):
    for step in range(1, 8):
        ckpt.save(tmp_path, step, small_state(), keep_last=2, keep_every=3)
    assert ckpt.all_steps(tmp_path) == [3, 6, 7]


def test_without_keep_last_nothing_is_deleted(tmp_path):
    for step in range(1, 4):
        ckpt.save(tmp_path, step, small_state(), keep_every=2)
    assert ckpt.all_steps(tmp_path) == [1, 2, 3]


def test_retention_never_deletes_the_step_just_saved(tmp_path):
    for step in (10, 11):
        ckpt.save(tmp_path, step, small_state())
    ckpt.save(tmp_path, 3, small_state(), keep_last=1)
    assert ckpt.all_steps(tmp_path) == [3, 11]


def test_retention_of_a_symlinked_step_removes_the_link_and_keeps_what_it_points_to(tmp_path):
    # a run started from another run's checkpoint linked into its own checkpoints directory
    other = ckpt.save(tmp_path / "other", 1, small_state(7.0))
    root = tmp_path / "run"
    root.mkdir()
    (root / "step_1").symlink_to(other)
    for step in (2, 3, 4):
        ckpt.save(root, step, small_state(), keep_last=2)
    assert ckpt.all_steps(root) == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == [layout.LOCK_NAME, "step_3", "step_4"]
    restored, _ = ckpt.load(tmp_path / "other", 1, verify=True)
    assert float(restored["w"][0, 0]) == 7.0


def test_a_step_retention_cannot_remove_yet_fails_no_save(tmp_path, monkeypatch):
    # On NFS a file that a reader (an evaluation job) still holds open is renamed to .nfsXXXX
    # when unlinked, so its directory cannot be removed until the reader lets go.
    real_rmtree = shutil.rmtree

    def rmtree_with_a_file_held_open(path, *args, **kwargs):
        if os.path.basename(path).startswith(".step_1."):
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_with_a_file_held_open)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3, 4):  # 3's retention hides step 1, 4's leftover cleanup meets it again
            assert ckpt.save(tmp_path, step, small_state(), keep_last=2) == tmp_path / f"step_{step}"
    assert ckpt.all_steps(tmp_path) == [3, 4]
    (leftover,) = layout.hidden_leftovers(tmp_path)
    assert leftover.startswith(".step_1.deleting-")
    why = (f"{tmp_path / leftover}: cannot remove it yet ([Errno {errno.ENOTEMPTY}] Directory not empty: "
           f"'{tmp_path / leftover}'); it stays hidden, and the next save to {tmp_path} tries again")
    assert [str(w.message) for w in caught] == [why, why]
    monkeypatch.undo()  # the reader let go
    ckpt.save(tmp_path, 5, small_state(), keep_last=2)
    assert ckpt.all_steps(tmp_path) == [4, 5] and layout.hidden_leftovers(tmp_path) == []


def test_republishing_a_symlinked_step_replaces_the_link_and_keeps_what_it_pointed_to(tmp_path):
    other = ckpt.save(tmp_path / "other", 5, small_state(7.0))
    root = tmp_path / "run"
    root.mkdir()
    (root / "step_5").symlink_to(other)
    ckpt.save(root, 5, small_state(2.0))
    assert not (root / "step_5").is_symlink() and layout.hidden_leftovers(root) == []
    assert float(ckpt.load(root, 5, verify=True)[0]["w"][0, 0]) == 2.0
    assert float(ckpt.load(tmp_path / "other", 5, verify=True)[0]["w"][0, 0]) == 7.0


# ---------------------------------------------------------------- metrics log ordering


class OrderCheckingLog(MetricsLog):
    """A real MetricsLog that records which steps were visible when it was synced."""

    def __init__(self, path, checkpoint_root):
        super().__init__(path)
        self.checkpoint_root = checkpoint_root
        self.visible_at_sync = []

    def flush_and_sync(self):
        super().flush_and_sync()
        self.visible_at_sync.append(ckpt.all_steps(self.checkpoint_root))


def test_save_syncs_the_metrics_log_before_publishing(tmp_path):
    log = OrderCheckingLog(tmp_path / "metrics.jsonl", tmp_path / "ckpt")
    for step in (1, 2):
        log.append({"step": step, "policy_version": step, "loss": 0.5})
        ckpt.save(tmp_path / "ckpt", step, small_state(), metrics_log=log)
    assert log.visible_at_sync == [[], [1]]
    assert [r["step"] for r in read_metrics(log.path)] == [1, 2]


# ---------------------------------------------------------------- sharding

SHARDED_RESTORE = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jrl.checkpoint as ckpt

    assert jax.device_count() == 4
    root = sys.argv[1]
    save_mesh = jax.make_mesh((4,), ("fsdp",))
    w = jax.device_put(jnp.arange(64 * 8, dtype=jnp.bfloat16).reshape(64, 8),
                       NamedSharding(save_mesh, P("fsdp", None)))
    keys = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(save_mesh, P("fsdp")))
    ckpt.save(root, 1, {"w": w, "keys": keys, "step": 1})

    load_mesh = jax.make_mesh((2, 2), ("data", "tensor"))
    w_sharding = NamedSharding(load_mesh, P(None, "tensor"))
    key_sharding = NamedSharding(load_mesh, P("data"))
    target = {"w": jax.ShapeDtypeStruct((64, 8), jnp.bfloat16, sharding=w_sharding),
              "keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=key_sharding), "step": 0}
    restored, _ = ckpt.load(root, target=target, verify=True)
    assert restored["w"].sharding == w_sharding, restored["w"].sharding
    assert restored["keys"].sharding.spec == key_sharding.spec, restored["keys"].sharding
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(w))
    assert np.array_equal(jax.random.key_data(restored["keys"]), jax.random.key_data(keys))
    assert restored["step"] == 1
    print("ok")
    """
)


def test_sharded_state_restores_onto_another_mesh(tmp_path):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", SHARDED_RESTORE, str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
