"""Paged KV-cache blocks: allocation, reference counts and prefix caching.

Hybrid models also give each request holding blocks one state slot (its linear-attention
layers' conv and recurrent states), taken with its first blocks and freed with them. A drafter
with sliding-window layers gives its blocks pages of its window pool (window_pages.py).

A full block whose tokens are all computed is registered under a hash of (previous block's
hash, its token ids); a new request whose prompt starts with the same tokens shares the block
instead of recomputing it. Freed blocks keep their hash and stay reusable until a fresh
allocation takes them (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict

from blockdraft.engine.sequence import Sequence
from blockdraft.engine.window_pages import DrafterWindowPages


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_state_slots: int = 0,  # hybrid models: requests that can hold a state slot
        window_pages: DrafterWindowPages | None = None,
    ) -> None:
        if window_pages is not None and enable_prefix_caching:
            raise ValueError("the drafter's window pages cannot follow prefix-cached blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.window_pages = window_pages
        self.uses_state_slots = num_state_slots > 0
        self.free_state_slots = list(range(num_state_slots))
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_key: dict[int, tuple] = {}  # block id -> (parent hash, token ids)
        self.cached: dict[tuple, int] = {}  # (parent hash, token ids) -> block id
        # `free` calls so far: a block freed since a count was taken may belong to another
        # request by now (a drafter with window pages writes its deferred context then).
        self.num_frees = 0
        # Blocks taken fresh since the engine last looked (None: not tracked): a drafter's
        # deferred context rows in such a block must land before its new owner's.
        self.reallocated: set[int] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _block_keys(
        self, token_ids: list[int], first: int, end: int, parent: int | None
    ) -> list[tuple]:
        """Keys of blocks first .. end-1; `parent` is the hash of block first-1's key."""
        keys = []
        for i in range(first, end):
            key = (parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            keys.append(key)
            parent = hash(key)
        return keys

    def _take(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_blocks[block_id]
        self.ref_counts[block_id] += 1

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Share the cached blocks that match the start of `seq`; returns tokens covered.
        At least one token is always left to compute, so the step has logits to sample from."""
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        seq.last_block_hash = None
        for key in self._block_keys(seq.token_ids, 0, max_blocks, None):
            block_id = self.cached.get(key)
            if block_id is None:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.last_block_hash = hash(key)
        seq.num_hashed_blocks = len(seq.block_table)
        return len(seq.block_table) * self.block_size

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` enough blocks for `num_tokens` positions (and a state slot, on hybrid
        models); False (and nothing allocated) when the pool cannot."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        needs_slot = self.uses_state_slots and seq.state_slot is None
        if needs_slot and not self.free_state_slots:
            return False
        if needed > len(self.free_blocks):
            return False
        if needs_slot:
            seq.state_slot = self.free_state_slots.pop()
        for _ in range(needed):
            block_id, _ = self.free_blocks.popitem(last=False)
            key = self.block_key.pop(block_id, None)
            if key is not None and self.cached.get(key) == block_id:
                del self.cached[key]  # evict: its contents are about to be overwritten
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
            if self.reallocated is not None:
                self.reallocated.add(block_id)
        if self.window_pages is not None:
            self.window_pages.update(seq)
        return True

    def register_computed_blocks(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        # Only the newly full blocks are hashed: chaining from the last registered block's
        # hash keeps a long request's per-step cost flat instead of growing with its length.
        first = seq.num_hashed_blocks
        keys = self._block_keys(seq.token_ids, first, num_full, seq.last_block_hash)
        for block_id, key in zip(seq.block_table[first:num_full], keys, strict=True):
            if key not in self.cached:
                self.cached[key] = block_id
                self.block_key[block_id] = key
        seq.num_hashed_blocks, seq.last_block_hash = num_full, hash(keys[-1])

    def free(self, seq: Sequence) -> None:
        self.num_frees += 1
        if self.window_pages is not None:
            self.window_pages.free(seq)
        # Release the tail first so that, among a sequence's blocks, its prefix is evicted last.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
