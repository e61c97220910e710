"""The feature ring the decode graphs copy their features into: the host's mirror finds each
replay's rows, across wraps, and knows when a next replay could overwrite rows still kept."""

import pytest
import torch

from blockdraft.runtime.feature_ring import FeatureRing


def test_the_mirror_finds_each_replays_rows_across_wraps(rng) -> None:
    capacity, width, max_batch = 11, 6, 4
    ring = FeatureRing(capacity, width, max_batch, torch.float32, torch.device("cpu"))
    forward = ring.tapped(lambda ids, pos: (None, features_of[ids.shape[0]]))
    runs, expected = [], []
    for _ in range(9):  # 9 replays of 1-4 rows: about 2 laps
        batch = int(torch.randint(1, max_batch + 1, (1,), generator=rng))
        features_of = {batch: torch.randn(batch, width, generator=rng)}
        forward(torch.zeros(batch, dtype=torch.int64), None)
        ring.replayed(batch)
        start = ring.take_start()
        assert ring.take_start() is None  # taken once
        real = int(torch.randint(1, batch + 1, (1,), generator=rng))  # the rest: padding
        runs.append((start, real))
        expected.append(features_of[batch][:real])
        # Only the runs a next replay cannot reach are still readable.
        while runs and ring.would_overwrite(runs[0][0]):
            runs.pop(0)
            expected.pop(0)
        assert runs, "the last replay's rows always fit"
        torch.testing.assert_close(ring.gather(runs), torch.cat(expected))
    assert ring.num_written > capacity
    # The device's counter, mirrored.
    assert ring.next_rows.tolist() == [(ring.num_written + i) % capacity for i in range(max_batch)]


def test_would_overwrite_is_exact() -> None:
    ring = FeatureRing(10, 2, 3, torch.float32, torch.device("cpu"))
    ring.replayed(3)
    ring.replayed(3)  # rows 0..5 written; a next replay writes 6..8 at most
    assert not ring.would_overwrite(0)
    ring.replayed(2)  # 0..7; a next one may reach 10 (= row 0 again)
    assert ring.would_overwrite(0) and not ring.would_overwrite(1)
    ring.reset()
    assert ring.num_written == 0 and ring.take_start() is None
    assert ring.next_rows.tolist() == [0, 1, 2]


def test_a_ring_must_hold_more_than_a_batch() -> None:
    with pytest.raises(ValueError, match="ring of 4 rows cannot take a batch of 4"):
        FeatureRing(4, 2, 4, torch.float32, torch.device("cpu"))
