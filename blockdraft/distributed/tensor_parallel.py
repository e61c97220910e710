"""A rank's view of its tensor-parallel group, and the shards of the layers built under it.

Layers read `current_tensor_parallel()` once, when they are built: inside
`building_tensor_parallel(tp)` (the engine wraps model construction in it) they create only
their rank's slice of each weight, tag it with the `Shard` of the checkpoint tensor it holds
(`tag_shard`; the loader reads just that slice) and keep `tp` for their collectives. Outside it
they get no group (`None`) and build the unsharded model: one process, no collectives, the
code path of an engine without tensor parallelism.

Collectives run on the group's device backend (NCCL on GPUs, gloo on CPUs) on the current
stream, so a CUDA graph captured with them replays them (NCCL inside CUDA graphs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """The slice of a checkpoint tensor a rank's parameter holds: rows `start:stop` of `dim`
    of a tensor whose `dim` has `full` entries, then the rows of each `more` range, in order (a
    fused q|k|v tensor: a rank's heads are one range of each part). The parameter may be longer
    along `dim` (a vocabulary padded to a multiple of the ranks): its tail past `length` stays
    zero."""

    dim: int
    start: int
    stop: int
    full: int
    more: tuple[tuple[int, int], ...] = ()

    @property
    def length(self) -> int:
        """Rows of `dim` the shard holds."""
        return sum(stop - start for start, stop in self.ranges())

    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.stop), *self.more)

    def index(self, start: int | None = None, stop: int | None = None) -> tuple[slice, ...]:
        """The index of one range along `dim` (default the first)."""
        rows = slice(self.start if start is None else start, self.stop if stop is None else stop)
        return (slice(None),) * self.dim + (rows,)

    def take(self, tensor) -> torch.Tensor:
        """The shard's rows of `tensor` (a torch tensor, or a safetensors slice, read range by
        range so that nothing else is read)."""
        parts = [tensor[self.index(start, stop)] for start, stop in self.ranges()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def tag_shard(param: torch.nn.Parameter, shard: Shard) -> None:
    """Marks `param` as holding `shard` of its checkpoint tensor (read by the loader)."""
    param.tp_shard = shard


def param_shard(param: torch.Tensor) -> Shard | None:
    return getattr(param, "tp_shard", None)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group of `size` > 1 ranks."""

    rank: int
    size: int
    group: dist.ProcessGroup  # the device collectives' (NCCL on CUDA, gloo on the CPU)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of n items split evenly (n divisible by size)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def padded_split(self, n: int) -> tuple[int, int, int]:
        """(start, stop, per-rank length) of n items over the ranks, the last ones shorter
        when size does not divide n (vocabularies)."""
        per = -(-n // self.size)
        start = min(self.rank * per, n)
        return start, min(start + per, n), per

    def all_reduce(
        self,
        x: torch.Tensor,  # [..., hidden] this rank's partial sum
    ) -> torch.Tensor:  # [..., hidden] the sum over the ranks
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(
        self,
        x: torch.Tensor,  # [rows, per] this rank's slice of the last dim
    ) -> torch.Tensor:  # [rows, size * per]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (sizes each rank computes from its own memory)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


_current: TensorParallel | None = None


def current_tensor_parallel() -> TensorParallel | None:
    """The group the layers being built shard over; None: no tensor parallelism."""
    return _current


@contextlib.contextmanager
def building_tensor_parallel(tp: TensorParallel | None) -> Iterator[None]:
    """Layers built inside shard over `tp` (None: unsharded)."""
    global _current
    previous, _current = _current, tp
    try:
        yield
    finally:
        _current = previous
