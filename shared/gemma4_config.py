"""Gemma 4's language model (transformers' ``gemma4_text``) as `ModelConfig` fields, read
as transformers reads its config.

Sliding layers (every layer but each sixth and the last by default) attend with head_dim
and num_key_value_heads; full-attention layers with global_head_dim (512 where left out)
and, where attention_k_eq_v, num_global_key_value_heads, their values the keys' projection.
transformers 5.2x saves those two as per_layer_config, a head_dim and num_key_value_heads
for each full-attention layer, which Weir reads too (the same for every such layer).
The last num_kv_shared_layers layers reuse the KV of the last earlier layer of their kind.
Per-layer embeddings (hidden_size_per_layer_input, 256 where left out; 0: none) feed each
layer a vector of its own. Queries are not scaled (its q/k norms stand in), and every
RMSNorm scales in float32 by its weight as it is (not Gemma 3's 1 + weight). With
enable_moe_block (gemma-4-26B-A4B) each layer runs experts beside its dense MLP.
"""

from __future__ import annotations

import math
from typing import Any

from weir.shared import config_fields
from weir.shared.config_fields import count, flag, mapping, positive, size

MODEL_TYPE = "gemma4_text"
# transformers' Gemma4TextConfig defaults (a multimodal checkpoint's text_config may lean on
# them), the full layers' proportional rotation among them.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    },
}
_KINDS = ("sliding_attention", "full_attention")


def layer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's kind: config.json's layer_types (its last layer always full attention,
    as transformers forces it), else five sliding layers to one full."""
    default = [_KINDS[(i + 1) % 6 == 0] for i in range(num_layers)]
    types = config_fields.layer_types(hf, num_layers, _KINDS, default)
    assert types is not None
    return [*types[:-1], _KINDS[1]]


def full_attention_heads(hf: dict[str, Any], num_layers: int) -> tuple[int, int]:
    """The full-attention layers' (head_dim, KV heads; 0: num_key_value_heads), from
    per_layer_config where the file has one (transformers then reads nothing else), else from
    global_head_dim and num_global_key_value_heads."""
    if "per_layer_config" not in hf:
        # transformers reads num_global_key_value_heads only where values are the keys.
        key = "num_global_key_value_heads"
        global_kv = count(hf, key) if flag(hf, "attention_k_eq_v") and key in hf else 0
        return count(hf, "global_head_dim"), global_kv
    overrides = mapping(hf, "per_layer_config")
    types = layer_types(hf, num_layers)
    full = [str(i) for i, kind in enumerate(types) if kind == _KINDS[1]]
    shapes = set()
    for key in overrides:
        changes = mapping(overrides, key)
        if key not in full or set(changes) - {"head_dim", "num_key_value_heads"}:
            raise ValueError(
                f"config.json: per_layer_config[{key!r}] {changes!r}: only the full-attention "
                f"layers' head_dim and num_key_value_heads may differ (full layers: {full})"
            )
        shapes.add(
            (count(changes, "head_dim", hf["head_dim"]), size(changes, "num_key_value_heads"))
        )
    if len(shapes) > 1 or (shapes and len(overrides) != len(full)):
        raise ValueError(
            "config.json: per_layer_config must give every full-attention layer the same "
            f"head_dim and num_key_value_heads, got {overrides!r}"
        )
    return shapes.pop() if shapes else (count(hf, "head_dim"), 0)


def gemma4_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The fields Gemma 4 sets beside those every model reads (its experts, with
    enable_moe_block, are read with the other mixtures': `model_config._experts`); ValueError
    names what is refused (bidirectional attention over text)."""
    if hf.get("use_bidirectional_attention") not in (None, "vision"):
        raise ValueError(
            "config.json: use_bidirectional_attention "
            f"{hf['use_bidirectional_attention']!r} is not supported (a causal LM's text "
            "attends causally; 'vision' only changes images' tokens)"
        )
    types = layer_types(hf, num_layers)
    shared = size(hf, "num_kv_shared_layers")
    first_shared = num_layers - shared
    if not 0 <= shared < num_layers:
        raise ValueError(
            f"config.json: num_kv_shared_layers {shared} must leave at least one of the "
            f"{num_layers} layers its own KV"
        )
    # A sharing layer reads the last layer before the sharing ones of its own kind.
    sources = {
        kind: max((i for i in range(first_shared) if types[i] == kind), default=None)
        for kind in _KINDS
    }
    if shared and any(sources[types[i]] is None for i in range(first_shared, num_layers)):
        raise ValueError(
            "config.json: the KV-sharing layers' kinds must each appear among the layers "
            f"before them (layer_types {types!r}, num_kv_shared_layers {shared})"
        )
    head_dim, kv_heads = full_attention_heads(hf, num_layers)
    per_layer = size(hf, "hidden_size_per_layer_input")
    cap = "final_logit_softcapping"
    return {
        "global_head_dim": head_dim,
        "global_num_kv_heads": kv_heads,
        "values_from_keys": flag(hf, "attention_k_eq_v"),
        "value_norm": True,
        "kv_sources": tuple(i if i < first_shared else sources[types[i]] for i in range(num_layers))
        if shared
        else (),
        "double_wide_mlp": flag(hf, "use_double_wide_mlp"),
        "per_layer_input_size": per_layer,
        "per_layer_vocab_size": count(hf, "vocab_size_per_layer_input") if per_layer else 0,
        "layer_scalars": True,
        "embedding_multiplier": math.sqrt(count(hf, "hidden_size")),
        "attention_multiplier": 1.0,
        cap: positive(hf, cap, 1.0) if cap in hf else None,
    }
