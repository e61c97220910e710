"""Where a never-drafting step's target features wait for the drafter's deferred context write
without costing the host anything: the target's one-row (decode) graphs copy their features into
this device ring themselves, at a row counter the device keeps, so a step at N = 0 keeps no
tensor of its own (a clone of the features' graph output cost ~15 us of host time a step, ~1.5%
of a small target's step on an H100).

The host mirrors the counter (every replay of a tapped graph advances it by the graph's padded
batch) and so knows the ring rows of each step's real rows; the draft launcher writes the
deferred rows before a replay could wrap onto them (`would_overwrite`). Off CUDA the graphs are
eager twins that run the same tap.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdraft.kernels.host_tensors import int64_tensors

ForwardFn = Callable[[torch.Tensor, torch.Tensor], object]


class FeatureRing:
    def __init__(
        self,
        capacity: int,  # rows
        width: int,  # K * hidden
        max_batch: int,  # the largest decode graph's batch
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if capacity <= max_batch:
            raise ValueError(f"a ring of {capacity} rows cannot take a batch of {max_batch}")
        self.capacity, self.max_batch = capacity, max_batch
        # [max_batch] the ring rows a next replay writes: the device's counter (+ 0, 1, ...,
        # wrapped), advanced in place by each replay (two launches besides the copy).
        self.next_rows = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.rows = torch.empty(capacity, width, dtype=dtype, device=device)  # [capacity, width]
        self.num_written = 0  # the host's mirror of the counter, unwrapped
        self._last_start: int | None = None  # unwrapped row of the last replay's first row

    def tapped(self, forward: ForwardFn) -> ForwardFn:
        """`forward` (returning (hidden, features)) that also copies its features into the
        ring at the device's counter and advances it: captured with the graph."""

        def forward_and_keep(input_ids: torch.Tensor, positions: torch.Tensor) -> object:
            out = forward(input_ids, positions)
            features = out[1]  # [batch, K * hidden]
            batch = features.shape[0]
            self.rows.index_copy_(0, self.next_rows[:batch], features)
            self.next_rows.add_(batch).remainder_(self.capacity)
            return out

        return forward_and_keep

    def reset(self) -> None:
        """Forgets the rows written so far (a capture's warm-up runs): counter and mirror at 0."""
        torch.arange(self.max_batch, out=self.next_rows)
        self.num_written, self._last_start = 0, None

    def replayed(self, batch: int) -> None:
        """A tapped graph of `batch` (padded) rows was replayed: the mirror follows the device."""
        self._last_start = self.num_written
        self.num_written += batch

    def take_start(self) -> int | None:
        """The unwrapped ring row of the first row of the forward just run when it was a tapped
        replay, else None; taken once (an eager forward after it gets None)."""
        start, self._last_start = self._last_start, None
        return start

    def would_overwrite(self, first_kept: int) -> bool:
        """Whether a next replay (of up to `max_batch` rows) could wrap onto the rows kept since
        the unwrapped row `first_kept`."""
        return self.num_written + self.max_batch - first_kept > self.capacity

    def gather(self, runs: list[tuple[int, int]]) -> torch.Tensor:  # [rows, K * hidden]
        """The rows of each (unwrapped first row, count) run, in order."""
        index = [(start + i) % self.capacity for start, n in runs for i in range(n)]
        return self.rows[int64_tensors(self.rows.device, index)[0]]
