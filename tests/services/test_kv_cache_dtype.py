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
from kv_cache_scales import save_with_kv_scales
from serving_helpers import metric, read_metrics

from weir.services.executor.weights import load_model
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


def _prompt_token_logprobs(completion, ids: list[int]) -> torch.Tensor:
    """Each prompt token's logprob after the first, of its row of ``{id: logprob}``."""
    return torch.tensor([row[t] for row, t in zip(completion.prompt_logprobs[1:], ids[1:])])


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

    weir = _prompt_token_logprobs(completion, ids)
    distance = {name: (weir - ref).abs().mean().item() for name, ref in references.items()}
    others = [d for name, d in distance.items() if name != kv_cache_dtype]
    assert distance[kv_cache_dtype] < 0.6 * min(others), distance


def test_a_draft_models_cache_is_fp8_too(default_model_dir):
    """With a draft model each block holds both models' K/V in fp8 (the default model
    drafting for itself: two fp8 caches a block), and the draft, reading its own fp8 cache
    as the served model reads its own, proposes what the served model then accepts."""
    with LLM(
        kv_cache_dtype="fp8",
        kv_cache_memory=CACHE_BYTES,
        speculative_model=str(default_model_dir),
        num_speculative_tokens=3,
    ) as llm:
        llm.chat(
            [{"role": "user", "content": "List the days of the week."}],
            SamplingParams(max_tokens=32, temperature=0.0),
        )
        num_blocks = llm.server_info["num_blocks"]
        samples = read_metrics(llm.server_info["metrics_address"])
    cfg = read_model_config(default_model_dir)
    block_bytes = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim
    assert num_blocks == CACHE_BYTES // (2 * block_bytes)
    drafted = metric(samples, "weir_spec_decode_draft_tokens_total")
    assert drafted > 0
    assert metric(samples, "weir_spec_decode_accepted_tokens_total") > 0.9 * drafted


def _scales(num_layers: int) -> dict[str, torch.Tensor]:
    """A calibrated checkpoint's k_scale and v_scale per layer, some as one-element vectors:
    small enough that K / k_scale saturates e4m3 in places, so they change what is cached."""
    tensors = {}
    for layer in range(num_layers):
        for kind, value in (("k", 0.02 * (1 + layer % 3)), ("v", 0.01 * (1 + layer % 2))):
            shape = () if layer % 2 else (1,)
            tensors[f"model.layers.{layer}.self_attn.{kind}_scale"] = torch.full(shape, value)
    return tensors


@pytest.fixture(scope="module")
def scaled_checkpoint(tmp_path_factory, default_model_dir):
    """The default model with a calibrated fp8 cache's scales (`kv_cache_scales`)."""
    path = tmp_path_factory.mktemp("kv-scales")
    num_layers = read_model_config(default_model_dir).num_layers
    scales = _scales(num_layers)
    save_with_kv_scales(default_model_dir, path, scales)
    return path, scales


def test_checkpoint_scales_divide_what_an_fp8_cache_holds(
    default_model_dir, prompt_and_references, scaled_checkpoint
):
    """vLLM's reading of a checkpoint's KV cache scales: the cache holds K / k_scale and
    V / v_scale in e4m3 and attention reads them multiplied back. Against transformers whose
    attention rounds K and V so, each layer by its own scales; the scales go unused without
    an fp8 cache (the model computes as the plain checkpoint)."""
    path, scales = scaled_checkpoint
    ids, references = prompt_and_references
    limit = torch.finfo(torch.float8_e4m3fn).max
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def scaled_rounding(module, query, key, value, attention_mask, **kwargs):
        layer = f"model.layers.{module.layer_idx}.self_attn"
        rounded = []
        for x, scale in ((key, scales[f"{layer}.k_scale"]), (value, scales[f"{layer}.v_scale"])):
            x8 = (x / scale).clamp(-limit, limit).to(torch.float8_e4m3fn)
            rounded.append(x8.to(x.dtype) * scale)
        return sdpa_attention_forward(module, query, *rounded, attention_mask, **kwargs)

    transformers.AttentionInterface.register("weir_test_scaled_fp8", scaled_rounding)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, attn_implementation="weir_test_scaled_fp8"
    ).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)[:-1]
    scaled = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    weir = {}
    for kv_cache_dtype in ("fp8", "auto"):
        with LLM(str(path), kv_cache_dtype=kv_cache_dtype, kv_cache_memory=CACHE_BYTES) as llm:
            (completion,) = llm.generate([ids], params)
        weir[kv_cache_dtype] = _prompt_token_logprobs(completion, ids)
    distance = {
        name: (weir["fp8"] - ref).abs().mean().item()
        for name, ref in {"scaled": scaled, **references}.items()
    }
    others = [d for name, d in distance.items() if name != "scaled"]
    assert distance["scaled"] < 0.6 * min(others), distance
    torch.testing.assert_close(weir["auto"], references["auto"], atol=1e-3, rtol=0)


def test_scales_by_head_are_refused_for_an_fp8_cache(default_model_dir, tmp_path):
    """Scales an fp8 cache does not apply (per head here) stop the start with the reason,
    rather than quietly caching with scales of 1."""
    num_layers = read_model_config(default_model_dir).num_layers
    save_with_kv_scales(default_model_dir, tmp_path, _scales(num_layers), strategy="attn_head")
    with pytest.raises(ValueError, match="kv_cache_scheme of float 8-bit scales by attn_head"):
        load_model(tmp_path, kv_cache_dtype=torch.float8_e4m3fn)
