"""The physical KV blocks: reference counts, the free queue and the prefix cache.

A block with ``ref_cnt == 0`` is free. A free block that still carries a content
hash stays findable in the prefix cache until it is reused ("evicted"). The free
queue is an ``OrderedDict`` (O(1) pop from either end and removal by id, all in C)
ordered by eviction priority: blocks without a hash hold nothing worth keeping
and sit at the front, so they are reused first; hashed blocks are appended at
the back as they are freed, so among them the least recently freed goes first.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from weir.services.scheduler.kv_events import KVEventLog

# Chained-hash root. What else changes a block's KV is mixed into the root (a LoRA
# adapter, see ``salted_root``; multimodal inputs or a cache dtype would be too); a version
# tag keeps hashes from different layouts apart.
ROOT_BLOCK_HASH = blake2b(b"weir prefix cache v1", digest_size=16).digest()


def salted_root(
    cache_salt: str | None, lora_name: str | None = None, long_rotated: bool = False
) -> bytes:
    """The chain's root for a request's ``cache_salt`` (vLLM's) and LoRA adapter: requests
    share cached blocks only with requests of the same salt, so one tenant cannot time
    another's prompts through cache hits, and of the same adapter, whose K/V differ; and
    ``long_rotated`` for a LongRoPE prompt over its threshold, whose every token rotates
    otherwise than a shorter prompt's."""
    if cache_salt is None and lora_name is None and not long_rotated:
        return ROOT_BLOCK_HASH
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    lora = b"" if lora_name is None else b"lora:" + lora_name.encode()
    long = b"\0long" if long_rotated else b""
    return blake2b(ROOT_BLOCK_HASH + salt + b"\0" + lora + long, digest_size=16).digest()


def chain_block_hashes(
    parent_hash: bytes,
    token_ids: Sequence[int],
    block_size: int,
    extras: dict[int, bytes] | None = None,
) -> list[bytes]:
    """Content hashes of consecutive full blocks, each chained to the one before it
    (the first to ``parent_hash``): a block's hash names its whole prefix. ``extras``: bytes
    mixed into the hash of the block of that index (of these), and so into every later one's
    (an image's digest into the block where its tokens begin: the same tokens of another
    image are other KV).

    blake2b over fixed-width token bytes: stable across processes and Python
    versions (unlike ``hash()``). The tokens are packed once for all the blocks.
    """
    data = struct.pack(f"<{len(token_ids)}I", *token_ids)
    stride = 4 * block_size
    hashes = []
    for offset in range(0, len(data) - stride + 1, stride):
        block = data[offset : offset + stride]
        if extras:
            block += extras.get(offset // stride, b"")
        parent_hash = blake2b(parent_hash + block, digest_size=16).digest()
        hashes.append(parent_hash)
    return hashes


@dataclass(slots=True, eq=False)  # identity: two free blocks are not "equal"
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        self.events = events  # where evictions and resets are told, if anywhere
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (evicting their cached content); the caller
        has checked ``num_free_blocks``."""
        pop = self.free_queue.popitem
        events = self.events
        ids = []
        for _ in range(num_blocks):
            block_id, block = pop(last=False)
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                if events is not None:
                    events.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        free_queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                del free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, in the given order (the caller passes a
        request's blocks tail first, so its tail is evicted before its head)."""
        blocks = self.blocks
        free_queue = self.free_queue
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free_queue[block_id] = block
                if block.block_hash is None:
                    free_queue.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Make a computed full block findable by its hash. When identical content is
        already cached in another block, that one stays the canonical copy."""
        if block_hash not in self.cached_blocks:
            block = self.blocks[block_id]
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's content, so no later request reads it: free ones are
        plain free blocks, ones in use stay with their requests and are freed uncached.
        Returns how many blocks were cached."""
        dropped = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        if self.events is not None:
            self.events.cleared()
        return dropped

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)
