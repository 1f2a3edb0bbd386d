"""Batched paged attention for the CPU: the semantics of `weir.kernels.reference`, fast.

The reference runs one request at a time, which on a CPU costs a dozen small operator
calls per request per layer. Here the step is planned once (`plan_step`, host-side NumPy) for
each span and shape of heads its layers have, and every layer then runs a handful of large
operators that reuse its plan:

* Short queries (decodes and speculative decodes, `query_len <= SHORT_QUERY_MAX`) are
  grouped into buckets of equal query length and similar sequence length. The query heads
  sharing a KV head are folded into the query axis, so each KV head is read once for all
  of them. A bucket gathers its keys with one `index_select` straight into
  `[requests, kv_heads, padded_seq, head_dim]`, scores them with one `bmm`, adds the mask,
  and takes the softmax; `embedding_bag` then sums the value rows weighted by the
  probabilities, reading them from the paged cache without gathering them first. (SDPA's
  CPU kernel is several times slower on these few-row queries.)
* Long queries (prefill chunks) run one SDPA per request over its gathered context, causal
  without a mask when there is no earlier context.

With a soft cap c (Gemma 2's attn_logit_softcapping), each scaled score s becomes
c * tanh(s / c) before the mask: in place on a bucket's scores, and, since SDPA cannot cap,
by an explicit float32 attention for long queries. Attention sinks (gpt-oss) join each
softmax as one more logit per query head, and likewise take the explicit path for long
queries.

The cache stays paged: gathers read the blocks through the block table every layer. With a
span (a sliding window W or a chunk C), a request gathers only from the first key its first
query sees, so a short query reads at most W + Q - 1 (C + Q - 1) keys however long its
sequence, and the masks hide the keys below each later query's first.
"""

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from weir.kernels.reference import AttentionSpan, check_sinks, to_cache

SHORT_QUERY_MAX = 8
# Each bucket costs about eight operator calls per layer, so a bucket splits only where that
# saves more than this many padded key positions. On benchmarks/executor_step.py 512 and 2048
# measured the same, and a single bucket (all padding kept) made decode attention ~13% slower.
BUCKET_SPLIT_TOKENS = 512


@dataclass(slots=True)
class ShortBucket:
    """Requests with the same query length Q, padded to the bucket's longest sequence S."""

    num_reqs: int
    query_len: int  # Q
    seq_len: int  # S: keys gathered per request, from its first visible one
    query_rows: torch.Tensor  # [R * Q] int64 flat batch row of query i of request r
    kv_rows: torch.Tensor  # [R * Hkv * S] int64 rows of the cache viewed as [slots * Hkv, D]
    bag_rows: torch.Tensor  # [R * Hkv * Q * G, S] the same rows for each folded query row
    mask: torch.Tensor | None  # [R, 1, Q * G, S] additive; None when nothing is masked


@dataclass(slots=True)
class LongQuery:
    start: int
    end: int
    kv_rows: torch.Tensor  # [Hkv * S] int64, S keys from the first one its first query sees
    mask: torch.Tensor | None  # [Q, S] bool (True = attend); None = plain causal (no context)


@dataclass(slots=True)
class CacheWrites:
    """Where one step's tokens write K and V: the same for every layer, whatever its heads."""

    slots: torch.Tensor  # [n] int64 cache slots of the tokens that write K/V
    rows: torch.Tensor | None  # [n] their rows in the flat batch; None = every row, in order


@dataclass(slots=True)
class StepPlan:
    """Index tensors of one step, derived once and shared by every layer of its span and heads
    (the KV rows and the folded query rows depend on the KV heads and the group)."""

    num_kv_heads: int
    group: int  # query heads per KV head
    short: list[ShortBucket]
    long: list[LongQuery]


_PlanT = TypeVar("_PlanT", CacheWrites, StepPlan)


def plan_writes(slot_mapping: torch.Tensor, device: torch.device | str = "cpu") -> CacheWrites:
    """`reshape_and_cache`'s rows and slots from the reference's slot mapping (a CPU tensor):
    tokens with slot -1 (padding) write nothing."""
    slots = slot_mapping.numpy().astype(np.int64)
    valid = slots >= 0
    if valid.all():
        writes = CacheWrites(torch.from_numpy(slots), None)
    else:
        writes = CacheWrites(
            torch.from_numpy(slots[valid]), torch.from_numpy(np.flatnonzero(valid))
        )
    return writes if torch.device(device).type == "cpu" else _on(writes, device)


def plan_step(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device | str = "cpu",
    span: AttentionSpan | None = None,
) -> StepPlan:
    """Host-side planning from the reference's metadata (CPU tensors); the plan's tensors go to
    `device`. With `span` (the reference's), each token attends to the keys from its first
    visible one (its window's or its chunk's) up to its own, and no key below its request's
    first query's first is gathered."""
    qsl = query_start_loc.numpy().astype(np.int64)
    lens = seq_lens.numpy().astype(np.int64)
    table = block_table.numpy()
    group = num_heads // num_kv_heads

    query_lens = qsl[1:] - qsl[:-1]
    # The first key any query of a request sees: its first query's.
    first_keys = (
        np.zeros_like(lens) if span is None else np.maximum(span.first_key(lens - query_lens), 0)
    )
    short_reqs = np.flatnonzero((query_lens > 0) & (query_lens <= SHORT_QUERY_MAX))
    long_reqs = np.flatnonzero(query_lens > SHORT_QUERY_MAX)
    short = [
        _short_bucket(reqs, qsl, lens, first_keys, table, block_size, num_kv_heads, group, span)
        for reqs in _buckets(short_reqs, query_lens, lens - first_keys)
    ]
    long = [
        _long_query(int(r), qsl, lens, first_keys, table, block_size, num_kv_heads, span)
        for r in long_reqs
    ]
    plan = StepPlan(num_kv_heads, group, short, long)
    return plan if torch.device(device).type == "cpu" else _on(plan, device)


def _on(plan: _PlanT, device: torch.device | str) -> _PlanT:
    moved = _to_device(plan, device)
    assert isinstance(moved, type(plan))
    return moved


def _to_device(obj: object, device: torch.device | str) -> object:
    """A copy of a plan (or one of its parts) with every tensor on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [_to_device(x, device) for x in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj,
            **{f.name: _to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)},
        )
    return obj


def _buckets(reqs: np.ndarray, query_lens: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    """Split requests by query length, then, longest first (`lens`: keys gathered per request),
    wherever the padding a split saves (rows left x shorter length) exceeds BUCKET_SPLIT_TOKENS."""
    buckets = []
    for q in np.unique(query_lens[reqs]):
        same_q = reqs[query_lens[reqs] == q]
        ordered = same_q[np.argsort(-lens[same_q], kind="stable")]
        ordered_lens = lens[ordered]
        start = 0
        for i in range(1, len(ordered)):
            if (ordered_lens[start] - ordered_lens[i]) * (len(ordered) - i) > BUCKET_SPLIT_TOKENS:
                buckets.append(ordered[start:i])
                start = i
        buckets.append(ordered[start:])
    return buckets


def _kv_rows(
    table: np.ndarray,
    reqs: np.ndarray,
    lens: np.ndarray,
    first_keys: np.ndarray,
    seq_len: int,
    block_size: int,
    num_kv_heads: int,
) -> np.ndarray:
    """[R, Hkv, S] rows of the cache viewed as [num_blocks * block_size * Hkv, D], of S positions
    from each request's first key. Positions past a request's length repeat its last token, so
    padding reads real data and the mask hides it."""
    pos = np.minimum(
        first_keys[reqs][:, None] + np.arange(seq_len)[None, :], lens[reqs][:, None] - 1
    )  # [R, S]
    blocks = np.take_along_axis(table[reqs], pos // block_size, axis=1).astype(np.int64)
    token_slots = blocks * block_size + pos % block_size
    rows: np.ndarray = (
        token_slots[:, None, :] * num_kv_heads + np.arange(num_kv_heads)[None, :, None]
    )
    return rows


def _visible(
    reqs: np.ndarray,
    lens: np.ndarray,
    first_keys: np.ndarray,
    query_len: int,
    seq_len: int,
    span: AttentionSpan | None,
) -> np.ndarray:
    """[R, Q, S] whether query i of each request sees its gathered key j (position
    first_key + j): iff that is <= context_len + i, and with a span from its first key on."""
    key_pos = first_keys[reqs][:, None, None] + np.arange(seq_len)[None, None, :]
    query_pos = (lens[reqs] - query_len)[:, None, None] + np.arange(query_len)[None, :, None]
    visible: np.ndarray = key_pos <= query_pos
    if span is not None:
        visible &= key_pos >= span.first_key(query_pos)
    return visible


def _short_bucket(
    reqs: np.ndarray,
    qsl: np.ndarray,
    lens: np.ndarray,
    first_keys: np.ndarray,
    table: np.ndarray,
    block_size: int,
    num_kv_heads: int,
    group: int,
    span: AttentionSpan | None,
) -> ShortBucket:
    query_len = int(qsl[reqs[0] + 1] - qsl[reqs[0]])
    seq_len = int((lens[reqs] - first_keys[reqs]).max())
    query_rows = qsl[reqs][:, None] + np.arange(query_len)[None, :]  # [R, Q]
    kv_rows = _kv_rows(table, reqs, lens, first_keys, seq_len, block_size, num_kv_heads)
    visible = _visible(reqs, lens, first_keys, query_len, seq_len, span)
    mask = None
    if not visible.all():
        additive = np.where(visible, np.float32(0), np.float32(-np.inf))
        mask = torch.from_numpy(
            np.repeat(additive, group, axis=1)[:, None]
        )  # row i*G + g, as folded
    return ShortBucket(
        num_reqs=len(reqs),
        query_len=query_len,
        seq_len=seq_len,
        query_rows=torch.from_numpy(query_rows.reshape(-1)),
        kv_rows=torch.from_numpy(kv_rows.reshape(-1)),
        bag_rows=torch.from_numpy(
            np.repeat(kv_rows, query_len * group, axis=1).reshape(-1, seq_len)
        ),
        mask=mask,
    )


def _long_query(
    r: int,
    qsl: np.ndarray,
    lens: np.ndarray,
    first_keys: np.ndarray,
    table: np.ndarray,
    block_size: int,
    num_kv_heads: int,
    span: AttentionSpan | None,
) -> LongQuery:
    reqs = np.array([r])
    start, end = int(qsl[r]), int(qsl[r + 1])
    seq_len = int(lens[r] - first_keys[r])
    kv_rows = _kv_rows(table, reqs, lens, first_keys, seq_len, block_size, num_kv_heads)
    mask = None
    # Keys gathered from the first query's own on, none of them hidden from the last query by
    # its span, is SDPA's own causal case: no mask to build or read.
    hidden = span is not None and span.first_key(int(lens[r]) - 1) > first_keys[r]
    if seq_len != end - start or hidden:
        visible = _visible(reqs, lens, first_keys, end - start, seq_len, span)
        mask = torch.from_numpy(visible[0])
    return LongQuery(start, end, torch.from_numpy(kv_rows.reshape(-1)), mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, writes: CacheWrites
) -> None:
    """Write each token's K and V into its cache slot (in place); tokens with slot -1 are skipped.
    An fp8 cache takes them converted (saturating), as bytes: PyTorch copies no fp8 rows."""
    rows = kv_cache.shape[2] * kv_cache.shape[1]
    if writes.rows is not None:
        key, value = key[writes.rows], value[writes.rows]
    for half, new in ((kv_cache[0], key), (kv_cache[1], value)):
        new = to_cache(new.flatten(1), kv_cache.dtype)
        if kv_cache.element_size() == 1:
            half, new = half.view(torch.uint8), new.view(torch.uint8)
        half.view(rows, -1).index_copy_(0, writes.slots, new)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: StepPlan,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, H, D] -> [T, H, D]; rows of no request (padding) are left unset. With
    `softcap`, the scores are soft-capped as the reference's; with `sinks`, each head's sink
    logit joins its softmax."""
    if softcap is not None and softcap <= 0:
        raise ValueError(f"a soft cap of {softcap} is not positive")
    head_dim = query.shape[2]
    hkv, group = plan.num_kv_heads, plan.group
    if sinks is not None:
        # [Hkv, G]: the sinks of the query heads folded into a KV head's rows.
        sinks = check_sinks(sinks, hkv * group).float().view(hkv, 1, group)
    key_rows = kv_cache[0].view(-1, head_dim)
    value_rows = kv_cache[1].view(-1, head_dim)
    # Rows of another dtype than the query's (fp8; bfloat16 under a float32 model) are read
    # converted: embedding_bag takes no fp8 table, and bfloat16 probabilities would round.
    widen = kv_cache.dtype != query.dtype
    out = torch.empty_like(query)
    for b in plan.short:
        r, qg, s = b.num_reqs, b.query_len * group, b.seq_len
        k = key_rows.index_select(0, b.kv_rows).view(r * hkv, s, head_dim).to(torch.float32)
        # [R*Q, H, D] -> [R*Hkv, Q*G, D], row i*G + g.
        qb = query.index_select(0, b.query_rows).view(r, b.query_len, hkv, group, head_dim)
        qb = qb.transpose(1, 2).reshape(r * hkv, qg, head_dim).to(torch.float32) * scale
        scores = torch.bmm(qb, k.transpose(1, 2)).view(r, hkv, qg, s)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        if b.mask is not None:
            scores += b.mask
        if sinks is not None:
            column = sinks.expand(hkv, b.query_len, group).reshape(1, hkv, qg, 1)
            scores = torch.cat((scores, column.expand(r, -1, -1, -1)), dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :s]
        if widen:
            v = value_rows.index_select(0, b.kv_rows).view(r * hkv, s, head_dim).float()
            o = torch.bmm(probs.reshape(r * hkv, qg, s), v).view(-1, head_dim)
        else:
            probs = probs.reshape(-1, s).to(value_rows.dtype)
            o = F.embedding_bag(b.bag_rows, value_rows, per_sample_weights=probs, mode="sum")
        o = (
            o.view(r, hkv, b.query_len, group, head_dim)
            .transpose(1, 2)
            .reshape(-1, hkv * group, head_dim)
        )
        out.index_copy_(0, b.query_rows, o.to(out.dtype))
    for lq in plan.long:
        s = len(lq.kv_rows) // hkv
        k = key_rows.index_select(0, lq.kv_rows).view(1, hkv, s, head_dim)
        v = value_rows.index_select(0, lq.kv_rows).view(1, hkv, s, head_dim)
        if widen:
            k, v = k.to(query.dtype), v.to(query.dtype)
        q = query[lq.start : lq.end].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, H, Q, D]
        if softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=lq.mask, is_causal=lq.mask is None, scale=scale, enable_gqa=True
            )
        else:
            o = _explicit_attention(q, k, v, lq.mask, scale, softcap, sinks)
        out[lq.start : lq.end] = o[0].transpose(0, 1)
    return out


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA's result for q [1, H, Q, D] over k, v [1, Hkv, S, D] (mask [Q, S] True = attend;
    None = causal with Q == S) with the scores soft-capped and the sinks ([Hkv, 1, G]) in the
    softmax where given, in float32 as the reference."""
    _, num_heads, query_len, head_dim = q.shape
    hkv, seq_len = k.shape[1], k.shape[2]
    # Query head h reads KV head h // group: the group's heads share one broadcast K and V.
    qg = q.view(hkv, num_heads // hkv, query_len, head_dim).float()
    k, v = k[0].unsqueeze(1).float(), v[0].unsqueeze(1).float()  # [Hkv, 1, S, D]
    scores = qg @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.transpose(1, 2).unsqueeze(-1).expand(-1, -1, query_len, 1)
        scores = torch.cat((scores, column), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :seq_len]
    return (probs @ v).view(1, num_heads, query_len, head_dim)
