"""Requests in a paged KV cache with shuffled, non-contiguous blocks, kept test-side: the
flat batch and attention metadata of a step, built without the scheduler or the runner."""

import torch

from weir.services.executor.attention import AttentionMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 40


class PagedRequests:
    """Test-side bookkeeping of requests in a paged cache with shuffled, non-contiguous blocks."""

    def __init__(self, seed: int) -> None:
        self.free = torch.randperm(
            NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)
        ).tolist()
        self.blocks: dict[str, list[int]] = {}

    def step(
        self, work: list[tuple[str, list[int], int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """work: (request, all its token ids so far, num_computed_tokens); every uncomputed token runs."""
        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for req, tokens, computed in work:
            blocks = self.blocks.setdefault(req, [])
            while len(blocks) * BLOCK_SIZE < len(tokens):
                blocks.append(self.free.pop())
            for pos in range(computed, len(tokens)):
                ids.append(tokens[pos])
                positions.append(pos)
                slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            qsl.append(len(ids))
            seq_lens.append(len(tokens))
            tables.append(blocks)
        width = max(len(t) for t in tables)
        table = torch.full((len(tables), width), -1, dtype=torch.int32)
        for r, t in enumerate(tables):
            table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        query_lens = [b - a for a, b in zip(qsl, qsl[1:])]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(ids), torch.tensor(positions), meta
