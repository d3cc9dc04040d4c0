"""The bundled addition task: format, held-out split, determinism, config errors."""

import numpy as np
import pytest

from jrl.config import ConfigError, from_dict
from jrl.data.tasks import AdditionConfig, AdditionTask, make_task, sft_records
from jrl.rl.tasks import TaskConfig


def test_prompt_is_zero_padded_and_answer_reversed_by_default():
    task = AdditionTask(AdditionConfig(n_digits=2))
    p = task.problem(37, 48)
    assert (p.prompt, p.answer) == ("37+48=", "58")
    assert task.problem(7, 5).prompt == "07+05="
    assert task.problem(7, 5).answer == "21"


def test_answer_in_natural_order_when_not_reversed():
    task = AdditionTask(AdditionConfig(n_digits=3, reverse_answer=False))
    assert task.problem(999, 1).answer == "1000"


def test_heldout_validation_and_training_problems_are_disjoint():
    task = AdditionTask(AdditionConfig(n_digits=1, n_heldout=25, n_validation=15))
    held = {p.prompt for p in task.heldout}
    val = {p.prompt for p in task.validation}
    assert (len(held), len(val)) == (25, 15) and held.isdisjoint(val)
    drawn = {p.prompt for p in task.sample_train(np.random.default_rng(0), 2000)}
    assert drawn.isdisjoint(held | val)
    assert len(drawn) == 100 - 40  # every trainable pair of one-digit numbers shows up


def test_heldout_set_does_not_depend_on_the_validation_size():
    assert AdditionTask(AdditionConfig(n_validation=0)).heldout == AdditionTask(AdditionConfig(n_validation=300)).heldout


def test_split_and_samples_are_deterministic_in_the_seeds():
    a, b = make_task({"seed": 3}), make_task({"seed": 3})
    assert a.heldout == b.heldout
    assert make_task({"seed": 4}).heldout != a.heldout
    assert sft_records(a, 5, seed=1) == sft_records(b, 5, seed=1)
    rec = sft_records(a, 1)[0]
    assert set(rec) == {"prompt", "response", "answer"} and rec["response"] == rec["answer"]


@pytest.mark.parametrize("data,field", [({"n_digits": 0}, "task.n_digits"),
                                        ({"n_heldout": 6000}, "task.n_heldout"), ({"n_validation": -1}, "task.n_validation"),
                                        ({"name": "sorting"}, "task.name"),
                                        ({"digits": 2}, "task.digits")])
def test_bad_task_config_names_the_field(data, field):
    with pytest.raises(ConfigError, match=field):
        from_dict(TaskConfig, data, prefix="task.")
