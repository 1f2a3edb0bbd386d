"""Triton paged attention against the PyTorch reference (on CPU), on a GPU or under the interpreter.

Every batch goes through the whole step: earlier context is in the cache, the step's
new K/V are written by the Triton reshape_and_cache (padding tokens carry slot -1),
then attention runs. Cache slots no request owns hold a large constant, so reading
past a sequence's end or through a wrong block-table entry changes the result.
bf16 runs only on a GPU: the interpreter's tl.dot gives wrong results for it.
"""

from dataclasses import dataclass, replace

import pytest
import torch
import triton
import triton.language as tl

from weir.kernels import reference, triton_attention
from weir.kernels.reference import AttentionSpan

POISON = 30.0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# Under the interpreter the dtype takes no other path through the window and softcap masks: on a
# CPU their batch kinds run in float32 (the tightest tolerance), and the float16 tests of windows
# and softcaps (split-KV, head dims) check them beside the casts.
MASK_DTYPES = DTYPES if DEVICE == "cuda" else [torch.float32]


@dataclass(slots=True)
class Step:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor  # before the step's K/V are written
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scale: float

    @property
    def num_real_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def make_step(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_padding_tokens: int = 0,
    transposed_table: bool = False,
    seed: int = 0,
) -> Step:
    """A step over requests given as (context_len, query_len), with shuffled physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = [-(-(ctx + q) // block_size) for ctx, q in requests]
    num_blocks = sum(blocks_per_request) + 2  # two spare blocks no request owns
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    spare = physical[-1]
    # Rows of a wider persistent table: the slice has a row stride larger than its width
    # (or, transposed, a column stride > 1), and unused entries point at a spare (poisoned) block.
    width = max(blocks_per_request) + 1
    table_store = torch.full((len(requests) + 1, width + 3), spare, dtype=torch.int32)
    if transposed_table:
        table_store = table_store.t().contiguous().t()
    block_table = table_store[: len(requests), :width]
    cursor = 0
    for r, n in enumerate(blocks_per_request):
        block_table[r, :n] = torch.tensor(physical[cursor : cursor + n])
        cursor += n

    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), POISON)
    slots, starts, seq_lens = [], [0], []
    for r, (ctx, q) in enumerate(requests):
        positions = torch.arange(ctx + q)
        request_slots = (
            block_table[r, positions // block_size].long() * block_size + positions % block_size
        )
        context = request_slots[:ctx]
        kv_cache.view(2, -1, num_kv_heads, head_dim)[:, context] = torch.randn(
            2, ctx, num_kv_heads, head_dim, generator=gen
        )
        slots.append(request_slots[ctx:])
        starts.append(starts[-1] + q)
        seq_lens.append(ctx + q)
    slots.append(torch.full((num_padding_tokens,), -1, dtype=torch.long))
    num_tokens = starts[-1] + num_padding_tokens

    # Q, K, V as views into one fused projection output, like the model produces them.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    return Step(
        query=qkv[:, :num_heads],
        key=qkv[:, num_heads : num_heads + num_kv_heads],
        value=qkv[:, num_heads + num_kv_heads :],
        kv_cache=kv_cache.to(dtype),
        slot_mapping=torch.cat(slots).to(torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        scale=head_dim**-0.5,
    )


def reference_output(
    step: Step,
    span: AttentionSpan | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    cache = step.kv_cache.clone()
    reference.reshape_and_cache(step.key, step.value, cache, step.slot_mapping)
    out = reference.paged_attention(
        step.query,
        cache,
        step.query_start_loc,
        step.seq_lens,
        step.block_table,
        step.scale,
        span=span,
        softcap=softcap,
        sinks=sinks,
    )
    return out[: step.num_real_tokens]


def on_device(step: Step) -> Step:
    """The step's tensors on the test device, keeping their strides (views stay views)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        return base.to(DEVICE).as_strided(t.size(), t.stride(), t.storage_offset())

    return Step(
        query=move(step.query),
        key=move(step.key),
        value=move(step.value),
        kv_cache=move(step.kv_cache),
        slot_mapping=move(step.slot_mapping),
        query_start_loc=move(step.query_start_loc),
        seq_lens=move(step.seq_lens),
        block_table=move(step.block_table),
        scale=step.scale,
    )


def triton_output(step: Step, sinks: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    step = on_device(step)
    if sinks is not None:
        kwargs["sinks"] = sinks.to(DEVICE)
    cache = step.kv_cache.clone()
    triton_attention.reshape_and_cache(step.key, step.value, cache, step.slot_mapping)
    out = triton_attention.paged_attention(
        step.query,
        cache,
        step.query_start_loc,
        step.seq_lens,
        step.block_table,
        step.scale,
        **kwargs,
    )
    return out[: step.num_real_tokens].cpu()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.float32:
        # On a GPU Triton may still round fp32 to tf32 in places the interpreter does not.
        tolerance = 2e-5 if DEVICE == "cpu" else 2e-3
        torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance * 5)
    elif expected.dtype == torch.float16:
        torch.testing.assert_close(actual, expected, atol=2e-3, rtol=1e-2)
    else:
        torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


def assert_span_matches(
    step: Step,
    span: AttentionSpan,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    **kwargs,
) -> None:
    """Windowed or chunked attention against the reference, with NaN in the cached K/V of every key
    tile below the first key of a request's first token: the kernels must skip those tiles, not load
    and mask them (a NaN value times a zero weight is NaN)."""
    plan = triton_attention.plan_for(on_device(step).query, step.kv_cache, step.seq_lens.shape[0])
    tile_n = max(tile.tile_n for tile in (plan.decode, plan.prefill) if tile is not None)
    block_size = step.kv_cache.shape[2]
    cache = step.kv_cache.clone()
    query_lens = step.query_start_loc.diff()
    for r, (seq_len, query_len) in enumerate(zip(step.seq_lens.tolist(), query_lens.tolist())):
        first_visible = max(span.first_key(seq_len - query_len), 0)
        positions = torch.arange(first_visible // tile_n * tile_n)
        slots = step.block_table[r, positions // block_size].long() * block_size
        cache.view(2, -1, *cache.shape[3:])[:, slots + positions % block_size] = float("nan")
    actual = triton_output(
        replace(step, kv_cache=cache), span=span, softcap=softcap, sinks=sinks, **kwargs
    )
    expected = reference_output(step, span=span, softcap=softcap, sinks=sinks)
    assert_close(actual, expected)


# With 4 query heads over 2 KV heads (the default below) a decode tile holds up to 32 query tokens
# when the whole step fits it (64 rows), else 8 (16 rows); longer requests take 64-row prefill tiles of
# 32 tokens, over 64-key tiles.
DECODE = [(0, 1), (16, 1), (40, 1), (70, 1)]
PREFILL = [(0, 20), (0, 37)]
CHUNKED_PREFILL = [(33, 20), (64, 9)]
SPECULATIVE = [(5, 4), (47, 3), (64, 2)]
MIXED = [(30, 1), (0, 23), (45, 4), (17, 12), (80, 1)]
# Prefill tiles: several query blocks per request, earlier context of full and partial key tiles
# (unmasked tiles, the masked diagonal, key tiles past the diagonal skipped), beside decode tiles, a
# speculative query, a query just over the decode tile (9) and a padded request with no tokens.
LONG_CHUNKS = [(100, 70), (0, 150)]
MIXED_LONG = [(130, 1), (100, 70), (45, 4), (0, 0), (0, 150), (3, 9), (80, 1)]


@pytest.mark.parametrize(
    "requests",
    [DECODE, PREFILL, CHUNKED_PREFILL, SPECULATIVE, MIXED, LONG_CHUNKS, MIXED_LONG],
    ids=[
        "decode",
        "prefill",
        "chunked_prefill",
        "speculative",
        "mixed",
        "long_chunks",
        "mixed_long",
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_batch_kinds_match_reference(requests, dtype):
    step = make_step(requests, num_heads=4, num_kv_heads=2, dtype=dtype, num_padding_tokens=2)
    assert_close(triton_output(step), reference_output(step))


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gqa_ratios_and_block_sizes(group, block_size):
    step = make_step(
        MIXED,
        num_heads=2 * group,
        num_kv_heads=2,
        block_size=block_size,
        transposed_table=block_size == 32,
        seed=group,
    )
    assert_close(triton_output(step), reference_output(step))


@pytest.mark.parametrize("head_dim", [80, 96, 128])
def test_head_dims(head_dim):
    step = make_step([(19, 3)], num_heads=2, num_kv_heads=1, head_dim=head_dim, dtype=torch.float16)
    assert_close(triton_output(step), reference_output(step))


@pytest.mark.parametrize("group", [4, 16])
def test_wide_heads_walk_every_query_through_decode_tiles(group):
    """DeepSeek's latent rows (576 channels over one KV head): decode tiles for every query,
    long prefill chunks included, as the reference."""
    step = make_step(MIXED, num_heads=group, num_kv_heads=1, head_dim=576, dtype=torch.float16)
    assert_close(triton_output(step), reference_output(step))
    with pytest.raises(ValueError, match="32 query heads over one KV head of 576 channels"):
        triton_attention.plan_launches(8, 1, 32, 1, 576, 16, torch.float16, 9, 132, 1, 64, None)


@pytest.mark.parametrize("group", [2, 8])
@pytest.mark.parametrize("capability", [0, 9], ids=["fallback", "hopper"])
def test_heads_of_512_channels(group, capability):
    """Gemma 4's full-attention heads: decode tiles and prefill tiles of 16 keys, their one masked
    key loop over diagonal and whole tiles alike, and split-KV's merge, as the reference; the
    Hopper plan's 64-row prefill tiles too (given as the plan: the interpreter plans the
    fallback's)."""
    requests = [(70, 1), (5, 3), (40, 37), (0, 0), (0, 70)]
    step = make_step(requests, num_heads=group, num_kv_heads=1, head_dim=512, dtype=torch.float16)
    num_tokens = sum(q for _, q in requests)
    plan = triton_attention.plan_launches(
        num_tokens, len(requests), group, 1, 512, 16, torch.float16, capability, 0, 70, 110, None
    )
    assert plan.prefill is not None and plan.decode.tile_n == plan.prefill.tile_n == 16
    expected = reference_output(step)
    assert_close(triton_output(step, plan=plan), expected)
    decodes = make_step(requests[:2], num_heads=group, num_kv_heads=1, head_dim=512)
    assert_close(triton_output(decodes, split_kv=4), reference_output(decodes))


def test_launch_plan_for_heads_of_512_channels():
    def plan(max_query_len, *, group=8, capability=9):
        return triton_attention.plan_launches(
            64 * max_query_len, 64, 4 * group, 4, 512, 16, torch.bfloat16, capability, 132,
            max_query_len, 4096, None,
        )  # fmt: skip

    stages = triton_attention.HOPPER_STAGES
    decode = plan(1)
    assert decode.prefill is None and decode.decode == triton_attention.TileShape(16, 16, 8, stages)
    assert decode.segments == 4  # 64 requests x 4 KV heads split as any decode launch
    speculative = plan(4)  # 4 tokens x 8 heads: one decode tile of 32 rows
    assert speculative.prefill is None and speculative.decode.block_m == 32
    mixed = plan(8)  # 64 rows: too many registers for a decode tile of 512 channels
    assert mixed.decode.block_m == 16 and mixed.short_query_len == 2
    assert mixed.prefill == triton_attention.TileShape(64, 16, 8, stages)
    assert plan(512, capability=8).prefill == triton_attention.TileShape(32, 16, 8, 2)
    assert plan(512, group=2).short_query_len == 8
    with pytest.raises(ValueError, match="32 query heads over one KV head of 512 channels"):
        plan(1, group=32)


def test_hints_do_not_change_result():
    # The hints pick tiles and launches only. Too low, long queries run in decode tiles (walked tile
    # by tile); too high, decodes run beside an extra prefill launch whose programs all exit.
    step = make_step(MIXED_LONG, num_heads=4, num_kv_heads=2)
    expected = reference_output(step)
    assert_close(triton_output(step, max_query_len=1, max_seq_len=1), expected)
    assert_close(triton_output(step, max_query_len=150, max_seq_len=230), expected)
    # Windowed, each query block walked in a decode tile starts at its own first visible key tile.
    assert_span_matches(step, AttentionSpan(100), max_query_len=1, max_seq_len=1)
    step = make_step(SPECULATIVE, num_heads=4, num_kv_heads=4)
    assert_close(triton_output(step, max_query_len=1000), reference_output(step))


def test_launch_plan_routes_requests_by_query_length():
    def plan(max_query_len, *, group=4, head_dim=128, capability=9, num_requests=64):
        return triton_attention.plan_launches(
            num_requests * max_query_len, num_requests, 8 * group, 8, head_dim, 16,
            torch.bfloat16, capability, 132, max_query_len, 4096, None,
        )  # fmt: skip

    decode = plan(1)
    assert decode.prefill is None and decode.decode.block_m == 16 and decode.segments == 2
    assert decode.short_query_len == triton_attention.INT32_MAX
    speculative = plan(8)  # 8 tokens x 4 heads = 32 rows: still one decode tile, no prefill launch
    assert speculative.prefill is None and speculative.decode.block_m == 32
    mixed = plan(512)
    assert mixed.decode.block_m == 16 and mixed.short_query_len == 4 and mixed.segments == 1
    assert mixed.prefill == triton_attention.TileShape(128, 64, 8, triton_attention.HOPPER_STAGES)
    assert mixed.prefill_grid == (8, 64 * 512 // 32 + 64)
    assert plan(512, capability=8).prefill == triton_attention.TileShape(64, 64, 8, 2)
    assert plan(512, head_dim=256).prefill.tile_n == 32
    wide_group = plan(512, group=32)  # one token's heads fill a decode tile of 32 rows
    assert wide_group.decode.block_m == 32 and wide_group.short_query_len == 1
    for segments in (0, triton_attention.MAX_SEGMENTS + 1):
        with pytest.raises(ValueError, match="segments must be from 1 to 16"):
            triton_attention.plan_launches(
                4, 4, 4, 2, 64, 16, torch.float16, 9, 132, 1, None, segments
            )
    # Any count up to 16 when asked (the segment sweep), its merge over 4 slots, 1 masked off.
    three = triton_attention.plan_launches(4, 4, 4, 2, 64, 16, torch.float16, 9, 132, 1, None, 3)
    assert three.segments == 3 and three.merge_constexprs()["SEGMENT_SLOTS"] == 4


@pytest.mark.parametrize(
    ("num_requests", "max_seq_len", "segments"),
    [(1, 512, 1), (1, 4096, 8), (8, 4096, 8), (32, 4096, 4), (64, 4096, 2), (66, 4096, 1),
     (32, 16384, 4), (256, 32768, 1), (1, None, 16)],
)  # fmt: skip
def test_split_kv_rule_on_an_h200(num_requests, max_seq_len, segments):
    # 132 SMs, 8 KV heads: split up to 4 programs per SM, never below 512 keys per segment.
    assert triton_attention.split_kv_segments(num_requests, 8, 132, max_seq_len) == segments
    assert triton_attention.split_kv_segments(num_requests, 8, 0, max_seq_len) == 1


@pytest.mark.parametrize("split_kv", [False, 4], ids=["single", "split"])
@pytest.mark.parametrize(
    "cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_fp8_cache_matches_reference(dtype, cache_dtype, split_kv):
    """--kv-cache-dtype fp8: decode, speculative and prefill tiles (and split-KV segments)
    widen the cache's tiles to the query's dtype. The cache is written by the reference here
    (tests/kernels/test_triton_cache.py checks the Triton writer on a GPU)."""
    step = make_step(MIXED_LONG, num_heads=4, num_kv_heads=2, dtype=dtype, num_padding_tokens=2)
    cache = step.kv_cache.to(cache_dtype)
    reference.reshape_and_cache(step.key, step.value, cache, step.slot_mapping)
    meta = (step.query_start_loc, step.seq_lens, step.block_table, step.scale)
    expected = reference.paged_attention(step.query, cache, *meta)[: step.num_real_tokens]
    device = on_device(replace(step, kv_cache=cache))
    actual = triton_attention.paged_attention(
        device.query,
        device.kv_cache,
        device.query_start_loc,
        device.seq_lens,
        device.block_table,
        step.scale,
        split_kv=split_kv,
    )
    assert_close(actual[: step.num_real_tokens].cpu(), expected)


@pytest.mark.parametrize("split_kv", [False, 4], ids=["single", "split"])
def test_padding_requests_and_preallocated_output(split_kv):
    # A decode step padded to a fixed size (as for a CUDA graph): requests with no query tokens and
    # seq_len 0, padding tokens outside every request.
    step = make_step(
        [(20, 1), (0, 0), (50, 2), (0, 0)], num_heads=4, num_kv_heads=2, num_padding_tokens=3
    )
    device_step = on_device(step)
    out = torch.full_like(device_step.query, float("nan"))
    cache = device_step.kv_cache.clone()
    triton_attention.reshape_and_cache(
        device_step.key, device_step.value, cache, device_step.slot_mapping
    )
    result = triton_attention.paged_attention(
        device_step.query,
        cache,
        device_step.query_start_loc,
        device_step.seq_lens,
        device_step.block_table,
        device_step.scale,
        out=out,
        max_query_len=2,
        split_kv=split_kv,
    )
    assert result is out
    assert_close(out[: step.num_real_tokens].cpu(), reference_output(step))


@pytest.mark.parametrize(
    ("launch", "tile"),
    [
        ("decode", {"tile_n": 32}),
        ("prefill", {"tile_n": 128}),
        ("prefill", {"block_m": 64, "num_warps": 4}),
    ],
    ids=["decode 32 keys", "prefill 128 keys", "prefill 64 rows"],
)
def test_a_plan_given_launches_its_tiles(launch, tile):
    # As benchmarks/attention.py --sweep-tiles does: plan_for's plan with other tile constants.
    from dataclasses import replace

    step = make_step([(30, 40), (20, 1), (45, 1), (0, 150)], num_heads=8, num_kv_heads=2)
    device_step = on_device(step)
    planned = triton_attention.plan_for(device_step.query, device_step.kv_cache, 4)
    assert planned.prefill is not None
    other = replace(planned, **{launch: replace(getattr(planned, launch), **tile)})
    calls: list[dict] = []
    kernel = getattr(triton_attention, f"_{launch}_attention_kernel")
    run = kernel.run

    def recording_run(*args, **kwargs):
        calls.append(kwargs)
        return run(*args, **kwargs)

    kernel.run = recording_run
    try:
        actual = triton_output(step, plan=other)
    finally:
        kernel.run = run
    launched = getattr(other, launch)
    assert [(c["BLOCK_M"], c["TILE_N"], c["num_warps"]) for c in calls] == [
        (launched.block_m, launched.tile_n, launched.num_warps)
    ]
    assert_close(actual, reference_output(step))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_mixed_step_padded_as_a_cuda_graph_replays_it(dtype):
    # A mixed step in a mixed graph's shape (cuda_graphs.StepGraphs): a prefill chunk, a
    # short prefill and decodes, then padding requests holding no token and padding tokens
    # outside every request; the hint is the padded token count, whatever the longest query.
    step = make_step(
        [(30, 40), (20, 1), (0, 9), (45, 1), (0, 0), (0, 0), (0, 0)],
        num_heads=8,
        num_kv_heads=2,
        num_padding_tokens=13,
        dtype=dtype,
    )
    num_tokens = step.query.shape[0]
    plan = triton_attention.plan_for(
        step.query, step.kv_cache, 7, max_query_len=num_tokens, max_seq_len=1024
    )
    assert plan.prefill is not None and plan.short_query_len < 9  # both launches run
    actual = triton_output(step, max_query_len=num_tokens, max_seq_len=1024)
    assert_close(actual, reference_output(step))


@pytest.mark.parametrize(
    ("requests", "group", "split_kv"),
    [
        ([(0, 1), (130, 1), (300, 1), (1000, 1)], 1, True),
        ([(7, 3), (290, 4), (250, 12)], 3, 4),
        ([(300, 1), (200, 40), (0, 0), (400, 3)], 2, 2),
        ([(0, 1), (130, 1), (300, 1), (1000, 1)], 1, 3),
        ([(7, 3), (290, 4), (250, 12)], 3, 6),
    ],
    ids=["decode", "speculative", "mixed", "decode_3_segments", "speculative_6_segments"],
)
def test_split_kv_matches_single_pass(requests, group, split_kv):
    # Contexts of several 64-key tiles, so segments are full, partial and empty; in the last
    # segment of (250, 12) the first queries see no key at all. In the mixed batch the prefill
    # launch writes (200, 40) and the merge must leave it alone.
    step = make_step(
        requests, num_heads=2 * group, num_kv_heads=2, block_size=32, dtype=torch.float16
    )
    single = triton_output(step, split_kv=False)
    workspace = triton_attention.allocate_split_kv_workspace(48, 2 * group, 64, DEVICE)
    split = triton_output(step, split_kv=split_kv, workspace=workspace)
    torch.testing.assert_close(split, single, atol=1e-3, rtol=1e-3)
    assert_close(split, reference_output(step))


def test_split_kv_beside_a_prefill_launch_keeps_rows_for_the_decodes_only():
    # A 100-token chunk beside three decodes: the split decode launch writes the partials of
    # 4 requests x short_query_len rows, far fewer than the step's tokens (a workspace of the
    # step's tokens, as the split launch took before, would be 8192 rows for a mixed graph).
    requests = [(120, 100), (300, 1), (0, 1), (200, 1)]
    step = make_step(requests, num_heads=4, num_kv_heads=2, block_size=32, dtype=torch.float16)
    num_tokens = sum(q for _, q in requests)
    plan = triton_attention.plan_for(
        step.query, step.kv_cache, len(requests), max_query_len=100, split_kv=4
    )
    rows = triton_attention.split_kv_rows(plan, num_tokens, len(requests))
    assert plan.prefill is not None and rows == 4 * plan.short_query_len < num_tokens
    workspace = triton_attention.allocate_split_kv_workspace(rows, 4, 64, DEVICE)
    split = triton_output(step, split_kv=4, workspace=workspace, max_query_len=100)
    assert_close(split, reference_output(step))


def test_split_kv_rejects_small_workspace():
    step = make_step(DECODE, num_heads=2, num_kv_heads=2)
    workspace = triton_attention.allocate_split_kv_workspace(2, 2, 64, DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        triton_output(step, split_kv=True, workspace=workspace)


# Sliding windows and chunks over MIXED_LONG (the prefill blocks of (100, 70) start at key 100, 132
# and 164, of (0, 150) at 0, 32, ..., 128; key tiles of 64): one key, spans inside a key tile whose
# lower edge crosses from the chunk into its context, and a span over a page and a query block, so
# that blocks have key tiles below their span skipped, masked at the span's lower edge, unmasked and
# masked on the diagonal. Chunks of 16, 40 and 64 put chunk boundaries inside the query blocks of
# (100, 70) and (0, 150) (a block's rows in two chunks), start the (100, 70) prefill chunk mid-chunk,
# and make the decodes at 80 (16, 40) and 130 (64) the first token of their chunk; of 160, the
# (100, 70) block of 132-163 sees two key tiles whole from its first token but not from its last.
@pytest.mark.parametrize(
    "span",
    [
        *(AttentionSpan(window) for window in (1, 5, 17, 100)),
        *(AttentionSpan(chunk, chunked=True) for chunk in (1, 16, 40, 64, 160)),
    ],
    ids=lambda span: f"{'chunk' if span.chunked else 'window'}{span.size}",
)
@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_span_batch_kinds_match_reference(span, dtype):
    step = make_step(
        [*MIXED_LONG, (64, 1), (126, 5)], num_heads=4, num_kv_heads=2, dtype=dtype,
        num_padding_tokens=2,
    )  # fmt: skip
    assert_span_matches(step, span)


@pytest.mark.parametrize(
    ("requests", "group", "size", "split_kv"),
    [
        ([(0, 1), (130, 1), (300, 1), (1000, 1)], 1, 200, True),
        ([(7, 3), (290, 4), (250, 12)], 3, 70, 4),
        ([(5, 4), (47, 3), (64, 2), (200, 1)], 2, 1, 2),
        ([(300, 1), (200, 40), (0, 0), (400, 3)], 2, 5, 2),
    ],
    ids=["decode", "speculative", "speculative_window_1", "mixed"],
)
@pytest.mark.parametrize("chunked", [False, True], ids=["window", "chunk"])
def test_span_split_kv(requests, group, size, split_kv, chunked):
    # Segments divide only the key tiles inside the span: with 16 segments over the 4 tiles of
    # (1000, 1) most are empty, and of (250, 12) over tiles 2-4 the last query sees nothing of
    # tile 2 and the first nothing of tile 4, so the merge weighs segments without a key of a row
    # by 0.
    step = make_step(
        requests, num_heads=2 * group, num_kv_heads=2, block_size=32, dtype=torch.float16
    )
    span = AttentionSpan(size, chunked=chunked)
    assert_span_matches(step, span, split_kv=False)
    assert_span_matches(step, span, split_kv=split_kv)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("chunked", [False, True], ids=["window", "chunk"])
def test_span_gqa_ratios_and_block_sizes(group, block_size, chunked):
    step = make_step(
        [(90, 1), (40, 30), (45, 4)],
        num_heads=2 * group,
        num_kv_heads=2,
        block_size=block_size,
        transposed_table=block_size == 32,
        seed=group,
    )
    assert_span_matches(step, AttentionSpan(37, chunked=chunked))


@pytest.mark.parametrize("head_dim", [80, 128, 256])
def test_sliding_window_head_dims(head_dim):
    # head_dim 256 walks key tiles of 32.
    step = make_step(
        [(100, 40), (70, 1)], num_heads=2, num_kv_heads=1, head_dim=head_dim, dtype=torch.float16
    )
    assert_span_matches(step, AttentionSpan(45))


@pytest.mark.parametrize("split_kv", [False, 4], ids=["single", "split"])
def test_window_over_every_sequence_changes_nothing(split_kv):
    # A window of the longest sequence (100, 70) hides no key: the same tiles and sums as without a
    # window, to the bit.
    step = make_step(MIXED_LONG, num_heads=4, num_kv_heads=2, num_padding_tokens=2)
    windowed = triton_output(step, span=AttentionSpan(170), split_kv=split_kv)
    assert torch.equal(windowed, triton_output(step, split_kv=split_kv))
    assert_close(windowed, reference_output(step, span=AttentionSpan(170)))


def test_split_kv_rule_counts_the_window():
    # One decode over 32k keys with a window of 1024: two segments of 512 keys, not 16 of 64.
    def segments(window):
        return triton_attention.plan_launches(
            1, 1, 32, 8, 128, 16, torch.bfloat16, 9, 132, 1, 32768, None, window
        ).segments

    assert segments(None) == 16
    assert segments(AttentionSpan(1024)) == segments(AttentionSpan(1024, chunked=True)) == 2
    assert segments(AttentionSpan(100)) == 1


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, triton_attention._tanh(tl.load(x_ptr + offsets)))


def test_tanh_matches_torch():
    # Relative error everywhere: near 0 (the Taylor branch, down to tiny arguments), on both sides of
    # the switch at 1/4, and saturated (the cap's plateau, and infinities) without overflow.
    magnitudes = torch.cat(
        [torch.logspace(-30, 0, 1000), torch.linspace(0.2, 0.3, 1000), torch.linspace(1, 50, 1000)]
    )
    x = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, float("inf"), -float("inf")])])
    x = torch.nn.functional.pad(x, (0, 8192 - x.numel())).to(DEVICE)
    out = torch.empty_like(x)
    _tanh_kernel[(1,)](x, out, N=x.numel())
    # On a GPU exp2 and the division are approximate to a few ulp.
    tolerance = 1e-6 if DEVICE == "cpu" else 4e-6
    torch.testing.assert_close(out, torch.tanh(x), rtol=tolerance, atol=0)


def sharpened(step: Step, softcap: float) -> Step:
    """The step with its queries scaled x8 (scores of standard deviation 8, beyond a cap of 5:
    tanh saturates), checked to make the cap change the result."""
    step.query.mul_(8)  # in place: the query stays a view into the fused projection
    capped = reference_output(step, softcap=softcap)
    assert (capped - reference_output(step)).abs().max() > 0.1
    return step


def assert_softcap_matches(step: Step, softcap: float, window: int | None, **kwargs) -> None:
    if window is None:
        expected = reference_output(step, softcap=softcap)
        assert_close(triton_output(step, softcap=softcap, **kwargs), expected)
    else:
        assert_span_matches(step, AttentionSpan(window), softcap=softcap, **kwargs)


# MIXED_LONG: decode tiles, prefill tiles with unmasked and masked key tiles, a speculative query,
# padding; the window of 100 adds prefill key tiles masked at its lower edge and skipped below it.
@pytest.mark.parametrize(("softcap", "window"), [(5.0, None), (50.0, 100)])
@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_softcap_batch_kinds_match_reference(softcap, window, dtype):
    step = make_step(MIXED_LONG, num_heads=4, num_kv_heads=2, dtype=dtype, num_padding_tokens=2)
    assert_softcap_matches(sharpened(step, softcap), softcap, window)


@pytest.mark.parametrize(
    ("requests", "group", "window", "split_kv"),
    [
        ([(0, 1), (130, 1), (300, 1), (1000, 1)], 1, None, True),
        ([(7, 3), (290, 4), (250, 12)], 3, 70, 4),
        ([(300, 1), (200, 40), (0, 0), (400, 3)], 2, None, 2),
    ],
    ids=["decode", "speculative_window", "mixed"],
)
def test_softcap_split_kv(requests, group, window, split_kv):
    # The merge weighs segments by their maxima, which must be of the capped scores.
    step = make_step(
        requests, num_heads=2 * group, num_kv_heads=2, block_size=32, dtype=torch.float16
    )
    assert_softcap_matches(sharpened(step, 5.0), 5.0, window, split_kv=split_kv)


@pytest.mark.parametrize(
    ("head_dim", "group", "window"), [(64, 8, None), (128, 1, 45), (256, 2, None)]
)
def test_softcap_head_dims_and_gqa(head_dim, group, window):
    step = make_step(
        [(100, 40), (70, 1)],
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=torch.float16,
    )
    assert_softcap_matches(sharpened(step, 5.0), 5.0, window)


@pytest.mark.parametrize("softcap", [0.0, -5.0, float("nan"), float("inf")])
def test_softcap_must_be_positive_and_finite(softcap):
    step = make_step(DECODE, num_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="softcap"):
        triton_output(step, softcap=softcap)


def sinks_for(step: Step) -> torch.Tensor:
    """One sink logit per query head, from far below the scores to far above them (outputs near
    0), checked to change the reference's result."""
    sinks = torch.linspace(-30.0, 6.0, step.query.shape[1])
    assert (reference_output(step, sinks=sinks) - reference_output(step)).abs().max() > 0.05
    return sinks


# gpt-oss' sinks join the softmax's sum once per row: after the tiles on a single pass, in the merge
# on split-KV (not once per segment), beside windows.
@pytest.mark.parametrize(
    ("requests", "group", "window", "split_kv"),
    [
        (MIXED_LONG, 2, None, None),
        (MIXED_LONG, 2, 100, None),
        ([(0, 1), (130, 1), (300, 1), (1000, 1)], 1, None, True),
        ([(7, 3), (290, 4), (250, 12)], 3, 70, 4),
    ],
    ids=["mixed", "mixed_window", "split_decode", "split_speculative_window"],
)
def test_sinks_match_reference(requests, group, window, split_kv):
    step = make_step(
        requests, num_heads=2 * group, num_kv_heads=2, block_size=32, dtype=torch.float16
    )
    sinks = sinks_for(step).to(torch.bfloat16)
    if window is None:
        assert_close(
            triton_output(step, sinks=sinks, split_kv=split_kv), reference_output(step, sinks=sinks)
        )
    else:
        assert_span_matches(step, AttentionSpan(window), sinks=sinks, split_kv=split_kv)
