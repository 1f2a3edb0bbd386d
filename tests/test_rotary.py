"""Each rotary scaling type's frequencies and attention factor, and the cos and sin of a
step's tokens, against transformers' own (`ROPE_INIT_FUNCTIONS`, its models' rotary
embedding modules): LongRoPE's short and long factors as transformers switches them by the
sequence's length."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from weir.services.executor.rotary import Rotary, inv_freq  # noqa: E402
from weir.shared.model_config import ModelConfig  # noqa: E402
from weir.shared.rope_config import LONG_ROTATION  # noqa: E402

SHAPE = dict(
    hidden_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    num_hidden_layers=1,
    vocab_size=64,
    max_position_embeddings=4096,
)
HEAD_DIM = 128


def _longrope(pairs: int, **extra) -> dict:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.0 + 0.9 * i for i in range(pairs)],
        **extra,
    }


CONFIGS = {
    "default": lambda: transformers.LlamaConfig(**SHAPE, rope_theta=500.0),
    "linear": lambda: transformers.LlamaConfig(
        **SHAPE, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0}
    ),
    "llama3": lambda: transformers.LlamaConfig(
        **SHAPE,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    ),
    "yarn": lambda: transformers.Qwen2Config(
        **SHAPE,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ),
    # DeepSeek's ratio of two scales, and a correction range left untruncated.
    "yarn-mscale": lambda: transformers.LlamaConfig(
        **SHAPE,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
    ),
    "yarn-attention-factor": lambda: transformers.Qwen3Config(
        **SHAPE,
        head_dim=HEAD_DIM,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 2.0,
            "original_max_position_embeddings": 2048,
            "attention_factor": 1.3,
        },
    ),
    # Phi-3.5's: the original context at the top level, the factor from the two lengths.
    "longrope": lambda: transformers.Phi3Config(
        **SHAPE,
        original_max_position_embeddings=256,
        rope_scaling=_longrope(HEAD_DIM // 2),
        pad_token_id=0,
    ),
    # Phi-4-mini's: three quarters of each head rotate.
    "longrope-partial": lambda: transformers.Phi3Config(
        **SHAPE,
        original_max_position_embeddings=1024,
        partial_rotary_factor=0.75,
        rope_scaling=_longrope(HEAD_DIM * 3 // 8),
        pad_token_id=0,
    ),
    "longrope-factors": lambda: transformers.Phi3Config(
        **SHAPE,
        original_max_position_embeddings=1024,
        rope_scaling=_longrope(HEAD_DIM // 2, factor=2.5, attention_factor=1.1),
        pad_token_id=0,
    ),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_frequencies_and_attention_factor_are_transformers(kind):
    hf = CONFIGS[kind]()
    rope = ModelConfig.from_hf(hf.to_dict()).rope
    rotary = transformers.AutoModelForCausalLM.from_config(hf).model.rotary_emb
    theirs = rotary.inv_freq
    assert torch.equal(inv_freq(rope), theirs)
    assert rope.attention_factor == rotary.attention_scaling
    assert rope.rotary_dim == 2 * len(theirs)
    if rope.type == "longrope":
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=rope.original_max_position + 1)
        assert torch.equal(inv_freq(rope, long=True), long)
        assert not torch.equal(long, theirs)
        assert rope.long_prompt_threshold == rope.original_max_position
    else:
        assert rope.long_prompt_threshold is None


@pytest.mark.parametrize("kind", ["yarn", "longrope-partial", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_and_sin_are_those_of_the_model_in_transformers(kind, dtype):
    """LongRoPE: transformers rotates a forward pass's tokens by the short factors while
    its sequence fits the original context, by the long ones past it; Weir is told which
    per token (LONG_ROTATION)."""
    hf = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(hf)
    theirs = model.model.rotary_emb
    rope = ModelConfig.from_hf(hf.to_dict()).rope
    ours = Rotary(rope, torch.device("cpu"))
    x = torch.zeros(1, dtype=dtype)
    limit = rope.long_prompt_threshold or 0
    for length in (5, 700, 1500, 3000):
        positions = torch.arange(length)
        want_cos, want_sin = theirs(x, positions[None])
        long = limit and length > limit
        cos, sin = ours(positions + LONG_ROTATION if long else positions, dtype)
        half = rope.rotary_dim // 2
        # transformers repeats the half for the rotate-half layout.
        assert torch.equal(cos[:, 0], want_cos[0, :, :half])
        assert torch.equal(sin[:, 0], want_sin[0, :, half:])
