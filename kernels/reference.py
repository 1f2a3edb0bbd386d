"""PyTorch reference versions of the paged-KV kernels.

These define the semantics the Triton kernels must match, and they are the
attention path on machines without a GPU.

Shapes (the flat mixed-batch layout):
  query          [T, num_heads, head_dim]      T = total new tokens in the step
  key, value     [T, num_kv_heads, head_dim]
  kv_cache       [2, num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping   [T]       int, block_id * block_size + offset; -1 = padding, skipped
  query_start_loc[R + 1]   int, request r owns query rows [qsl[r], qsl[r+1])
  seq_lens       [R]       int, context + new tokens of request r
  block_table    [R, max_blocks] int, physical block of each logical block

Causal rule: query i of request r (0-based within its new tokens) sees key
position j iff j <= context_len + i, where context_len = seq_len - query_len.
A layer's `AttentionSpan` bounds the keys from below, j >= span.first_key(context_len + i):
a sliding window W (a layer of Mistral, Gemma 3, Qwen2 with use_sliding_window) lets each
token see itself and the W - 1 keys before it, as transformers' `sliding_window_overlay` and
FlashAttention's window (W - 1, 0) do; a chunk C (Llama 4's chunked local attention on its
rotated layers) the keys of its own chunk, j // C == p // C at position p, as transformers'
`chunked_overlay` does.
With a soft cap c (Gemma 2's attn_logit_softcapping), each scaled score s becomes
c * tanh(s / c) before the mask and the softmax.
With sinks (gpt-oss' learned attention sinks, one logit per query head), head h's softmax
has one more logit, sinks[h], with no value: probs = exp(s) / (sum exp(s) + exp(sinks[h])).
An fp8 cache (float8_e4m3fn or float8_e5m2, `--kv-cache-dtype`) holds each K/V value clamped
to the format's largest finite value, then rounded to nearest (`to_cache`), and is read widened
back to float, as vLLM's fp8 cache with scales of 1.
"""

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

# Positions: one, or many elementwise (the torch path plans with numpy, the reference masks
# with tensors).
Positions = TypeVar("Positions", int, np.ndarray, torch.Tensor)


@dataclass(frozen=True, slots=True)
class AttentionSpan:
    """The earliest key a layer's query sees, where not the sequence's first: the last ``size``
    positions up to its own (a sliding window), or with ``chunked`` those of its own chunk,
    the ``size``-aligned run of positions that holds it (Llama 4's chunked local attention).
    One concept for both, since the kernels need only the lower bound and that it never
    decreases along the query: a query block's first token then bounds the keys the whole block
    reads (O(size) of them), and its last token those every row of it sees."""

    size: int
    chunked: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"an attention span of {self.size} keys hides every key")

    def first_key(self, pos: Positions) -> Positions:
        """The first key position a query at ``pos`` sees (a window's may be negative: none
        hidden yet)."""
        return pos - pos % self.size if self.chunked else pos - (self.size - 1)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's K and V into its cache slot (in place)."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = to_cache(key[valid], kv_cache.dtype)
    kv_cache[1, blocks, offsets] = to_cache(value[valid], kv_cache.dtype)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` holds it: an fp8 cache saturates (PyTorch's e5m2 cast
    would overflow to inf, which no attention recovers from)."""
    if dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    span: AttentionSpan | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every new token over its request's cached keys (one request at a time);
    with ``span``, over those from its first key on only; with ``softcap``, its
    scores soft-capped; with ``sinks``, each head's sink logit in its softmax."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    if sinks is not None:
        sinks = check_sinks(sinks, num_heads).float()
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[r] : starts[r + 1]]
        query_len = q.shape[0]
        if query_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_table[r, :num_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        scores = torch.einsum("qhd,hkd->hqk", q.float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        context_len = seq_len - query_len
        q_pos = torch.arange(query_len, device=query.device).unsqueeze(1) + context_len
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if span is not None:
            hidden |= k_pos < span.first_key(q_pos)
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:
            sink_column = sinks.view(-1, 1, 1).expand(-1, query_len, 1)
            probs = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,hkd->qhd", probs, v).to(query.dtype)
    return out


def check_sinks(sinks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``sinks`` as given; ValueError unless it holds one logit per query head (their values
    are the model's to check, once: reading them here would wait for the device)."""
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: one per query head ({num_heads})")
    return sinks
