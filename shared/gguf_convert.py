"""Convert a GGUF file (llama.cpp's format) into a Hugging Face model directory.

The output is what `transformers` would save: config.json, model.safetensors (float32),
tokenizer.json, tokenizer_config.json and generation_config.json. Supported architectures are
llama (Mixtral where it has experts), qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3 (their
norm weights stored plus one, as llama.cpp's converter writes them; its fixed patterns of
sliding layers, Gemma 3's local base, and its query scale, head_dim but for the 27B models')
and phi3 (fused q/k/v and gate/up, a partial rotation, LongRoPE's factor tensors) with a
byte-level BPE ("gpt2") tokenizer; anything else raises `UnsupportedGGUFError` naming what the file
states. Converted for a model served with another tokenizer (``--tokenizer``), the file's own
is left out, whatever its kind: vLLM's advice for GGUF files, whose tokenizers convert
slowly or not at all (SentencePiece's "llama" kind here). llama.cpp stacks a layer's experts in one tensor per projection; they are written
one tensor per expert, as Hugging Face checkpoints hold them.

RoPE scaling: ``rope.scaling.type`` linear and yarn (with their factor and original context)
become Hugging Face's ``rope_scaling``. Llama 3.1's and later (``llama3``) files state no
type: llama.cpp writes the divisor of each rotated pair's frequency as the tensor
``rope_freqs``, which becomes a ``longrope`` scaling of those factors, short and long alike,
with no attention scale (its original context the file's): the rotation llama.cpp applies.
"""

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

logger = logging.getLogger(__name__)

# What an unsupported tokenizer's error adds: vLLM's way round it.
_GIVE_TOKENIZER = (
    "; serve the file with its original Hugging Face tokenizer instead: --tokenizer DIR "
    "(a directory with its tokenizer.json and tokenizer_config.json)"
)
# llama.cpp's token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class UnsupportedGGUFError(ValueError):
    """The GGUF file is unreadable, or describes a model or tokenizer this converter cannot rebuild."""


@dataclass(slots=True, frozen=True)
class _Architecture:
    hf_class: str
    model_type: str
    # llama.cpp's converter interleaves q/k rows for its rotary layout on these architectures only.
    permuted_qk: bool
    # Layer tensors that are other modules than llama's of the same name (Gemma's norms,
    # Phi-3's fused projections): (GGUF name, Hugging Face module) pairs.
    renames: tuple[tuple[str, str], ...] = ()
    # llama.cpp's converter adds one to Gemma's norm weights (its norms scale by 1 + weight).
    norms_plus_one: bool = False


_GEMMA_NORMS = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)


_ARCHITECTURES = {
    "llama": _Architecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": _Architecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": _Architecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
    "qwen2moe": _Architecture("Qwen2MoeForCausalLM", "qwen2_moe", permuted_qk=False),
    "qwen3moe": _Architecture("Qwen3MoeForCausalLM", "qwen3_moe", permuted_qk=False),
    "gemma2": _Architecture("Gemma2ForCausalLM", "gemma2", False, _GEMMA_NORMS, True),
    "gemma3": _Architecture("Gemma3ForCausalLM", "gemma3_text", False, _GEMMA_NORMS, True),
    "phi3": _Architecture(
        "Phi3ForCausalLM",
        "phi3",
        permuted_qk=False,
        renames=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")),
    ),
}
# llama.cpp renormalizes the chosen experts' weights for these (where the file does not say).
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}

_TOP_LEVEL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Rotations' factors, read into the config (_rope_scaling): llama3's, Phi-3's LongRoPE.
    "rope_freqs": "rope_freqs",
    "rope_factors_long": "rope_factors_long",
    "rope_factors_short": "rope_factors_short",
}
_ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A layer's experts stacked, [experts, rows, columns]: one Hugging Face tensor per expert.
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Mixtral's Hugging Face names for what Qwen's MoE calls mlp.gate and mlp.experts.E.*_proj.
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Nemo, Small 3, Ministral): words split at a case change, single digits.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's (gpt-oss, Llama 4, MiniMax-M2): Tekken's words with their contractions, 1-3 digits.
_O200K_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _O200K_CONTRACTION
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _O200K_CONTRACTION
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass(slots=True, frozen=True)
class _Pretokenization:
    """How the original HF tokenizer cut text before BPE; llama.cpp names it in `tokenizer.ggml.pre`."""

    pre_tokenizer: pre_tokenizers.PreTokenizer
    normalizer: normalizers.Normalizer | None = None
    ignore_merges: bool = False


def _pretokenization(pre: str) -> _Pretokenization:
    if pre in ("gpt2", "default"):
        return _Pretokenization(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    if pre in ("smollm", "starcoder", "refact"):
        # StarCoder-family vocabularies were trained on single digits; HF splits them before the GPT-2 regex.
        return _Pretokenization(
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        )
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral"):
        return _Pretokenization(_split_then_bytes(_LLAMA3_SPLIT), ignore_merges=True)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _Pretokenization(_split_then_bytes(_QWEN2_SPLIT), normalizer=normalizers.NFC())
    if pre == "tekken":
        return _Pretokenization(_split_then_bytes(_TEKKEN_SPLIT))
    if pre in ("gpt-4o", "llama4", "minimax-m2"):
        return _Pretokenization(_split_then_bytes(_O200K_SPLIT))
    raise UnsupportedGGUFError(
        f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: gpt2, smollm, "
        f"starcoder, refact, llama-bpe, qwen2, tekken, gpt-4o){_GIVE_TOKENIZER}"
    )


class _Metadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise UnsupportedGGUFError(f"GGUF file has no {key!r} metadata")
        return self._fields[key].contents()


def _f32(value: float) -> float:
    # GGUF stores float32; print the shortest decimal that round-trips (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of rotary rows (works on weights and biases)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensor_name(gguf_name: str, arch: _Architecture) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_TENSORS:
        return f"{_TOP_LEVEL_TENSORS[stem]}.{suffix}"
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    names = {**_LAYER_TENSORS, **dict(arch.renames)}
    if match is None or match.group(2) not in names:
        raise UnsupportedGGUFError(
            f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this converter"
        )
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{names[kind]}.{suffix}"


def _convert_tensors(
    reader: GGUFReader, arch: _Architecture, n_head: int, n_kv_head: int
) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        # GGUF lists dimensions fastest-first; numpy (and HF) order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        with np.errstate(invalid="ignore", over="ignore"):  # damage is reported below, by name
            w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape(shape)
        if not np.isfinite(w).all():
            raise UnsupportedGGUFError(
                f"GGUF tensor {tensor.name!r} holds {np.count_nonzero(~np.isfinite(w))} NaN or "
                "infinite values: the file is damaged; download it again"
            )
        if arch.permuted_qk and ".attn_q." in tensor.name:
            w = _unpermute_rows(w, n_head)
        elif arch.permuted_qk and ".attn_k." in tensor.name:
            w = _unpermute_rows(w, n_kv_head)
        match = _LAYER_TENSOR_NAME.fullmatch(tensor.name)
        if match is not None and match.group(2) in _EXPERT_TENSORS:
            layer, kind, suffix = match.groups()
            for expert, rows in enumerate(w):
                name = f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_TENSORS[kind]}.{suffix}"
                tensors[name] = np.ascontiguousarray(rows)
            continue
        if match is not None and match.group(2) == "ffn_gate_inp_shexp":
            w = w.reshape(1, -1)  # llama.cpp keeps the shared expert's gate as a vector
        if arch.norms_plus_one and tensor.name.endswith("norm.weight"):
            w = w - np.float32(1)
        tensors[_hf_tensor_name(tensor.name, arch)] = np.ascontiguousarray(w)
    return tensors


def _as_mixtral(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A llama file's experts under Mixtral's Hugging Face names."""
    renamed = {}
    for name, w in tensors.items():
        name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        if ".mlp.experts." in name:
            stem, projection, suffix = name.rsplit(".", 2)
            stem = stem.replace(".mlp.experts.", ".block_sparse_moe.experts.")
            name = f"{stem}.{_MIXTRAL_NAMES[projection]}.{suffix}"
        renamed[name] = w
    return renamed


def _rope_scaling(
    meta: _Metadata, arch_name: str, factors: dict[str, np.ndarray]
) -> dict[str, Any] | None:
    """Hugging Face's rope_scaling of the file's (see the module docstring)."""

    def key(name: str) -> str:
        return f"{arch_name}.rope.scaling.{name}"

    kind = meta.get(key("type"), "none")
    if factors and kind != "none":
        raise UnsupportedGGUFError(f"GGUF rope scaling {kind!r} with rope factor tensors")
    if "rope_freqs.weight" in factors:
        llama3 = [float(f) for f in factors["rope_freqs.weight"].reshape(-1)]
        context = int(meta.require(f"{arch_name}.context_length"))
        return _longrope(llama3, llama3, context, 1.0)
    if factors:  # Phi-3's LongRoPE: both lists, its original context and attention scale
        if len(factors) != 2:
            raise UnsupportedGGUFError(f"GGUF file has {sorted(factors)} but not both lists")
        long, short = ([float(f) for f in w.reshape(-1)] for _, w in sorted(factors.items()))
        original = int(meta.require(key("original_context_length")))
        return _longrope(short, long, original, _f32(meta.get(key("attn_factor"), 0.0)))
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedGGUFError(
            f"GGUF rope scaling {kind!r} is not supported (supported: linear, yarn, and the "
            "rope_freqs and rope_factors tensors)"
        )
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(meta.require(key("factor")))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(
            meta.require(key("original_context_length"))
        )
        stated = {
            "beta_fast": meta.get(key("yarn_beta_fast")),
            "beta_slow": meta.get(key("yarn_beta_slow")),
            "attention_factor": meta.get(key("attn_factor")),
        }
        scaling |= {name: _f32(value) for name, value in stated.items() if value is not None}
    return scaling


def _longrope(
    short: list[float], long: list[float], original: int, attention_factor: float
) -> dict[str, Any]:
    """A longrope scaling; an attention factor of 0 is none stated (transformers computes it)."""
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": original,
    }
    return scaling | ({"attention_factor": attention_factor} if attention_factor else {})


def _build_config(
    meta: _Metadata,
    arch_name: str,
    arch: _Architecture,
    tensors: dict[str, np.ndarray],
    rope_factors: dict[str, np.ndarray],
) -> dict[str, Any]:
    def key(name: str) -> str:
        return f"{arch_name}.{name}"

    hidden = int(meta.require(key("embedding_length")))
    n_head = int(meta.require(key("attention.head_count")))
    vocab_size, embed_dim = tensors["model.embed_tokens.weight"].shape
    if embed_dim != hidden:
        raise UnsupportedGGUFError(
            f"token_embd width {embed_dim} differs from embedding_length {hidden}"
        )
    config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(key("feed_forward_length"))),
        "num_hidden_layers": int(meta.require(key("block_count"))),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(key("attention.head_count_kv"), n_head)),
        "head_dim": int(meta.get(key("attention.key_length"), hidden // n_head)),
        "max_position_embeddings": int(meta.require(key("context_length"))),
        "rms_norm_eps": _f32(meta.require(key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": _f32(meta.get(key("rope.freq_base"), 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch_name, rope_factors),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "hidden_act": "silu",
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    # model.layers.L.mlp.experts.E.*: the experts the file's stacked tensors hold
    found = {name.split(".")[5] for name in tensors if ".mlp.experts." in name}
    config.update(_experts(meta, arch_name, arch, config, len(found)))
    config.update(_family(meta, arch_name, config))
    config.update(_special_token_ids(meta))
    return config


# Gemma's layers of each full-attention layer and the sliding ones before it (llama.cpp's
# fixed patterns), and the layer count of its 27B, whose queries llama.cpp scales by
# hidden_size / heads rather than head_dim (the files state no query_pre_attn_scalar).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _family(meta: _Metadata, arch_name: str, config: dict[str, Any]) -> dict[str, Any]:
    """The config keys of Gemma 2 and 3 and Phi-3 that the file states or llama.cpp
    implies."""

    def key(name: str) -> str:
        return f"{arch_name}.{name}"

    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    if arch_name == "phi3":
        window, rotated = (
            meta.get(key("attention.sliding_window")),
            meta.get(key("rope.dimension_count"), head_dim),
        )
        family: dict[str, Any] = {"sliding_window": None if window is None else int(window)}
        if int(rotated) != head_dim:
            family["partial_rotary_factor"] = int(rotated) / head_dim
        return family
    if arch_name not in _GEMMA_PATTERN:
        return {}
    pattern = _GEMMA_PATTERN[arch_name]
    big = layers == _GEMMA_27B_LAYERS[arch_name]
    family = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": (
            config["hidden_size"] // config["num_attention_heads"] if big else head_dim
        ),
        "sliding_window": int(meta.require(key("attention.sliding_window"))),
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ],
        "final_logit_softcapping": meta.get(key("final_logit_softcapping")),
        "attn_logit_softcapping": meta.get(key("attn_logit_softcapping")),
    }
    if arch_name == "gemma3":
        family["rope_local_base_freq"] = 10000.0  # llama.cpp's, for every Gemma 3
    return family


def _experts(
    meta: _Metadata, arch_name: str, arch: _Architecture, config: dict[str, Any], found: int
) -> dict[str, Any]:
    """The config keys of a mixture of experts (a llama file with experts is Mixtral);
    ``found``: how many experts the file's ffn_*_exps tensors hold."""
    experts = meta.get(f"{arch_name}.expert_count")
    if not experts:
        if arch.model_type.endswith("_moe") or found:
            raise UnsupportedGGUFError(f"GGUF file has no '{arch_name}.expert_count' metadata")
        return {}
    if int(experts) != found:
        raise UnsupportedGGUFError(
            f"GGUF file says {arch_name}.expert_count {int(experts)}, but its ffn_*_exps "
            f"tensors hold {found} experts"
        )
    used = int(meta.require(f"{arch_name}.expert_used_count"))
    norm = bool(meta.get(f"{arch_name}.expert_weights_norm", _NORM_TOPK[arch_name]))
    if arch_name == "llama":
        if not norm:
            raise UnsupportedGGUFError("GGUF llama experts without renormalized weights")
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": int(experts),
            "num_experts_per_tok": used,
            "sliding_window": None,
        }
    moe = {
        "num_experts": int(experts),
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(meta.require(f"{arch_name}.expert_feed_forward_length")),
        "norm_topk_prob": norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch.model_type == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = int(
            meta.require(f"{arch_name}.expert_shared_feed_forward_length")
        )
        moe["qkv_bias"] = config["attention_bias"]
    return moe


def _special_token_ids(meta: _Metadata) -> dict[str, int]:
    """bos/eos/pad ids under their Hugging Face config names, for those the file states."""
    names = {
        "bos_token_id": "bos_token_id",
        "eos_token_id": "eos_token_id",
        "pad_token_id": "padding_token_id",
    }
    ids = {name: meta.get(f"tokenizer.ggml.{meta_key}") for name, meta_key in names.items()}
    return {name: int(value) for name, value in ids.items() if value is not None}


def _build_tokenizer(meta: _Metadata) -> Tokenizer:
    """A `tokenizers` byte-level BPE equal to the model's original tokenizer.json."""
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedGGUFError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level "
            f"BPE){_GIVE_TOKENIZER}"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in meta.require("tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}

    pretokenization = _pretokenization(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            ignore_merges=pretokenization.ignore_merges,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = pretokenization.normalizer
    tokenizer.pre_tokenizer = pretokenization.pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
                ),
            ]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == _TOKEN_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == _TOKEN_USER_DEFINED
        ]
    )
    return tokenizer


def _tokenizer_config(meta: _Metadata, context_length: int) -> dict[str, Any]:
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []

    def token(meta_key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{meta_key}")
        return None if index is None else tokens[index]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "additional_special_tokens": [
            t for t, kind in zip(tokens, token_types) if kind == _TOKEN_CONTROL
        ],
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def _generation_config(meta: _Metadata) -> dict[str, Any]:
    stop_ids: list[int] = []
    # End-of-turn / end-of-message tokens also stop a chat turn (llama.cpp keeps them apart from eos).
    for meta_key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{meta_key}")
        if value is not None and int(value) not in stop_ids:
            stop_ids.append(int(value))
    return _special_token_ids(meta) | {
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else stop_ids
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, *, with_tokenizer: bool = True) -> None:
    """Write the Hugging Face files for `gguf_path` into the existing directory `out_dir`;
    without tokenizer.json and tokenizer_config.json unless `with_tokenizer`."""
    try:
        reader = GGUFReader(gguf_path)
    except Exception as exc:  # the reader reports a malformed file with assorted exception types
        raise UnsupportedGGUFError(
            f"cannot read GGUF file {str(gguf_path)!r} (damaged or truncated?): {exc}"
        ) from exc
    meta = _Metadata(reader)
    arch_name = meta.require("general.architecture")
    arch = _ARCHITECTURES.get(arch_name)
    if arch is None:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch_name!r} is not supported (supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    # Build the tokenizer first: it fails fast on an unsupported vocabulary, before the costly dequantization.
    tokenizer = _build_tokenizer(meta) if with_tokenizer else None
    n_head = int(meta.require(f"{arch_name}.attention.head_count"))
    n_kv_head = int(meta.get(f"{arch_name}.attention.head_count_kv", n_head))
    tensors = _convert_tensors(reader, arch, n_head, n_kv_head)
    factors = {name: tensors.pop(name) for name in _ROPE_FACTORS if name in tensors}
    config = _build_config(meta, arch_name, arch, tensors, factors)
    if config["model_type"] == "mixtral":
        tensors = _as_mixtral(tensors)
    logger.info("converted %d tensors from %s", len(tensors), gguf_path)

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    if tokenizer is not None:
        tokenizer.save(str(out_dir / "tokenizer.json"))
        _write_json(
            out_dir / "tokenizer_config.json",
            _tokenizer_config(meta, config["max_position_embeddings"]),
        )
    _write_json(out_dir / "generation_config.json", _generation_config(meta))
    # safetensors writes through a private (0600) temporary file: give every file the mode a
    # newly created file gets, so a cache one user prepared can be read by others the umask allows.
    mode = 0o666 & ~_umask()
    for path in out_dir.iterdir():
        if path.is_file():
            os.chmod(path, mode)


def _umask() -> int:
    try:  # Linux states it without changing it
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
