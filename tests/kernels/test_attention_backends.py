"""Every attention backend over one step whose layers differ in KV heads and head_dim, against
the PyTorch reference called layer by layer.

Gemma 4's sliding-window layers have more KV heads, and narrower ones, than its full-attention
layers (`global_head_dim`, `num_global_key_value_heads`), so the caches of one step differ in
shape. The backend prepares the step once, with the first attention layer's cache, as the model
does; every layer then writes and attends through the backend's one metadata. The step mixes
decodes, a speculative decode, a prefill chunk over earlier context, a whole prompt and padding
tokens, over shuffled blocks; cache slots no request owns hold a large constant, so a read
through a wrong row or block changes the result. Triton runs on a GPU or under the interpreter
(tests/kernels/conftest.py).
"""

from dataclasses import replace

import pytest
import torch

from weir.kernels import cpu_native, reference
from weir.kernels.reference import AttentionSpan
from weir.services.executor.attention import AttentionMetadata, get_attention_backend

BLOCK_SIZE = 4
POISON = 30.0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (context_len, query_len): decodes, a speculative decode of 1 + 2 drafts, a prefill chunk after
# earlier context (a long query on every CPU path) and a whole prompt.
REQUESTS = [(13, 1), (40, 1), (7, 3), (11, 20), (0, 17)]
NUM_PADDING = 2
# Every request's blocks and a spare one, which the block tables' unused entries point at.
NUM_BLOCKS = sum(-(-(ctx + q) // BLOCK_SIZE) for ctx, q in REQUESTS) + 1
WINDOW = AttentionSpan(8)
# Per set: its layers' (num_kv_heads, head_dim, span) in a model's order, and their query heads.
LAYER_SETS = {
    # Gemma 4's pattern in small: sliding-window layers of 4 x 32 around a full one of 2 x 64.
    "sliding-full": (((4, 32, WINDOW), (2, 64, None), (4, 32, WINDOW)), 8),
    # Layers of one span that differ in heads only: a plan per span would not do.
    "one-span": (((4, 32, None), (2, 64, None)), 8),
    # Gemma 4's real widths, 256 and 512 channels, with few heads and a group of 4 on the full layer.
    "head-dim-512": (((2, 256, WINDOW), (1, 512, None)), 4),
}
BACKENDS = [
    "torch",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(cpu_native.load() is None, reason="native CPU kernels not built"),
    ),
    "reference",
    "triton",
]


def make_step() -> tuple[AttentionMetadata, torch.Tensor]:
    """The step's metadata (on the host) and the slots of the requests' earlier context."""
    gen = torch.Generator().manual_seed(0)
    physical = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    blocks = [-(-(ctx + q) // BLOCK_SIZE) for ctx, q in REQUESTS]
    table = torch.full((len(REQUESTS), max(blocks) + 1), physical[-1], dtype=torch.int32)
    for r, n in enumerate(blocks):
        table[r, :n] = torch.tensor(physical[:n])
        del physical[:n]
    slots, starts = [], [0]
    for r, (ctx, q) in enumerate(REQUESTS):
        pos = torch.arange(ctx + q)
        slots.append(table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + q)
    new_slots = [s[ctx:] for s, (ctx, _) in zip(slots, REQUESTS)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([ctx + q for ctx, q in REQUESTS], dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.cat([*new_slots, torch.full((NUM_PADDING,), -1)]),
        max_query_len=max(q for _, q in REQUESTS),
        max_seq_len=max(ctx + q for ctx, q in REQUESTS),
    )
    return meta, torch.cat([s[:ctx] for s, (ctx, _) in zip(slots, REQUESTS)])


def make_layer(
    num_heads: int, num_kv_heads: int, head_dim: int, context_slots: torch.Tensor, seed: int
) -> dict[str, torch.Tensor]:
    """A layer's cache holding its requests' context, and its query, key and value of the step."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(q for _, q in REQUESTS) + NUM_PADDING
    cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), POISON)
    cache.view(2, -1, num_kv_heads, head_dim)[:, context_slots] = torch.randn(
        2, len(context_slots), num_kv_heads, head_dim, generator=gen
    )
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return {
        "cache": cache,
        "query": qkv[:, :num_heads],
        "key": qkv[:, num_heads : num_heads + num_kv_heads],
        "value": qkv[:, num_heads + num_kv_heads :],
    }


@pytest.mark.parametrize("layer_set", LAYER_SETS)
@pytest.mark.parametrize("name", BACKENDS)
def test_layers_of_other_heads_in_one_step_match_reference(name, layer_set):
    shapes, num_heads = LAYER_SETS[layer_set]
    meta, context_slots = make_step()
    layers = [
        make_layer(num_heads, hkv, d, context_slots, seed)
        for seed, (hkv, d, _) in enumerate(shapes)
    ]
    num_real = int(meta.query_start_loc[-1])

    device = DEVICE if name == "triton" else "cpu"
    backend = get_attention_backend(name, device)
    step = replace(
        meta,
        **{
            field: getattr(meta, field).to(device)
            for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
        },
    )
    caches = [layer["cache"].clone().to(device) for layer in layers]
    backend.prepare(step, caches[0])
    for layer, cache, (_, head_dim, span) in zip(layers, caches, shapes, strict=True):
        want_cache = layer["cache"].clone()
        reference.reshape_and_cache(layer["key"], layer["value"], want_cache, meta.slot_mapping)
        want = reference.paged_attention(
            layer["query"],
            want_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            head_dim**-0.5,
            span=span,
        )[:num_real]

        backend.write_kv(layer["key"].to(device), layer["value"].to(device), cache, step)
        got = backend.attend(layer["query"].to(device), cache, step, head_dim**-0.5, span=span)
        assert torch.equal(cache.cpu(), want_cache)
        # Triton's fp32 products may round through tf32 on a GPU.
        tol = 2e-3 if device == "cuda" else 2e-5
        torch.testing.assert_close(got[:num_real].cpu(), want, atol=tol, rtol=5 * tol)
    if name == "torch":  # planned once for every layer of one span and shape of heads
        assert len(step.plan.plans) == len({(span, hkv) for hkv, _, span in shapes})
