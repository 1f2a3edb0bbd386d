"""Model families beside Llama and Qwen, served by real processes as transformers decodes
them: a mixture of experts through `weir serve` (the official openai client, concurrent and
streamed), a tensor-parallel group of two, dummy weights of its shape, and what a start
refuses; sliding windows (Mistral's, Gemma 2's and 3's) served past their length; Qwen 3.5's
hybrid of linear attention and attention; Gemma 4's layers of two head sizes, its KV shared
across layers and its per-layer embeddings."""

import concurrent.futures
import shutil

import openai
import pytest
import torch
from conftest import save_speaking
from lora_adapters import cached_greedy
from serving_helpers import hf_greedy, metric, read_metrics, small_server

from weir.services import LLM
from weir.services.launcher import ChildFailedError
from weir.shared.client import WeirClient
from weir.shared.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, default_model_dir):
    """A 3-layer random Qwen3-MoE (8 experts, 2 a token, renormalized; layer 0 dense) with
    SmolLM2's vocabulary, so text prompts and chat work."""
    path = tmp_path_factory.mktemp("models") / "tiny-moe"
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    save_speaking(transformers.Qwen3MoeForCausalLM(config).eval(), path, default_model_dir)
    return path


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    # transformers' loop over experts, not the grouped matmul Weir runs.
    return transformers.AutoModelForCausalLM.from_pretrained(
        moe_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()


def _complete_as_transformers(client: openai.OpenAI, model: str, hf, prompts: list[str]) -> None:
    """The prompts completed at once (12 greedy tokens each) as transformers decodes them."""

    def complete(prompt: str):
        return client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        ).choices[0]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        choices = list(pool.map(complete, prompts))
    for prompt, choice in zip(prompts, choices):
        assert choice.token_ids == hf_greedy(hf, choice.prompt_token_ids, 12), prompt


def test_openai_clients_get_what_transformers_decodes(moe_dir, hf_moe):
    prompts = ["The experts agree that", "Mixture", "A river runs " * 20]
    with small_server(moe_dir, "tiny-moe", max_num_batched_tokens=32) as server:
        client = openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="unused")
        _complete_as_transformers(client, "tiny-moe", hf_moe, prompts * 2)
        stream = client.chat.completions.create(
            model="tiny-moe",
            messages=[{"role": "user", "content": "Which expert?"}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        whole = client.chat.completions.create(
            model="tiny-moe",
            messages=[{"role": "user", "content": "Which expert?"}],
            max_tokens=8,
            temperature=0,
        )
        assert streamed == whole.choices[0].message.content


def test_two_ranks_serve_the_experts_split_like_transformers(moe_dir, hf_moe):
    prompts = [[5, 6, 7, 8], list(range(100, 140))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(moe_dir), tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        for prompt, c in zip(prompts, llm.generate(prompts, params)):
            assert c.token_ids == hf_greedy(hf_moe, prompt, 8)


def test_dummy_weights_of_a_moe_shape_serve(moe_dir, tmp_path):
    for item in moe_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, tmp_path / item.name)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path), load_format="dummy", device="cpu") as llm:
        assert [len(c.token_ids) for c in llm.generate(["Hello", [3, 4]], params)] == [5, 5]


def test_int8_weights_of_experts_are_refused_at_start_in_one_line(moe_dir):
    with pytest.raises(ChildFailedError) as refused:
        LLM(str(moe_dir), quantization="int8", startup_timeout=120)
    message = str(refused.value)
    assert "\n" not in message
    assert "--quantization int8 does not quantize a mixture of experts' weights" in message


WINDOWED = {
    "mistral": lambda **common: transformers.MistralConfig(
        **common, sliding_window=24, bos_token_id=1, eos_token_id=2
    ),
    # Layers 0 and 2 local (window 24), soft caps that bind.
    "gemma2": lambda **common: transformers.Gemma2Config(
        **common,
        head_dim=8,
        sliding_window=24,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # Layers 0, 1 and 3 local (window 24), layer 2 global.
    "gemma3_text": lambda **common: transformers.Gemma3TextConfig(
        **common,
        head_dim=8,
        sliding_window=24,
        sliding_window_pattern=3,
        query_pre_attn_scalar=16,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
}


# The shape of the rotation tests' random models (the default model's vocabulary and ids).
SMALL = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _saved_and_loaded(config, path, default_model_dir):
    """A random model of ``config`` saved under ``path`` with the default model's tokenizer,
    and transformers' copy loaded back from there (the reference)."""
    save_speaking(transformers.AutoModelForCausalLM.from_config(config), path, default_model_dir)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", sorted(WINDOWED))
def test_sliding_windows_are_served_past_their_length(kind, tmp_path, default_model_dir):
    """A window of 24 tokens and prompts of 80: the whole context is served (not the
    window), chunked by 16-token steps, and greedy decoding past the window is what
    transformers decodes; the second prompt, sent after the first, shares its first 48
    tokens, which the prefix cache (on by default) then holds."""
    torch.manual_seed(1)
    config = WINDOWED[kind](
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    hf = _saved_and_loaded(config, tmp_path, default_model_dir)
    prompts = [list(range(200, 280)), list(range(200, 248)) + list(range(900, 932))]
    with LLM(str(tmp_path), max_num_batched_tokens=16) as llm:
        with WeirClient(llm.server_info["client_address"]) as client:
            assert client.model_info()["max_model_len"] == 512
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 24) for p in prompts]


def test_phi4_mini_rotation_is_served_as_transformers_generates(tmp_path, default_model_dir):
    """Phi-4-mini's rotation (LongRoPE, three quarters of each head rotating) with an original
    context of 64: a prompt within it decoded past it, then one sharing its first 40 tokens
    (read from the prefix cache), then one sharing them but past 64 tokens itself, whose
    every token transformers rotates by the long factors: served in 16-token chunks, each
    decodes what transformers generates with its cache."""
    torch.manual_seed(1)
    config = transformers.Phi3Config(
        **SMALL,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [3.0**i for i in range(6)],
        },
    )
    hf = _saved_and_loaded(config, tmp_path, default_model_dir)
    first = list(range(200, 240))
    prompts = [first, first + list(range(900, 910)), first + list(range(900, 940))]
    with LLM(str(tmp_path), max_num_batched_tokens=16) as llm:
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    assert [o.token_ids for o in outputs] == [cached_greedy(hf, p, 32) for p in prompts]


def test_a_yarn_rope_scaling_stretches_the_served_context(tmp_path, default_model_dir):
    """Qwen's long-context recipe adds only rope_scaling (YaRN, factor 4) to a config whose
    max_position_embeddings stays the original context (64 here): the served context is
    256, as vLLM derives it, and a 150-token prompt decodes as transformers generates."""
    torch.manual_seed(1)
    config = transformers.Qwen2Config(
        **SMALL,
        max_position_embeddings=64,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    hf = _saved_and_loaded(config, tmp_path, default_model_dir)
    prompt = list(range(300, 450))
    with LLM(str(tmp_path)) as llm:
        with WeirClient(llm.server_info["client_address"]) as client:
            assert client.model_info()["max_model_len"] == 256
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        assert llm.generate([prompt], params)[0].token_ids == hf_greedy(hf, prompt, 16)


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory, default_model_dir):
    """A 4-layer random Qwen 3.5 (three Gated DeltaNet layers, one gated attention layer) with
    SmolLM2's vocabulary, so text prompts and chat work."""
    path = tmp_path_factory.mktemp("models") / "tiny-qwen3.5"
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        **{**SMALL, "num_hidden_layers": 4},
        head_dim=16,
        max_position_embeddings=512,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
    )
    save_speaking(transformers.Qwen3_5ForCausalLM(config).eval(), path, default_model_dir)
    return path


def test_qwen3_5_is_served_as_transformers_decodes_without_prefix_caching(qwen3_5_dir):
    """Concurrent requests (each linear-attention state in a slot of its own), a prompt
    longer than a step, and the same prompt twice: what transformers decodes, through the
    official openai client; the scheduler caches no prefixes (a state is not a prefix's KV),
    as /metrics says; a start asking for drafts fails in one line."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_5_dir, dtype=torch.float32)
    prompts = ["The state of the river", "Delta", "A river runs " * 20]
    with small_server(qwen3_5_dir, "tiny-qwen3.5", max_num_batched_tokens=32) as server:
        client = openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="unused")
        _complete_as_transformers(client, "tiny-qwen3.5", hf, prompts * 2)
        info = [
            key
            for key in read_metrics(server.info["metrics_address"])
            if key.startswith("weir_cache_config_info{")
        ]
        assert len(info) == 1 and 'enable_prefix_caching="False"' in info[0]
    with pytest.raises(ChildFailedError) as refused:
        LLM(
            str(qwen3_5_dir),
            speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
            startup_timeout=120,
        )
    message = str(refused.value)
    assert "\n" not in message and "state cannot take back rejected drafts" in message


def test_gemma4_is_served_as_transformers_decodes_with_its_prefixes_cached(
    tmp_path, default_model_dir
):
    """A random Gemma 4 of its small models' build (full-attention heads twice as wide, the
    last two layers reading layers 3's and 1's KV, per-layer embeddings of SmolLM2's vocabulary)
    through the official openai client: concurrent requests, one longer than its window and
    a step, each prompt twice, decoded as transformers decodes them; the second time from the
    prefix cache, as /metrics counts."""
    torch.manual_seed(1)
    config = transformers.Gemma4TextConfig(
        **{**SMALL, "num_hidden_layers": 6},
        head_dim=8,
        global_head_dim=16,
        sliding_window=12,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"]
        + ["sliding_attention"] * 3
        + ["full_attention"],
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=49152,
        final_logit_softcapping=30.0,
        tie_word_embeddings=False,
    )
    hf = _saved_and_loaded(config, tmp_path, default_model_dir)
    prompts = ["The state of the river", "Gemma", "A river runs " * 20]
    with small_server(tmp_path, "tiny-gemma4", max_num_batched_tokens=32) as server:
        client = openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="unused")
        _complete_as_transformers(client, "tiny-gemma4", hf, prompts)
        _complete_as_transformers(client, "tiny-gemma4", hf, prompts)
        hits = metric(
            read_metrics(server.info["metrics_address"]), "weir_prefix_cache_hit_tokens_total"
        )
        assert hits >= 48  # the long prompt's first blocks, at least
