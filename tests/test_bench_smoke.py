"""`jrl bench`: every stage runs end to end on CPU with tiny shapes and writes JSON rows
that carry where and when they were measured. Checked: the rows' keys and that measured
values are finite and positive, never wall-clock thresholds."""

import json
import math
import os
import threading

import numpy as np
import pytest

import jrl.bench.grpo as grpo_module
from jrl.bench import STAGES, UNAVAILABLE
from jrl.bench.grpo import response_lengths
from jrl.bench.cli import main
from jrl.bench.shapes import TRAIN_1B
from jrl.bench.train import add_scaling, markov_batch
from jrl.bench.results import COMMON_KEYS
from pallas_kernels import dispatch


def bench(tmp_path, *args: str, rc: int = 0) -> list[dict]:
    path = tmp_path / "rows.jsonl"
    assert main([*args, "--tiny", "--json", str(path)]) == rc
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows
    for r in rows:
        assert all(k in r for k in COMMON_KEYS), r
        assert r["stage"] == args[0] and r["command"].startswith(f"jrl bench {args[0]}")
        assert r["date"].endswith("+00:00") and r["jax_version"]
    return rows


def positive(row: dict, *keys: str) -> None:
    for k in keys:
        assert isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] > 0, (k, row)


def section(rows, name):
    return [r for r in rows if r["section"] == name]


def test_help_lists_every_stage(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in (*STAGES, *UNAVAILABLE):
        assert f"  {name} " in out


@pytest.mark.parametrize("argv", [["grpo_lora"], ["kernels", "--check"]])
def test_a_stage_that_needs_a_gpu_says_so_on_a_cpu(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"jrl bench {argv[0]}: needs a GPU for these settings and this machine has "
                                       "none (backend cpu); --tiny runs the same code CPU-sized\n")


def test_bandwidth_measures_streams_and_the_matmul_ceiling(tmp_path):
    rows = bench(tmp_path, "bandwidth")
    assert {r["stream"] for r in section(rows, "stream")} == {"f32 a+1", "bf16 a*2 donated", "copy", "read"}
    for r in section(rows, "stream"):
        positive(r, "tb_per_s")
    positive(section(rows, "matmul")[0], "tflops")
    positive(section(rows, "ceilings")[0], "copy_tb_per_s", "matmul_tflops")


def test_decode_engine_counts_multi_step_calls_and_the_replayed_kv(tmp_path):
    default_stream_rows = dispatch.STREAM_ROWS
    rows = bench(tmp_path, "decode", "--batches", "2", "--tuning", json.dumps({"decode_steps_per_call": 3}),
                 "--stream-rows", "2")
    (r,) = section(rows, "engine")
    # 8 new tokens: the first from the prefill step, 7 from decode calls of up to 3 steps
    assert r["batch"] == 2 and r["steps_per_call"] == 3 and r["weight_dtype"] == "bfloat16"
    assert r["stream_rows"] == 2 and dispatch.STREAM_ROWS == default_stream_rows  # put back after the run
    assert r["completions"] == 2 and r["lengths"] == [8]
    assert (r["decode_steps"], r["decode_calls"]) == (7, 3)
    # the replayed call is decode call 1 (8 // 2 // 3): positions 24, 25, 26 read 25..27 keys
    assert r["replayed_mean_kv_len"] == 26
    positive(r, "decode_tokens_per_s", "e2e_tokens_per_s", "prefill_s", "step_ms", "device_step_ms", "floor_ms",
             "copy_bandwidth_tb_s")


def test_decode_ab_times_every_variant_against_the_first(tmp_path):
    rows = bench(tmp_path, "decode", "--ab", "base,two_scatters", "--batches", "4", "--pages", "random",
                 "--rounds", "2", "--per-round", "1")
    ab = section(rows, "ab")
    assert [(r["variant"], r["pages"], r["context"]) for r in ab] == [("base", "random", 28), ("two_scatters", "random", 28)]  # 24 + 8 // 2
    assert ab[0]["delta_ms"] == 0
    for r in ab:
        positive(r, "ms", "floor_ms", "over_floor")


def test_decode_ab_compares_fp8_kv_variants_with_the_bf16_kv_batch(tmp_path):
    rows = bench(tmp_path, "decode", "--ab", "base,bf16_kv,fp8_fold_k_regs,fp8_mma", "--batches", "2", "--page-size",
                 "32", "--rounds", "1", "--per-round", "1", "--engine", json.dumps({"kv_dtype": "float8_e4m3fn"}))
    ab = section(rows, "ab")
    assert [(r["variant"], r["kv_dtype"]) for r in ab] == [
        ("base", "float8_e4m3fn"), ("bf16_kv", "bfloat16"), ("fp8_fold_k_regs", "float8_e4m3fn"),
        ("fp8_mma", "float8_e4m3fn")]
    assert ab[0]["floor_ms"] < ab[1]["floor_ms"]  # half the KV bytes
    for r in ab:
        positive(r, "ms", "floor_ms", "over_floor")


def test_decode_host_and_gemms(tmp_path):
    (r,) = section(bench(tmp_path, "decode", "--host", "--batches", "2", "--repeat", "1", "--digest"), "host")
    positive(r, "schedule_ms", "pack_ms", "call_ms", "dispatch_ms", "host_ms", "decode_steps")
    assert r["completions"] == 2 and len(r["token_hash"]) == 8
    gemms = section(bench(tmp_path, "decode", "--gemms", "--rows", "2", "--bandwidth", "1e10", "--matmul-tflops", "0.1"),
                    "gemms")
    assert {r["weights"] for r in gemms} == {"separate", "fused", "fused_fp8"}
    for r in gemms:
        positive(r, "us_per_layer", "floor_us", "tflops", "matmul_tflops")


def test_decode_gemms_times_only_the_layouts_asked_for(tmp_path):
    gemms = section(bench(tmp_path, "decode", "--gemms", "--rows", "2", "--weights", "fused_fp8",
                          "--bandwidth", "1e10", "--matmul-tflops", "0.1"), "gemms")
    assert [(r["weights"], r["options"], r["xla_options"]) for r in gemms] == [("fused_fp8", "default", {})]


def test_decode_gemms_refuses_an_unknown_layout(tmp_path):
    with pytest.raises(SystemExit, match=r"--weights: unknown layout\(s\) \['fused_fp4'\]"):
        main(["decode", "--gemms", "--tiny", "--weights", "fused,fused_fp4", "--json", str(tmp_path / "r.jsonl")])


def test_prefill_reports_tokens_per_second_against_the_compute_floor(tmp_path):
    (r,) = section(bench(tmp_path, "prefill", "--batches", "2"), "engine")
    assert r["completions"] == 2 and r["engine_steps"] >= 2  # 96 prompt tokens at 64 a step
    positive(r, "prefill_tokens_per_s", "tflops", "floor_ms", "flops_per_token")


def test_generate_times_the_first_call_cold_and_warm_and_compares_configs(tmp_path):
    # Two fresh processes on one cache directory: the second reads the first's programs.
    rows = bench(tmp_path, "generate", "--batches", "2", "--cache-dir", str(tmp_path / "cache"))
    cold, warm = section(rows, "first_call")
    assert (cold["cache"], warm["cache"]) == ("cold", "warm") and cold["batch"] == warm["batch"] == 2
    assert cold["programs_from_cache"] == 0 and cold["programs_compiled"] > 0
    assert warm["programs_from_cache"] > 0 and warm["cache_dir"] == cold["cache_dir"]
    assert cold["max_tokens_per_step"] == 64  # 2 x 24 prompt tokens, rounded up
    for r in (cold, warm):
        positive(r, "first_call_s", "process_s", "init_s")
    (default,) = section(rows, "default")
    positive(default, "e2e_tokens_per_s", "prefill_s", "prefill_tokens_per_s", "engine_build_s", "engine_generate_s")
    assert len(default["e2e_s_runs"]) == 3 and default["e2e_s"] == sorted(default["e2e_s_runs"])[1]
    tuned = section(rows, "tuned")
    assert [r["max_tokens_per_step"] for r in tuned] == [8192, 32768]
    for r in tuned:
        assert r["tuned"] == {"max_tokens_per_step": r["max_tokens_per_step"]}
        assert r["programs_compiled"] == 0  # the same step programs as the default config's
        positive(r, "e2e_tokens_per_s", "vs_default")


def test_kernels_check_and_decode_in_interpret_mode(tmp_path):
    rows = bench(tmp_path, "kernels", "--check", "--decode", "--check-kinds", "decode")
    (check,) = section(rows, "check")
    assert check["ok"] and check["nans"] == 0 and check["rel_err"] < 1e-2
    (dec,) = section(rows, "decode")
    positive(dec, "jrl_tb_per_s", "xla_tb_per_s")
    assert dec["jrl_rel_err"] < 1e-2
    assert "stock_tb_per_s" in dec or "stock_error" in dec  # the stock kernel is GPU only


def test_kernels_check_runs_on_fp8_buffers(tmp_path):
    rows = bench(tmp_path, "kernels", "--check", "--kv-dtype", "float8_e4m3fn", "--check-kinds", "decode")
    (check,) = section(rows, "check")
    assert check["kv_dtype"] == "float8_e4m3fn" and check["page_size"] == 32
    assert check["ok"] and check["nans"] == 0 and check["rel_err"] < 1e-2


def test_kernels_check_takes_a_tile_path_that_is_not_the_default(tmp_path):
    rows = bench(tmp_path, "kernels", "--check", "--kv-dtype", "float8_e4m3fn", "--check-kinds", "decode",
                 "--check-decode-tuning", json.dumps({"fp8_tiles": "fold"}))
    (check,) = section(rows, "check")
    assert check["tuning"] == {"fp8_tiles": "fold"}
    assert check["ok"] and check["nans"] == 0 and check["rel_err"] < 1e-2
    (tmp_path / "bad").mkdir()
    rows = bench(tmp_path / "bad", "kernels", "--check", "--kv-dtype", "float8_e4m3fn", "--check-kinds", "decode",
                 "--check-decode-tuning", json.dumps({"fp8_tiles": "no_such_path"}), rc=1)
    (bad,) = section(rows, "check")
    assert not bad["ok"] and "fp8_tiles" in bad["error"]


def test_kernels_decode_times_fp8_tile_paths_against_the_bf16_kernel(tmp_path):
    rows = bench(tmp_path, "kernels", "--decode", "--kv-dtype", "float8_e4m3fn",
                 "--decode-variants", json.dumps([{"fp8_tiles": "fold_k_regs"}]))
    (dec,) = section(rows, "decode")
    assert dec["kv_dtype"] == "float8_e4m3fn" and dec["page_size"] == 32
    positive(dec, "jrl_bf16_tb_per_s", "jrl_tb_per_s", "jrl_vs_bf16", "jrl_fp8_tiles_fold_k_regs_vs_bf16")
    # the default reads slot-minor values through "mma": e4m3 probabilities (3 mantissa bits)
    assert dec["jrl_rel_err"] < 3e-2 and dec["jrl_fp8_tiles_fold_k_regs_rel_err"] < 1e-2
    assert "stock_tb_per_s" not in dec  # the stock kernel reads bf16 pages only


def test_decode_engine_rows_name_an_fp8_kv_dtype(tmp_path):
    rows = bench(tmp_path, "decode", "--batches", "2", "--page-size", "32",
                 "--engine", json.dumps({"kv_dtype": "float8_e4m3fn"}))
    (r,) = section(rows, "engine")
    assert r["kv_dtype"] == "float8_e4m3fn" and r["completions"] == 2
    positive(r, "decode_tokens_per_s", "floor_ms")


def test_decode_step_only_replays_the_program_on_fp8_kv(tmp_path):
    rows = bench(tmp_path, "decode", "--step-only", "--batches", "2", "--page-size", "32",
                 "--engine", json.dumps({"kv_dtype": "float8_e4m3fn"}))
    (r,) = section(rows, "step_only")
    assert r["kv_dtype"] == "float8_e4m3fn" and r["page_size"] == 32
    positive(r, "device_step_ms", "floor_ms", "tokens_per_s")


def test_grpo_times_every_phase(tmp_path):
    rows = bench(tmp_path, "grpo", "--steps", "2")
    assert [r["step"] for r in section(rows, "step")] == [0, 1]
    (mean,) = section(rows, "mean")
    positive(mean, "generation_ms", "reward_ms", "batch_ms", "logprobs_ms", "optimizer_ms", "weight_sync_ms",
             "total_ms")
    assert section(rows, "step")[-1]["ack_version"] == 4  # two optimizer steps a GRPO step
    assert mean["wait_ms"] == mean["post_ms"] == 0.0  # nothing overlaps in sync mode
    first, second = section(rows, "step")
    assert first["compiled_in_generation"] > 0 and second["compiled_in_generation"] == 0  # --tiny: one shape


@pytest.mark.parametrize("mode", ["sync", "overlapped"])
def test_grpo_trace_profiles_one_more_step_left_out_of_the_mean(tmp_path, mode):
    rows = bench(tmp_path, "grpo", "--steps", "2", "--mode", mode, "--trace", str(tmp_path / "trace"))
    steps = section(rows, "step")
    assert [(r["step"], r["traced"]) for r in steps] == [(0, False), (1, False), (2, True)]
    (mean,) = section(rows, "mean")
    assert mean["mean_over"].startswith("1 step(s)") and mean["total_ms"] == steps[1]["total_ms"]
    summary = json.loads((tmp_path / "trace" / f"trace_grpo_{mode}.json").read_text())
    assert summary["n_steps"] == 1 and "kernels_per_step" in steps[2]
    # the profiled step trains on a rollout of its own, as lagged as the step before's
    assert steps[2]["token_lag_mean"] == steps[1]["token_lag_mean"]


@pytest.mark.parametrize("mode", ["sync", "overlapped"])
def test_grpo_exact_logprobs_checks_the_first_rollout_bitwise_then_skips_the_recompute(tmp_path, mode):
    rows = bench(tmp_path, "grpo", "--steps", "3", "--mode", mode, "--exact-logprobs")
    steps = section(rows, "step")
    assert steps[0]["exact_bitwise_pct"] == 100.0 and steps[0]["logprobs_computed_tokens"] > 0
    assert all("exact_bitwise_pct" not in r and r["logprobs_computed_tokens"] == 0 for r in steps[1:])
    assert all(r["exact_logprobs"] and np.isfinite(r["loss"]) for r in steps)


def test_grpo_engine_warmup_leaves_no_compile_to_the_measured_rollouts(tmp_path):
    rows = bench(tmp_path, "grpo", "--steps", "2", "--mode", "interruptible", "--lengths", "longtail",
                 "--engine-warmup")
    (warm,) = section(rows, "engine_warmup")
    assert warm["programs"] > 0 and warm["seconds"] > 0
    assert [r["compiled_in_generation"] for r in section(rows, "step")] == [0, 0]


@pytest.mark.parametrize("mode", ["overlapped", "interruptible"])
def test_grpo_overlapped_modes_time_the_trainers_wait_and_long_tail_idle(tmp_path, mode):
    rows = bench(tmp_path, "grpo", "--steps", "3", "--mode", mode, "--lengths", "longtail")
    steps = section(rows, "step")
    assert [r["step"] for r in steps] == [0, 1, 2] and {r["mode"] for r in steps} == {mode}
    (mean,) = section(rows, "mean")
    positive(mean, "generation_ms", "wait_ms", "logprobs_ms", "optimizer_ms", "weight_sync_ms", "total_ms")
    # rollout k+1 was started by the weights of the start of step k: two optimizer steps behind
    assert steps[0]["token_lag_mean"] == 0 and all(0 < r["token_lag_mean"] <= 2 for r in steps[1:])
    for r in steps:  # lognormal lengths capped at --new (8): a long tail leaves decode rows empty
        assert r["response_len_max"] <= 8 and r["response_len_mean"] < 8
        assert 0 < r["engine_idle_frac"] < 1
        assert r["ack_version"] == 2 * r["step"]  # the engine serves the trainer's weights of the step's start
    if mode == "overlapped":
        assert all(r["mixed_version_samples"] == 0 and r["post_ms"] == 0 for r in steps)


def test_grpo_longtail_lengths_are_fixed_per_step_and_capped():
    a, b = response_lengths("longtail", 256, 256, 3), response_lengths("longtail", 256, 256, 3)
    np.testing.assert_array_equal(a, b)
    assert a.min() >= 1 and a.max() == 256 and np.median(a) < 128  # capped, most far below the cap
    assert (response_lengths("fixed", 4, 8, 0) == 8).all()


def test_placement_times_a_grpo_step_per_layout(tmp_path):
    rows = bench(tmp_path, "placement", "--layouts", "colocated")  # split needs a second device
    (r,) = section(rows, "layout")
    assert (r["layout"], r["trainer_devices"], r["replicas"], r["mean_over"]) == ("colocated", 1, 1, 1)
    positive(r, "grpo_step_ms", "generate_ms", "rollout_tokens_per_s")
    # one device: the engine serves the trainer's arrays in place, so no sync moves (or times) weights
    assert (r["weight_sync_ms"], r["weight_sync_gb"], r["weight_sync_s_per_gb"]) == (0, 0, None)


def test_train_reports_throughput_and_mfu(tmp_path):
    rows = bench(tmp_path, "train", "--variants", "causal", "--torch")  # --check: compiles 6 more programs
    (r,) = section(rows, "jrl")
    assert r["variant"] == "causal" and r["mesh"] == "1" and r["batch"] == 2 and r["seq"] == 64
    assert r["matmul_dtype"] == "bfloat16" and r["fp8_gemms"] == 0 and "speedup_vs_bf16" not in r
    positive(r, "tokens_per_s", "mfu_pct", "step_ms", "compile_s")
    (torch_row,) = section(rows, "transformers")  # measured, or skipped without torch
    assert "tokens_per_s" in torch_row or "skipped" in torch_row or "error" in torch_row


def test_train_rows_compare_each_matmul_dtype_with_bf16_of_the_same_variant_and_mesh():
    rows = [dict(variant="causal", matmul_dtype="bfloat16", mesh="1", devices=1, tokens_per_s=100.0),
            dict(variant="causal", matmul_dtype="float8", mesh="1", devices=1, tokens_per_s=150.0),
            dict(variant="causal", matmul_dtype="float8", mesh="data=2", devices=2, tokens_per_s=240.0),
            dict(variant="mask", matmul_dtype="float8", mesh="1", devices=1, tokens_per_s=90.0)]
    add_scaling(rows)
    assert "speedup_vs_bf16" not in rows[0] and rows[1]["speedup_vs_bf16"] == 1.5
    assert rows[2]["scaling_pct"] == 80 and "speedup_vs_bf16" not in rows[2]  # no bf16 row on that mesh
    assert "speedup_vs_bf16" not in rows[3]


def test_train_loss_steps_trains_each_matmul_dtype_on_the_same_data(tmp_path):
    rows = bench(tmp_path, "train", "--variants", "causal", "--loss-steps", "3")
    bf16, fp8 = section(rows, "loss")
    assert (bf16["matmul_dtype"], fp8["matmul_dtype"]) == ("bfloat16", "float8")
    assert bf16["steps"] == fp8["steps"] == 3 and bf16["all_finite"] and fp8["all_finite"]
    assert bf16["loss_first"] == pytest.approx(fp8["loss_first"], rel=0.01)  # same weights, same first batch
    assert bf16["rel_diff_pct"] == 0 and math.isfinite(fp8["rel_diff_pct"])
    assert not section(rows, "jrl")


def test_markov_batch_stays_on_its_states_and_each_token_has_four_successors():
    tokens = [np.asarray(markov_batch(TRAIN_1B, 8, 256, step, states=64)["tokens"][0]) for step in range(4)]
    stream = np.concatenate(tokens)
    assert stream.min() >= 0 and stream.max() < 64
    successors = {}
    for row in stream:
        for a, b in zip(row[:-1], row[1:]):
            successors.setdefault(int(a), set()).add(int(b))
    assert max(len(s) for s in successors.values()) <= 4 and len(successors) > 32
    again = np.asarray(markov_batch(TRAIN_1B, 8, 256, 2, states=64)["tokens"][0])
    assert (again == tokens[2]).all()


def test_decode_vs_bf16_runs_a_bf16_engine_then_the_fp8_weights_one(tmp_path):
    rows = bench(tmp_path, "decode", "--batches", "1", "--vs-bf16", "--engine",
                 json.dumps({"weight_dtype": "float8_e4m3fn"}))
    bf16, fp8 = section(rows, "engine")
    assert (bf16["precision"], bf16["weight_dtype"], bf16["engine"]) == ("bfloat16", "bfloat16", {})
    assert (fp8["precision"], fp8["weight_dtype"]) == ("weight_dtype=float8_e4m3fn", "float8_e4m3fn")
    positive(fp8, "decode_tokens_per_s", "speedup_vs_bf16")
    assert fp8["floor_ms"] < bf16["floor_ms"]  # the served projection kernels are half the bytes
    assert "speedup_vs_bf16" not in bf16


def test_decode_drift_compares_fp8_weights_with_the_trainer_and_the_bf16_engine(tmp_path):
    rows = bench(tmp_path, "decode", "--drift", "--engine", json.dumps({"weight_dtype": "float8_e4m3fn"}))
    bf16, fp8 = section(rows, "drift")
    assert (bf16["precision"], fp8["precision"]) == ("bfloat16", "weight_dtype=float8_e4m3fn")
    assert (fp8["prompts"], fp8["new"]) == (2, 8)  # --tiny's sizes
    # the bf16 engine against itself: every sample and greedy token agrees, no drift
    assert bf16["vs_bf16_max_abs"] == 0 and bf16["vs_bf16_tokens_compared"] == 16
    assert bf16["sample_identical_pct"] == bf16["greedy_identical_pct"] == 100
    for r in (bf16, fp8):
        assert 0 <= r["vs_trainer_mean_abs"] <= r["vs_trainer_p99_abs"] <= r["vs_trainer_max_abs"] < 0.5
        assert 0 <= r["greedy_identical_pct"] <= r["greedy_prefix_agree_pct"] <= 100
    assert fp8["vs_trainer_mean_abs"] > 0  # the quantized weights are not the trainer's
    assert 0 < fp8["vs_bf16_tokens_compared"] <= 16


def test_decode_drift_compares_fp8_kv_with_the_trainer_and_the_bf16_engine(tmp_path):
    rows = bench(tmp_path, "decode", "--drift", "--page-size", "32",
                 "--engine", json.dumps({"kv_dtype": "float8_e4m3fn"}))
    bf16, fp8 = section(rows, "drift")
    assert fp8["precision"] == "kv_dtype=float8_e4m3fn" and fp8["page_size"] == 32
    assert 0 < fp8["vs_bf16_tokens_compared"] <= 16 and 0 < fp8["sample_prefix_agree_pct"] <= 100
    assert 0 <= fp8["vs_bf16_mean_abs"] <= fp8["vs_bf16_p99_abs"] <= fp8["vs_bf16_max_abs"] < 1
    assert 0 <= fp8["vs_trainer_mean_abs"] <= fp8["vs_trainer_max_abs"] < 1


def test_bad_input_names_the_choices(capsys):
    assert main(["nope"]) == 2
    assert "choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="choose from"):
        main(["decode", "--ab", "nope", "--tiny"])


def test_stream_rows_outside_engine_mode_or_negative_is_refused():
    with pytest.raises(SystemExit, match="--stream-rows: .* engine mode only, got 2 in step_only mode"):
        main(["decode", "--step-only", "--stream-rows", "2", "--tiny"])
    with pytest.raises(SystemExit, match="--stream-rows: an integer >= 0"):
        main(["decode", "--stream-rows", "-1", "--tiny"])


@pytest.mark.parametrize("argv,error", [
    (["decode", "--tuning", '{"decode_step_per_call": 4}'],
     "jrl bench decode: --tuning: unknown field(s) decode_step_per_call; allowed: cublas_decode_rows, "),
    (["prefill", "--tuning", '{"decode_steps_per_call": 0}'],
     "jrl bench prefill: --tuning: tuning.decode_steps_per_call: must be an integer >= 1"),
    (["decode", "--engine", '{"kv_dtyp": "float8_e4m3fn"}'], "jrl bench decode: --engine: unknown field(s) kv_dtyp; "),
])
def test_a_bad_tuning_or_engine_override_is_one_line_before_anything_runs(capsys, argv, error):
    assert main([*argv, "--tiny"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(error) and captured.err.count("\n") == 1


def test_grpo_lora_reports_tokens_per_second_phases_and_adapter_only_syncs(tmp_path):
    rows = bench(tmp_path, "grpo_lora", "--steps", "2", "--lora", "4")
    steps = section(rows, "step")
    assert [r["step"] for r in steps] == [0, 1] and [r["ack_version"] for r in steps] == [2, 4]
    # each version moves the adapters alone: float32, rank 4 on q k v o gate up down
    assert all(r["sync_bytes"] == 4 * r["adapter_params"] for r in steps)
    (mean,) = section(rows, "mean")
    positive(mean, "generation_ms", "logprobs_ms", "update_ms", "weight_sync_ms", "total_ms", "tokens_per_s_gpu",
             "first_step_s")
    assert mean["tokens"] == steps[1]["tokens"] == 8 * 16 + steps[1]["generated_tokens"]


@pytest.mark.parametrize("mode", ["overlapped", "interruptible"])
def test_grpo_overlapped_modes_run_every_trainer_program_before_the_rollout_thread(tmp_path, monkeypatch, mode):
    events = []
    warm, generate = grpo_module.warm_trainer, grpo_module.generate

    def warm_and_note(*args, **kwargs):
        events.append(("warm", threading.current_thread().name))
        return warm(*args, **kwargs)

    def generate_and_note(engine, params, step, *args):
        events.append((f"generate {step}", threading.current_thread().name))
        return generate(engine, params, step, *args)

    monkeypatch.setattr(grpo_module, "warm_trainer", warm_and_note)
    monkeypatch.setattr(grpo_module, "generate", generate_and_note)
    rows = bench(tmp_path, "grpo", "--steps", "2", "--mode", mode)
    assert events[0] == ("warm", threading.current_thread().name)
    assert [e for e, _ in events[1:3]] == ["generate 0", "generate 1"]
    assert all(name.startswith("bench-rollout") for _, name in events[1:])
    (warmup,) = section(rows, "warmup")
    positive(warmup, "warmup_ms")
    assert [r["ack_version"] for r in section(rows, "step")] == [0, 2]  # the warm-up updated a copy


def test_grpo_sync_mode_runs_no_warm_up(tmp_path):
    assert section(bench(tmp_path, "grpo", "--steps", "1"), "warmup") == []


def test_grpo_command_buffers_off_reaches_xla_flags_before_the_run_and_is_undone(monkeypatch):
    seen = {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setattr(grpo_module, "run", lambda args, results: seen.update(flags=os.environ["XLA_FLAGS"]))
    assert main(["grpo", "--tiny", "--command-buffers", "off"]) == 0
    assert seen["flags"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


def test_grpo_keeps_xlas_command_buffers_by_default(monkeypatch):
    seen = {}
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(grpo_module, "run", lambda args, results: seen.update(flags=os.environ.get("XLA_FLAGS")))
    assert main(["grpo", "--tiny"]) == 0
    assert seen == {"flags": None}


@pytest.mark.parametrize("stage", ["grpo", "grpo_lora"])
def test_grpo_pack_rows_reports_the_tokens_computed_beside_the_steps_tokens(tmp_path, stage):
    extra = ("--lora", "4") if stage == "grpo_lora" else ("--micro-batch", "4")
    rows = bench(tmp_path, stage, "--steps", "1", "--pack-rows", *extra)
    (step,) = section(rows, "step")
    micro, seq = (2, 16 + 8) if stage == "grpo_lora" else (4, 16 + 8)
    n = 8 if stage == "grpo_lora" else 16
    assert step["pack_rows"] is True
    assert step["tokens"] == n * 16 + step["generated_tokens"]  # the throughput's tokens: unpadded
    # packed rows: a multiple of the micro-batch, never more than one sample a row
    for key in ("computed_tokens", "logprobs_computed_tokens"):
        assert step[key] % (micro * seq) == 0 and 0 < step[key] <= n * seq


def test_decode_drift_of_an_exact_engine_is_bitwise_the_trainers(tmp_path):
    rows = bench(tmp_path, "decode", "--drift", "--engine", json.dumps({"exact_logprobs": True}))
    default, exact = section(rows, "drift")
    assert (default["precision"], exact["precision"]) == ("bfloat16", "exact_logprobs=True")
    assert exact["vs_trainer_bitwise_equal_pct"] == 100 and exact["vs_trainer_max_abs"] == 0
    assert default["vs_trainer_bitwise_equal_pct"] < 100  # the default engine's bf16 rounds its own way


def test_decode_vs_bf16_runs_the_default_engine_then_the_exact_one(tmp_path):
    rows = bench(tmp_path, "decode", "--batches", "1", "--vs-bf16", "--engine", json.dumps({"exact_logprobs": True}))
    default, exact = section(rows, "engine")
    assert exact["precision"] == "exact_logprobs=True" and "speedup_vs_bf16" not in default
    positive(exact, "decode_tokens_per_s", "speedup_vs_bf16")


def test_kernels_profiled_runs_on_a_gpu_only():
    with pytest.raises(SystemExit, match="--profiled: needs a CUDA GPU"):
        main(["kernels", "--decode", "--profiled", "--tiny"])


class FakeDriver:
    """libcuda's profiler calls, recorded with the calls of the timed function between them."""

    def __init__(self, events):
        self.events = events

    def cuProfilerStart(self):
        self.events.append("start")
        return 0

    def cuProfilerStop(self):
        self.events.append("stop")
        return 0


def test_a_profiled_timing_puts_only_the_timed_calls_in_the_profiler_range(monkeypatch):
    from jrl.bench import timing
    events = []
    monkeypatch.setattr(timing.ctypes, "CDLL", lambda name: FakeDriver(events))
    timing.timeit(lambda: events.append("call"), iters=1, reps=2, profile=True)
    assert events == ["call", "start", "call", "call", "stop"]  # the compiling call stays outside


def test_profiling_without_the_cuda_driver_names_it(monkeypatch):
    from jrl.bench import timing

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(timing.ctypes, "CDLL", missing)
    with pytest.raises(RuntimeError, match="profiling needs the CUDA driver \\(libcuda.so.1\\)"):
        with timing.profiled():
            pass


@pytest.mark.parametrize("tuned,match", [
    ('{"max_tokens": 64}', r"--tuned \{\"max_tokens\": 64\}: .*max_tokens"),
    ('{"page_size": "big"}', r"engine.page_size"),
    ('[3]', r"each config must be a JSON object of EngineConfig fields, got 3"),
])
def test_generate_refuses_a_bad_tuned_config_before_any_worker_runs(tuned, match, monkeypatch):
    import jrl.bench.generate as generate
    monkeypatch.setattr(generate, "worker", lambda *a, **k: pytest.fail("a worker started"))
    with pytest.raises(SystemExit, match=match):
        main(["generate", "--tiny", "--batches", "2", "--tuned", tuned])


def test_decode_engine_names_the_attention_that_failed_and_the_fallback_that_ran(tmp_path, monkeypatch):
    import jrl.bench.decode as decode_module

    engine_batch = decode_module.engine_batch
    calls = []

    def first_fails(engine, *args, **kwargs):
        calls.append(engine.config.attention_impl)
        if len(calls) == 1:
            raise MemoryError("out of memory")
        return engine_batch(engine, *args, **kwargs)

    monkeypatch.setattr(decode_module, "engine_batch", first_fails)
    rows = bench(tmp_path, "decode", "--batches", "2,1")
    failed, fallback = section(rows, "engine")
    assert (failed["attention_impl"], "out of memory" in failed["error"]) == ("auto", True)
    assert (fallback["attention_impl"], fallback["completions"]) == ("reference", 1)
