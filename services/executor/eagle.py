"""EAGLE draft heads (vLLM's ``eagle`` and ``eagle3`` methods) for a Llama-family served model.

At position q a head reads the token at q + 1 and a context row of the served model at q
(or, past the verified tokens, its own output at q - 1); ``drafter.py`` runs it. The token
embedding is the served model's (a head's own ``embed_tokens``, a frozen copy of it, is
ignored).

An EAGLE-1 head (``Eagle1Head``) is ``fc`` (2 x hidden -> hidden, no bias) and Llama decoder
layers of the served model's hidden size, the first without its input norm, and no final
norm: its context is the served model's final hidden state, ``fc`` reads it beside the
token's embedding at every pass, and the served model's LM head turns its output into
logits.

An EAGLE-3 head (``Eagle3Head``) reads the residual stream entering three layers of the
served model side by side (``CausalLM.forward_with_aux``), which ``fc`` (3 x hidden ->
hidden) turns into the first pass's context; later passes read the head's own output. Its
one decoder layer (``midlayer``) attends over the token's normalized embedding beside the
normalized context (2 x hidden wide: ``hidden_norm``'s), the context being its residual
stream; its own final norm and LM head give logits over a draft vocabulary, whose argmax
``d2t`` maps to the served model's token (target id = draft id + d2t[draft id]).
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weir.services.executor.attention import AttentionBackend, AttentionMetadata
from weir.services.executor.layers import Linear, ModuleList, RMSNorm, layer_kernels_for
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
from weir.shared.model_config import ModelConfig, read_hf_config, read_model_config
from weir.shared.shard_layout import ShardLayout


class EagleLayers(nn.Module):
    """A head's decoder layers, named as a Llama's so ``weights.load_weights`` fills them;
    with ``eagle3``, the final norm and the LM head (of ``cfg.vocab_size``, the draft
    vocabulary's) too."""

    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        eagle3: bool,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.layout = ShardLayout.of(cfg)
        kernels = layer_kernels_for(attention, device)
        layers = [
            DecoderLayer(i, cfg, self.layout, None, attention, kernels, device, dtype)
            for i in range(cfg.num_layers)
        ]
        if eagle3:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype, kernels)
            self.lm_head = nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype),
                requires_grad=False,
            )
        else:
            # fc's output is the first layer's input as it is (EAGLE's layer 0 has no input norm).
            layers[0].input_layernorm = None
        self.layers = ModuleList(layers)


class EagleHead(nn.Module):
    """What EAGLE-1's and EAGLE-3's heads share: decoder layers of ``decoder_cfg`` and
    their KV cache, over ``target``, the served model, whose embedding they read (it stays
    the target's parameter, not the head's)."""

    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]
    fc: Linear  # each head's own: it reads a context of the head's width

    def __init__(
        self,
        cfg: ModelConfig,
        decoder_cfg: ModelConfig,
        target: CausalLM,
        aux_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.config = cfg
        self.dtype, self.device = target.dtype, target.device
        self.kv_cache_dtype = target.kv_cache_dtype
        self.attention = target.attention
        # The served model's layers whose inputs the head reads (EAGLE-3's); none: its final
        # hidden states.
        self.aux_hidden_state_layers = aux_layers
        eagle3 = bool(aux_layers)
        self.decoder = EagleLayers(decoder_cfg, self.attention, self.device, self.dtype, eagle3)
        self.layers, self.layout = self.decoder.layers, self.decoder.layout
        self.kv_cache_shape = KVCacheShape(
            decoder_cfg, self.layout, self.dtype, self.kv_cache_dtype, self.device
        )
        self.rotary = Rotary(cfg.rope, self.device)
        # Of the served model's rows, the width the first pass reads.
        self.context_size = max(1, len(self.aux_hidden_state_layers)) * target.config.hidden_size
        self.read_from(target)

    def read_from(self, target: CausalLM) -> None:
        """Read ``target``'s embedding (and EAGLE-1's, its LM head) from now on, ``target``
        keeping the hidden states the head reads (the served model was replaced by one of
        new weights)."""
        # A tuple: not a submodule, whose weights would count as the head's.
        self._target: tuple[CausalLM] = (target,)
        target.aux_hidden_state_layers = self.aux_hidden_state_layers

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.kv_cache_shape.bytes_per_block(block_size)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        return self.kv_cache_shape.allocate(num_blocks, block_size)

    def combine_hidden_states(self, rows: torch.Tensor) -> torch.Tensor:
        """The first pass's context of the served model's ``rows`` [T, context_size]."""
        return rows

    def to_target(self, tokens: torch.Tensor) -> torch.Tensor:
        """The served model's ids of the argmax tokens of ``compute_logits``."""
        return tokens

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor | None:
        """Logits of the head's outputs (``widen``: as ``CausalLM.compute_logits``)."""
        raise NotImplementedError


class Eagle1Head(EagleHead):
    """An EAGLE-1 head: its output, through the served model's LM head, gives the logits."""

    def __init__(self, cfg: ModelConfig, target: CausalLM) -> None:
        super().__init__(cfg, cfg, target)
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, False, self.device, self.dtype)

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
        self.attention.prepare(attn_metadata, kv_caches[0])
        cos, sin = self.rotary(positions, self.dtype)
        x = self.fc(torch.cat((self._target[0]._embed(input_ids), context), dim=-1))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, attn_metadata, kv_cache)
        return x

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor | None:
        return self._target[0].compute_logits(hidden, widen)


class Eagle3Head(EagleHead):
    """An EAGLE-3 head reading the inputs of the served model's ``aux_layers``, proposing
    from a draft vocabulary of ``draft_vocab_size`` tokens."""

    # A buffer (register_buffer), which nn.Module's attribute lookup types only as Tensor | Module.
    d2t: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        target: CausalLM,
        aux_layers: tuple[int, ...],
        draft_vocab_size: int,
        norm_before_residual: bool = False,
    ) -> None:
        h = cfg.hidden_size
        decoder_cfg = dataclasses.replace(
            cfg, vocab_size=draft_vocab_size, tie_word_embeddings=False, qkv_input_size=2 * h
        )
        super().__init__(cfg, decoder_cfg, target, aux_layers)
        self.draft_vocab_size = draft_vocab_size
        # vLLM's config key: the residual stream is the normalized context, not the context.
        self.norm_before_residual = norm_before_residual
        self.fc = Linear(self.context_size, h, False, self.device, self.dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, self.device, self.dtype)
        # Draft id -> the served model's id, less the draft id (zeros: the same ids).
        self.register_buffer(
            "d2t", torch.zeros(draft_vocab_size, dtype=torch.int64, device=self.device)
        )

    def combine_hidden_states(self, rows: torch.Tensor) -> torch.Tensor:
        return self.fc(rows)

    def to_target(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens + self.d2t[tokens]

    def forward(
        self,
        input_ids: torch.Tensor,
        context: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """The head's output before its final norm [T, hidden] for T flat tokens, each with
        its ``context`` row (``combine_hidden_states``' of the served model's rows at the
        position before, or the head's output there), which is its residual stream (the
        output is written into ``context``, or with ``norm_before_residual`` into its
        normalized copy)."""
        self.attention.prepare(attn_metadata, kv_caches[0])
        cos, sin = self.rotary(positions, self.dtype)
        layer = self.layers[0]
        assert layer.input_layernorm is not None
        embeds = layer.input_layernorm(self._target[0]._embed(input_ids))
        hidden = self.hidden_norm(context)
        residual = hidden if self.norm_before_residual else context
        normed = torch.cat((embeds, hidden), dim=-1)
        return layer.residual_block(residual, normed, cos, sin, attn_metadata, kv_caches[0])

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor | None:
        """Logits [N, draft_vocab_size] of the head's outputs."""
        logits = F.linear(self.decoder.norm(hidden), self.decoder.lm_head)
        return logits.float() if widen else logits


def load_eagle_head(
    head_dir: Path, target: CausalLM, load_format: str, method: str = "eagle"
) -> EagleHead:
    """The EAGLE head (of ``method``: eagle or eagle3) of directory ``head_dir`` over
    ``target``; a head that does not fit the target is refused, saying why."""
    cfg = read_model_config(head_dir)
    name = f"{'EAGLE-3' if method == 'eagle3' else 'EAGLE'} head {head_dir.name}"
    served = target.config
    if cfg.model_type != "llama":
        raise ValueError(
            f"{name}: its config.json's model_type is {cfg.model_type!r}; an EAGLE head is "
            "a Llama decoder layer (model_type llama)"
        )
    if cfg.hidden_size != served.hidden_size:
        raise ValueError(
            f"{name}: hidden_size {cfg.hidden_size} is not the served model's "
            f"{served.hidden_size} (a head of another model?)"
        )
    head = (
        _eagle3_head(name, read_hf_config(head_dir), cfg, target)
        if method == "eagle3"
        else Eagle1Head(cfg, target)
    )
    if load_format == "dummy":
        init_dummy_weights(head)  # type: ignore[arg-type]
        return head.eval()
    _load_head_weights(name, head_dir, head)
    return head.eval()


def _eagle3_head(name: str, hf: dict[str, Any], cfg: ModelConfig, target: CausalLM) -> Eagle3Head:
    """An EAGLE-3 head of config.json ``hf`` (parsed: ``cfg``) over ``target``, unloaded."""
    served = target.config
    eagle_config = hf.get("eagle_config") or {}
    if not eagle_config.get("use_aux_hidden_state", True):
        raise ValueError(
            f"{name}: an EAGLE-3 head without auxiliary hidden states is not supported"
        )
    if cfg.num_layers != 1:
        raise ValueError(
            f"{name}: num_hidden_layers {cfg.num_layers}; an EAGLE-3 head of one layer "
            "(midlayer) is supported"
        )
    target_hidden = hf.get("target_hidden_size", served.hidden_size)
    if target_hidden != served.hidden_size:
        raise ValueError(
            f"{name}: target_hidden_size {target_hidden} is not the served model's "
            f"{served.hidden_size} (a head of another model?)"
        )
    draft_vocab_size = hf.get("draft_vocab_size") or cfg.vocab_size
    if type(draft_vocab_size) is not int or not 0 < draft_vocab_size <= served.vocab_size:
        raise ValueError(
            f"{name}: draft_vocab_size {draft_vocab_size!r} is not a vocabulary within the "
            f"served model's {served.vocab_size} tokens"
        )
    return Eagle3Head(
        cfg,
        target,
        aux_hidden_state_layers(name, hf, served.num_layers),
        draft_vocab_size,
        bool(hf.get("norm_before_residual", False)),
    )


def aux_hidden_state_layers(name: str, hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The served model's layers (of ``num_layers``) whose inputs the EAGLE-3 head of
    config.json ``hf`` reads, in the layers' order (vLLM concatenates them so): its
    ``eagle_aux_hidden_state_layer_ids`` (or its eagle_config's), else vLLM's default."""
    eagle_config = hf.get("eagle_config") or {}
    ids = hf.get(
        "eagle_aux_hidden_state_layer_ids",
        eagle_config.get("eagle_aux_hidden_state_layer_ids"),
    )
    if ids is None:
        ids = [2, num_layers // 2, num_layers - 3]
    if (
        not isinstance(ids, list)
        or not ids
        or any(type(i) is not int or not 0 <= i < num_layers for i in ids)
        or len(set(ids)) != len(ids)
    ):
        raise ValueError(
            f"{name}: auxiliary hidden state layers {ids} are not distinct layers of the "
            f"served model's {num_layers} (set eagle_aux_hidden_state_layer_ids)"
        )
    return tuple(sorted(ids))


def _load_head_weights(name: str, head_dir: Path, head: EagleHead) -> None:
    """``head``'s weights from ``head_dir``'s safetensors: its decoder's through
    ``load_weights``, the rest (fc; EAGLE-3's hidden_norm and d2t) each checked here."""
    eagle3 = isinstance(head, Eagle3Head)
    kind = "EAGLE-3" if eagle3 else "EAGLE-1"
    own: dict[str, torch.Tensor] = {"fc.weight": head.fc.weight}
    ignored = {"embed_tokens.weight"}  # the served model's embedding is read instead
    decoder: tuple[str, ...] = ("layers.",)
    if isinstance(head, Eagle3Head):
        own.update({"layers.0.hidden_norm.weight": head.hidden_norm.weight, "d2t": head.d2t})
        ignored.add("t2d")  # the target vocabulary's mask of draft tokens: for training
        decoder += ("norm.", "lm_head.")
    found: dict[str, TensorSource] = {}
    layers: list[tuple[str, TensorSource]] = []
    for tensor_name, source in iter_safetensors(head_dir):
        bare = tensor_name.removeprefix("model.")
        if eagle3 and bare.startswith("midlayer."):
            bare = "layers.0." + bare.removeprefix("midlayer.")
        if bare in own:
            found[bare] = source
        elif bare.startswith(decoder):
            layers.append((bare, source))
        elif bare not in ignored:
            raise ValueError(f"{name}: unexpected tensor {tensor_name!r} (not an {kind} head?)")
    required = [n for n in own if n != "d2t"]
    if isinstance(head, Eagle3Head):
        required.append("lm_head.weight")
        if head.draft_vocab_size < head._target[0].config.vocab_size:
            required.append("d2t")  # without it, draft ids are the served model's
    present = {*found, *(n for n, _ in layers)}
    for needed in required:
        if needed not in present:
            raise ValueError(f"{name}: no {needed} (not an {kind} head?)")
    with torch.no_grad():
        for key, source in found.items():
            param = own[key]
            if tuple(source.get_shape()) != tuple(param.shape):
                raise ValueError(
                    f"{name}: {key} of shape {tuple(source.get_shape())}, not {tuple(param.shape)}"
                )
            param.copy_(source[(slice(None),)])
    if isinstance(head, Eagle3Head):
        _check_d2t(name, head)
    try:
        load_weights(head.decoder, iter(layers))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _check_d2t(name: str, head: Eagle3Head) -> None:
    """Every draft token maps to a token of the served model."""
    ids = torch.arange(head.draft_vocab_size, device=head.device) + head.d2t
    vocab_size = head._target[0].config.vocab_size
    if not bool(((ids >= 0) & (ids < vocab_size)).all()):
        raise ValueError(f"{name}: d2t maps draft tokens outside the served model's vocabulary")
