"""Pages of the drafter's sliding-window layers, freed once they fall out of the window.

A drafter's sliding layers (z-lab's drafters for hybrid targets: window 2048 or 4096, then one
full layer) only ever read the last `window` keys before their queries, so a long request would
waste most of their share of the shared paged pool. Their K/V lives in a pool of its own
instead, addressed through a map from the target's block ids to pages of that pool
(`page_of`, mirrored on the device where the layers translate their block tables and slots):
a block gets a page when it is allocated within reach of the window and gives it back once every
query the drafter can still run lies more than a window past it. Blocks without a page map to
the pad page, which takes the writes of rows outside every window and is never read unmasked.

A drafter block's queries start at its anchor, the request's last committed token, whose
position (`num_tokens - 1`) only grows, so keys before `num_tokens - window` are never read
again. That holds for prompt chunks too: their first anchor is the token after the prompt.
Only without prefix caching: a shared cached block would need its page after its first owner
moved on.
"""

from __future__ import annotations

import torch

from blockdraft.engine.sequence import Sequence
from blockdraft.kernels.host_tensors import int64_tensors


def window_pages_per_seq(window: int, lookahead: int, block_size: int) -> int:
    """Pages one request can hold: the window before its anchor plus the blocks the scheduler
    reserves past it (the verify rows and the drafter block: 2 * lookahead), each end rounded
    out to a block."""
    return -(-(window + 2 * lookahead) // block_size) + 2


class DrafterWindowPages:
    def __init__(
        self,
        num_blocks: int,
        num_pages: int,
        window: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.window, self.block_size = window, block_size
        self.num_pages = num_pages
        self.pad_page = num_pages  # the pool's extra page
        self.page_of = [self.pad_page] * (num_blocks + 1)  # + the target's pad block
        # The layers' copy, updated in place (CUDA graphs read it) before each step's forwards.
        self.page_map = torch.full(
            (num_blocks + 1,), self.pad_page, dtype=torch.int64, device=device
        )
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.updates: dict[int, int] = {}  # block -> page since the last `take_updates`

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def update(self, seq: Sequence) -> None:
        """Gives pages to `seq`'s blocks within reach of its window and takes them back from
        those left behind it (after every allocation for it)."""
        table = seq.block_table
        first_needed = max(0, seq.num_tokens - self.window) // self.block_size
        start, end = seq.window_span
        for j in range(start, min(first_needed, end)):
            self._release(table[j])
        start = max(start, first_needed)
        for j in range(max(start, end), len(table)):
            self._assign(table[j])
        seq.window_span = (start, max(start, len(table)))

    def free(self, seq: Sequence) -> None:
        start, end = seq.window_span
        for block in seq.block_table[start:end]:
            self._release(block)
        seq.window_span = (0, 0)

    def take_updates(self) -> tuple[list[int], list[int]]:
        """(blocks, their pages) changed since the last call, for the device map."""
        blocks, pages = list(self.updates), list(self.updates.values())
        self.updates = {}
        return blocks, pages

    def apply(self, blocks: list[int], pages: list[int]) -> None:
        """Queues the device map's update (behind the work already queued, which still reads
        the pages it was launched with)."""
        if blocks:
            index, values = int64_tensors(self.page_map.device, blocks, pages)
            self.page_map.index_copy_(0, index, values)

    def _assign(self, block: int) -> None:
        if not self.free_pages:
            raise RuntimeError(
                f"the drafter's window pool ran out of its {self.num_pages} pages (an engine "
                "bug: it is sized for every running request's window)"
            )
        page = self.free_pages.pop()
        self.page_of[block] = self.updates[block] = page

    def _release(self, block: int) -> None:
        self.free_pages.append(self.page_of[block])
        self.page_of[block] = self.updates[block] = self.pad_page
