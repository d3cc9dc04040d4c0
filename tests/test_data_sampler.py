"""The sampler: full epochs, a different order per epoch, the same stream after resume."""

import numpy as np
import pytest

from jrl.data import EpochSampler


def test_every_epoch_is_a_permutation_and_epochs_differ():
    s = EpochSampler(10, seed=3)
    first, second = s.take(10), s.take(10)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(10))
    assert first.tolist() != second.tolist()


def test_resume_from_saved_cursor_continues_the_same_stream():
    straight = EpochSampler(7, seed=1)
    expected = np.concatenate([straight.take(3) for _ in range(6)])
    a = EpochSampler(7, seed=1)
    head = np.concatenate([a.take(3) for _ in range(2)])
    b = EpochSampler(7, seed=1)
    b.load_state_dict(a.state_dict())
    tail = np.concatenate([b.take(3) for _ in range(4)])
    np.testing.assert_array_equal(np.concatenate([head, tail]), expected)


def test_batches_cross_epoch_boundaries():
    s = EpochSampler(4, seed=0)
    batch = s.take(6)
    assert sorted(batch[:4].tolist()) == [0, 1, 2, 3]
    assert s.epoch == 1 and s.cursor == 6


def test_seed_changes_the_order():
    assert EpochSampler(20, seed=0).take(20).tolist() != EpochSampler(20, seed=1).take(20).tolist()


def test_no_shuffle_is_sequential():
    assert EpochSampler(3, seed=0, shuffle=False).take(5).tolist() == [0, 1, 2, 0, 1]


def test_state_for_other_data_is_rejected():
    s = EpochSampler(5, seed=0)
    with pytest.raises(ValueError, match="data changed since the checkpoint"):
        s.load_state_dict({"cursor": 3, "n": 6, "seed": 0})


def test_a_state_saved_with_the_other_shuffle_setting_is_rejected():
    # its cursor is a position in the other order: data.shuffle switched on resume went on
    # without a word, repeating rows of the epoch under way and skipping others
    shuffled = EpochSampler(5, seed=0)
    shuffled.take(3)
    in_order = EpochSampler(5, seed=0, shuffle=False)
    with pytest.raises(ValueError, match=r"^sampler state is for rows in shuffled order, but this sampler hands "
                                         r"them out in source order: the data changed since the checkpoint$"):
        in_order.load_state_dict(shuffled.state_dict())
    assert in_order.cursor == 0
    in_order.load_state_dict({"cursor": 3, "n": 5, "seed": 0})  # a state saved before the field existed
    assert in_order.cursor == 3
