"""The prefix cache's changes, as vLLM reports them to KV-cache-aware routers.

A full block becomes findable by its hash (``BlockStored``, one event for the blocks a
request caches at once, with their tokens and the hash of the block before them), a
cached block is evicted for reuse (``BlockRemoved``), or the whole cache is forgotten
(``AllBlocksCleared``: a prefix cache reset, or a new executor group's empty cache). A
router rebuilds each block's identity from the tokens and the chain of parents, so the
hashes only have to be consistent within this engine.

Events are kept as vLLM's positional msgpack arrays (msgspec's ``array_like`` tagged
structs, the format every vLLM consumer reads), ready for the publisher to pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# vLLM's medium name for the engine's own KV cache (its CPU backend says GPU too); routers
# take it as the cache's tier.
MEDIUM = "GPU"


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM publishes it by default: its last 8 bytes, a big-endian
    unsigned 64-bit integer."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventLog:
    """The events since the last ``take``, oldest first."""

    __slots__ = ("block_size", "events")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[list[Any]] = []

    def stored(
        self,
        block_hashes: Sequence[bytes],
        parent_hash: bytes | None,
        token_ids: list[int],
        lora_name: str | None,
    ) -> None:
        self.events.append(
            [
                "BlockStored",
                [external_hash(h) for h in block_hashes],
                None if parent_hash is None else external_hash(parent_hash),
                token_ids,
                self.block_size,
                None,  # lora_id: vLLM's integer adapter id, which Weir has not; the name is next
                MEDIUM,
                lora_name,
            ]
        )

    def removed(self, block_hash: bytes) -> None:
        """One evicted block; those evicted one after another share an event."""
        events = self.events
        if events and events[-1][0] == "BlockRemoved":
            events[-1][1].append(external_hash(block_hash))
        else:
            events.append(["BlockRemoved", [external_hash(block_hash)], MEDIUM])

    def cleared(self) -> None:
        self.events = [["AllBlocksCleared"]]  # what came before no longer matters

    def take(self) -> list[list[Any]]:
        events, self.events = self.events, []
        return events
