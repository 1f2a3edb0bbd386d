"""Load a Hugging Face model directory (config.json + *.safetensors) into `CausalLM`.

Under tensor parallelism every rank opens the full (unsharded) checkpoint and reads only
its `ShardLayout` share: rows of the column-parallel projections and of the vocabulary,
columns of the row-parallel ones."""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from weir.services.executor.attention import AttentionBackend, get_attention_backend
from weir.services.executor.gpt_oss_checkpoint import CHECKPOINT_NAMES, split_gpt_oss_tensors
from weir.services.executor.granite_moe_checkpoint import split_granite_moe_tensors
from weir.services.executor.layers import layer_kernels_for
from weir.services.executor.llama4_checkpoint import split_llama4_tensors
from weir.services.executor.model import CausalLM
from weir.services.executor.moe import check_moe
from weir.services.executor.packed_weights import can_pack, pack_model
from weir.services.executor.parallel import TensorParallel
from weir.services.executor.quantization import quantize_model
from weir.services.executor.quantized_checkpoint import dequantized_tensors
from weir.services.executor.stacked_experts_checkpoint import split_stacked_experts
from weir.services.executor.vision_towers import is_tower_weight, load_tower
from weir.shared.model_config import (
    QWEN_HYBRID_TYPES,
    ModelConfig,
    read_model_config,
    vocab_id,
)
from weir.shared.shard_layout import ShardLayout

# DeepSeek-V3's router bias is named as no other tensor is: read as the router's score_bias.
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias|e_score_correction_bias)")
# MiniMax-M2 keeps the routing bias beside its router (as transformers 5 names it, mlp.),
# ERNIE 4.5 in its moe_statics, one row of one group: read as DeepSeek-V3's, the router's own.
_ROUTER_BIAS = "e_score_correction_bias"
_BIAS_BESIDE_ROUTER = ("block_sparse_moe", "mlp", "mlp.moe_statics")
# An FP8 KV cache's scale (compressed-tensors' are the attention's own, self_attn.k_scale;
# ModelOpt's its projections', self_attn.k_proj.k_scale, as vLLM reads them).
_KV_SCALE_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.([kv]_scale)")
# An expert's tensor: Qwen's mlp.experts.E.{gate,up,down}_proj, Mixtral's
# block_sparse_moe.experts.E.{w1,w3,w2}.
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MOE_MODULES = ("mlp.experts.", "mlp.shared_expert")  # and the router, mlp.gate
# Checkpoints that store a layer's q/k/v or gate/up as one tensor (Phi-3): read as its parts.
FUSED_MODULES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    # Qwen 3.5's linear attention: q/k/v channels side by side in the projection and the
    # convolution (its weight read without its middle dimension of 1).
    "linear_attn.in_proj_qkv": (
        "linear_attn.in_proj_q",
        "linear_attn.in_proj_k",
        "linear_attn.in_proj_v",
    ),
    "linear_attn.conv1d": ("linear_attn.conv1d_q", "linear_attn.conv1d_k", "linear_attn.conv1d_v"),
}
# Models whose checkpoints stack each layer's experts (Qwen3-VL-MoE's multimodal ones too;
# Qwen3-Next's where transformers 5 saves them so, its Hub files holding one per expert).
STACKED_EXPERT_TYPES = ("mistral4", "qwen3_5_moe_text", "qwen3_next", "gemma4_text")
# Those of them stacked only as transformers' forward multiplies them (not Qwen's transposed).
_TRANSFORMERS_STACKED_TYPES = ("mistral4", "gemma4_text")
# Parameters named without a .weight: Qwen3-Next's and Qwen 3.5's linear attention's, Gemma 4's
# layer_scalar and router's.
_BARE_PARAM_RE = re.compile(
    r"model\.layers\.\d+\.(linear_attn\.A_log|linear_attn\.dt_bias|layer_scalar"
    r"|router\.scale|router\.per_expert_scale)"
)
# GLM-4's norms around the attention and the MLP, read as Gemma's (``sandwich_norms``).
_GLM4_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}
_VOCAB_PARAMS = ("embed_tokens", "lm_head")
# A multimodal checkpoint's language model, under the names transformers < 5 saves (and 5
# still writes) or 5 loads, read as a causal LM's; its other towers are not read.
_LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.text_model.": "model.",  # Idefics3's and SmolVLM's
}
_BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")
_CAUSAL_LM_PREFIXES = tuple("model." + prefix for prefix in _BARE_PREFIXES)
# HF sub-module name -> (Weir sub-module, which part of the fused output rows it fills;
# "*_in": a row-parallel projection, split by its input columns: query heads or MLP columns).
LAYER_PARTS: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("qkv_proj", "q"),
    "self_attn.k_proj": ("qkv_proj", "k"),
    "self_attn.v_proj": ("qkv_proj", "v"),
    "self_attn.o_proj": ("o_proj", "o_in"),
    "self_attn.q_norm": ("q_norm", "all"),
    "self_attn.sinks": ("sinks", "heads"),
    "self_attn.k_norm": ("k_norm", "all"),
    "self_attn.query_layernorm": ("q_norm", "all"),  # Hunyuan's
    "self_attn.key_layernorm": ("k_norm", "all"),
    "mlp.gate_proj": ("gate_up_proj", "gate"),
    "mlp.up_proj": ("gate_up_proj", "up"),
    "mlp.down_proj": ("down_proj", "down_in"),
    "mlp.c_fc": ("gate_up_proj", "gate"),  # Starcoder2's up projection: not gated
    "mlp.c_proj": ("down_proj", "down_in"),
    "input_layernorm": ("input_layernorm", "all"),
    "post_attention_layernorm": ("post_attention_layernorm", "all"),
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm", "all"),
    "post_feedforward_layernorm": ("post_feedforward_layernorm", "all"),
    "mlp.gate": ("moe.gate", "all"),
    "mlp.experts.gate_proj": ("moe.experts_gate_up", "expert_gate"),
    "mlp.experts.up_proj": ("moe.experts_gate_up", "expert_up"),
    "mlp.experts.down_proj": ("moe.experts_down", "expert_down_in"),
    "mlp.shared_expert.gate_proj": ("moe.shared_gate_up", "shared_gate"),
    "mlp.shared_expert.up_proj": ("moe.shared_gate_up", "shared_up"),
    "mlp.shared_expert.down_proj": ("moe.shared_down", "shared_down_in"),
    "mlp.shared_expert_gate": ("moe.shared_expert_gate", "all"),
    "mlp.shared_experts.gate_proj": ("moe.shared_gate_up", "shared_gate"),
    "mlp.shared_experts.up_proj": ("moe.shared_gate_up", "shared_up"),
    "mlp.shared_experts.down_proj": ("moe.shared_down", "shared_down_in"),
    # Qwen 3.5's gated attention: its q_proj's query rows and gate rows (``_parts``).
    "self_attn.gated_q": ("qkv_proj", "q"),
    "self_attn.q_gate": ("qkv_proj", "q_gate"),
    # Its linear attention's projections fill qkv_proj and o_proj (``lin_``: split by heads).
    "linear_attn.in_proj_q": ("qkv_proj", "lin_q"),
    "linear_attn.in_proj_k": ("qkv_proj", "lin_k"),
    "linear_attn.in_proj_v": ("qkv_proj", "lin_v"),
    "linear_attn.in_proj_z": ("qkv_proj", "lin_z"),
    "linear_attn.in_proj_b": ("qkv_proj", "lin_b"),
    "linear_attn.in_proj_a": ("qkv_proj", "lin_a"),
    "linear_attn.conv1d_q": ("linear_attn.conv1d", "lin_q"),
    "linear_attn.conv1d_k": ("linear_attn.conv1d", "lin_k"),
    "linear_attn.conv1d_v": ("linear_attn.conv1d", "lin_v"),
    "linear_attn.dt_bias": ("linear_attn.dt_bias", "lin_heads"),
    "linear_attn.A_log": ("linear_attn.A_log", "lin_heads"),
    "linear_attn.norm": ("linear_attn.norm", "all"),
    "linear_attn.out_proj": ("o_proj", "lin_out_in"),
    # Gemma 4's per-layer input branch and output scale.
    "per_layer_input_gate": ("per_layer_input_gate", "all"),
    "per_layer_projection": ("per_layer_projection", "all"),
    "post_per_layer_input_norm": ("post_per_layer_input_norm", "all"),
    "layer_scalar": ("layer_scalar", "all"),
    # Gemma 4's router (whole on every rank) and the norms around its experts (its stacked
    # experts are read as Qwen's: `stacked_experts_checkpoint`).
    "router.proj": ("moe.gate", "all"),
    "router.scale": ("moe.router_norm", "all"),
    "router.per_expert_scale": ("moe.per_expert_scale", "all"),
    "pre_feedforward_layernorm_2": ("pre_feedforward_layernorm_2", "all"),
    "post_feedforward_layernorm_1": ("post_feedforward_layernorm_1", "all"),
    "post_feedforward_layernorm_2": ("post_feedforward_layernorm_2", "all"),
}
# Gemma 4's model-wide per-layer embedding tensors, whole on every rank.
_PER_LAYER_PARAMS = {
    "model.embed_tokens_per_layer.weight": "embed_tokens_per_layer",
    "model.per_layer_model_projection.weight": "per_layer_model_projection.weight",
    "model.per_layer_projection_norm.weight": "per_layer_projection_norm.weight",
}
# A Gemma 4 KV-sharing layer's K/V projections and norms, which its checkpoint may keep and
# transformers does not read.
_SHARED_KV_MODULES = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm")
# OLMo's q/k norms over the whole projections: each rank's weights of its heads' channels.
WHOLE_QK_NORM_PARTS: dict[str, tuple[str, str]] = {
    "self_attn.q_norm": ("q_norm", "q_heads"),
    "self_attn.k_norm": ("k_norm", "kv_heads"),
}
# Arcee's MLP is not gated: its up projection alone fills gate_up_proj's rows.
UNGATED_MLP_PARTS: dict[str, tuple[str, str]] = {"mlp.up_proj": ("gate_up_proj", "gate")}
# Command R+'s q/k LayerNorms, a weight row per head: each rank's rows of its heads.
HEAD_LAYER_NORM_PARTS: dict[str, tuple[str, str]] = {
    "self_attn.q_norm": ("q_norm", "heads"),
    "self_attn.k_norm": ("k_norm", "kv_head_rows"),
}
# DeepSeek's latent attention in place of the q/k/v projections (``mla_``: split by heads).
LATENT_ATTENTION_PARTS: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("mla.q_proj", "mla_q"),
    "self_attn.q_a_proj": ("mla.q_a_proj", "all"),
    "self_attn.q_a_layernorm": ("mla.q_a_layernorm", "all"),
    "self_attn.q_b_proj": ("mla.q_b_proj", "mla_q"),
    "self_attn.kv_a_proj_with_mqa": ("mla.kv_a_proj", "all"),
    "self_attn.kv_a_layernorm": ("mla.kv_a_layernorm", "all"),
    "self_attn.kv_b_proj": ("mla.kv_b_proj", "mla_kv_b"),
    "self_attn.o_proj": ("o_proj", "mla_o_in"),
}


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class TensorSource(Protocol):
    """A checkpoint tensor that reads only the part an index asks for (a safetensors slice)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The files that hold the weights, chosen as transformers and vLLM choose them: those
    the index of a sharded checkpoint names, else model.safetensors, else every
    *.safetensors (so an adapter or an old copy beside them is not read as weights)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc!r})") from None
        files = sorted(model_dir / str(name) for name in names)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names files that are not there: {missing[:3]}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def open_checkpoint(model_dir: str | Path) -> list[Any]:
    """Every file of the checkpoint, opened (safetensors' handles: each tensor is read only
    when asked for, so a tensor-parallel rank reads its shard only)."""
    opened = []
    for path in checkpoint_files(model_dir):
        try:
            opened.append(safe_open(str(path), framework="pt", device="cpu"))
        except SafetensorError as exc:  # truncated, empty, not safetensors
            raise ValueError(f"{path}: not a readable safetensors file: {exc}") from None
    return opened


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, TensorSource]]:
    """Every tensor of the checkpoint, lazily."""
    for f in open_checkpoint(model_dir):
        for name in f.keys():
            yield name, f.get_slice(name)


_ALL = (slice(None),)


def _span(start: int, size: int) -> slice:
    return slice(start, start + size)


def _vocab_rows(cfg: ModelConfig, layout: ShardLayout) -> slice:
    return slice(
        layout.vocab_start, min(layout.vocab_start + layout.vocab_per_rank, cfg.vocab_size)
    )


def layer_part(
    cfg: ModelConfig, layout: ShardLayout, part: str, kind: str
) -> tuple[slice, tuple[slice, ...]] | None:
    """(rows of the fused parameter, index into the checkpoint tensor) of one part; None
    for a row-parallel bias on a rank other than 0 (rank 0 adds it). An ``expert_`` or
    ``shared_`` part splits that MLP's columns."""
    mlp, _, part = (
        part.partition("_") if part.startswith(("expert_", "shared_")) else ("", "", part)
    )
    if part.startswith("mla_"):
        return _latent_part(cfg, layout, part, kind)
    if part.startswith("lin_"):
        return _linear_part(layout, part)
    d = cfg.head_dim
    inter = {
        "": layout.intermediate_size,
        "expert": layout.moe_intermediate_size,
        "shared": layout.shared_expert_intermediate_size,
    }[mlp]
    q, kv = layout.num_heads * d, layout.num_kv_heads * d
    q_src, kv_src = _span(layout.q_head_start * d, q), _span(layout.kv_head_start * d, kv)
    inter_src = _span(layout.rank * inter, inter)
    if part in ("o_in", "down_in"):
        if kind == "bias":
            return (slice(None), _ALL) if layout.rank == 0 else None
        return slice(None), (slice(None), q_src if part == "o_in" else inter_src)
    return {
        "q": (slice(0, q), (q_src,)),
        "q_gate": (_span(q + 2 * kv, q), (q_src,)),
        "k": (_span(q, kv), (kv_src,)),
        "v": (_span(q + kv, kv), (kv_src,)),
        "heads": (slice(None), (_span(layout.q_head_start, layout.num_heads),)),
        "q_heads": (slice(None), (q_src,)),
        "kv_heads": (slice(None), (kv_src,)),
        "kv_head_rows": (slice(None), (_span(layout.kv_head_start, layout.num_kv_heads),)),
        "gate": (slice(0, inter), (inter_src,)),
        "up": (_span(inter, inter), (inter_src,)),
        "all": (slice(None), _ALL),
    }[part]


def _latent_part(
    cfg: ModelConfig, layout: ShardLayout, part: str, kind: str
) -> tuple[slice, tuple[slice, ...]] | None:
    """A latent attention projection's share: its rows of this rank's heads (the output
    projection's columns)."""
    mla = cfg.latent_attention
    assert mla is not None
    per_head = {
        "mla_q": mla.qk_head_dim,
        "mla_kv_b": mla.qk_nope_head_dim + mla.v_head_dim,
        "mla_o_in": mla.v_head_dim,
    }[part]
    heads = _span(layout.q_head_start * per_head, layout.num_heads * per_head)
    if part != "mla_o_in":
        return slice(None), (heads,)
    if kind == "bias":
        return (slice(None), _ALL) if layout.rank == 0 else None
    return slice(None), (slice(None), heads)


def _linear_part(layout: ShardLayout, part: str) -> tuple[slice, tuple[slice, ...]]:
    """A linear-attention tensor's share: the rows (columns of out_proj) of this rank's key
    heads and of the value heads they serve, in the fused projection's order: q, k, v, z, b, a
    (the convolution's q, k, v)."""
    key = layout.linear_k_heads * layout.linear_k_head_dim
    value, heads = layout.linear_value_dim, layout.linear_v_heads
    key_src = (_span(layout.linear_k_head_start * layout.linear_k_head_dim, key),)
    value_src = (_span(layout.linear_v_head_start * layout.linear_v_head_dim, value),)
    head_src = (_span(layout.linear_v_head_start, heads),)
    return {
        "lin_q": (slice(0, key), key_src),
        "lin_k": (_span(key, key), key_src),
        "lin_v": (_span(2 * key, value), value_src),
        "lin_z": (_span(2 * key + value, value), value_src),
        "lin_b": (_span(2 * (key + value), heads), head_src),
        "lin_a": (_span(2 * (key + value) + heads, heads), head_src),
        "lin_heads": (slice(None), head_src),
        "lin_out_in": (slice(None), (slice(None), *value_src)),
    }[part]


class Squeezed:
    """A checkpoint tensor without its leading dimensions of size 1 (ERNIE's [1, experts]
    routing bias, read as a vector)."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        shape = source.get_shape()
        self.ones = next((i for i, size in enumerate(shape) if size != 1), len(shape))

    def get_shape(self) -> list[int]:
        return self.source.get_shape()[self.ones :]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        part = self.source[(slice(None),) * self.ones + index]
        return part.reshape(part.shape[self.ones :])


class RowsOf:
    """Rows [start, start + rows) of a checkpoint tensor, read as a tensor of their own."""

    def __init__(self, source: TensorSource, start: int, rows: int) -> None:
        self.source, self.start, self.rows = source, start, rows

    def get_shape(self) -> list[int]:
        return [self.rows, *self.source.get_shape()[1:]]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        first, last, _ = index[0].indices(self.rows)
        return self.source[(slice(self.start + first, self.start + last), *index[1:])]


class GroupPart:
    """Part ``part`` of every row group of a checkpoint tensor whose groups hold parts of
    ``sizes`` rows side by side, read as a tensor of those rows (Qwen 3.5's q_proj: each
    head's query channels, then its gate's; Qwen3-Next's in_proj_qkvz: each key head's q, k,
    then the v and z of the value heads it serves). Rows are asked for whole groups' (a
    tensor-parallel rank's share of heads)."""

    def __init__(self, source: TensorSource, sizes: tuple[int, ...], part: int) -> None:
        self.source = source
        self.group, self.size = sum(sizes), sizes[part]
        self.offset = sum(sizes[:part])

    def get_shape(self) -> list[int]:
        rows, *rest = self.source.get_shape()
        return [rows // self.group * self.size, *rest]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        first, last, _ = index[0].indices(self.get_shape()[0])
        assert first % self.size == 0 and last % self.size == 0, "rows of whole groups"
        groups = slice(first // self.size * self.group, last // self.size * self.group)
        rows = self.source[(groups, *index[1:])]
        grouped = rows.reshape(-1, self.group, *rows.shape[1:])
        part = grouped[:, self.offset : self.offset + self.size]
        return part.reshape(last - first, *rows.shape[1:])


class MiddleSqueezed:
    """A [rows, 1, columns] checkpoint tensor read as [rows, columns] (a depthwise
    convolution's weight)."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source

    def get_shape(self) -> list[int]:
        rows, _, columns = self.source.get_shape()
        return [rows, columns]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.source[(index[0], slice(None), *index[1:])].squeeze(1)


def _parts(cfg: ModelConfig, name: str, source: TensorSource) -> list[tuple[str, TensorSource]]:
    """A fused checkpoint tensor's parts under their own names (its whole shape checked
    first), GLM-4's norms under Gemma's, MiniMax-M2's and ERNIE's routing biases under
    their routers'; any other tensor as it is."""
    if _BARE_PARAM_RE.fullmatch(name):
        name += ".weight"
    m = _LAYER_RE.fullmatch(name)
    if m is not None and m.group(2) == "linear_attn.conv1d" and len(source.get_shape()) == 3:
        source = MiddleSqueezed(source)
    if m is not None and cfg.model_type == "glm4" and m.group(2) in _GLM4_NORMS:
        return [(f"model.layers.{m.group(1)}.{_GLM4_NORMS[m.group(2)]}.{m.group(3)}", source)]
    if m is not None and m.group(2) in _BIAS_BESIDE_ROUTER and m.group(3) == _ROUTER_BIAS:
        return [(f"model.layers.{m.group(1)}.mlp.gate.{_ROUTER_BIAS}", Squeezed(source))]
    grouped = None if m is None else _grouped_parts(cfg, m.group(2))
    if m is None or not (grouped or m.group(2) in FUSED_MODULES):
        return [(name, source)]
    expected = checkpoint_shape(cfg, name)
    if tuple(source.get_shape()) != expected:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(source.get_shape())} != {expected} from "
            "config.json: the config does not describe these weights"
        )
    if grouped is not None:
        modules, sizes = grouped
        return [
            (f"model.layers.{m.group(1)}.{module}.{m.group(3)}", GroupPart(source, sizes, j))
            for j, module in enumerate(modules)
        ]
    parts: list[tuple[str, TensorSource]] = []
    start = 0
    for module in FUSED_MODULES[m.group(2)]:
        rows = cfg.layer_tensor_shape(module)[0]
        part = f"model.layers.{m.group(1)}.{module}.{m.group(3)}"
        parts.append((part, RowsOf(source, start, rows)))
        start += rows
    return parts


def _grouped_parts(cfg: ModelConfig, module: str) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The parts (as `LAYER_PARTS` names them) of a fused tensor whose rows interleave them
    by head, and their rows in each head's group; None for any other tensor. Qwen 3.5's
    q_proj and Qwen3-Next's, their gates beside each head's queries; Qwen3-Next's
    in_proj_qkvz and in_proj_ba, grouped by key head (transformers'
    ``fix_query_key_value_ordering``)."""
    if module == "self_attn.q_proj" and cfg.attn_output_gate:
        return ("self_attn.gated_q", "self_attn.q_gate"), (cfg.head_dim, cfg.head_dim)
    la = cfg.linear_attention
    if la is None:
        return None
    k, v = la.head_k_dim, la.group * la.head_v_dim
    return {
        "linear_attn.in_proj_qkvz": (
            tuple(f"linear_attn.in_proj_{part}" for part in "qkvz"),
            (k, k, v, v),
        ),
        "linear_attn.in_proj_ba": (
            ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
            (la.group, la.group),
        ),
    }.get(module)


def checkpoint_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The whole (unsharded) shape the config gives a checkpoint tensor: a config that
    disagrees with its weights must fail, not load a slice of each."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return cfg.vocab_size, cfg.hidden_size
    if name in ("model.norm.weight", "model.norm.bias"):
        return (cfg.hidden_size,)
    if name == "score.weight":
        return cfg.num_labels, cfg.hidden_size
    per_layer = cfg.num_layers * cfg.per_layer_input_size
    if name in _PER_LAYER_PARAMS:
        return {
            "model.embed_tokens_per_layer.weight": (cfg.per_layer_vocab_size, per_layer),
            "model.per_layer_model_projection.weight": (per_layer, cfg.hidden_size),
            "model.per_layer_projection_norm.weight": (cfg.per_layer_input_size,),
        }[name]
    m = _LAYER_RE.fullmatch(name)
    assert m is not None  # _target refused any other name
    layer_cfg = cfg.for_layer(int(m.group(1)))
    rows, columns = layer_cfg.layer_tensor_shape(_module(m.group(2))[0])
    return (rows,) if m.group(3) != "weight" or not columns else (rows, columns)


def _module(name: str) -> tuple[str, int | None]:
    """A decoder layer's sub-module name as `LAYER_PARTS` knows it, and the expert's number
    for an expert's tensor (Mixtral's and Hunyuan's names read as Qwen's)."""
    if name in ("block_sparse_moe.gate", "mlp.gate.wg"):
        return "mlp.gate", None
    if name.startswith("mlp.shared_mlp."):
        return name.replace("mlp.shared_mlp.", "mlp.shared_expert."), None
    m = _EXPERT_RE.fullmatch(name)
    if m is None:
        return name, None
    return f"mlp.experts.{_MIXTRAL_NAMES.get(m.group(2), m.group(2))}", int(m.group(1))


def _target(
    model: CausalLM, name: str
) -> tuple[str, slice | tuple[int, slice], tuple[slice, ...]] | None:
    """Weir parameter name, its row range, and the index of this rank's share of the
    checkpoint tensor, for an HF tensor name; None for tensors to skip."""
    cfg, layout = model.config, model.layout
    if name == "model.embed_tokens.weight":
        rows = _vocab_rows(cfg, layout)
        return "embed_tokens", slice(0, rows.stop - rows.start), (rows,)
    if name in ("model.norm.weight", "model.norm.bias"):  # a bias: Starcoder2's LayerNorm
        return name.removeprefix("model."), slice(None), _ALL
    if name == "lm_head.weight":
        # Some tied checkpoints still ship a copy of the embedding as lm_head.
        if cfg.tie_word_embeddings:
            return None
        rows = _vocab_rows(cfg, layout)
        return "lm_head", slice(0, rows.stop - rows.start), (rows,)
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name in _PER_LAYER_PARAMS and cfg.per_layer_input_size:
        return _PER_LAYER_PARAMS[name], slice(None), _ALL
    # ERNIE 4.5's, Qwen3-Next's and Qwen 3.5's multi-token prediction blocks: Weir does not
    # draft with them.
    if (cfg.model_type == "ernie4_5_moe" and "mtp" in name) or (
        cfg.model_type in QWEN_HYBRID_TYPES and name.startswith("mtp.")
    ):
        return None
    if name == "score.weight" and cfg.num_labels:  # a sequence classifier's head
        return "score", slice(None), _ALL
    m = _LAYER_RE.fullmatch(name)
    module, expert = _module(m.group(2)) if m is not None else ("", None)
    parts = LAYER_PARTS
    if cfg.latent_attention is not None:
        parts = {**LAYER_PARTS, **LATENT_ATTENTION_PARTS}
    elif cfg.whole_qk_norms:
        parts = {**LAYER_PARTS, **WHOLE_QK_NORM_PARTS}
    elif cfg.layer_norms:
        parts = {**LAYER_PARTS, **HEAD_LAYER_NORM_PARTS}
    if not cfg.gated_mlp:
        parts = {**parts, **UNGATED_MLP_PARTS}
    nextn = range(cfg.num_layers, cfg.num_layers + cfg.num_nextn_predict_layers)
    if m is not None and int(m.group(1)) in nextn:
        return None  # DeepSeek-V3's multi-token prediction layers: Weir does not draft with them
    score_bias = m is not None and m.group(3) == "e_score_correction_bias"
    if (
        m is None
        or module not in parts
        or (score_bias and not (module == "mlp.gate" and cfg.routing.score_bias))
    ):
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    layer = int(m.group(1))
    if layer >= cfg.num_layers:
        raise ValueError(
            f"checkpoint tensor {name!r} is past config.json's num_hidden_layers "
            f"{cfg.num_layers}: the config does not describe these weights"
        )
    if module in _SHARED_KV_MODULES and cfg.kv_source(layer) != layer:
        return None
    # The layer's own shapes: Gemma 4's full-attention layers' heads, wider MLPs.
    cfg, layout = model.layers[layer].config, model.layers[layer].layout
    of_experts = module == "mlp.gate" or module.startswith(_MOE_MODULES)
    moe_layer = cfg.is_moe_layer(layer)
    # An MoE layer's MLP is its experts (Gemma 4's: its experts and a dense MLP beside them).
    in_layer = moe_layer if of_experts else not moe_layer or cfg.experts_beside_mlp
    if module.startswith("mlp.") and not in_layer:
        kind = "a mixture of experts" if moe_layer else "one MLP"
        raise ValueError(
            f"checkpoint tensor {name!r}: layer {layer} has {kind} by config.json: the config "
            "does not describe these weights"
        )
    if expert is not None and expert >= cfg.num_experts:
        raise ValueError(
            f"checkpoint tensor {name!r} is past config.json's {cfg.num_experts} experts"
        )
    weir_module, part = parts[module]
    target = layer_part(cfg, layout, part, m.group(3))
    if target is None:
        return None
    if score_bias:
        return f"layers.{layer}.moe.score_bias", *target
    if expert is not None:  # one expert's rows of the stacked experts' parameter (or bias)
        rows, index = target
        stacked = weir_module + ("_bias" if m.group(3) == "bias" else "")
        return f"layers.{layer}.{stacked}", (expert, rows), index
    return (f"layers.{layer}.{weir_module}.{m.group(3)}", *target)


def _language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under its causal LM name; None for another tower's."""
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    if name.startswith(_CAUSAL_LM_PREFIXES):  # Qwen2-VL's and Qwen2.5-VL's older files
        return name
    # lm_head.weight: where transformers 5 saves the tied head of the whole model.
    return name if name == "lm_head.weight" else None


@torch.no_grad()
def load_weights(
    model: CausalLM,
    tensors: Iterator[tuple[str, TensorSource]],
    lm_head_optional: bool = False,
    score_tokens: list[int] | None = None,
) -> None:
    """Copy checkpoint tensors (this rank's share) into the model, fusing q/k/v and gate/up;
    every parameter must be filled, but the LM head when ``lm_head_optional`` (an embedding
    model's checkpoint has none: its LM head stays zero, never used). A checkpoint of the
    bare transformer (names without ``model.``, as embedding models are saved) loads too.
    ``score_tokens``: a classifier's head is read from those tokens' rows of the LM head
    (``ModelConfig.classifier_from_token``)."""
    # The vision tower's tensors are read apart, by their own names (``vision.py``).
    params = {n: p for n, p in model.named_parameters() if not n.startswith("vision.")}
    tower = model.vision if isinstance(model, CausalLM) else None  # not an EAGLE head's layers
    vision: list[tuple[str, torch.Tensor]] = []
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    filled: dict[str, int] = {}
    rows = _vocab_rows(model.config, model.layout)
    for vocab_param in _VOCAB_PARAMS:
        if vocab_param in params:  # the last rank's rows past the vocabulary stay zero
            padding = params[vocab_param][rows.stop - rows.start :]
            filled[vocab_param] = padding.zero_().numel()
    if lm_head_optional and "lm_head" in params:
        params["lm_head"].zero_()
    # Where each tensor went, by destination: a second tensor for the same rows (a name
    # repeated across files, or two names of one module) could hide a missing one from the
    # element count below.
    written: dict[str, str] = {}
    for checkpoint_name, whole in tensors:
        if tower is not None and is_tower_weight(tower, checkpoint_name):
            vision.append((checkpoint_name, whole[_ALL]))
            continue
        if model.config.multimodal:
            language_model_name = _language_model_name(checkpoint_name)
            if language_model_name is None:
                continue
            checkpoint_name = language_model_name
        elif checkpoint_name.startswith(_BARE_PREFIXES):
            checkpoint_name = "model." + checkpoint_name
        scale = _KV_SCALE_RE.fullmatch(checkpoint_name)
        if scale is not None:
            _load_kv_scale(params, filled, written, scale, whole)
            continue
        for name, source in _parts(model.config, checkpoint_name, whole):
            if score_tokens is not None and name == head:
                _score_from_rows(model, params, filled, written, name, source, score_tokens)
            _load_tensor(model, params, filled, written, name, source)
    missing = [
        n
        for n, p in params.items()
        if filled.get(n, 0) != p.numel() and not (lm_head_optional and n == "lm_head")
    ]
    if missing:
        named = ", ".join(_checkpoint_names(n, model.config) for n in missing[:3])
        raise ValueError(
            f"checkpoint does not fill {len(missing)} parameters: it lacks some of {named}"
        )
    if tower is not None:
        load_tower(tower, vision)


def _load_kv_scale(
    params: dict[str, torch.nn.Parameter],
    filled: dict[str, int],
    written: dict[str, str],
    match: re.Match[str],
    source: TensorSource,
) -> None:
    """A layer's fp8 cache scale into its parameter, where the model has one (an fp8 cache
    of a checkpoint with a kv_cache_scheme); skipped elsewhere, as the cache does not use it."""
    name = match.group(0)
    param_name = f"layers.{match.group(1)}.{match.group(3)}"
    owner = match.group(2)
    if (
        owner not in ("self_attn", f"self_attn.{match.group(3)[0]}_proj")
        or param_name not in params
    ):
        return
    if param_name in written:
        raise ValueError(f"checkpoint tensor {name!r} appears twice (in two files?): keep one")
    shape = tuple(source.get_shape())
    if shape not in ((), (1,)):
        raise ValueError(f"{name}: an fp8 cache's scale is one value, not of shape {shape}")
    value = source[()] if shape == () else source[_ALL]
    if not value.isfinite().all() or not (value > 0).all():
        raise ValueError(f"{name}: an fp8 cache's scale must be positive, got {value.tolist()}")
    params[param_name].copy_(value.reshape(()))
    written[param_name] = name
    filled[param_name] = 1


def _score_from_rows(
    model: CausalLM,
    params: dict[str, torch.nn.Parameter],
    filled: dict[str, int],
    written: dict[str, str],
    name: str,
    source: TensorSource,
    tokens: list[int],
) -> None:
    """A classifier's head from its LM head's rows of ``tokens`` (with two-way softmax, the
    second's less the first's: the logit whose sigmoid is the second's probability of the
    two), read whole on every rank."""
    written[f"score[{slice(None)}]"] = name
    rows = torch.cat([source[(slice(t, t + 1),)].float() for t in tokens])
    if model.config.two_way_softmax:
        rows = rows[1:] - rows[:1]
    params["score"].copy_(rows)
    filled["score"] = rows.numel()


def _checkpoint_names(param: str, cfg: ModelConfig) -> str:
    """The checkpoint tensors a Weir parameter is read from, for an error to name."""
    if not param.startswith("layers."):
        return {
            "embed_tokens": "model.embed_tokens.weight",
            "norm.weight": "model.norm.weight",
        }.get(param, f"{param}.weight")
    _, layer, rest = param.split(".", 2)
    if rest in ("k_scale", "v_scale"):
        return f"model.layers.{layer}.self_attn.{rest}"
    if cfg.model_type == "gpt_oss" and rest in CHECKPOINT_NAMES:
        return f"model.layers.{layer}.{CHECKPOINT_NAMES[rest]}"
    if rest.endswith("_bias"):  # a stacked experts' bias
        rest = rest.removesuffix("_bias") + ".bias"
    module, _, kind = (
        rest.rpartition(".") if rest.endswith((".weight", ".bias")) else (rest, "", "")
    )
    parts = {**LAYER_PARTS, **LATENT_ATTENTION_PARTS}
    sources = [hf for hf, (weir, _) in parts.items() if weir == module]
    suffix = f".{kind}" if kind else ".weight"
    names = [
        f"model.layers.{layer}." + hf.replace("mlp.experts.", "mlp.experts.E.") + suffix
        for hf in sources
    ]
    return " / ".join(names)


def _load_tensor(
    model: CausalLM,
    params: dict[str, torch.nn.Parameter],
    filled: dict[str, int],
    written: dict[str, str],
    name: str,
    source: TensorSource,
) -> None:
    """This rank's share of checkpoint tensor ``name`` copied into its parameter, counted."""
    target = _target(model, name)
    if target is None:
        return
    param_name, rows, index = target
    destination = f"{param_name}[{rows}]"
    if destination in written:
        first = written[destination]
        twice = (
            f"tensor {name!r} appears twice"
            if first == name
            else (f"tensors {first!r} and {name!r} hold the same weights")
        )
        raise ValueError(f"checkpoint {twice} (in two files?): keep one copy")
    written[destination] = name
    if param_name not in params:
        raise ValueError(
            f"checkpoint tensor {name!r} has no place in the model config.json describes "
            "(a bias it says the model lacks?): the config does not describe these weights"
        )
    expected = checkpoint_shape(model.config, name)
    if tuple(source.get_shape()) != expected:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(source.get_shape())} != {expected} from "
            "config.json: the config does not describe these weights"
        )
    tensor = source[index]
    dest = params[param_name][rows]
    if dest.shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
        )
    dest.copy_(tensor)
    filled[param_name] = filled.get(param_name, 0) + tensor.numel()


def _score_tokens(
    model_dir: str | Path, cfg: ModelConfig, tokenizer_dir: str | Path | None = None
) -> list[int] | None:
    """The token ids of a classifier's ``classifier_from_token``, in the served tokenizer
    (``tokenizer_dir``'s, --tokenizer, where given: vLLM reads them with its tokenizer);
    None for any other model."""
    if not cfg.classifier_from_token:
        return None
    source = Path(model_dir if tokenizer_dir is None else tokenizer_dir)
    ids = [vocab_id(source, token) for token in cfg.classifier_from_token]
    missing = [t for t, i in zip(cfg.classifier_from_token, ids, strict=True) if i is None]
    if missing:
        raise ValueError(
            f"config.json: classifier_from_token {missing[0]!r} is not a token of "
            f"{source / 'tokenizer.json'}"
        )
    return [i for i in ids if i is not None]


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of the model's shape: norms (and an fp8 cache's scales, Gemma 4's layer
    scalars and experts' factors) at 1, everything else N(0, 0.02), the scale of a trained
    model's initialisation, so activations stay finite at any depth. Seeded, so every process
    (and rank) builds the same model."""
    ones = ("k_scale", "v_scale", "layer_scalar.weight", "per_expert_scale.weight")
    generator = torch.Generator(device=model.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith(ones):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)


def load_model(
    model_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attention: AttentionBackend | None = None,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
    quantization: str | None = None,
    lm_head_optional: bool = False,
    hf_overrides: str | None = None,
    pack: bool = True,
    kv_cache_dtype: torch.dtype | None = None,
    weight_dtype: torch.dtype | None = None,
    tokenizer_dir: str | Path | None = None,
) -> CausalLM:
    """Build the model from `model_dir/config.json` and load its safetensors weights
    (``load_format="dummy"``: random weights, no checkpoint read); with ``tp``, this
    rank's shard; with ``quantization``, its weights then quantized (see `quantization`);
    with ``hf_overrides``, config.json's keys replaced by those (a JSON object's text).
    ``pack``: on a CPU, the projections prepacked for its matmul (`packed_weights`).
    ``kv_cache_dtype``: what its caches hold (None: ``dtype``). ``weight_dtype``: the packed
    projections' (None: ``dtype``; bfloat16 over a float32 model: `packed_weights.cpu_dtypes`).
    ``tokenizer_dir``: the tokenizer served in place of the model's (--tokenizer), which
    numbers a reranker's ``classifier_from_token``."""
    cfg = read_model_config(model_dir, hf_overrides)
    dtype = dtype or default_dtype(device)
    check_moe(cfg, torch.device(device), dtype, quantization)
    if attention is None:
        attention = get_attention_backend(None, device, dtype)
    model = CausalLM(
        cfg,
        attention,
        device,
        dtype,
        tp,
        layer_kernels_for(attention, torch.device(device)),
        kv_cache_dtype,
    )
    if load_format == "dummy":
        init_dummy_weights(model)
    elif load_format == "auto":
        quantized = cfg.checkpoint_quantization
        tensors = (
            iter_safetensors(model_dir)
            if quantized is None or quantized.method == "mxfp4"
            else dequantized_tensors(open_checkpoint(model_dir), quantized)
        )
        if cfg.model_type == "gpt_oss":
            tensors = split_gpt_oss_tensors(tensors, cfg)
        elif cfg.model_type in ("granitemoe", "granitemoeshared"):
            tensors = split_granite_moe_tensors(tensors)
        elif (
            cfg.model_type == "qwen3_moe" and cfg.multimodal
        ) or cfg.model_type in STACKED_EXPERT_TYPES:
            qwen_layout = cfg.model_type not in _TRANSFORMERS_STACKED_TYPES
            tensors = split_stacked_experts(tensors, cfg, qwen_layout)
        elif cfg.model_type == "llama4_text":
            tensors = split_llama4_tensors(tensors, cfg)
        load_weights(model, tensors, lm_head_optional, _score_tokens(model_dir, cfg, tokenizer_dir))
    else:
        raise ValueError(f"load_format must be one of ('auto', 'dummy'), got {load_format!r}")
    model.finish_loading()
    if quantization is not None:
        quantize_model(model, quantization)
    elif pack and can_pack(torch.device(device), dtype, model.attention.kernels):
        pack_model(model, weight_dtype or dtype)
    return model.eval()
