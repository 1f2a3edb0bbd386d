"""``--kv-cache-dtype fp8`` (vLLM's): the executor caches K and V one byte a value, so the same
memory holds 4x the blocks of a float32 cache, and the model computes what transformers
computes when its attention reads K and V rounded through the same fp8 format.

The comparison is of prompt logprobs over one long prompt, computed in chunks that read the
earlier chunks' K/V back from the cache. Rounding to 3 mantissa bits turns the last-bit
differences of two float32 implementations into different roundings of a few values, which
grow through the layers: Weir's native and torch backends themselves differ by ~0.02 nats
on average with an fp8 cache (7e-6 without). So the test asks that Weir's fp8 logprobs lie
well closer to transformers' of the same format than to those of the other format or of
no rounding at all.
"""

import pytest
import torch
from conftest import transformers

from weir.services.llm import LLM
from weir.shared.model_config import read_model_config
from weir.shared.sampling import SamplingParams

pytestmark = pytest.mark.slow

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TEXT = (
    "The history of the Roman Empire spans centuries. It began when Augustus became the "
    "first emperor in 27 BC, and the western half fell in 476 AD. During this time, Roman "
    "law, roads and language spread across Europe, and Latin became the root of many "
    "languages spoken today, from Spanish and French to Italian and Romanian."
)
CACHE_BYTES = 16 << 20


def _rounding_attention(dtype: torch.dtype):
    """transformers' SDPA attention over K and V clamped and rounded to ``dtype``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    limit = torch.finfo(dtype).max

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = (x.clamp(-limit, limit).to(dtype).to(x.dtype) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


@pytest.fixture(scope="module")
def prompt_and_references(default_model_dir):
    """The prompt's token ids and transformers' logprob of each token after the first, with
    the attention reading K/V as each format holds them (and as float32: "auto")."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer(TEXT)["input_ids"]
    references = {}
    for name, dtype in {**FORMATS, "auto": None}.items():
        implementation = "sdpa"
        if dtype is not None:
            implementation = f"weir_test_{name}"
            transformers.AttentionInterface.register(implementation, _rounding_attention(dtype))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            default_model_dir, dtype=torch.float32, attn_implementation=implementation
        ).eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        logprobs = torch.log_softmax(logits, dim=-1)[:-1]
        references[name] = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return ids, references


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_fp8_cache_holds_4x_the_blocks_and_computes_as_transformers_rounding(
    default_model_dir, prompt_and_references, kv_cache_dtype
):
    ids, references = prompt_and_references
    with LLM(
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=CACHE_BYTES,
        max_num_batched_tokens=24,  # the prompt's 60-odd tokens in three chunks
    ) as llm:
        (completion,) = llm.generate(
            [ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        )
        num_blocks = llm.server_info["num_blocks"]
    cfg = read_model_config(default_model_dir)
    block_bytes = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim  # one byte a value
    assert num_blocks == CACHE_BYTES // block_bytes

    weir = torch.tensor(completion.prompt_logprobs[1:])
    distance = {name: (weir - ref).abs().mean().item() for name, ref in references.items()}
    others = [d for name, d in distance.items() if name != kv_cache_dtype]
    assert distance[kv_cache_dtype] < 0.6 * min(others), distance
