"""Convert a GGUF file (llama.cpp's format) into a Hugging Face model directory.

The output is what `transformers` would save: config.json, model.safetensors (float32),
tokenizer.json, tokenizer_config.json and generation_config.json. Supported architectures are
llama (Mixtral where it has experts), qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3 (their
norm weights stored plus one, as llama.cpp's converter writes them; its fixed patterns of
sliding layers, Gemma 3's local base, and its query scale, head_dim but for the 27B models'),
phi3 (fused q/k/v and gate/up, a partial rotation, LongRoPE's factor tensors), granite
(llama's layout, its multipliers and logit scale; an attention multiplier the file leaves out
is llama.cpp's, 1 / sqrt(head_dim)), granitemoe (granite's, its experts stacked again as
Granite's checkpoints hold them, with a shared expert GraniteMoeShared's), seed_oss (llama's
layers, biased q/k/v, unpermuted), olmoe (Qwen's experts, OLMo 2's q/k norms), olmo2 (norms after the attention and the MLP, q/k
norms over the whole projections; OLMo 3's sliding layers are refused), smollm3 (llama's
layout, every fourth layer unrotated: llama.cpp's fixed step), glm4 (GLM-4-0414: norms
before and after the attention and the MLP, fused gate/up, a partial rotation), command-r
(layer norms, its logit scale, Command R+'s q/k norms per head), cohere2 (Command R7B: its
sliding layers, three of each four where the file states no pattern, llama.cpp's period) and
starcoder2 (biased layer norms and projections, an ungated MLP, and no sliding window, as
llama.cpp's converter drops it), with the tokenizer the file states
(`weir.shared.gguf_tokenizer`); anything else raises `UnsupportedGGUFError` naming what the
file states. Converted for a model served with another tokenizer (``--tokenizer``), the file's
own is left out, whatever its kind (vLLM's advice for GGUF files, whose tokenizers it converts
slowly or not at all). llama.cpp stacks a layer's experts in one tensor per projection; they
are written one tensor per expert, as Hugging Face checkpoints hold them.

RoPE scaling: ``rope.scaling.type`` linear and yarn (with their factor and original context)
become Hugging Face's ``rope_scaling``. Llama 3.1's and later (``llama3``) files state no
type: llama.cpp writes the divisor of each rotated pair's frequency as the tensor
``rope_freqs``, which becomes a ``longrope`` scaling of those factors, short and long alike,
with no attention scale (its original context the file's): the rotation llama.cpp applies.
"""

import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from weir.shared.gguf_metadata import GGUFMetadata, UnsupportedGGUFError
from weir.shared.gguf_tokenizer import (
    build_tokenizer,
    generation_config,
    special_token_ids,
    tokenizer_config,
)

logger = logging.getLogger(__name__)

__all__ = ["UnsupportedGGUFError", "convert_gguf"]


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
    # The config key of the norms' epsilon: RMS norms' (the file's layer_norm_rms_epsilon),
    # or another, of layer norms (the file's layer_norm_epsilon).
    norm_eps: str = "rms_norm_eps"


# Norms after the attention and the MLP (OLMo 2's, Gemma's), and Gemma's before its MLP.
_POST_NORMS = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)
_GEMMA_NORMS = (*_POST_NORMS, ("ffn_norm", "pre_feedforward_layernorm"))


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
    "granite": _Architecture("GraniteForCausalLM", "granite", permuted_qk=True),
    # Seed-OSS: llama's layers with biased q/k/v, rotating as llama.cpp does (no permutation).
    "seed_oss": _Architecture("SeedOssForCausalLM", "seed_oss", permuted_qk=False),
    # OLMoE: Qwen's experts, OLMo 2's q/k norms over the whole projections.
    "olmoe": _Architecture("OlmoeForCausalLM", "olmoe", permuted_qk=False),
    # Granite 3's mixtures of experts (with a shared expert: GraniteMoeShared's).
    "granitemoe": _Architecture("GraniteMoeForCausalLM", "granitemoe", permuted_qk=True),
    # Its q/k norms span the whole projections: stored as they are.
    "olmo2": _Architecture("Olmo2ForCausalLM", "olmo2", False, _POST_NORMS),
    "smollm3": _Architecture("SmolLM3ForCausalLM", "smollm3", permuted_qk=True),
    # Cohere's layer norms without bias, attention and MLP in parallel, adjacent pairs rotating
    # as llama.cpp rotates them; Command R+'s q/k norms per head.
    "command-r": _Architecture(
        "CohereForCausalLM", "cohere", permuted_qk=False, norm_eps="layer_norm_eps"
    ),
    "cohere2": _Architecture(
        "Cohere2ForCausalLM", "cohere2", permuted_qk=False, norm_eps="layer_norm_eps"
    ),
    # Biased layer norms and projections, an ungated MLP.
    "starcoder2": _Architecture(
        "Starcoder2ForCausalLM",
        "starcoder2",
        permuted_qk=False,
        renames=(("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj")),
        norm_eps="norm_epsilon",
    ),
    # GLM-4-0414: rotates adjacent pairs as llama.cpp does (no permutation), its norms before
    # and after the attention and the MLP, gate/up fused.
    "glm4": _Architecture(
        "Glm4ForCausalLM",
        "glm4",
        permuted_qk=False,
        renames=(
            ("post_attention_norm", "post_self_attn_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("post_ffw_norm", "post_mlp_layernorm"),
            ("ffn_up", "mlp.gate_up_proj"),
        ),
    ),
}
# llama.cpp renormalizes the chosen experts' weights for these (where the file does not say).
_NORM_TOPK = {
    "llama": True,
    "qwen2moe": False,
    "qwen3moe": True,
    "granitemoe": True,
    "olmoe": False,
}

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

_Tensors = dict[str, np.ndarray]

_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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


_GRANITE_MOE_PROJECTION = re.compile(
    r"(model\.layers\.\d+)\.mlp\.(?:experts\.(\d+)|shared_expert)\.(gate|up|down)_proj\.weight"
)


def _as_granite_moe(tensors: _Tensors) -> _Tensors:
    """A granitemoe file's experts as Granite's checkpoints hold them: a layer's experts
    stacked, each one's gate rows then up rows in `block_sparse_moe.input_linear` [experts,
    2 x columns, hidden], its down rows in `output_linear`; the router as `router.layer`;
    the shared expert's gate and up rows in `shared_mlp.input_linear`."""
    held: _Tensors = {}
    parts: dict[tuple[str, str], dict[tuple[int, str], np.ndarray]] = {}
    for name, w in tensors.items():
        match = _GRANITE_MOE_PROJECTION.fullmatch(name)
        if match is None:
            held[name.replace(".mlp.gate.", ".block_sparse_moe.router.layer.")] = w
            continue
        layer, expert, projection = match.groups()
        module = "shared_mlp" if expert is None else "block_sparse_moe"
        parts.setdefault((layer, module), {})[int(expert or 0), projection] = w
    for (layer, module), weights in parts.items():
        count = 1 + max(expert for expert, _ in weights)
        inputs = [np.concatenate([weights[e, "gate"], weights[e, "up"]]) for e in range(count)]
        outputs = [weights[e, "down"] for e in range(count)]
        shared = module == "shared_mlp"
        held[f"{layer}.{module}.input_linear.weight"] = inputs[0] if shared else np.stack(inputs)
        held[f"{layer}.{module}.output_linear.weight"] = outputs[0] if shared else np.stack(outputs)
    return held


def _rope_scaling(
    meta: GGUFMetadata, arch_name: str, factors: dict[str, np.ndarray]
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
    meta: GGUFMetadata,
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
        arch.norm_eps: _f32(
            meta.require(
                key("attention.layer_norm_rms_epsilon")
                if arch.norm_eps == "rms_norm_eps"
                else key("attention.layer_norm_epsilon")
            )
        ),
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
    if arch_name in _FAMILIES:
        config.update(_FAMILIES[arch_name](meta, arch_name, config, tensors))
    config.update(special_token_ids(meta))
    return config


# Gemma's layers of each full-attention layer and the sliding ones before it (llama.cpp's
# fixed patterns), and the layer count of its 27B, whose queries llama.cpp scales by
# hidden_size / heads rather than head_dim (the files state no query_pre_attn_scalar).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _partial_rotation(meta: GGUFMetadata, arch_name: str, head_dim: int) -> dict[str, Any]:
    """partial_rotary_factor, stated even when whole: GLM-4's default is half."""
    rotated = int(meta.get(f"{arch_name}.rope.dimension_count", head_dim))
    return {"partial_rotary_factor": rotated / head_dim}


def _phi3(
    meta: GGUFMetadata, arch_name: str, config: dict[str, Any], tensors: _Tensors
) -> dict[str, Any]:
    window = meta.get(f"{arch_name}.attention.sliding_window")
    return {
        "sliding_window": None if window is None else int(window),
        **_partial_rotation(meta, arch_name, config["head_dim"]),
    }


def _gemma(
    meta: GGUFMetadata, arch_name: str, config: dict[str, Any], tensors: _Tensors
) -> dict[str, Any]:
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    pattern = _GEMMA_PATTERN[arch_name]
    big = layers == _GEMMA_27B_LAYERS[arch_name]
    family = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": (
            config["hidden_size"] // config["num_attention_heads"] if big else head_dim
        ),
        "sliding_window": int(meta.require(f"{arch_name}.attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ],
        "final_logit_softcapping": meta.get(f"{arch_name}.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get(f"{arch_name}.attn_logit_softcapping"),
    }
    if arch_name == "gemma3":
        family["rope_local_base_freq"] = 10000.0  # llama.cpp's, for every Gemma 3
    return family


def _granite(
    meta: GGUFMetadata, arch_name: str, config: dict[str, Any], tensors: _Tensors
) -> dict[str, Any]:
    # llama.cpp's converter writes a multiplier only where the checkpoint states one (not
    # zero), and its runtime reads one left out as none: queries scaled by 1 / sqrt(head_dim).
    def stated(name: str, otherwise: float) -> float:
        value = meta.get(f"{arch_name}.{name}")
        return _f32(value) if value else otherwise

    return {
        "embedding_multiplier": stated("embedding_scale", 1.0),
        "residual_multiplier": stated("residual_scale", 1.0),
        "attention_multiplier": stated("attention.scale", 1 / math.sqrt(config["head_dim"])),
        "logits_scaling": _f32(meta.require(f"{arch_name}.logit_scale")),
    }


def _olmo2(
    meta: GGUFMetadata, arch_name: str, config: dict[str, Any], tensors: _Tensors
) -> dict[str, Any]:
    # llama.cpp writes OLMo 3 as olmo2 with a sliding window and its pattern of layers.
    if meta.get(f"{arch_name}.attention.sliding_window") is not None:
        raise UnsupportedGGUFError(
            "GGUF olmo2 file with sliding-window layers (OLMo 3) is not supported"
        )
    return {}


# SmolLM3's layers without rotation: every fourth, llama.cpp's fixed step (no key states it).
_SMOLLM3_NO_ROPE_STEP = 4


def _smollm3(
    meta: GGUFMetadata, arch_name: str, config: dict[str, Any], tensors: _Tensors
) -> dict[str, Any]:
    step = _SMOLLM3_NO_ROPE_STEP
    return {
        "no_rope_layer_interval": step,
        "no_rope_layers": [int((i + 1) % step != 0) for i in range(config["num_hidden_layers"])],
    }


def _cohere(
    meta: GGUFMetadata, arch_name: str, config: dict[str, Any], tensors: _Tensors
) -> dict[str, Any]:
    family: dict[str, Any] = {
        "logit_scale": _f32(meta.require(f"{arch_name}.logit_scale")),
        "use_qk_norm": "model.layers.0.self_attn.q_norm.weight" in tensors,
    }
    if arch_name == "cohere2":
        if _partial_rotation(meta, arch_name, config["head_dim"])["partial_rotary_factor"] != 1:
            raise UnsupportedGGUFError("GGUF cohere2 file with a partial rotation")
        family |= {
            "sliding_window": int(meta.require(f"{arch_name}.attention.sliding_window")),
            "layer_types": _layer_types(meta, arch_name, config["num_hidden_layers"], 4),
        }
    return family


def _layer_types(meta: GGUFMetadata, arch_name: str, layers: int, period: int) -> list[str]:
    """Which layers slide: the file's pattern (a period, or a flag per layer) where it states
    one, else every layer but each `period`-th, llama.cpp's fixed period."""
    stated = meta.get(f"{arch_name}.attention.sliding_window_pattern", period)
    if isinstance(stated, list):
        sliding = [bool(flag) for flag in stated]
    else:
        sliding = [(i + 1) % int(stated) != 0 for i in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def _starcoder2(
    meta: GGUFMetadata, arch_name: str, config: dict[str, Any], tensors: _Tensors
) -> dict[str, Any]:
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "use_bias": config["attention_bias"],
        # llama.cpp's converter leaves the checkpoint's window out, and its runtime attends
        # to every earlier token: so does the conversion.
        "sliding_window": None,
    }


_Family = Callable[[GGUFMetadata, str, dict[str, Any], _Tensors], dict[str, Any]]
# The config keys, beyond llama's, that a file of these architectures states or llama.cpp implies.
_FAMILIES: dict[str, _Family] = {
    "phi3": _phi3,
    "gemma2": _gemma,
    "gemma3": _gemma,
    "granite": _granite,
    "granitemoe": _granite,
    "olmo2": _olmo2,
    "smollm3": _smollm3,
    "starcoder2": _starcoder2,
    "command-r": _cohere,
    "cohere2": _cohere,
    "glm4": lambda meta, arch_name, config, _: _partial_rotation(
        meta, arch_name, config["head_dim"]
    ),
}


def _experts(
    meta: GGUFMetadata, arch_name: str, arch: _Architecture, config: dict[str, Any], found: int
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
    if arch_name in ("llama", "granitemoe") and not norm:
        raise UnsupportedGGUFError(f"GGUF {arch_name} experts without renormalized weights")
    if arch_name == "granitemoe":
        shared = meta.get(f"{arch_name}.expert_shared_feed_forward_length")
        granite = {"num_local_experts": int(experts), "num_experts_per_tok": used}
        if not shared:
            return granite
        return granite | {
            "architectures": ["GraniteMoeSharedForCausalLM"],
            "model_type": "granitemoeshared",
            "shared_intermediate_size": int(shared),
        }
    if arch_name == "olmoe":  # its experts' columns are the file's feed_forward_length
        return {"num_experts": int(experts), "num_experts_per_tok": used, "norm_topk_prob": norm}
    if arch_name == "llama":
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
    meta = GGUFMetadata(reader)
    arch_name = meta.require("general.architecture")
    arch = _ARCHITECTURES.get(arch_name)
    if arch is None:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch_name!r} is not supported (supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    # Build the tokenizer first: it fails fast on an unsupported vocabulary, before the costly dequantization.
    tokenizer = build_tokenizer(meta, arch_name) if with_tokenizer else None
    n_head = int(meta.require(f"{arch_name}.attention.head_count"))
    n_kv_head = int(meta.get(f"{arch_name}.attention.head_count_kv", n_head))
    tensors = _convert_tensors(reader, arch, n_head, n_kv_head)
    factors = {name: tensors.pop(name) for name in _ROPE_FACTORS if name in tensors}
    config = _build_config(meta, arch_name, arch, tensors, factors)
    if config["model_type"] == "mixtral":
        tensors = _as_mixtral(tensors)
    elif arch.model_type == "granitemoe":
        tensors = _as_granite_moe(tensors)
    logger.info("converted %d tensors from %s", len(tensors), gguf_path)

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    if tokenizer is not None:
        tokenizer.save(str(out_dir / "tokenizer.json"))
        _write_json(
            out_dir / "tokenizer_config.json",
            tokenizer_config(meta, config["max_position_embeddings"]),
        )
    _write_json(out_dir / "generation_config.json", generation_config(meta))
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
