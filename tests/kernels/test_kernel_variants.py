"""Every Triton kernel variant a step can launch is one the startup warm-up launched.

Triton compiles a kernel again for each new set of compile-time constants and for each new
class (1, a multiple of 16, other) of a specialized integer argument (`triton_keys`). A step
that meets a variant first stalls the whole batch while it compiles, so (1) the arguments
that change from step to step must not be specialized, and (2) the few steps `warm_up_hints`
picks must reach every launch plan that plan_launches chooses for any batch: for an
H100/H200 (132 SMs, sm_90), an A100 (108, sm_80), an L4 (58, sm_89) and a CPU.
"""

import random

import pytest
import torch
from triton_keys import LaunchKeys

from weir.kernels import triton_attention
from weir.kernels.reference import AttentionSpan
from weir.kernels.triton_attention import LayerAttention, warm_up_hints

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEVICES = {"h200": (132, 9), "a100": (108, 8), "l4": (58, 8), "cpu": (0, 0)}
MODELS = {
    "llama-1b": [LayerAttention(32, 8, 64)],
    "smollm2": [LayerAttention(9, 3, 64)],
    "mha-128": [LayerAttention(16, 16, 128)],
    "gqa-16": [LayerAttention(16, 1, 128)],
    "gemma2": [
        LayerAttention(8, 4, 256, span=AttentionSpan(4096), softcap=50.0),
        LayerAttention(8, 4, 256, softcap=50.0),
    ],
    "gpt-oss": [
        LayerAttention(64, 8, 64, span=AttentionSpan(128), has_sinks=True),
        LayerAttention(64, 8, 64, has_sinks=True),
    ],
    "llama4": [
        LayerAttention(40, 8, 128, span=AttentionSpan(8192, chunked=True)),
        LayerAttention(40, 8, 128),
    ],
    "latent-576": [LayerAttention(16, 1, 576)],
}


@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_warm_up_hints_reach_every_plan_a_batch_gets(model, device, fp8_cache):
    layers, (num_sms, major) = MODELS[model], DEVICES[device]
    max_model_len = 131072

    def plans(num_tokens, num_requests, max_query_len, max_seq_len):
        return tuple(
            layer.plan(
                num_tokens, num_requests, max_query_len, max_seq_len, block_size=16,
                compute_dtype=torch.bfloat16, fp8_cache=fp8_cache, device_info=(num_sms, major),
            ).variant
            for layer in layers
        )  # fmt: skip

    hints = warm_up_hints(layers, 16, torch.bfloat16, fp8_cache, max_model_len, (num_sms, major))
    warmed = {plans(q, 1, q, s) for q, s in hints}
    assert len(warmed) == len(hints)  # one step per variant, none wasted
    rng = random.Random(0)
    for _ in range(3000):
        num_requests = rng.choice([1, 2, 3, 8, 16, 17, 33, 64, 100, 256, 1024])
        max_query_len = rng.choice([1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 64, 65, 512, 8192])
        num_tokens = max_query_len + rng.randrange(num_requests)  # one request is the longest
        max_seq_len = rng.randrange(max_query_len, max_model_len + 1)
        seen = plans(num_tokens, num_requests, max_query_len, max_seq_len)
        assert seen in warmed, (num_requests, max_query_len, max_seq_len)


def test_a_kernel_variant_does_not_depend_on_the_batch():
    """The same plan for batches of 1, 3, 16 and 17 requests with block tables 1, 2, 3, 5
    and 16 blocks wide compiles to one kernel each: only the compile-time constants tell them
    apart."""
    with LaunchKeys() as launches:
        g = torch.Generator().manual_seed(0)
        num_blocks, block_size, heads, kv_heads, dim = 48, 16, 4, 2, 16
        cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(DEVICE)
        for num_requests, table_width in ((1, 1), (3, 5), (16, 16), (17, 2)):
            for query_len, split_kv in ((1, 1), (1, 2), (40, None)):
                width = max(table_width, -(-query_len // block_size))  # the keys hold the query
                seq_lens = torch.full((num_requests,), width * block_size, dtype=torch.int32)
                qsl = torch.arange(num_requests + 1, dtype=torch.int32) * query_len
                query = torch.randn(num_requests * query_len, heads, dim, generator=g)
                table = torch.randint(0, num_blocks, (num_requests, width), dtype=torch.int32)
                triton_attention.paged_attention(
                    query.to(DEVICE), cache, qsl.to(DEVICE), seq_lens.to(DEVICE),
                    table.to(DEVICE), 0.25, split_kv=split_kv,
                    max_query_len=query_len, max_seq_len=width * block_size,
                )  # fmt: skip
    # Decodes: single pass and two segments; the prefill launch: one variant.
    assert launches.per_kernel() == {
        "_prefill_attention_kernel": 1,
        "_decode_attention_kernel": 2,
        "_merge_segments_kernel": 1,
    }
