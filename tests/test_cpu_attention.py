"""The batched CPU attention path equals the PyTorch reference on a mixed paged batch.

One step mixes decodes of very different lengths (so they split into several buckets),
speculative decodes with two draft counts, a prefill chunk over earlier context and a fresh
prefill, under GQA, with shuffled physical blocks, a strided block table whose unused
entries are -1, padding tokens (slot -1), and poisoned cache slots no request owns. Both
paths also run it under sliding windows from one key to more than any sequence, under Llama
4's attention chunks (boundaries inside a step's queries, prefill chunks starting mid-chunk,
decodes of a chunk's first token), with Gemma 2's soft cap of the scores, and with gpt-oss'
attention sinks.
"""

from types import SimpleNamespace

import pytest
import torch
from native_builds import BUILDS, NATIVE, build

from weir.kernels import cpu_attention, reference
from weir.kernels.reference import AttentionSpan

BLOCK_SIZE = 4
POISON = 1e4
# Sliding windows: the token itself only, less than a block, binding on some requests of the
# mixed batches and not others, and longer than every sequence (the same as no window). Chunks:
# the token itself only, boundaries inside the prefill chunks and speculative queries of the
# mixed batches (a chunk of 10: (11, 25) starts mid-chunk and crosses three boundaries, (20, 3)
# decodes the first token of its chunk and (5, 3) straddles one; of 37: (33, 4) straddles one),
# and a chunk no sequence reaches (the same as none).
SPANS = [
    *(AttentionSpan(window) for window in (1, 3, 37, 160, 400)),
    *(AttentionSpan(chunk, chunked=True) for chunk in (1, 10, 37, 400)),
]

# Windows and a chunk, each binding on some requests.
SOME_SPANS = [None, AttentionSpan(3), AttentionSpan(37), AttentionSpan(10, chunked=True)]
# Soft caps: one that flattens most scores of queries scaled up by QUERY_BOOST, one that
# bends only their largest.
SOFTCAPS = [5.0, 50.0]
QUERY_BOOST = 8


def span_id(span: AttentionSpan | None) -> str:
    """A test id naming the span: "window37", "chunk10"."""
    return "none" if span is None else f"{'chunk' if span.chunked else 'window'}{span.size}"


def mixed_step(
    requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, dtype
):
    """(context_len, query_len) per request -> tensors of one step, context already in the cache."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = [-(-(ctx + q) // BLOCK_SIZE) for ctx, q in requests]
    num_blocks = sum(blocks_per_req) + 3
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_req) + 2
    table = torch.full((len(requests), width + 5), -1, dtype=torch.int32)[
        :, :width
    ]  # row stride > width
    kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), POISON)
    slots, starts, seq_lens = [], [0], []
    for r, (ctx, q) in enumerate(requests):
        table[r, : blocks_per_req[r]] = torch.tensor(physical[: blocks_per_req[r]])
        del physical[: blocks_per_req[r]]
        pos = torch.arange(ctx + q)
        req_slots = table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_cache.view(2, -1, num_kv_heads, head_dim)[:, req_slots[:ctx]] = torch.randn(
            2, ctx, num_kv_heads, head_dim, generator=gen
        )
        slots.append(req_slots[ctx:])
        starts.append(starts[-1] + q)
        seq_lens.append(ctx + q)
    num_padding = 3
    slots.append(torch.full((num_padding,), -1))
    qkv = torch.randn(
        starts[-1] + num_padding, num_heads + 2 * num_kv_heads, head_dim, generator=gen
    )
    qkv = qkv.to(dtype)
    return dict(
        query=qkv[:, :num_heads],
        key=qkv[:, num_heads : num_heads + num_kv_heads],
        value=qkv[:, num_heads + num_kv_heads :],
        kv_cache=kv_cache.to(dtype),
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
    )


def attention_metadata(step: dict) -> tuple[torch.Tensor, ...]:
    """The arguments of every paged_attention after (query, cache) and before scale."""
    return step["query_start_loc"], step["seq_lens"], step["block_table"]


def reference_step(
    step: dict,
    scale: float,
    span: AttentionSpan | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache after the reference writes the step's K/V, and the reference's output."""
    cache = step["kv_cache"].clone()
    reference.reshape_and_cache(step["key"], step["value"], cache, step["slot_mapping"])
    out = reference.paged_attention(
        step["query"],
        cache,
        *attention_metadata(step),
        scale,
        span=span,
        softcap=softcap,
        sinks=sinks,
    )
    return cache, out


def sinks_for(step: dict, scale: float, span: AttentionSpan | None) -> torch.Tensor:
    """One sink logit per query head, from far below the scores (no effect) to far above
    them (outputs near 0), the reference's output checked to change with them."""
    num_heads = step["query"].shape[1]
    sinks = torch.linspace(-30.0, 6.0, num_heads)
    num_real = int(step["query_start_loc"][-1])
    _, with_sinks = reference_step(step, scale, span, sinks=sinks)
    _, without = reference_step(step, scale, span)
    assert (with_sinks[:num_real] - without[:num_real]).abs().max() > 0.05
    return sinks


def softcapped_step(step: dict, scale: float, span: AttentionSpan | None, softcap: float):
    """Boost the step's queries so the cap saturates; the cache and reference output as
    `reference_step`'s, after checking that the cap changes the reference's output."""
    step["query"] = step["query"] * QUERY_BOOST
    num_real = int(step["query_start_loc"][-1])
    cache, want = reference_step(step, scale, span, softcap)
    _, uncapped = reference_step(step, scale, span)
    assert (want[:num_real] - uncapped[:num_real]).abs().max() > 0.05
    return cache, want


BATCHED = [
    (300, 1),
    (7, 1),
    (0, 1),
    (150, 1),
    (298, 1),
    (9, 1),  # decodes, one with no context
    (20, 3),
    (33, 4),
    (5, 3),  # speculative decodes: 1 + 2 or 1 + 3 drafts
    (11, 25),  # a prefill chunk after earlier context
    (0, 17),  # a whole prompt
]
BATCHED_HEADS = (6, 2, 16)  # query heads, KV heads, head_dim


def batched_plan(
    step: dict, span: AttentionSpan | None = None, heads: tuple[int, int, int] = BATCHED_HEADS
) -> cpu_attention.StepPlan:
    num_heads, num_kv_heads, _ = heads
    return cpu_attention.plan_step(
        step["query_start_loc"],
        step["seq_lens"],
        step["block_table"],
        BLOCK_SIZE,
        num_heads,
        num_kv_heads,
        span=span,
    )


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_batched_cpu_attention_equals_reference(dtype, tol):
    step = mixed_step(BATCHED, *BATCHED_HEADS, dtype)
    scale = BATCHED_HEADS[2] ** -0.5
    num_real = int(step["query_start_loc"][-1])

    want_cache, want = reference_step(step, scale)

    plan = batched_plan(step)
    assert len(plan.short) >= 4 and len(plan.long) == 2  # several decode buckets, two spec buckets
    cache = step["kv_cache"].clone()
    cpu_attention.reshape_and_cache(
        step["key"], step["value"], cache, cpu_attention.plan_writes(step["slot_mapping"])
    )
    assert torch.equal(cache, want_cache)
    got = cpu_attention.paged_attention(step["query"], cache, plan, scale)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=tol, rtol=tol)


@pytest.mark.parametrize("span", SPANS, ids=span_id)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_batched_cpu_attention_with_span_equals_reference(dtype, tol, span):
    """A spanned plan gathers each request's keys from its first query's first key on (so a
    short query's bucket pads to at most W + Q - 1 keys, or C + Q - 1) and masks below each
    later query's; a span no sequence reaches plans, and computes, exactly what none does."""
    step = mixed_step(BATCHED, *BATCHED_HEADS, dtype)
    scale = BATCHED_HEADS[2] ** -0.5
    num_real = int(step["query_start_loc"][-1])
    cache, want = reference_step(step, scale, span)

    plan = batched_plan(step, span)
    for bucket in plan.short:
        assert bucket.seq_len <= span.size + bucket.query_len - 1
    got = cpu_attention.paged_attention(step["query"], cache, plan, scale)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=tol, rtol=tol)
    if span.size > int(step["seq_lens"].max()):
        unwindowed = cpu_attention.paged_attention(step["query"], cache, batched_plan(step), scale)
        assert torch.equal(got[:num_real], unwindowed[:num_real])


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("span", SOME_SPANS, ids=span_id)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_batched_cpu_attention_with_softcap_equals_reference(dtype, tol, span, softcap):
    """Capped before the mask in the buckets, and in the long queries' explicit attention
    that stands in for SDPA (which cannot cap)."""
    step = mixed_step(BATCHED, *BATCHED_HEADS, dtype)
    scale = BATCHED_HEADS[2] ** -0.5
    num_real = int(step["query_start_loc"][-1])
    cache, want = softcapped_step(step, scale, span, softcap)

    plan = batched_plan(step, span)
    got = cpu_attention.paged_attention(step["query"], cache, plan, scale, softcap)
    assert got.dtype == dtype
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=tol, rtol=tol)


@pytest.mark.parametrize("span", SOME_SPANS, ids=span_id)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_batched_cpu_attention_with_sinks_equals_reference(dtype, tol, span):
    """The sinks join the buckets' softmax, each folded row its own head's, and the long
    queries' explicit attention that stands in for SDPA (which has no sinks)."""
    step = mixed_step(BATCHED, *BATCHED_HEADS, dtype)
    scale = BATCHED_HEADS[2] ** -0.5
    num_real = int(step["query_start_loc"][-1])
    sinks = sinks_for(step, scale, span)
    cache, want = reference_step(step, scale, span, sinks=sinks)
    plan = batched_plan(step, span)
    got = cpu_attention.paged_attention(step["query"], cache, plan, scale, sinks=sinks)
    assert got.dtype == dtype
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=tol, rtol=tol)


needs_native = pytest.mark.skipif(NATIVE is None, reason="no C compiler: native kernels not built")


def native_on_two_threads(
    step: dict, cache: torch.Tensor, scale: float, kernels: str = "native", **kwargs
) -> torch.Tensor:
    """The native kernel's output for ``step`` over ``cache`` (``kernels``: a BUILDS name), on
    two threads (the kernel's OpenMP pool is PyTorch's): two or more requests per thread merge
    a decode's KV heads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return build(kernels).paged_attention(
            step["query"], cache, *attention_metadata(step), scale, **kwargs
        )
    finally:
        torch.set_num_threads(threads)


MIXED = [(300, 1), (0, 1), (150, 1), (20, 3), (33, 4), (11, 25), (0, 17), (40, 70)]


@needs_native
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 16), (8, 1, 20), (4, 4, 64), (9, 3, 64)]
)
@pytest.mark.parametrize(
    "requests",
    [MIXED, [(300, 1)], [(70, 2)]],
    ids=["mixed", "one-decode", "one-speculative"],
)
@pytest.mark.parametrize("span", [None, *SPANS], ids=span_id)
@pytest.mark.parametrize("kernels", BUILDS)
def test_native_cpu_attention_equals_reference(
    num_heads, num_kv_heads, head_dim, requests, span, kernels
):
    """Every query length and tile split (prefill chunks longer than one work item, a head
    size that is not a multiple of 8), against the reference, with the cache written by the
    native kernel from strided views of one fused projection. On two threads the mixed batch
    (two or more requests per thread) gives each decode one work item over all its KV heads;
    a lone decode is split per KV head. Under a span the key tiles start mid-block and rows
    skip keys inside a tile; a span no sequence reaches computes exactly what none does."""
    step = mixed_step(requests, num_heads, num_kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    num_real = int(step["query_start_loc"][-1])

    want_cache, want = reference_step(step, scale, span)
    cache = step["kv_cache"].clone()
    NATIVE.reshape_and_cache(step["key"], step["value"], cache, step["slot_mapping"])
    assert torch.equal(cache, want_cache)
    got = native_on_two_threads(step, cache, scale, kernels, span=span)
    unwindowed = native_on_two_threads(step, cache, scale, kernels)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=1e-5, rtol=1e-5)
    if span is not None and span.size > int(step["seq_lens"].max()):
        assert torch.equal(got[:num_real], unwindowed[:num_real])


@needs_native
@pytest.mark.parametrize("span", [None, AttentionSpan(37)], ids=span_id)
@pytest.mark.parametrize("kernels", BUILDS)
def test_native_heads_of_512_channels(span, kernels):
    """Gemma 4's full-attention heads, 512 channels (its sliding-window layers have 256) under
    a group of 8, on the mixed batch: the scratch rows and value sums of every vector width."""
    step = mixed_step(MIXED, 8, 1, 512, torch.float32)
    scale = 512**-0.5
    num_real = int(step["query_start_loc"][-1])

    want_cache, want = reference_step(step, scale, span)
    cache = step["kv_cache"].clone()
    build(kernels).reshape_and_cache(step["key"], step["value"], cache, step["slot_mapping"])
    assert torch.equal(cache, want_cache)
    got = native_on_two_threads(step, cache, scale, kernels, span=span)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 16), (9, 3, 64)])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("span", SOME_SPANS, ids=span_id)
@pytest.mark.parametrize("kernels", BUILDS)
def test_native_cpu_attention_with_softcap_equals_reference(
    num_heads, num_kv_heads, head_dim, span, softcap, kernels
):
    """The cap on every tile's scores, wide and transposed, in the causal loop and the
    windowed rows'."""
    step = mixed_step(MIXED, num_heads, num_kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    num_real = int(step["query_start_loc"][-1])
    cache, want = softcapped_step(step, scale, span, softcap)
    got = native_on_two_threads(step, cache, scale, kernels, span=span, softcap=softcap)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 16), (8, 1, 20)])
@pytest.mark.parametrize("requests", [MIXED, [(300, 1)]], ids=["mixed", "one-decode"])
@pytest.mark.parametrize("span", SOME_SPANS, ids=span_id)
@pytest.mark.parametrize("kernels", BUILDS)
def test_native_cpu_attention_with_sinks_equals_reference(
    num_heads, num_kv_heads, head_dim, requests, span, kernels
):
    """Each row's sink joins its sum once, after the tiles, in items of one KV head and of
    all of them (merged decodes), with and without a window; the sinks sent as bfloat16,
    as a bfloat16 checkpoint holds them."""
    step = mixed_step(requests, num_heads, num_kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    num_real = int(step["query_start_loc"][-1])
    sinks = sinks_for(step, scale, span).bfloat16()
    cache, want = reference_step(step, scale, span, sinks=sinks)
    got = native_on_two_threads(step, cache, scale, kernels, span=span, sinks=sinks)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=1e-5, rtol=1e-5)


def test_sinks_must_be_one_per_query_head():
    step = mixed_step([(30, 1), (0, 5)], *BATCHED_HEADS, torch.float32)
    args = (step["query"], step["kv_cache"], *attention_metadata(step), 0.25)
    for paged_attention in (
        reference.paged_attention,
        *(() if NATIVE is None else (NATIVE.paged_attention,)),
    ):
        with pytest.raises(ValueError, match="one per query head"):
            paged_attention(*args, sinks=torch.zeros(BATCHED_HEADS[1]))


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", [*FP8, torch.bfloat16], ids=["e4m3", "e5m2", "bf16"])
@pytest.mark.parametrize(
    "span", [None, AttentionSpan(37), AttentionSpan(10, chunked=True)], ids=span_id
)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [BATCHED_HEADS, (9, 3, 64)], ids=["gqa3", "gqa3-64"]
)
def test_narrow_cache_equals_reference(num_heads, num_kv_heads, head_dim, span, cache_dtype):
    """--kv-cache-dtype fp8, and the bfloat16 cache of bfloat16 weights over a float32 model:
    the batched path and the native kernels write the step's K/V converted as PyTorch
    converts them (fp8 saturating: the poison is past e4m3's 448) and attend over the cache's
    widened values, as the reference over a float32 copy of them; and the cache's rounding
    shows in the result."""
    step = mixed_step(MIXED, num_heads, num_kv_heads, head_dim, torch.float32)
    step["kv_cache"] = step["kv_cache"].to(cache_dtype)
    step["key"][5] *= 1e5  # past both formats' largest value: held as it, not as inf
    scale = head_dim**-0.5
    num_real = int(step["query_start_loc"][-1])
    want_cache, want = reference_step(step, scale, span)
    assert want_cache.float().isfinite().all()
    limit = torch.finfo(cache_dtype).max
    rounded = {
        k: step[k].float().clamp(-limit, limit).to(cache_dtype).float()
        for k in ("kv_cache", "key", "value")
    }
    _, over_floats = reference_step({**step, **rounded}, scale, span)
    torch.testing.assert_close(want[:num_real], over_floats[:num_real], atol=1e-6, rtol=1e-6)
    _, unrounded = reference_step({**step, "kv_cache": step["kv_cache"].float()}, scale, span)
    assert (want[:num_real] - unrounded[:num_real]).abs().max() > 1e-3

    plan = batched_plan(step, span, (num_heads, num_kv_heads, head_dim))
    cache = step["kv_cache"].clone()
    cpu_attention.reshape_and_cache(
        step["key"], step["value"], cache, cpu_attention.plan_writes(step["slot_mapping"])
    )
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    got = cpu_attention.paged_attention(step["query"], cache, plan, scale)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=1e-5, rtol=1e-5)
    if NATIVE is None:
        return
    cache = step["kv_cache"].clone()
    NATIVE.reshape_and_cache(step["key"], step["value"], cache, step["slot_mapping"])
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    got = native_on_two_threads(step, cache, scale, span=span)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("head_dim", [16, 12], ids=["vector", "vector-and-tail"])
@pytest.mark.parametrize(
    ("cache_dtype", "codes_dtype"),
    [(FP8[0], torch.uint8), (FP8[1], torch.uint8), (torch.bfloat16, torch.int16)],
    ids=["e4m3", "e5m2", "bf16"],
)
def test_native_kernel_reads_every_cached_code_as_pytorch_does(cache_dtype, codes_dtype, head_dim):
    """Each of the format's 256 or 65,536 codes (subnormals, the largest values, infinities,
    NaNs) as a value of one token that attends only to itself (a window of one key): the
    output is the value, widened by the kernel (fp8: eight at a time through a half, the
    rest through the table), against PyTorch's own reading of the code."""
    count = 1 << (8 * codes_dtype.itemsize)
    num_tokens = -(-count // head_dim)
    codes = torch.arange(num_tokens * head_dim) % count
    cache = torch.zeros(2, num_tokens, 1, 1, head_dim, dtype=codes_dtype)
    cache[1] = codes.to(codes_dtype).view(num_tokens, 1, 1, head_dim)
    cache = cache.view(cache_dtype)
    query = torch.zeros(num_tokens, 1, head_dim)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    table = torch.arange(num_tokens, dtype=torch.int32).view(1, -1)
    got = NATIVE.paged_attention(query, cache, qsl, seq_lens, table, 1.0, span=AttentionSpan(1))
    want = cache[1].float().view(num_tokens, 1, head_dim)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@needs_native
@pytest.mark.parametrize(
    "span", [AttentionSpan(3), AttentionSpan(37), AttentionSpan(16, chunked=True)], ids=span_id
)
def test_native_span_ignores_hidden_keys_whatever_their_scores(span):
    """Scores spread over hundreds: a key below a row's first but inside its tile (seen by
    the item's earlier tokens) that took any part in the row's softmax, its running max
    included, would swamp or underflow the keys the row does see."""
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    step = mixed_step([(100, 40), (60, 3)], num_heads, num_kv_heads, head_dim, torch.float32)
    step["kv_cache"][0] *= 40
    step["key"] *= 40
    scale = head_dim**-0.5
    num_real = int(step["query_start_loc"][-1])
    cache, want = reference_step(step, scale, span)
    got = NATIVE.paged_attention(step["query"], cache, *attention_metadata(step), scale, span=span)
    torch.testing.assert_close(got[:num_real], want[:num_real], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_span_of_no_keys_is_refused(chunked):
    """A span below one key would hide a token from itself (the native kernel would read 0
    as no span at all)."""
    with pytest.raises(ValueError, match="hides every key"):
        AttentionSpan(0, chunked=chunked)


@pytest.mark.parametrize("softcap", [0.0, -5.0])
def test_a_soft_cap_that_is_not_positive_is_refused(softcap):
    """The native kernel would read 0 as no cap at all."""
    step = mixed_step([(30, 1), (0, 5)], *BATCHED_HEADS, torch.float32)
    with pytest.raises(ValueError, match="not positive"):
        cpu_attention.paged_attention(
            step["query"], step["kv_cache"], batched_plan(step), 0.25, softcap
        )
    if NATIVE is not None:
        args = (step["query"], step["kv_cache"], *attention_metadata(step), 0.25)
        with pytest.raises(ValueError, match="not positive"):
            NATIVE.paged_attention(*args, softcap=softcap)


def request_kv(
    step: dict, cache: torch.Tensor, seq_len: int, group: int, request: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's K and V read from the cache through its block table, [Hkv * group, S, D]
    with every KV head repeated for the query heads of its group (as `repeat_kv`)."""
    num_kv_heads, head_dim = cache.shape[3], cache.shape[4]
    pos = torch.arange(seq_len)
    slots = step["block_table"][request, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = (cache[i].view(-1, num_kv_heads, head_dim)[slots] for i in (0, 1))
    return tuple(t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))


def test_reference_sliding_window_is_transformers_mask():
    """The reference's window, checked against transformers' own mask functions: a prefill
    chunk over earlier context, attended densely with the mask that `sliding_window_overlay`
    and `causal_mask_function` give at absolute positions, as transformers applies them."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    window, context, query_len, num_heads, num_kv_heads, head_dim = 5, 9, 7, 4, 2, 8
    step = mixed_step([(context, query_len)], num_heads, num_kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    cache, got = reference_step(step, scale, AttentionSpan(window))

    seq_len = context + query_len
    pos = torch.arange(seq_len)
    k, v = request_kv(step, cache, seq_len, num_heads // num_kv_heads)  # [H, S, D]
    attend = masking_utils.and_masks(
        masking_utils.sliding_window_overlay(window), masking_utils.causal_mask_function
    )
    # Index tensors broadcast to the [Q, S] mask, as transformers' sdpa_mask evaluates them.
    zero = torch.tensor(0)
    mask = attend(zero, zero, context + torch.arange(query_len)[:, None], pos[None, :])
    assert mask.sum(-1).tolist() == [window] * query_len  # the window binds on every query
    q = step["query"][:query_len].transpose(0, 1)  # [H, Q, D]
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    want = (scores.softmax(-1) @ v).transpose(0, 1)
    torch.testing.assert_close(got[:query_len], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_reference_chunk_is_the_definition(chunk):
    """The reference's chunks against a dense softmax masked by their definition, query at
    position p seeing key j iff j <= p and j // C == p // C (transformers' `chunked_overlay`
    and `causal_mask_function` agree on it), under GQA: prefill chunks starting mid-chunk and
    crossing boundaries, a decode of a chunk's first token (at 28, a multiple of 4 and 7), a
    speculative query straddling a boundary, and a fresh prompt."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    requests = [(9, 7), (28, 1), (5, 4), (0, 17), (13, 30)]
    num_heads, num_kv_heads, head_dim = 6, 2, 8
    step = mixed_step(requests, num_heads, num_kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    cache, got = reference_step(step, scale, AttentionSpan(chunk, chunked=True))
    attend = masking_utils.and_masks(
        masking_utils.chunked_overlay(chunk, torch.tensor([0])), masking_utils.causal_mask_function
    )
    zero = torch.tensor(0)
    start = 0
    for r, (context, query_len) in enumerate(requests):
        seq_len = context + query_len
        k, v = request_kv(step, cache, seq_len, num_heads // num_kv_heads, request=r)
        q_pos = context + torch.arange(query_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = (k_pos <= q_pos) & (k_pos // chunk == q_pos // chunk)
        assert torch.equal(mask, attend(zero, zero, q_pos, k_pos))
        q = step["query"][start : start + query_len].transpose(0, 1)  # [H, Q, D]
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        want = (scores.softmax(-1) @ v).transpose(0, 1)
        torch.testing.assert_close(got[start : start + query_len], want, atol=1e-6, rtol=1e-6)
        start += query_len
    # The chunk binds: without it, some query attends differently.
    _, unchunked = reference_step(step, scale)
    assert (got[:start] - unchunked[:start]).abs().max() > 0.05


def test_reference_softcap_is_gemma2_eager_attention():
    """The reference's cap, checked against transformers' own Gemma 2 attention
    (`eager_attention_forward` with its `softcap`) on a prefill chunk over earlier context,
    its GQA heads repeated by transformers and its causal mask additive."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    softcap, context, query_len, num_heads, num_kv_heads, head_dim = 5.0, 9, 7, 4, 2, 8
    step = mixed_step([(context, query_len)], num_heads, num_kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    cache, got = softcapped_step(step, scale, None, softcap)
    want = eager_attention(gemma2, step, cache, context, scale, softcap=softcap)
    torch.testing.assert_close(got[:query_len], want, atol=1e-6, rtol=1e-6)


def eager_attention(
    model_module, step: dict, cache: torch.Tensor, context: int, scale: float, **kwargs
) -> torch.Tensor:
    """[Q, H, D]: transformers' own `eager_attention_forward` of ``model_module`` over the
    first request of ``step`` (a query after ``context`` cached tokens), its GQA heads
    repeated by transformers and its causal mask additive; ``kwargs`` go to it, but
    ``sinks``, which it reads from the attention module."""
    query_len = int(step["query_start_loc"][1])
    num_heads, num_kv_heads = step["query"].shape[1], cache.shape[3]
    seq_len = context + query_len
    k, v = request_kv(step, cache, seq_len, 1)  # [Hkv, S, D]: transformers repeats them
    hidden = torch.arange(seq_len)[None, :] > context + torch.arange(query_len)[:, None]
    mask = torch.zeros(query_len, seq_len).masked_fill(hidden, float("-inf"))
    module = SimpleNamespace(
        num_key_value_groups=num_heads // num_kv_heads,
        training=False,
        sinks=kwargs.pop("sinks", None),
    )
    want, _ = model_module.eager_attention_forward(
        module,
        step["query"][:query_len].transpose(0, 1)[None],  # [1, H, Q, D]
        k[None],
        v[None],
        mask[None, None],
        scaling=scale,
        **kwargs,
    )
    return want[0]


def test_reference_sinks_are_gpt_oss_eager_attention():
    """The reference's sinks, checked against transformers' own gpt-oss attention
    (`eager_attention_forward`, which appends each head's sink as a column of the scores) on
    a prefill chunk over earlier context, its GQA heads repeated by transformers."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    context, query_len, num_heads, num_kv_heads, head_dim = 9, 7, 4, 2, 8
    step = mixed_step([(context, query_len)], num_heads, num_kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    sinks = sinks_for(step, scale, None)
    cache, got = reference_step(step, scale, sinks=sinks)
    want = eager_attention(gpt_oss, step, cache, context, scale, sinks=sinks)
    torch.testing.assert_close(got[:query_len], want, atol=1e-6, rtol=1e-6)


@needs_native
def test_native_norm_and_rope_equal_pytorch():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3 * 96, generator=gen)[:, :96]  # strided rows
    weight = torch.randn(96, generator=gen)
    want = torch.nn.functional.rms_norm(x, (96,), weight, 1e-6)
    torch.testing.assert_close(NATIVE.rms_norm(x, weight, 1e-6), want, atol=1e-5, rtol=1e-5)

    qkv = torch.randn(5, 7, 32, generator=gen)
    angles = torch.randn(5, 16, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = qkv[:, :5].chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    untouched = qkv[:, 5:].clone()
    NATIVE.rope_(qkv[:, :5], cos, sin)
    torch.testing.assert_close(qkv[:, :5], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 5:], untouched)

    # Phi-4-mini's partial rotation: the first 24 of each head's 32 channels, the rest as they are.
    angles = angles[:, :12]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = qkv[:, :5, :24].chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, qkv[:, :5, 24:]), dim=-1)
    untouched = qkv[:, 5:].clone()
    NATIVE.rope_(qkv[:, :5, :24], cos, sin)
    torch.testing.assert_close(qkv[:, :5], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 5:], untouched)


@pytest.mark.parametrize("kernels", BUILDS)
def test_native_silu_mul_equals_pytorch(kernels):
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(6, 2 * 2 * 37, generator=gen)[:, : 2 * 37] * 4  # strided rows
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -87.5])  # exp's range ends
    gate, up = gate_up.clone().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = build(kernels).silu_mul_(gate_up)
    assert got.data_ptr() == gate_up.data_ptr()  # in place, over the gate half
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_native
def test_native_kernels_refuse_metadata_outside_the_cache():
    """A block id, slot or query range outside the cache or batch raises IndexError (the
    step fails and the executor's isolation takes over) instead of reading or writing
    memory the cache does not own; nothing is written."""
    step = mixed_step([(30, 1), (0, 5)], 4, 2, 16, torch.float32)
    cache = step["kv_cache"].clone()
    args = (*attention_metadata(step), 0.25)
    NATIVE.paged_attention(step["query"], cache, *args)  # the untouched step is fine

    bad_table = step["block_table"].clone()
    bad_table[0, 1] = cache.shape[1]
    with pytest.raises(IndexError):
        NATIVE.paged_attention(step["query"], cache, args[0], args[1], bad_table, 0.25)
    too_long = step["seq_lens"].clone()
    too_long[1] = bad_table.shape[1] * BLOCK_SIZE + 1
    with pytest.raises(IndexError):
        NATIVE.paged_attention(step["query"], cache, args[0], too_long, args[2], 0.25)
    past_batch = step["query_start_loc"].clone()
    past_batch[-1] = step["query"].shape[0] + 1
    with pytest.raises(IndexError):
        NATIVE.paged_attention(step["query"], cache, past_batch, *args[1:])

    ungrouped = step["query"][:, :3]  # 3 query heads over 2 KV heads: no grouping
    with pytest.raises(ValueError, match="do not group"):
        NATIVE.paged_attention(ungrouped.contiguous(), cache, *args)

    slots = step["slot_mapping"].clone()
    slots[0] = cache.shape[1] * cache.shape[2]
    with pytest.raises(IndexError):
        NATIVE.reshape_and_cache(step["key"], step["value"], cache, slots)
    assert torch.equal(cache, step["kv_cache"])
