"""LoRA adapters as PEFT saves them: which adapters a server serves, and what each one is.

``--lora-modules name=path`` names a directory holding PEFT's ``adapter_config.json`` and
``adapter_model.safetensors`` (what ``PeftModel.save_pretrained`` writes). The scheduler
reads the configs at start-up, so a bad adapter fails there with one line, before any
executor loads weights; the executor reads them again with the tensors
(``weir.services.executor.lora``). A request names its adapter (the API's ``model``, the
SDK's ``lora_name``); the adapter's low-rank update ``(alpha / r) * B @ A`` is added to the
base model's projections for that request's tokens only, so requests of several adapters
and of the base model share a batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from weir.shared.model_config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT options that make an adapter more than ``(alpha / r) * B @ A`` on linear weights.
_CHANGES_THE_FORWARD = {
    "use_dora": "DoRA",
    "lora_bias": "a trained bias",
    "modules_to_save": "whole trained modules",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "adapted parameters beside linear layers",
    "rank_pattern": "a rank per module",
    "alpha_pattern": "an alpha per module",
    "fan_in_fan_out": "transposed weights",
    "layer_replication": "replicated layers",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "routed adapters",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}
# PEFT's tensor names: base_model.model.<the base model's module>.lora_A.weight; the module
# lacks "model." for an adapter of the bare transformer (an embedding model's), and lies
# under language_model in a multimodal model (model.language_model.layers as transformers 5
# names it, language_model.model.layers as 4 did). Phi-3's modules are fused: qkv_proj and
# gate_up_proj.
_TENSOR = re.compile(
    r"base_model\.model\.(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\."
    r"(self_attn\.[qkvo]_proj|self_attn\.qkv_proj|mlp\.gate_proj|mlp\.up_proj|mlp\.gate_up_proj"
    r"|mlp\.down_proj)\.lora_([AB])\.weight"
)
# A multimodal model's other towers, which a text-only prompt never runs (Qwen-VL's visual,
# Kimi K2.5's mm_projector).
_OTHER_TOWERS = re.compile(
    r"base_model\.model\.(?:model\.)?(?:vision_tower|multi_modal_projector|visual|mm_projector)\."
)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One ``--lora-modules`` entry: the name requests use, and the adapter's directory."""

    name: str
    path: str

    @classmethod
    def parse(cls, spec: str) -> LoraModule:
        """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ...}`` (its optional
        ``base_model_name`` is taken and not used); ValueError says what is wrong."""
        spec = str(spec)
        if spec.lstrip().startswith("{"):
            name, path = _parse_json_module(spec)
        else:
            name, sep, path = spec.partition("=")
            if not sep or not path:
                raise ValueError(f"lora_modules: {spec!r} is not name=path")
        check_name(name, "lora_modules: adapter name")
        return cls(name, path)


def _parse_json_module(spec: str) -> tuple[str, str]:
    form = 'name=path or {"name": ..., "path": ...}'
    try:
        fields = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora_modules: {spec[:200]!r} is not JSON ({exc}); give {form}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"lora_modules: {spec[:200]!r} is not {form}")
    unknown = set(fields) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"lora_modules: unknown field(s) {sorted(unknown)} in {spec[:200]!r}")
    name, path = fields.get("name"), fields.get("path")
    if not isinstance(name, str) or not isinstance(path, str) or not path:
        raise ValueError(f"lora_modules: {spec[:200]!r} needs a string name and path")
    return name, path


def check_name(name: str, what: str) -> None:
    """ValueError unless ``name`` can name an adapter (``what``: how the error calls it)."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{what} {name[:300]!r} must be 1-256 letters, digits or ._:/@+- (starting with a "
            "letter or digit)"
        )


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What an adapter's ``adapter_config.json`` says that changes its output."""

    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A`` (PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def parse_lora_modules(specs: tuple[str, ...], served_names: tuple[str, ...]) -> list[LoraModule]:
    """The ``--lora-modules`` entries, each name once and none the base model's."""
    modules = [LoraModule.parse(spec) for spec in specs]
    names = [m.name for m in modules]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"lora_modules: adapter name {name!r} is given twice")
        if name in served_names:
            raise ValueError(
                f"lora_modules: adapter name {name!r} is the served model's name: requests "
                "for it would not know which they mean"
            )
    return modules


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter config in directory ``path``; ValueError names the file and what Weir
    cannot serve (DoRA, trained biases or whole modules, per-module ranks)."""
    directory = Path(path)
    config_path = directory / ADAPTER_CONFIG
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {directory}: no {ADAPTER_CONFIG} there")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        why = (
            " (adapter_model.bin is a pickle, which Weir never loads: save the adapter with "
            "safe_serialization=True)"
            if (directory / "adapter_model.bin").is_file()
            else ""
        )
        raise ValueError(f"LoRA adapter {directory}: no {ADAPTER_WEIGHTS} there{why}")
    try:
        raw: Any = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: must hold a JSON object")

    def refuse(what: str) -> ValueError:
        return ValueError(f"{config_path}: {what} is not supported")

    if raw.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {raw.get('peft_type')!r} (only LORA)")
    if raw.get("bias", "none") != "none":
        raise refuse(f"bias {raw.get('bias')!r} (a trained bias)")
    for key, what in _CHANGES_THE_FORWARD.items():
        if raw.get(key):
            raise refuse(f"{key} ({what})")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if type(rank) is not int or rank < 1:
        raise ValueError(f"{config_path}: r must be a positive int, got {rank!r}")
    if rank > max_rank:
        raise ValueError(
            f"{config_path}: rank {rank} is above --max-lora-rank {max_rank}: raise it"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)))


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """An adapter checked against the model it adapts, before any tensor is read."""

    config: AdapterConfig
    weights: Path
    # (layer, Hugging Face module name) -> the names of its A and B tensors
    pairs: dict[tuple[int, str], tuple[str, str]]
    # sha256 of the config and the weights: the scheduler and every executor must hold
    # the same adapter under a name, not merely files of that name.
    fingerprint: str


def check_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> AdapterFiles:
    """The adapter in directory ``path``, its config and its tensors' names and shapes
    checked against ``model`` (the file's header only); ValueError names the file and what
    does not fit."""
    if model.latent_attention is not None or model.linear_layers:
        kind = "linear attention" if model.linear_layers else "DeepSeek's latent attention"
        raise ValueError(
            f"{path}: Weir does not serve LoRA adapters of a model with {kind}: "
            "serve the model without them"
        )
    config = read_adapter_config(path, max_rank)
    weights = Path(path) / ADAPTER_WEIGHTS
    try:
        opened = safe_open(str(weights), framework="numpy")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{weights}: not a readable safetensors file: {exc}") from None
    found: dict[tuple[int, str], dict[str, str]] = {}
    with opened as f:
        for key in f.keys():
            if model.multimodal and _OTHER_TOWERS.match(key):
                continue  # Weir serves the language model only: text prompts never reach them
            m = _TENSOR.fullmatch(key)
            if m is None:
                raise ValueError(
                    f"{weights}: tensor {key!r} is not a LoRA A or B matrix of a q/k/v/o/gate/up/"
                    "down projection, the only modules Weir adapts"
                )
            layer, module, matrix = int(m.group(1)), m.group(2), m.group(3)
            if layer >= model.num_layers:
                raise ValueError(
                    f"{weights}: tensor {key!r} is past the model's {model.num_layers} layers: "
                    "the adapter was trained for another model"
                )
            if model.interleaved_rope and module in ("self_attn.q_proj", "self_attn.k_proj"):
                raise ValueError(
                    f"{weights}: tensor {key!r} adapts a query or key projection of a model "
                    "whose heads rotate in adjacent pairs, which Weir reorders as it loads: "
                    "train the adapter on the other projections"
                )
            if module.startswith("mlp.") and model.is_moe_layer(layer):
                raise ValueError(
                    f"{weights}: tensor {key!r} adapts the MLP of layer {layer}, a mixture of "
                    "experts, which Weir does not adapt: train the adapter on the attention "
                    "projections only"
                )
            if module.startswith("mlp.") and not model.gated_mlp:
                raise ValueError(
                    f"{weights}: tensor {key!r} adapts the MLP of a model whose MLP is not "
                    "gated (Arcee's), which Weir does not adapt: train the adapter on the "
                    "attention projections only"
                )
            layer_cfg = model.for_layer(layer)
            if (module == "self_attn.v_proj" and layer_cfg.values_from_keys) or (
                module in ("self_attn.k_proj", "self_attn.v_proj")
                and model.kv_source(layer) != layer
            ):
                raise ValueError(
                    f"{weights}: tensor {key!r} adapts a projection layer {layer} does not have "
                    "(Gemma 4's values are its full-attention layers' keys; its KV-sharing "
                    "layers project queries only): the adapter was trained for another model"
                )
            rows, columns = layer_cfg.layer_tensor_shape(module)
            shape = (config.rank, columns) if matrix == "A" else (rows, config.rank)
            if tuple(f.get_slice(key).get_shape()) != shape:
                raise ValueError(
                    f"{weights}: {key} has shape {tuple(f.get_slice(key).get_shape())}, not "
                    f"{shape}: the adapter was trained for another model, or its config's r is "
                    "wrong"
                )
            found.setdefault((layer, module), {})[matrix] = key
    pairs = {}
    for (layer, module), keys in sorted(found.items()):
        if len(keys) != 2:
            raise ValueError(f"{weights}: {module} of layer {layer} has lora_A or lora_B only")
        pairs[layer, module] = (keys["A"], keys["B"])
    if not pairs:
        raise ValueError(f"{weights}: holds no LoRA matrices")
    return AdapterFiles(config, weights, pairs, _fingerprint(Path(path)))


def _fingerprint(directory: Path) -> str:
    digest = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        with open(directory / name, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()
