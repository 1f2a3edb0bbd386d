"""EAGLE-1 draft heads (vLLM's ``eagle`` method) for a Llama-family served model.

A head is ``fc`` (2 x hidden -> hidden, no bias) and Llama decoder layers of the served
model's hidden size, the first without its input norm, and no final norm: at position q it
reads the token at q + 1 and the served model's final hidden state at q (or, past the
verified tokens, its own output at q - 1), and the served model's LM head turns its output
into logits. The token embedding is the served model's too (a head's own ``embed_tokens``
is ignored). ``drafter.py`` runs it.
"""

from pathlib import Path

import torch
from torch import nn

from weir.services.executor.attention import AttentionBackend, AttentionMetadata
from weir.services.executor.layers import Linear, layer_kernels_for
from weir.services.executor.model import (
    CausalLM,
    DecoderLayer,
    KVCacheShape,
)
from weir.services.executor.rotary import Rotary
from weir.services.executor.weights import (
    TensorSource,
    init_dummy_weights,
    iter_safetensors,
    load_weights,
)
from weir.shared.model_config import ModelConfig, read_model_config
from weir.shared.shard_layout import ShardLayout


class EagleLayers(nn.Module):
    """A head's decoder layers, named as a Llama's so ``weights.load_weights`` fills them."""

    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.layout = ShardLayout.of(cfg)
        kernels = layer_kernels_for(attention, device)
        layers = [
            DecoderLayer(i, cfg, self.layout, None, attention, kernels, device, dtype)
            for i in range(cfg.num_layers)
        ]
        # fc's output is the first layer's input as it is (EAGLE's layer 0 has no input norm).
        layers[0].input_layernorm = None
        self.windows = tuple(dict.fromkeys(layer.sliding_window for layer in layers))
        self.layers = nn.ModuleList(layers)


class EagleHead(nn.Module):
    """An EAGLE head over ``target``, the served model, whose embedding and LM head it
    reads (they stay the target's parameters, not the head's)."""

    def __init__(self, cfg: ModelConfig, target: CausalLM) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.dtype, self.device = target.dtype, target.device
        self.kv_cache_dtype = target.kv_cache_dtype
        self.attention = target.attention
        self.fc = Linear(2 * h, h, False, self.device, self.dtype)
        self.decoder = EagleLayers(cfg, self.attention, self.device, self.dtype)
        self.layers, self.layout = self.decoder.layers, self.decoder.layout
        self.kv_cache_shape = KVCacheShape(
            cfg, self.layout, self.dtype, self.kv_cache_dtype, self.device
        )
        self.rotary = Rotary(cfg.rope, self.device)
        self.windows = self.decoder.windows
        # A tuple: not a submodule, whose weights would count as the head's.
        self._target: tuple[CausalLM] = (target,)

    def read_from(self, target: CausalLM) -> None:
        """Read ``target``'s embedding and LM head from now on (the served model was
        replaced by one of new weights)."""
        self._target = (target,)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.kv_cache_shape.bytes_per_block(block_size)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        return self.kv_cache_shape.allocate(num_blocks, block_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        context: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """The head's output [T, hidden] for T flat tokens, each with its ``context`` row
        (the served model's final hidden state at the position before, or the head's)."""
        self.attention.prepare(attn_metadata, self.layout.num_heads, kv_caches[0], self.windows)
        cos, sin = self.rotary(positions, self.dtype)
        x = self.fc(torch.cat((self._target[0]._embed(input_ids), context), dim=-1))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, attn_metadata, kv_cache)
        return x

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor | None:
        return self._target[0].compute_logits(hidden, widen)


def load_eagle_head(head_dir: Path, target: CausalLM, load_format: str) -> EagleHead:
    """The EAGLE head of directory ``head_dir`` over ``target``; a head that does not fit
    the target is refused, saying why."""
    cfg = read_model_config(head_dir)
    name = f"EAGLE head {head_dir.name}"
    served = target.config
    if cfg.model_type != "llama":
        raise ValueError(
            f"{name}: its config.json's model_type is {cfg.model_type!r}; an EAGLE-1 head is "
            "a Llama decoder layer (model_type llama)"
        )
    if cfg.hidden_size != served.hidden_size:
        raise ValueError(
            f"{name}: hidden_size {cfg.hidden_size} is not the served model's "
            f"{served.hidden_size} (a head of another model?)"
        )
    head = EagleHead(cfg, target)
    if load_format == "dummy":
        init_dummy_weights(head)  # type: ignore[arg-type]
        return head.eval()
    fc = None
    layers: list[tuple[str, TensorSource]] = []
    for tensor_name, source in iter_safetensors(head_dir):
        bare = tensor_name.removeprefix("model.")
        if bare == "fc.weight":
            fc = source
        elif bare.startswith("layers."):
            layers.append((bare, source))
        elif bare != "embed_tokens.weight":  # the served model's embedding is read instead
            raise ValueError(f"{name}: unexpected tensor {tensor_name!r} (not an EAGLE-1 head?)")
    if fc is None:
        raise ValueError(f"{name}: no fc.weight (not an EAGLE-1 head?)")
    expected = (cfg.hidden_size, 2 * cfg.hidden_size)
    if tuple(fc.get_shape()) != expected:
        raise ValueError(f"{name}: fc.weight of shape {tuple(fc.get_shape())}, not {expected}")
    with torch.no_grad():
        head.fc.weight.copy_(fc[(slice(None),)])
    try:
        load_weights(head.decoder, iter(layers))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return head.eval()
