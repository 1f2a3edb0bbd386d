"""Per-request block tables on top of the block pool, and prefix-cache lookups.

A request's block table is ``request.block_ids`` (a plain list, so the scheduler's
hot loop reads it without a lookup). Full blocks get chained content hashes,
computed lazily into ``request.block_hashes`` and registered in the prefix cache
only once their KV has been computed (``cache_blocks`` after a step), so a hit
never points at KV that a preempted or aborted step did not write.

Meanwhile the first block of each prefill chunk a planned step computes is ``pending``:
a waiting request whose next block is one of them is admitted a step later, to hit it,
rather than compute the same prefix again beside it (a burst of prompts sharing a system
prompt computes it once; vLLM shares such blocks within the step itself).
"""

from __future__ import annotations

from hashlib import blake2b

from weir.services.scheduler.block_pool import (
    BlockPool,
    KVCacheBlock,
    chain_block_hashes,
    salted_root,
)
from weir.services.scheduler.kv_events import KVEventLog
from weir.services.scheduler.request import Request, RequestStatus
from weir.shared.arith import cdiv
from weir.shared.config import CacheConfig


class KVCacheManager:
    def __init__(self, cache_config: CacheConfig, events: KVEventLog | None = None) -> None:
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.pool = BlockPool(cache_config.num_blocks, events)
        self.long_prompt_threshold = cache_config.long_prompt_threshold
        # The first hashed full block of each prefill chunk that planned steps compute, by
        # hash: the request computing it and the block's index in it. An entry is stale
        # once its request caches the block or stops running (``_still_pending``).
        self.pending: dict[bytes, tuple[Request, int]] = {}
        self._pending_limit = 1024

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now; evictable cached blocks count as free."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (0..1)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block hashes, extended to at least ``num_blocks``."""
        hashes = request.block_hashes
        start = len(hashes)
        if start < num_blocks:
            bs = self.block_size
            hashes += chain_block_hashes(
                hashes[-1] if hashes else self._root(request),
                request.all_token_ids[start * bs : num_blocks * bs],
                bs,
                _image_digests(request, bs, start, num_blocks) if request.images else None,
            )
        return hashes

    def _root(self, request: Request) -> bytes:
        limit = self.long_prompt_threshold
        long = limit is not None and len(request.prompt_token_ids) > limit
        return salted_root(request.cache_salt, request.lora_name, long)

    def looks_up(self, request: Request) -> bool:
        """Whether ``get_computed_blocks`` looks in the cache for it: not for a request
        that asks for prompt logprobs (vLLM's rule), or that pools more than the last
        token's hidden state (each prompt position is computed for them), nor without
        prefix caching."""
        return (
            self.enable_prefix_caching
            and request.prompt_logprobs is None
            and request.pooling in (None, "LAST")
        )

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Longest cached prefix of the request's tokens, whole blocks only, and never
        all of them: the last token is always computed so the step yields logits; none
        where it does not look (``looks_up``)."""
        if not self.looks_up(request):
            return []
        get = self.pool.get_cached_block
        hits = []
        # Hashing every full block now is no waste: they are registered after prefill.
        num_blocks = (request.num_tokens - 1) // self.block_size
        for block_hash in self._block_hashes(request, num_blocks)[:num_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def computes(self, request: Request, num_computed: int, num_new: int) -> None:
        """Note the first hashed full block (a prompt's, hashed by ``get_computed_blocks``)
        that the step being planned computes for ``request`` as ``pending``: a request
        sharing the prefix finds its hits end there (the blocks before are cached, or in
        an earlier step still pending)."""
        first = num_computed // self.block_size
        if first < min((num_computed + num_new) // self.block_size, len(request.block_hashes)):
            if len(self.pending) >= self._pending_limit:
                self._drop_stale_pending()
            block_hash = request.block_hashes[first]
            held = self.pending.get(block_hash)
            if held is None or not _still_pending(held):
                self.pending[block_hash] = (request, first)

    def waits_for_pending(self, request: Request, num_hits: int) -> bool:
        """Whether the request's first block past its ``num_hits`` cached ones is one a
        running request's planned step computes (a block it could hit: never the one of
        its last token)."""
        hashes = request.block_hashes  # none where it does not look up
        limit = (request.num_tokens - 1) // self.block_size
        if num_hits >= min(len(hashes), limit) or not self.looks_up(request):
            return False
        holder = self.pending.get(hashes[num_hits])
        if holder is None:
            return False
        if not _still_pending(holder):
            del self.pending[hashes[num_hits]]
            return False
        return holder[0] is not request

    def _drop_stale_pending(self) -> None:
        """Entries are dropped when found stale, or all stale ones at once when they add
        up (each step adds at most one a prefill)."""
        self.pending = {h: e for h, e in self.pending.items() if _still_pending(e)}
        self._pending_limit = max(1024, 2 * len(self.pending))

    def num_blocks_to_admit(self, request: Request, hits: list[KVCacheBlock]) -> int:
        """Free blocks that admitting the request's whole remaining prompt consumes:
        new blocks plus the hits that are currently free (evictable)."""
        evictable = sum(1 for block in hits if block.ref_cnt == 0)
        return self.num_blocks_for(request.num_tokens) - len(hits) + evictable

    def admit(self, request: Request, hits: list[KVCacheBlock]) -> None:
        """Start the request's block table with its prefix-cache hits."""
        self.pool.touch(hits)
        request.block_ids = [block.block_id for block in hits]
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the block table to hold ``num_new_tokens`` more tokens. Returns the new
        block ids ([] when the last block has room), or None when too few are free."""
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(
            request.block_ids
        )
        if needed <= 0:
            return []
        if needed > self.pool.num_free_blocks:
            return None
        new_ids = self.pool.allocate(needed)
        request.block_ids += new_ids
        return new_ids

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        num_full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        start = request.num_cached_blocks
        if num_full <= start:
            return
        block_ids = request.block_ids
        hashes = self._block_hashes(request, num_full)
        cache_block = self.pool.cache_block
        for index in range(start, num_full):
            cache_block(block_ids[index], hashes[index])
        request.num_cached_blocks = num_full
        events = self.pool.events
        if events is not None:
            # vLLM's too: a block whose content another block already holds is reported
            # again (routers keep a set of hashes per engine).
            bs = self.block_size
            events.stored(
                hashes[start:num_full],
                hashes[start - 1] if start else None,
                request.all_token_ids[start * bs : num_full * bs],
                request.lora_name,
            )

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (see ``BlockPool``)."""
        self.pool.free(request.block_ids[::-1])
        request.block_ids = []
        request.num_cached_blocks = 0


def _image_digests(request: Request, block_size: int, start: int, stop: int) -> dict[int, bytes]:
    """The digests of the images whose tokens begin in blocks ``start`` to ``stop``, by block
    (counted from ``start``)."""
    digests: dict[int, bytes] = {}
    for image, first in zip(request.images, request.image_starts, strict=True):
        index = first // block_size - start
        if 0 <= index < stop - start:
            digest = blake2b(image, digest_size=16).digest()
            digests[index] = digests.get(index, b"") + digest
    return digests


def _still_pending(entry: tuple[Request, int]) -> bool:
    request, index = entry
    return request.status is RequestStatus.RUNNING and request.num_cached_blocks <= index
