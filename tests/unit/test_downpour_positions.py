"""Downpour resumed with another replica count: each new replica starts its new part of the
data at the run's place in it, so the epoch's remaining share is read once."""

import pytest

from scaleout.strategies.downpour.positions import data_progress, part_batches, rescaled


def test_part_batches_count_every_num_parts_th_example():
    # 1000 examples in 3 parts: 334, 333, 333 examples; batches of 64, the last one dropped
    assert [part_batches(1000, r, 3, 64) for r in range(3)] == [5, 5, 5]
    assert part_batches(10, 0, 1, 64) == 1  # a part smaller than a batch is one batch


def test_progress_is_the_mean_place_in_epochs():
    positions = [{"epoch": 1, "batch": 3}, {"epoch": 2, "batch": 0}]  # parts of 6 batches
    assert data_progress(positions, 768, 64) == pytest.approx((1.5 + 2.0) / 2)
    assert data_progress([None, None], 768, 64) == 0.0


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2), (4, 1), (1, 4)])
def test_the_remaining_share_of_the_epoch_is_read_once(old, new):
    train, batch = 6000, 50
    saved = [
        {
            "step": 300,
            "phase": 0,
            "epoch": 2,
            "batch": round(0.4 * part_batches(train, r, old, batch)),
        }
        for r in range(old)
    ]
    positions = rescaled(saved, new, train, batch, step=1200)
    assert {p["epoch"] for p in positions} == {2}
    assert all(p["step"] == 1200 // new for p in positions)
    left = sum(
        (part_batches(train, r, new, batch) - p["batch"]) * batch for r, p in enumerate(positions)
    )
    # 60% of the epoch's examples are left, to within a batch per replica
    assert abs(left - 0.6 * train) <= batch * (new + old)


def test_a_place_past_the_last_batch_turns_the_epoch():
    saved = [{"epoch": 0, "batch": 4}]  # 4 of 5 batches of one part: 0.8 of an epoch
    positions = rescaled(saved, 4, 320, 64, step=4)  # 4 parts of 80 examples: 1 batch each
    assert positions == [{"step": 1, "phase": 0, "epoch": 1, "batch": 0}] * 4
