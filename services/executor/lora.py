"""LoRA adapters on the executor: their weights, fused as the base model's projections are,
and the per-step pass that adds each request's adapter to its own tokens.

A PEFT adapter holds, per targeted projection ``W`` ([out, in]), ``A`` ([r, in]) and ``B``
([out, r]); the adapted projection is ``x @ W.T + scaling * (x @ A.T) @ B.T``. Weir fuses
q/k/v and gate/up into one matmul each (``weights.py``), so an adapter's parts are fused
the same way: their ``A`` stacked ([parts * r, in]), their ``B`` placed block-diagonally
where each part's rows sit in the fused output ([out, parts * r]), the scaling folded in.
A part the adapter does not target is simply absent. Under tensor parallelism a rank holds
the rows of ``B`` that its column-parallel projections produce, and the columns of ``A`` that
its row-parallel ones read: its delta to a row-parallel output is a partial sum, reduced
with the base projection's.

The flat batch is ordered by request, so an adapter's tokens are the rows of its requests;
a step adds each adapter present to those rows only (``LoraBatch.add``), and requests of
the base model, or of other adapters, share the step untouched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open

from weir.services.executor.model import CausalLM, DecoderLayer
from weir.services.executor.transfer import to_device
from weir.services.executor.weights import FUSED_MODULES, LAYER_PARTS, RowsOf, layer_part
from weir.shared.lora import LoraModule, check_adapter

_ALL = (slice(None),)
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoraWeights:
    """One fused projection's update, transposed for ``x @ a_t @ b_t``."""

    a_t: torch.Tensor  # [in, parts * r]
    b_t: torch.Tensor  # [parts * r, out], scaling folded in


@dataclass(slots=True)
class Adapter:
    name: str
    layers: list[dict[str, LoraWeights]]  # per layer: fused projection name -> its update
    fingerprint: str  # of its files (``AdapterFiles.fingerprint``)


ROW_PARALLEL = ("o_proj", "down_proj")  # the projections that end a residual branch


def _projection_rows(layer: DecoderLayer) -> dict[str, int]:
    """Output rows of each fused projection of ``layer`` on this rank."""
    return {
        "qkv_proj": layer.qkv_rows,
        "o_proj": layer.config.hidden_size,
        "gate_up_proj": 2 * layer.layout.intermediate_size,
        "down_proj": layer.config.hidden_size,
    }


def load_adapter(model: CausalLM, module: LoraModule, max_rank: int) -> Adapter:
    """``module``'s adapter for this rank of ``model``; ValueError names the file and what
    does not fit the model."""
    files = check_adapter(module.path, model.config, max_rank)
    rank, scaling = files.config.rank, files.config.scaling
    cfg = model.config
    # (layer, fused projection) -> [(rows of the fused output, A part, B part)]
    parts: dict[tuple[int, str], list[tuple[slice, torch.Tensor, torch.Tensor]]] = {}
    with safe_open(str(files.weights), framework="pt", device="cpu") as f:
        for (layer, hf_module), (key_a, key_b) in files.pairs.items():
            a_src, b_src = f.get_slice(key_a), f.get_slice(key_b)
            # A fused module's update (Phi-3's qkv_proj): its parts share A, and each takes
            # its rows of B.
            start = 0
            # The layer's own shapes (Gemma 4's full-attention layers' heads, wider MLPs).
            layer_cfg, layout = model.layers[layer].config, model.layers[layer].layout
            for hf_part in FUSED_MODULES.get(hf_module, (hf_module,)):
                projection, part = LAYER_PARTS[hf_part]
                target = layer_part(layer_cfg, layout, part, "weight")
                assert target is not None  # only a bias may be another rank's
                rows, index = target
                module_rows = layer_cfg.layer_tensor_shape(hf_part)[0]
                b_part = RowsOf(b_src, start, module_rows)
                start += module_rows
                if part.endswith("_in"):  # row-parallel: this rank reads some input columns
                    a, b = a_src[index], b_part[_ALL]
                else:
                    a, b = a_src[_ALL], b_part[index]
                parts.setdefault((layer, projection), []).append((rows, a, b))
    device = model.device
    layers: list[dict[str, LoraWeights]] = [{} for _ in range(cfg.num_layers)]
    for (layer, projection), fused in parts.items():
        a_t = torch.cat([a for _, a, _ in fused]).t()
        b_t = torch.zeros(len(fused) * rank, _projection_rows(model.layers[layer])[projection])
        # A residual branch's end carries Granite's residual_multiplier, as its weights do.
        factor = scaling * (cfg.residual_multiplier if projection in ROW_PARALLEL else 1.0)
        for i, (rows, _, b) in enumerate(fused):
            b_t[i * rank : (i + 1) * rank, rows] = b.float().t() * factor
        layers[layer][projection] = LoraWeights(
            a_t.to(device, model.dtype).contiguous(), b_t.to(device, model.dtype).contiguous()
        )
    return Adapter(module.name, layers, files.fingerprint)


class LoraAdapters:
    """The adapters this executor holds: request ``lora_name``s (adapter ids) map to
    ``ids`` (1, 2, ...; 0 is the base model), each the place of its adapter."""

    def __init__(self, adapters: list[Adapter]) -> None:
        self.adapters: list[Adapter | None] = list(adapters)  # None: a place freed
        self.ids = {a.name: i + 1 for i, a in enumerate(adapters)}

    @property
    def fingerprints(self) -> dict[str, str]:
        """Adapter id -> the fingerprint of its files."""
        return {name: self._held(i).fingerprint for name, i in self.ids.items()}

    def _held(self, adapter_id: int) -> Adapter:
        adapter = self.adapters[adapter_id - 1]
        assert adapter is not None  # a request's adapter stays while it runs
        return adapter

    @classmethod
    def load(cls, model: CausalLM, modules: list[LoraModule], max_rank: int) -> LoraAdapters:
        return cls([load_adapter(model, module, max_rank) for module in modules])

    def sync(self, model: CausalLM, wanted: dict[str, list[str]], max_rank: int) -> None:
        """Hold exactly the adapters of ``wanted`` (id -> [directory, fingerprint], as a
        plan says): load the new, drop the others. An adapter that fails to load, or whose
        files here are not the scheduler's, is logged and left out: a request of it then
        fails alone, naming it."""
        for name in [name for name in self.ids if name not in wanted]:
            self.adapters[self.ids.pop(name) - 1] = None
        for name, (path, fingerprint) in wanted.items():
            if name in self.ids:
                continue
            try:
                adapter = load_adapter(model, LoraModule(name, path), max_rank)
            except (ValueError, OSError) as exc:
                logger.error("LoRA adapter %s: cannot load %s: %s", name, path, exc)
                continue
            if adapter.fingerprint != fingerprint:
                logger.error(
                    "LoRA adapter %s: the files at %s differ from those the scheduler read "
                    "there: not loaded",
                    name,
                    path,
                )
                continue
            free = next((i for i, a in enumerate(self.adapters) if a is None), None)
            if free is None:
                self.adapters.append(adapter)
                free = len(self.adapters) - 1
            else:
                self.adapters[free] = adapter
            self.ids[name] = free + 1

    def batch(
        self, request_ids: np.ndarray, query_start_loc: np.ndarray, device: torch.device
    ) -> LoraBatch | None:
        """The step's adapters and their rows, from each scheduled request's adapter id
        ([R]) and where its tokens start; None when no request has an adapter."""
        if not request_ids.any():
            return None
        token_ids = np.repeat(request_ids, np.diff(query_start_loc))
        groups: list[tuple[Adapter, torch.Tensor | None]] = []
        for adapter_id in np.unique(request_ids[request_ids > 0]):
            rows = np.flatnonzero(token_ids == adapter_id)
            index = None if len(rows) == len(token_ids) else to_device(rows, device)
            groups.append((self._held(adapter_id), index))
        return LoraBatch(groups)


@dataclass(slots=True)
class LoraBatch:
    """One step's adapters, each with the rows of the flat batch it adapts (None: all)."""

    groups: list[tuple[Adapter, torch.Tensor | None]]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """``out`` (the projection of ``x``) += each adapter's update, on its rows only."""
        for adapter, rows in self.groups:
            weights = adapter.layers[layer].get(projection)
            if weights is None:
                continue
            if rows is None:
                out.addmm_(x @ weights.a_t, weights.b_t)
            else:
                out.index_add_(0, rows, (x[rows] @ weights.a_t) @ weights.b_t)
