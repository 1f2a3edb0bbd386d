"""Triton RMSNorm, RoPE and SiLU-and-multiply against the PyTorch operators they replace on a
GPU (the model's path without layer kernels), on a GPU or under the interpreter; and a whole
model with them against the same model without.

The kernels round where the operators round, so nearly every element is equal; the rest may
differ by one unit in the last place (an fp32 reduction order, an ``exp``). A kernel that
rounded once instead of per operator, or read a strided row wrongly, fails the equality count.
"""

import pytest
import torch

from weir.kernels.triton_layers import TritonLayerKernels
from weir.services.executor.attention import AttentionMetadata, get_attention_backend
from weir.services.executor.layers import RMSNorm, apply_rope, silu_and_mul
from weir.services.executor.model import CausalLM
from weir.services.executor.weights import init_dummy_weights
from weir.shared.model_config import ModelConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 is not a NumPy type: the interpreter runs it, but only a GPU says what the kernels do.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
KERNELS = TritonLayerKernels()


def assert_nearly_equal(
    out: torch.Tensor, expected: torch.Tensor, terms: torch.Tensor | None = None
) -> None:
    """In half precision: within one unit in the last place, and equal in at least 99% of the
    elements. In fp32, where the operators round twice where a kernel may round once: within
    four units. ``terms``: for a sum of products, the sum of their magnitudes, which sets the
    unit instead of the result: where the products cancel, a GPU's fused multiply-add (one
    rounding where the operators round twice) is off by units of the products, and so often
    that no equality count holds."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    a, b = out.float().cpu(), expected.float().cpu()
    finfo = torch.finfo(expected.dtype)
    units = 4 if expected.dtype == torch.float32 else 1
    scale = b.abs() if terms is None else terms.float().cpu()
    assert ((a - b).abs() <= units * finfo.eps * scale.clamp_min(finfo.tiny)).all()
    if expected.dtype != torch.float32 and b.numel() and terms is None:
        assert (a == b).float().mean() >= 0.99, (a == b).float().mean()


def strided_rows(num_tokens: int, width: int, extra: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_tokens, width] random values whose rows are ``extra`` elements apart beyond width,
    as a view into a fused projection's output is."""
    gen = torch.Generator().manual_seed(num_tokens * 7919 + width)
    wide = torch.randn(num_tokens, width + extra, generator=gen).to(dtype).to(DEVICE)
    return wide[:, extra:]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("num_tokens", "dim"), [(1, 64), (7, 576), (33, 2048), (0, 64)])
def test_rms_norm_matches_the_operators(dtype, num_tokens, dim):
    norm = RMSNorm(dim, 1e-5, torch.device(DEVICE), dtype)
    gen = torch.Generator().manual_seed(dim)
    norm.weight.copy_((1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype))
    x = strided_rows(num_tokens, dim, 16, dtype)
    assert_nearly_equal(KERNELS.rms_norm(x, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    ("num_heads", "head_dim", "rotary_dim"),
    [(3, 64, 64), (5, 80, 80), (12, 128, 128), (4, 128, 96)],
)
def test_rope_in_place_matches_the_operators(dtype, num_heads, head_dim, rotary_dim):
    """rotary_dim < head_dim: Phi-4-mini's partial rotation, of a view of each head's first
    channels; the others are left alone."""
    num_tokens = 9
    # The Q and K heads of a fused QKV projection: rows as wide as Q, K and V.
    qkv = strided_rows(num_tokens, (num_heads + 2) * head_dim, 0, dtype)
    qk = qkv.view(num_tokens, num_heads + 2, head_dim)[:, :num_heads, :rotary_dim]
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 1000, 4095, 30000], dtype=torch.float32)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = (positions[:, None] * inv_freq).to(DEVICE)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    expected = apply_rope(qk, cos[:, None], sin[:, None])
    # Each output channel is x1 cos -+ x2 sin: the magnitudes of its two products.
    x1, x2 = qk.abs().float().chunk(2, dim=-1)
    c, s = cos.abs().float()[:, None], sin.abs().float()[:, None]
    terms = torch.cat((x1 * c + x2 * s, x2 * c + x1 * s), dim=-1)
    heads = qkv.view(num_tokens, num_heads + 2, head_dim)
    v_before, pass_before = heads[:, num_heads:].clone(), heads[:, :, rotary_dim:].clone()

    KERNELS.rope_(qk, cos, sin)

    assert_nearly_equal(qk, expected, terms)
    # The V heads beside them in the same rows, and the channels past rotary_dim, are left alone.
    assert torch.equal(heads[:, num_heads:], v_before)
    assert torch.equal(heads[:, :, rotary_dim:], pass_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("num_tokens", "dim"), [(1, 64), (5, 1536), (3, 2500)])
def test_silu_mul_in_place_matches_the_operators(dtype, num_tokens, dim):
    gate_up = strided_rows(num_tokens, 2 * dim, 8, dtype)
    expected = silu_and_mul(gate_up.clone(), None)
    up_before = gate_up[:, dim:].clone()

    out = KERNELS.silu_mul_(gate_up)

    assert out.data_ptr() == gate_up.data_ptr() and out.shape == (num_tokens, dim)
    assert_nearly_equal(out, expected)
    assert torch.equal(gate_up[:, dim:], up_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_a_model_with_the_layer_kernels_gives_the_operators_logits(dtype):
    """Two layers of a Llama shape with random weights, one prefill of 12 tokens and one of 5
    (positions 0-11 and 0-4), through the same attention: the logits agree and so does
    every greedy token."""
    cfg = ModelConfig.from_hf(
        {
            "model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        }
    )  # fmt: skip
    device = torch.device(DEVICE)
    models = []
    for kernels in (None, KERNELS):
        attention = get_attention_backend("reference", device, dtype)
        model = CausalLM(cfg, attention, device, dtype, layer_kernels=kernels)
        init_dummy_weights(model, seed=3)
        models.append(model)
    seq_lens = [12, 5]
    block_size, num_blocks = 16, 4
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 12, 17], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor([[0], [1]], dtype=torch.int32, device=device),
        slot_mapping=torch.cat([torch.arange(12), torch.arange(16, 21)]).to(device),
        max_query_len=12,
        max_seq_len=12,
    )
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, cfg.vocab_size, (17,), generator=gen).to(device)
    positions = torch.cat([torch.arange(12), torch.arange(5)]).to(device)
    logits = []
    for model in models:
        kv_caches = model.allocate_kv_caches(num_blocks, block_size)
        with torch.inference_mode():
            logits.append(
                model.compute_logits(model(input_ids, positions, meta, kv_caches)).float()
            )
    reference_logits, kernel_logits = logits
    torch.testing.assert_close(kernel_logits, reference_logits, rtol=0.02, atol=0.02)
    assert torch.equal(kernel_logits.argmax(-1), reference_logits.argmax(-1))
