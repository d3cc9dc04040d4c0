"""`jrl bench exact`: every batch-invariance check runs on the CPU, where the exact numerics
are bitwise whatever program a row is computed in, and a row that does differ is caught."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jrl.bench.exact as exact
from jrl.bench.cli import main
from test_bench_smoke import bench, section


def test_every_check_is_bitwise_on_the_cpu(tmp_path):
    rows = section(bench(tmp_path, "exact", "--layers", "1"), "exact")
    assert {r["check"] for r in rows} == set(exact.CHECKS)
    assert {r["contexts"] for r in rows if r["check"] == "qkv"} == {
        "among vs alone", "among_shifted vs alone", "separate vs alone"}
    assert {r["contexts"] for r in rows if r["check"] == "attention"} == {
        "decode_single vs decode_steps", "prefill vs decode_steps", "trainer vs decode_steps"}
    for r in rows:
        assert r["ok"] and r["bitwise_equal_pct"] == 100 and r["max_abs_diff"] == 0 and r["rows"] > 0, r


def test_compare_reports_rows_that_differ_in_one_bit():
    a = np.zeros((4, 3), np.float32)
    b = a.copy()
    b[1, 2] = 0.5
    b[3, 0] = -0.0  # equal in value, not in bits
    assert exact.compare(a, b) == {"rows": 4, "bitwise_equal_pct": 50.0, "element_equal_pct": pytest.approx(250 / 3),
                                   "max_abs_diff": 0.5, "ok": False}
    assert exact.compare(a, a)["ok"]


def test_a_context_whose_rows_depend_on_the_batch_is_not_ok():
    rng = np.random.default_rng(0)
    chosen, filler = (jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),), (jnp.asarray(rng.normal(size=(64, 4))),)
    sizes = exact.TINY_SIZES._replace(rows=8, among=64)
    for fn, ok in ((lambda p, x: x * 2, True), (lambda p, x: x - jnp.mean(x, axis=0), False)):
        contexts = exact.row_contexts(fn, sizes, 16)
        (_, a), *others = exact.run_contexts(contexts, None, chosen, filler, exact.Programs("test", None))
        assert [exact.compare(a, b)["ok"] for _, b in others] == [ok, ok]


def test_flag_sets_run_one_process_each_with_the_flags_appended(tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, env, stdout):
        seen.append((env["XLA_FLAGS"], cmd[cmd.index("--checks") + 1]))
        path = cmd[cmd.index("--json") + 1]
        with open(path, "w") as f:
            f.write(json.dumps({"device": "fake", "stage": "exact", "section": "exact", "check": "rmsnorm",
                                "contexts": "among vs alone", "ok": True}) + "\n")
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setenv("XLA_FLAGS", "--base")
    monkeypatch.setenv("JRL_BENCH_COMMIT", "abc")  # (no `git rev-parse` through the fake)
    monkeypatch.setattr(exact.subprocess, "run", fake_run)
    path = tmp_path / "rows.jsonl"
    assert main(["exact", "--checks", "rmsnorm", "--xla-flags-sets", " ; --a=1 --b", "--json", str(path)]) == 0
    assert seen == [("--base", "rmsnorm"), ("--base --a=1 --b", "rmsnorm")]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["xla_flags"], r["device"], r["ok"]) for r in rows] == [("", "fake", True), ("--a=1 --b", "fake", True)]


@pytest.mark.parametrize("option, value, error", [
    ("--checks", "linear,lm", "--checks: unknown \\['lm'\\]; choose from linear,qkv"),
    ("--layers", "3", "--layers: must be 1..2, got 3"),
    ("--rows", "12", "--rows: must be 0 or a positive multiple of 8, got 12"),
])
def test_bad_options_are_refused_naming_the_option(option, value, error):
    with pytest.raises(SystemExit, match=error):
        main(["exact", "--tiny", option, value])


def test_hlo_dir_writes_each_program_and_counts_the_tile_loop(tmp_path):
    rows = section(bench(tmp_path, "exact", "--checks", "linear", "--hlo-dir", str(tmp_path / "hlo")), "exact")
    assert sorted(p.name for p in (tmp_path / "hlo").iterdir()) == [
        "linear.alone.hlo.txt", "linear.among.hlo.txt", "linear.among_shifted.hlo.txt"]
    for r in rows:  # one tile: XLA drops lax.map's loop; many tiles: one loop
        assert r["hlo_a"].startswith("while=0 dot=1 ") and r["hlo_b"].startswith("while=1 dot=1 "), r


def test_the_engine_check_runs_one_engine_per_tuning(tmp_path):
    tuning = {"unroll_layers": True, "decode_steps_per_call": 4}  # the GPU's program structure, on the CPU
    rows = bench(tmp_path, "exact", "--checks", "engine", "--layers", "1",
                 "--engine-tunings", "{};" + json.dumps(tuning))
    assert [(r["tuning"], r["ok"]) for r in section(rows, "exact")] == [({}, True), (tuning, True)]


def test_bad_engine_tunings_are_refused_naming_the_option():
    with pytest.raises(SystemExit, match="--engine-tunings: .*'unrol'"):
        main(["exact", "--tiny", "--checks", "engine", "--engine-tunings", '{"unrol": true}'])


def test_the_gemm_check_times_the_kernel_beside_the_tile_loop_and_a_plain_gemm(tmp_path):
    rows = bench(tmp_path, "exact", "--checks", "gemm")
    assert [r["ok"] for r in section(rows, "exact")] == [True, True]
    speed = section(rows, "gemm_speed")  # each projection shape at 1 row and at the check's 8
    shapes = ("q", "k/v", "o", "gate/up", "down", "q/k/v fused", "gate/up fused")
    assert [(r["gemm"], r["m"]) for r in speed] == [(g, m) for g in shapes for m in (1, 8)]
    assert all(r["kernel_us"] > 0 and r["kernel_deep_us"] > 0 and r["tile_loop_us"] > 0 and r["plain_us"] > 0
               and r["timing"] == "wall" for r in speed)  # kernel time from a trace on a GPU only
