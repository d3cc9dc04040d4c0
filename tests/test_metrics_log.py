"""The JSONL metrics log: appends, durability hooks, torn tails, resume truncation."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jrl import leftovers
from jrl.metrics_log import MetricsLog, read_metrics


def lines_of(path) -> list[str]:
    return path.read_text().splitlines()


def test_each_row_is_one_json_line_in_order(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 1, "policy_version": 1, "loss": 2.5})
    log.append({"step": 2, "policy_version": 2, "loss": 2.25})
    assert [json.loads(line) for line in lines_of(log.path)] == [
        {"step": 1, "policy_version": 1, "loss": 2.5},
        {"step": 2, "policy_version": 2, "loss": 2.25},
    ]


def test_appended_rows_reach_the_file_without_an_explicit_flush(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 0, "loss": 1.0})
    assert read_metrics(log.path) == [{"step": 0, "loss": 1.0}]


def test_numpy_and_jax_values_are_written_as_plain_numbers(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.append({"step": np.int64(3), "loss": jnp.float32(0.5), "lr": np.float64(1e-3),
                "hist": np.arange(3)})
    assert read_metrics(log.path) == [{"step": 3, "loss": 0.5, "lr": 1e-3, "hist": [0, 1, 2]}]


def test_non_finite_values_are_written_as_null_in_strict_json(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.append({"step": 1, "reward_mean": float("nan"), "kl": np.float32("inf"), "hist": np.array([1.0, -np.inf])})

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    (line,) = lines_of(log.path)
    assert json.loads(line, parse_constant=refuse) == {"step": 1, "reward_mean": None, "kl": None, "hist": [1.0, None]}


def test_creates_missing_parent_directories(tmp_path):
    log = MetricsLog(tmp_path / "runs" / "a" / "metrics.jsonl")
    log.append({"step": 1})
    log.flush_and_sync()
    assert read_metrics(tmp_path / "runs" / "a" / "metrics.jsonl") == [{"step": 1}]


@pytest.mark.parametrize("row", [{"loss": 1.0}, {"step": -1}, {"step": 1.5}, {"step": True}])
def test_rows_need_a_nonnegative_int_step(tmp_path, row):
    with pytest.raises(ValueError, match="step"):
        MetricsLog(tmp_path / "m.jsonl").append(row)


def test_a_value_that_is_not_json_is_named(tmp_path):
    with pytest.raises(ValueError, match="metrics row field 'note'"):
        MetricsLog(tmp_path / "m.jsonl").append({"step": 1, "note": object()})


def test_truncate_after_drops_later_rows_and_counts_them(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 7):
        log.append({"step": step, "loss": float(step)})
    assert log.truncate_after(4) == 2
    assert [r["step"] for r in read_metrics(log.path)] == [1, 2, 3, 4]


def test_appending_after_truncation_continues_the_curve(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 5):
        log.append({"step": step})
    log.truncate_after(2)
    log.append({"step": 3, "resumed": True})
    assert read_metrics(log.path) == [{"step": 1}, {"step": 2}, {"step": 3, "resumed": True}]


def test_truncate_after_of_a_missing_file_is_a_no_op(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    assert log.truncate_after(10) == 0
    assert not log.path.exists()


def test_truncate_after_leaves_no_temporary_files(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 1})
    log.append({"step": 2})
    log.truncate_after(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_torn_last_line_is_ignored_by_readers_and_dropped_by_truncation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    assert MetricsLog(path).truncate_after(5) == 0
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_reopening_after_a_torn_last_line_appends_on_a_fresh_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    MetricsLog(path).append({"step": 2, "loss": 0.5})
    assert read_metrics(path) == [{"step": 1}, {"step": 2, "loss": 0.5}]


def test_a_corrupt_line_in_the_middle_is_reported_with_its_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(path)


def test_truncate_after_validates_the_step(tmp_path):
    with pytest.raises(ValueError, match="step must be an int >= 0, got -3"):
        MetricsLog(tmp_path / "m.jsonl").truncate_after(-3)


def test_flush_and_sync_keeps_the_log_usable(tmp_path):
    with MetricsLog(tmp_path / "m.jsonl") as log:
        log.append({"step": 1})
        log.flush_and_sync()
        log.append({"step": 2})
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2]


def test_truncation_keeps_the_staged_file_of_a_live_writer(tmp_path):
    # a killed writer's staged file goes (tests/test_run_faults.py); one of a process still alive stays
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 1})
    live = tmp_path / leftovers.owned_name(".metrics.jsonl.truncate-")  # this process's
    live.write_text("")
    log.truncate_after(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "metrics.jsonl"]
