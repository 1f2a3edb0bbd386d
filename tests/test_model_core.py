"""Weir's decoder on a mixed paged batch gives the same logits as transformers on full sequences."""

import os

import pytest
import torch

# The Triton backend runs on CPU tensors under the interpreter; Triton reads this when a
# kernel module is first imported (lazily, by get_attention_backend). Not on a GPU machine:
# this module is imported by others whose CUDA cases run the kernels natively there
# (gpu_checks.sh), and the variable stays set for the whole pytest process.
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

transformers = pytest.importorskip("transformers")

from paged_requests import BLOCK_SIZE, NUM_BLOCKS, PagedRequests  # noqa: E402

from weir.kernels import cpu_native  # noqa: E402
from weir.services.executor.attention import get_attention_backend  # noqa: E402
from weir.services.executor.weights import load_model  # noqa: E402
from weir.shared.model_config import read_model_config  # noqa: E402

COMMON = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_theta=500.0),
    "llama3-rope-tied": lambda: transformers.LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    # YaRN stretched 4x from 64 positions: channels interpolated, extrapolated and between.
    "qwen2-yarn": lambda: transformers.Qwen2Config(
        **COMMON,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Phi-4-mini's partial rotation: half of each head's channels rotate.
    "phi3-partial-rotary": lambda: transformers.Phi3Config(
        **COMMON, partial_rotary_factor=0.5, pad_token_id=0
    ),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24, attention_bias=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, head_dim=24, sliding_window=64),
    # DeepSeek's latent attention (its MLPs dense here): 4 query heads over one cached row of
    # 32 latent and 8 rotated channels.
    "deepseek_v3-latent": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=2,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
    ),
}


def save_tiny_model(kind: str, path) -> torch.nn.Module:
    """A random HF model whose every weight (norms and biases too) is non-trivial, saved to `path`."""
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


needs_native = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler")
interpreted = pytest.mark.skipif(
    ON_GPU, reason="CPU tensors need the interpreter; tests/kernels runs Triton natively"
)


@pytest.mark.parametrize(
    ("kind", "backend"),
    [(kind, "torch") for kind in sorted(CONFIGS)]
    + [pytest.param(kind, "native", marks=needs_native) for kind in sorted(CONFIGS)]
    + [
        pytest.param(kind, "triton", marks=interpreted)
        for kind in ("qwen3", "llama", "deepseek_v3-latent")
    ]
    + [("llama", "reference")],
)
def test_mixed_paged_batch_matches_transformers(kind, backend, tmp_path):
    hf_model = save_tiny_model(kind, tmp_path)
    model = load_model(tmp_path, device="cpu", attention=get_attention_backend(backend, "cpu"))
    cfg = model.config
    assert cfg == read_model_config(tmp_path)
    kv_caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)

    g = torch.Generator().manual_seed(1)
    seqs = {
        "A": torch.randint(0, 128, (13,), generator=g).tolist(),  # full prefill in step 2
        "B": torch.randint(
            0, 128, (21,), generator=g
        ).tolist(),  # chunk 0..9 in step 1, 9..21 in step 2
        "C": torch.randint(
            0, 128, (8,), generator=g
        ).tolist(),  # 7 in step 1, one decode token in step 2
        "D": torch.randint(
            0, 128, (9,), generator=g
        ).tolist(),  # 6 in step 1, three (1 + 2 drafts) in step 2
    }
    with torch.no_grad():
        expected = {r: hf_model(torch.tensor([s])).logits[0] for r, s in seqs.items()}

    paged = PagedRequests(seed=2)
    steps = [
        [("C", seqs["C"][:7], 0), ("B", seqs["B"][:9], 0), ("D", seqs["D"][:6], 0)],
        [("A", seqs["A"], 0), ("B", seqs["B"], 9), ("C", seqs["C"], 7), ("D", seqs["D"], 6)],
    ]
    with torch.inference_mode():
        for work in steps:
            input_ids, positions, meta = paged.step(work)
            hidden = model(input_ids, positions, meta, kv_caches)
            # Logits only at a subset of rows, as the runner asks for them.
            rows = torch.arange(0, len(input_ids), 2)
            logits = model.compute_logits(hidden[rows])
            want = torch.stack(
                [expected[req][p] for req, tokens, done in work for p in range(done, len(tokens))]
            )
            torch.testing.assert_close(logits, want[rows], atol=1e-4, rtol=1e-4)
