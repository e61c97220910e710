"""The k largest values of each row: the specification (`torch.topk`, sorted, largest first) of
`blockdraft.kernels.triton_top_k`, which breaks ties by the lowest column."""

from __future__ import annotations

import torch


def top_k_torch(
    x: torch.Tensor,  # [..., V]
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # values [..., k] float32, columns [..., k] int64
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"top-k needs 1 <= k <= {x.shape[-1]} (the row length), got k={k}")
    values, columns = torch.topk(x, k, dim=-1)
    return values.float(), columns
