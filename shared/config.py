"""Every engine option and default, in one place.

``SchedulerConfig`` and ``CacheConfig`` are what the scheduling core runs with;
every field is validated on construction, and an invalid value raises
``ValueError`` whose message starts with the field name, so a CLI or config file
error points at the exact knob. ``EngineArgs`` is every option a user sets
(``weir serve`` flags, ``LLM(...)`` keywords, the roles' command lines): its
defaults for scheduling knobs are read from the two configs, and the CLI flags
are generated from its fields.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields, replace
from decimal import Decimal
from typing import Any

from weir.shared.checkpoint_quantization import CHECKPOINT_FLAGS
from weir.shared.config_fields import json_object
from weir.shared.gpu_info import GpuInfo
from weir.shared.hub_cache import local_path
from weir.shared.kv_events_config import KVEventsConfig
from weir.shared.lora import LoraModule, parse_lora_modules
from weir.shared.pooling import RUNNERS
from weir.shared.protocol.client import MAX_IMAGES
from weir.shared.sampling import DEFAULT_MAX_LOGPROBS

SCHEDULING_POLICIES = ("fcfs", "priority")
# auto: the checkpoint's weights; dummy: random weights of the checkpoint's shape (vLLM's
# name), for benchmarks on machines the weights cannot reach.
LOAD_FORMATS = ("auto", "dummy")
# vLLM's load formats that name what auto does: safetensors, the only weights Weir reads; gguf,
# a .gguf file given as the model (which Weir tells by its name).
LOAD_FORMAT_ALIASES = ("safetensors", "gguf")
# vLLM's other load formats: why each is refused.
_READS_ITSELF = (
    "Weir reads a model's safetensors files from its local directory itself (--load-format "
    "auto), with no {} loader"
)
_VLLM_LOAD_FORMATS = {
    **dict.fromkeys(
        ("pt", "npcache"),
        "Weir reads safetensors weights only ({}: a .bin checkpoint is a pickle, which Weir "
        "never loads)",
    ),
    "bitsandbytes": "Weir has no bitsandbytes kernels and reads no such checkpoint",
    "mistral": "Weir reads a model's Hugging Face files (config.json, *.safetensors), not "
    "Mistral's consolidated ones (params.json)",
    **dict.fromkeys(
        (
            "tensorizer",
            "sharded_state",
            "runai_streamer",
            "runai_streamer_sharded",
            "fastsafetensors",
            "instanttensor",
        ),
        _READS_ITSELF,
    ),
}
# ngram: drafts copied from the prompt and output (the scheduler proposes them); draft_model:
# drafts of a smaller model of the same vocabulary (each executor runs it after the target);
# eagle: an EAGLE-1 head's, which reads the target's hidden states (executor too); eagle3:
# an EAGLE-3 head's, which reads three of its layers' inputs.
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# The methods whose drafts the executor proposes, with speculative_model.
MODEL_SPECULATIVE_METHODS = ("draft_model", "eagle", "eagle3")
# The methods whose draft is a head over the served model's hidden states.
EAGLE_METHODS = ("eagle", "eagle3")
# Weights kept quantized by the executor (CPU only; see services/executor/quantization.py).
QUANTIZATION_METHODS = ("int8",)
# vLLM's --quantization methods of checkpoints Weir does not read: why each is refused (the
# names of those it reads, CHECKPOINT_FLAGS, are taken where the checkpoint is one).
_VLLM_QUANTIZATION = dict.fromkeys(
    ("gguf", "marlin"),
    "Weir has no {} matmul kernels and reads no such checkpoint (fp8, compressed-tensors, "
    "GPTQ, AWQ, bitsandbytes and ModelOpt checkpoints are read by their config.json; int8 is "
    "Weir's own, on the CPU)",
)
# The executor's attention implementations (services/executor/attention.py builds them).
ATTENTION_BACKENDS = ("triton", "native", "torch", "reference")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other names of the dtypes (--dtype half on GPUs without bfloat16).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# The KV cache's dtype (vLLM's names): auto, the model's; fp8 (= fp8_e4m3) and fp8_e5m2, one
# byte a value, widened back as attention reads it.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def resolve_max_model_len(requested: int | None, context_len: int) -> int:
    """The longest prompt + output served: ``requested``, or the model's context length
    (``ModelConfig.context_len``), which it may not exceed (vLLM refuses it too)."""
    if requested is not None and requested > context_len:
        raise ValueError(
            f"max_model_len {requested} is longer than this model's context of {context_len} "
            "tokens (max_position_embeddings in its config.json, times a linear or yarn "
            "rope_scaling's factor): it was never trained on later positions; lower "
            "--max-model-len or leave it out"
        )
    return context_len if requested is None else requested


def _check_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass; True as a block count is always a mistake.
    if type(value) is not int:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(slots=True)
class SchedulerConfig:
    """Knobs of the token-budget scheduler (see docs/architecture.md).

    ``long_prefill_token_threshold`` caps one request's chunk per step (0 = no cap).
    ``watermark`` is the fraction of all KV blocks kept free when admitting a new
    request while others run. ``policy="priority"`` orders the waiting queue by
    ``(priority, arrival_time)`` (lower value first) and preempts the running request
    with the largest such key; ``"fcfs"`` orders by arrival and preempts the most
    recently admitted. ``async_scheduling`` plans step N+1 while step N runs: each
    request that step N samples for counts one placeholder token (see the scheduler).
    ``num_lookahead_tokens``: slots a request gets past the tokens it computes, where
    blocks are free, for a draft model's proposals (which the executor writes there).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    watermark: float = 0.01
    policy: str = "fcfs"
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    async_scheduling: bool = False
    # Distinct LoRA adapters among running requests (0: the server serves none).
    max_loras: int = 0

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_loras", self.max_loras, 0)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        _check_int("num_lookahead_tokens", self.num_lookahead_tokens, 0)
        if type(self.async_scheduling) is not bool:
            raise ValueError(
                f"async_scheduling must be a bool, got {type(self.async_scheduling).__name__}"
            )
        if self.async_scheduling and self.num_speculative_tokens:
            raise ValueError("async_scheduling cannot verify draft tokens: turn one of them off")
        if type(self.enable_chunked_prefill) is not bool:
            raise ValueError(
                "enable_chunked_prefill must be a bool, "
                f"got {type(self.enable_chunked_prefill).__name__}"
            )
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)):
            raise ValueError(f"watermark must be a float, got {type(self.watermark).__name__}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        self.watermark = float(self.watermark)
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not self.enable_chunked_prefill:
            # Without chunking a whole prompt (or a preempted request's prompt plus
            # outputs) must fit one step, or it would wait forever.
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "max_num_batched_tokens must be >= max_model_len when chunked prefill is "
                    f"disabled, got {self.max_num_batched_tokens} < {self.max_model_len}: a "
                    "step holds a whole prompt then; give --max-num-batched-tokens "
                    f"{self.max_model_len} (or more), or a smaller --max-model-len"
                )
            if self.long_prefill_token_threshold:
                raise ValueError(
                    "long_prefill_token_threshold must be 0 when chunked "
                    "prefill is disabled (it would chunk the prefill)"
                )


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry. ``num_blocks`` has no sensible default (the executor
    sizes it from free memory) and must be given."""

    block_size: int = 16
    num_blocks: int = None  # type: ignore[assignment]  # required; None only to say so
    enable_prefix_caching: bool = True
    # A LongRoPE model's (`RopeConfig.long_prompt_threshold`): prompts longer than this
    # share cached blocks only among themselves.
    long_prompt_threshold: int | None = None

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.long_prompt_threshold is not None:
            _check_int("long_prompt_threshold", self.long_prompt_threshold, 1)
        if self.num_blocks is None:
            raise ValueError("num_blocks is required")
        _check_int("num_blocks", self.num_blocks, 1)
        if type(self.enable_prefix_caching) is not bool:
            raise ValueError(
                "enable_prefix_caching must be a bool, "
                f"got {type(self.enable_prefix_caching).__name__}"
            )


# The most KV blocks an executor offers (more memory is left unused): the scheduler keeps
# ~200 bytes per block, so this caps its pool near 1 GB (67M tokens at block size 16).
MAX_NUM_KV_BLOCKS = 1 << 22
# The largest mixed step a CUDA graph is captured for: larger steps' arithmetic, not their
# kernel launches, sets their time (cuda_graphs.MIXED_TOKEN_SIZES ends here).
MAX_MIXED_GRAPH_TOKENS = 8192


_STEP_LIMITS = ("max_num_batched_tokens", "max_num_seqs")


def default_step_limits(device: str | None, gpu: GpuInfo | None, offline: bool) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) unless given: vLLM's defaults on CUDA
    (EngineArgs.get_batch_defaults), where a GPU of 70 GiB or more that is not an A100 (an
    H100, H200) takes larger steps, and an offline engine (``LLM``, the benchmarks) larger
    than a server; on a CPU (no GPU found, device unset or cpu), the SchedulerConfig defaults,
    measured for it (docs/benchmarks.md). ``gpu``: gpu_info.probe_gpu(device)."""
    if gpu is None and (device is None or device.startswith("cpu")):
        return _default_of(SchedulerConfig, "max_num_batched_tokens"), _default_of(
            SchedulerConfig, "max_num_seqs"
        )
    if gpu is not None and gpu.total_memory >= 70 * 2**30 and "a100" not in gpu.name.lower():
        return (16384 if offline else 8192), 1024
    return (8192 if offline else 2048), 256


# ------------------------------------------------------------------ ports

DEFAULT_PORT = 8100  # clients
DEFAULT_METRICS_PORT = 8101  # the scheduler's /metrics
DEFAULT_EXECUTOR_PORT = 8102  # executors connect here when run apart
DEFAULT_EXECUTOR_METRICS_PORT = 8103  # rank 0's /metrics; rank r uses + r
DEFAULT_HTTP_PORT = 8000  # the gateway's OpenAI-compatible API
DEFAULT_ADDRESS = f"tcp://127.0.0.1:{DEFAULT_PORT}"
# Hosts only this machine reaches: a socket bound to one needs no keys.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def tcp_address(host: str, port: int | str) -> str:
    """ZeroMQ's ``tcp://HOST:PORT``, an IPv6 host in brackets (its sockets set zmq.IPV6)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# The largest client message the scheduler takes, and HTTP body the gateway parses: what
# fits any model's context is far smaller.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# The least --max-message-size: the SDK's own messages must fit, or the scheduler drops the
# connection (a health check did not fit 1 byte: every request was "no engine replica is
# ready"). The largest is a health check of its quiet streams, 4096 request ids of up to
# 256 characters (protocol.client's MAX_HEALTH_STREAM_IDS, MAX_REQUEST_ID_LEN): ~1.04 MB.
MIN_MAX_MESSAGE_BYTES = 2 << 20
# The most --max-num-seqs: each slot maps a row of max_model_len token ids, so 10^8 slots
# failed to allocate (ENOMEM) as the executor started; 16x vLLM's largest default (1024).
MAX_NUM_SEQS = 1 << 14
# ZeroMQ's limit on an ipc:// path (a socket address's sun_path, less its NUL).
_MAX_IPC_PATH_BYTES = 107


def check_connect_address(address: str) -> None:
    """ValueError unless a socket can connect to ``address``: tcp://HOST:PORT (PORT 1-65535)
    or ipc://PATH. ZeroMQ takes tcp://HOST:99999 and then never connects."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    why = None
    if not sep or scheme not in ("tcp", "ipc"):
        why = "no tcp:// or ipc:// in front"
    elif scheme == "ipc" and not rest:
        why = "no path"
    elif scheme == "ipc" and len(rest.encode()) > _MAX_IPC_PATH_BYTES:
        why = f"the path is longer than {_MAX_IPC_PATH_BYTES} bytes"
    elif scheme == "tcp" and not colon:
        why = "no :PORT"
    elif scheme == "tcp" and host in ("", "*", "[]"):
        why = "no host"
    elif scheme == "tcp" and not (port.isdigit() and 1 <= int(port) <= 65535):
        why = f"port {port!r} is not in 1-65535"
    if why is not None:
        raise ValueError(
            f"cannot connect to {address!r}: {why} (an address is tcp://HOST:PORT or ipc://PATH)"
        )


def make_profiler_dir(directory: str) -> None:
    """Create ``directory`` if missing (vLLM's profiler does), or ValueError naming
    profiler_dir: a file in its place lost the trace at /stop_profile."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"profiler_dir {directory!r} is not a directory and cannot be made one "
            f"({exc.strerror}): name a directory, which is created if missing"
        ) from None


# ------------------------------------------------------------------ engine arguments

SCHEDULER = "scheduler"
EXECUTOR = "executor"
_BOTH = frozenset({SCHEDULER, EXECUTOR})


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GB)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    scale = {
        "": 1,
        "K": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "KI": 2**10,
        "MI": 2**20,
        "GI": 2**30,
        "TI": 2**40,
    }[unit]
    return int(number * scale)


def human_readable_int(text: str) -> int:
    """vLLM's integers with a suffix: k, m, g, t powers of 1000 ('25.6k' = 25600), K, M, G,
    T powers of 1024 ('32K' = 32768, whole numbers only); else a plain integer."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgtKMGT]?)\s*", text)
    if match is None or ("." in match.group(1) and not match.group(2).islower()):
        raise argparse.ArgumentTypeError(
            f"not a whole number: {text!r} (e.g. 4096; 32k = 32000, 32K = 32768)"
        )
    number, suffix = match.groups()
    if not suffix:
        return int(number)
    base = 1000 if suffix.islower() else 1024
    # Decimal: a float made 1.001k 1000.
    return int(Decimal(number) * base ** ("kmgt".index(suffix.lower()) + 1))


def _refusing(reasons: dict[str, str]) -> Callable[[str], str]:
    """The type of a flag whose values among ``reasons`` (vLLM's, which Weir does not have)
    are refused, saying why (argparse's choices would list only Weir's own)."""

    def check(text: str) -> str:
        if text in reasons:
            raise argparse.ArgumentTypeError(f"{text!r} is refused: " + reasons[text].format(text))
        return text

    return check


def _default_of(cls: type, name: str) -> Any:
    return next(f.default for f in fields(cls) if f.name == name)


def _arg(default: Any, roles: frozenset[str] | str, help: str, **argparse_kwargs: Any) -> Any:
    """A field of ``EngineArgs``: its default, the roles that take it, and its flag's help."""
    roles = frozenset({roles}) if isinstance(roles, str) else roles
    return field(
        default=default, metadata={"roles": roles, "help": help, "argparse": argparse_kwargs}
    )


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Every engine option. ``weir serve`` and ``LLM`` hand each role the options it takes
    (``to_argv``); the roles parse them back with the flags ``add_cli_args`` made."""

    model: str | None = _arg(
        None, _BOTH, "HF model dir or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    served_model_name: tuple[str, ...] = _arg(
        (),
        _BOTH,
        "the names the API answers to (vLLM's: the first is the metrics' model_name and what "
        "a request naming none reports; default: the model directory's name)",
        nargs="+",
    )
    tokenizer: str | None = _arg(
        None,
        _BOTH,  # the executor bans the tokenizer's end token before min_tokens
        "a directory holding the Hugging Face tokenizer to serve the model with, in place of "
        "its own (vLLM's; a .gguf model with its original tokenizer, or a chat template and "
        "special tokens of another): its tokenizer.json, its chat template (chat_template.jinja, "
        "else tokenizer_config.json's) and bos/eos tokens; the sampling defaults "
        "and the model's own end tokens stay the model's (generation_config.json)",
        metavar="DIR",
    )
    chat_template: str | None = _arg(
        None,
        SCHEDULER,
        "the chat template (a Jinja file, or its text) that renders chats, in place of the model's",
    )
    generation_config: str = _arg(
        "auto",
        SCHEDULER,
        "auto: the sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) of the model's generation_config.json apply to HTTP requests and "
        "LLM calls that leave them out, as in vLLM; vllm: none; or a directory holding a "
        "generation_config.json",
    )
    override_generation_config: str | None = _arg(
        None,
        SCHEDULER,
        'sampling defaults as JSON in generation_config.json\'s keys, e.g. {"temperature": '
        "0.5}: over --generation-config's (with vllm, the only ones)",
    )
    hf_overrides: str | None = _arg(  # LLM(hf_overrides={...}) gives a dict, made JSON here
        None,
        _BOTH,
        'config.json keys replaced, as JSON, e.g. {"max_position_embeddings": 65536, '
        '"rope_scaling": {"rope_type": "yarn", "factor": 2.0, '
        '"original_max_position_embeddings": 32768}} (vLLM\'s; top-level keys, each whole)',
    )
    load_format: str = _arg(
        "auto",
        _BOTH,
        "auto: the model's weights; dummy: random weights of its shape (config.json and a "
        "tokenizer suffice); vLLM's safetensors, and gguf for a .gguf model, are auto; its "
        "other formats are refused",
        type=_refusing(_VLLM_LOAD_FORMATS),
        choices=(*LOAD_FORMATS, *LOAD_FORMAT_ALIASES),
    )
    runner: str = _arg(
        "auto",
        _BOTH,
        "generate: text generation; pooling: embeddings (/v1/embeddings), no generation; "
        "auto: pooling for an embedding model (sentence-transformers files, or a *Model "
        "architecture), else generate",
        choices=RUNNERS,
    )
    pooler_config: str | None = _arg(
        None,
        SCHEDULER,
        'how --runner pooling pools, as JSON: {"pooling_type": "LAST"|"MEAN"|"CLS", '
        '"normalize": true|false} (default: the model\'s sentence-transformers files, else '
        "LAST, normalized)",
    )
    block_size: int = _arg(
        _default_of(CacheConfig, "block_size"), _BOTH, "KV cache block size in tokens", type=int
    )
    max_num_batched_tokens: int | None = _arg(
        None,
        _BOTH,
        "token budget of one step (default: 2048; on CUDA vLLM's: 8192 for `weir serve` and "
        "16384 for LLM on a GPU of 70 GiB or more but an A100, else 2048 and 8192)",
        type=int,
    )
    max_num_seqs: int | None = _arg(
        None,
        _BOTH,
        f"most requests in one step, at most {MAX_NUM_SEQS} (default: 256; 1024 on CUDA where "
        "the step budget is vLLM's larger one)",
        type=int,
    )
    max_model_len: int | None = _arg(
        None,
        _BOTH,
        "longest prompt + output, e.g. 32768, 32k (32000) or 32K (32768) (default: the model's "
        "context length)",
        type=human_readable_int,
    )
    long_prefill_token_threshold: int = _arg(
        _default_of(SchedulerConfig, "long_prefill_token_threshold"),
        SCHEDULER,
        "cap on one request's prefill chunk per step (0 = none)",
        type=int,
    )
    enable_chunked_prefill: bool = _arg(
        _default_of(SchedulerConfig, "enable_chunked_prefill"),
        SCHEDULER,
        "split long prompts across steps",
    )
    enable_prefix_caching: bool = _arg(
        _default_of(CacheConfig, "enable_prefix_caching"),
        SCHEDULER,
        "reuse KV blocks of identical prompt prefixes",
    )
    otlp_traces_endpoint: str | None = _arg(
        None,
        SCHEDULER,
        "export a span per request (vLLM's llm_request) to this OpenTelemetry collector, e.g. "
        "http://collector:4317 (OTLP/gRPC; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf "
        "and http://collector:4318/v1/traces for OTLP/HTTP); an HTTP request's traceparent "
        "makes it a child of the caller's span",
    )
    kv_events_config: str | dict[str, Any] | None = _arg(
        None,
        SCHEDULER,
        "publish the prefix cache's changes for KV-cache-aware routers (llm-d, Dynamo), "
        'vLLM\'s JSON: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "...", "buffer_steps": 10000, "hwm": '
        "100000}; replica i of --data-parallel-size adds i to the ports",
    )
    watermark: float = _arg(
        _default_of(SchedulerConfig, "watermark"),
        SCHEDULER,
        "fraction of KV blocks kept free when admitting requests",
        type=float,
    )
    policy: str = _arg(
        _default_of(SchedulerConfig, "policy"),
        SCHEDULER,
        "waiting-queue order (--scheduling-policy as in vLLM)",
        choices=SCHEDULING_POLICIES,
    )
    limit_mm_per_prompt: str | None = _arg(  # LLM(limit_mm_per_prompt={...}): JSON here
        None,
        SCHEDULER,
        'the most images one prompt may send, as JSON, e.g. {"image": 2} (vLLM\'s; at most '
        f"and by default {MAX_IMAGES}; 0 refuses images)",
    )
    max_logprobs: int = _arg(
        DEFAULT_MAX_LOGPROBS,
        SCHEDULER,
        "the most logprobs (a completion's logprobs, a chat's top_logprobs) and "
        "prompt_logprobs a request may ask for, more is refused (vLLM's; -1: the vocabulary's "
        "size)",
        type=int,
    )
    enable_lora: bool = _arg(
        False, _BOTH, "serve LoRA adapters (those of --lora-modules; implied by it)"
    )
    lora_modules: tuple[str, ...] = _arg(
        (),
        _BOTH,
        "LoRA adapters as name=path (PEFT directories), requested by their name as the model",
        nargs="+",
    )
    max_loras: int = _arg(
        1, SCHEDULER, "most distinct LoRA adapters among the requests running at once", type=int
    )
    max_lora_rank: int = _arg(16, _BOTH, "highest LoRA rank an adapter may have", type=int)
    allow_runtime_lora_updating: bool = _arg(
        False,
        SCHEDULER,
        "let clients load and unload LoRA adapters while serving (/v1/load_lora_adapter, "
        "/v1/unload_lora_adapter; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    speculative_method: str | None = _arg(
        None,
        _BOTH,  # the executor captures CUDA graphs of speculative decodes' query length
        "draft proposer: ngram (prompt lookup), draft_model (a smaller model of the same "
        "vocabulary, --speculative-model), eagle or eagle3 (an EAGLE-1 or EAGLE-3 head of a "
        "Llama-family model, --speculative-model); drafts are verified in the same forward pass",
        choices=SPECULATIVE_METHODS,
    )
    speculative_model: str | None = _arg(
        None,
        _BOTH,
        "the draft model of draft_model speculative decoding (implies it): a Hugging Face "
        "directory or .gguf file whose tokenizer is the served model's; with "
        "--speculative-method eagle or eagle3, the EAGLE head's directory",
    )
    speculative_model_quantization: str | None = _arg(
        None,
        EXECUTOR,
        "keep the draft model's weights quantized: int8 (CPU only, as --quantization)",
        choices=QUANTIZATION_METHODS,
    )
    num_speculative_tokens: int = _arg(
        _default_of(SchedulerConfig, "num_speculative_tokens"),
        _BOTH,
        "draft tokens proposed per request and step (with --speculative-method)",
        type=int,
    )
    async_scheduling: bool = _arg(
        True,
        SCHEDULER,
        "plan step N+1 while step N runs (lockstep with --speculative-method, whose drafts "
        "need step N's tokens)",
    )
    ngram_min: int = _arg(2, SCHEDULER, "shortest n-gram the ngram proposer matches", type=int)
    ngram_max: int = _arg(4, SCHEDULER, "longest n-gram the ngram proposer matches", type=int)
    speculative_config: str | dict[str, Any] | None = _arg(
        None,
        _BOTH,
        'vLLM\'s form of the options above, JSON: {"method": "ngram", '
        '"num_speculative_tokens": K, "prompt_lookup_min": N, "prompt_lookup_max": M} or '
        '{"model": DIR, "num_speculative_tokens": K, "quantization": "int8"} or '
        '{"method": "eagle", "model": DIR, "num_speculative_tokens": K} (or "eagle3")',
    )
    max_message_size: int = _arg(
        DEFAULT_MAX_MESSAGE_BYTES,
        SCHEDULER,
        "largest client message in bytes (ZMQ_MAXMSGSIZE), e.g. 64MiB, at least 2MiB; a client "
        "that sends a larger one is disconnected (the SDK refuses one itself)",
        type=parse_size,
    )
    max_prompt_chars: int | None = _arg(
        None,
        SCHEDULER,
        "longest prompt text in characters, refused before tokenizing, and the most characters "
        "of a request's stop strings in all (default: max_model_len x the longest token, "
        "which no longer text can fit)",
        type=int,
    )
    executor_timeout: float = _arg(
        3.0,
        SCHEDULER,
        "seconds without an executor heartbeat before it counts as lost (its requests wait "
        "for a new one)",
        type=float,
    )
    recovery_timeout: float = _arg(
        120.0,
        SCHEDULER,
        "seconds the requests of a lost executor wait for a new one before they fail",
        type=float,
    )
    drain_timeout: float = _arg(
        30.0,
        SCHEDULER,
        "on SIGTERM: seconds to finish in-flight requests (new ones are refused) before stopping",
        type=float,
    )
    tensor_parallel_size: int = _arg(
        1,
        _BOTH,
        "executor ranks that each hold 1/N of the model and run every step together "
        "(torch.distributed: NCCL on GPUs, gloo on the CPU); -tp N as in vLLM",
        type=int,
    )
    device: str | None = _arg(None, EXECUTOR, "cpu or cuda (default: cuda if available)")
    dtype: str | None = _arg(
        None,
        EXECUTOR,
        "weight/activation dtype, half and float as in vLLM (float16, float32) (default: per "
        "device, float32 on a CPU, bfloat16 on CUDA)",
        choices=(*DTYPES, *DTYPE_ALIASES),
    )
    quantization: str | None = _arg(
        None,
        EXECUTOR,
        "keep the weights quantized (CPU only, float32 activations): int8 = weight-only int8 "
        "with a scale per output channel, requantized from the loaded weights (default: none); "
        "vLLM's name of a quantized checkpoint's method (gptq, awq, fp8, ...), as vLLM takes "
        "it, only says what the checkpoint is (read dequantized, by its config.json)",
        type=_refusing(_VLLM_QUANTIZATION),
        choices=(*QUANTIZATION_METHODS, *CHECKPOINT_FLAGS),
    )
    # In bytes; a size such as "64MiB" (``LLM(kv_cache_memory=...)``) is parsed on construction.
    kv_cache_memory: int | None = _arg(
        None, EXECUTOR, "KV cache size on CPU, e.g. 256MiB (default: 1GiB)", type=parse_size
    )
    gpu_memory_utilization: float = _arg(
        0.9, EXECUTOR, "fraction of GPU memory for weights + KV cache", type=float
    )
    kv_cache_dtype: str = _arg(
        "auto",
        EXECUTOR,
        "KV cache dtype: auto (the model's) or fp8 (fp8_e4m3; fp8_e5m2): one byte a value, "
        "so the cache holds 2x the tokens of bfloat16 and 4x float32's; values are clamped "
        "and rounded as written (divided first by a checkpoint's calibrated k_scale and "
        "v_scale where it has them), so outputs move slightly",
        choices=KV_CACHE_DTYPES,
    )
    attention_backend: str | None = _arg(
        None,
        EXECUTOR,
        "attention implementation (default: triton on CUDA; on a CPU native, the C kernels "
        "compiled at start, else torch)",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = _arg(
        False,
        EXECUTOR,
        "run every step eagerly (on CUDA, steps otherwise replay CUDA graphs captured at start-up)",
    )
    max_mixed_graph_tokens: int = _arg(
        MAX_MIXED_GRAPH_TOKENS,
        EXECUTOR,
        "on CUDA, the largest mixed step (prefill chunks beside decodes) that replays a CUDA "
        f"graph: mixed shapes are captured up to this many tokens (at most "
        f"{MAX_MIXED_GRAPH_TOKENS}; the step budget caps it too), larger mixed steps run "
        "eagerly; 0: only decode steps replay graphs, which saves the mixed graphs' "
        "activation memory",
        type=int,
    )
    threads: int | None = _arg(
        None,
        EXECUTOR,
        "torch threads of each executor (default: the cores available to the process, from "
        "its CPU affinity and cgroup quota; `weir serve` splits them between its executors "
        "and keeps one for the scheduler from 4 cores up); OMP_NUM_THREADS does not count",
        type=int,
    )
    seed: int | None = _arg(None, EXECUTOR, "sampler seed of requests without one", type=int)
    profiler_dir: str | None = _arg(
        None,
        _BOTH,
        "directory where each executor writes a torch.profiler trace (Chrome/Perfetto JSON) "
        "and a table of its operators and kernels for the steps between /start_profile and "
        "/stop_profile (vLLM's VLLM_TORCH_PROFILER_DIR); unset: profiling is refused",
    )
    log_level: str = _arg(
        "WARNING", _BOTH, "logging level of the processes", type=str.upper, choices=LOG_LEVELS
    )
    keys_dir: str | None = _arg(
        None,
        _BOTH,
        "CurveZMQ keys made by `weir keys`: encrypt and authenticate the client and executor "
        "sockets (default: $WEIR_KEYS_DIR, else plain sockets)",
    )

    def __post_init__(self) -> None:
        # What can be told before any process starts; the executor checks the device it got.
        if self.speculative_config is not None:
            self._expand_speculative_config()
        for name in ("tokenizer", "speculative_model"):  # a Hub repo id: its cached snapshot
            if (value := getattr(self, name)) is not None:
                object.__setattr__(self, name, local_path(value))  # frozen
        self._check_draft_model()
        if self.tokenizer is not None:
            self._check_tokenizer(self.tokenizer)
        if self.hf_overrides is not None:
            overrides = json_object("hf_overrides", self.hf_overrides)
            # One text for every role's command line.
            object.__setattr__(self, "hf_overrides", json.dumps(overrides, sort_keys=True))
        if self.limit_mm_per_prompt is not None:
            limits = json_object("limit_mm_per_prompt", self.limit_mm_per_prompt)
            image = limits.get("image", MAX_IMAGES)
            if limits.keys() - {"image"} or type(image) is not int or not 0 <= image <= MAX_IMAGES:
                raise ValueError(
                    f'limit_mm_per_prompt must be {{"image": N}}, N from 0 to {MAX_IMAGES} '
                    f"(Weir reads images only), got {json.dumps(limits)[:200]}"
                )
            object.__setattr__(self, "limit_mm_per_prompt", json.dumps(limits))  # frozen
        if self.kv_events_config is not None:
            KVEventsConfig.parse(self.kv_events_config)  # refused before any process starts
            text = json.dumps(json_object("kv_events_config", self.kv_events_config))
            object.__setattr__(self, "kv_events_config", text)  # frozen
        if isinstance(self.kv_cache_memory, str):
            try:
                size = parse_size(self.kv_cache_memory)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"kv_cache_memory: {exc}") from None
            object.__setattr__(self, "kv_cache_memory", size)  # frozen
        if self.dtype in DTYPE_ALIASES:  # LLM(dtype="half") as the command line's
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        self._resolve_load_format()
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("ngram_min", self.ngram_min, 1)
        if self.ngram_max < self.ngram_min:
            raise ValueError(
                f"ngram_max (prompt_lookup_max) {self.ngram_max} is less than ngram_min "
                f"(prompt_lookup_min) {self.ngram_min}"
            )
        for name in ("lora_modules", "served_model_name"):  # LLM(lora_modules="a=/x"), a list
            value = getattr(self, name)
            if isinstance(value, (str, list)):
                object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        parse_lora_modules(self.lora_modules, self.served_model_name)
        _check_int("max_loras", self.max_loras, 1)
        _check_int("max_lora_rank", self.max_lora_rank, 1)
        _check_int("max_logprobs", self.max_logprobs, -1)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if any(not str(name).strip() for name in self.served_model_name):
            raise ValueError("served_model_name must not be empty")
        if len(set(self.served_model_name)) < len(self.served_model_name):
            raise ValueError(f"served_model_name {list(self.served_model_name)} repeats a name")
        if self.threads is not None:
            _check_int("threads", self.threads, 1)
        for name in _STEP_LIMITS:
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.max_num_seqs is not None and self.max_num_seqs > MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs must be <= {MAX_NUM_SEQS}, got {self.max_num_seqs}")
        _check_int("max_message_size", self.max_message_size, 0)
        if self.max_message_size < MIN_MAX_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_size must be at least {MIN_MAX_MESSAGE_BYTES >> 20}MiB, got "
                f"{self.max_message_size}: the client SDK's own messages (health checks) take "
                "up to ~1 MB"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63))
            if self.seed >= 2**63:  # a request's seed is bounded so too; the sampler takes 64 bits
                raise ValueError(f"seed must be < 2**63 (a 64-bit integer), got {self.seed}")
        _check_int("max_mixed_graph_tokens", self.max_mixed_graph_tokens, 0)
        if self.max_mixed_graph_tokens > MAX_MIXED_GRAPH_TOKENS:
            raise ValueError(
                f"max_mixed_graph_tokens must be <= {MAX_MIXED_GRAPH_TOKENS} (larger steps are "
                f"compute-bound: they run eagerly), got {self.max_mixed_graph_tokens}"
            )
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        for name in ("executor_timeout", "recovery_timeout"):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.device is not None and not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        for name, choices in (
            ("dtype", DTYPES),
            ("attention_backend", ATTENTION_BACKENDS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
        ):
            if getattr(self, name) not in (None, *choices):
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if str(self.log_level).upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.quantization is None or self.quantization in CHECKPOINT_FLAGS:
            return  # a checkpoint's method: the executor checks the model is quantized so
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS}, a quantized checkpoint's "
                f"method ({', '.join(CHECKPOINT_FLAGS)}) or None, got {self.quantization!r}"
            )
        if self.device is not None and not self.device.startswith("cpu"):
            raise ValueError(
                f"quantization {self.quantization!r} runs on the CPU only, got device "
                f"{self.device!r}: drop the quantization or use device cpu"
            )
        if self.dtype not in (None, "auto", "float32"):
            raise ValueError(
                f"quantization {self.quantization!r} keeps activations in float32, got dtype "
                f"{self.dtype!r}: use float32 or leave dtype unset"
            )

    def _expand_speculative_config(self) -> None:
        """vLLM's ``speculative_config`` (JSON text, or a dict from ``LLM``) set as the
        options it stands for, and then dropped: the roles get those options."""
        config = dict(json_object("speculative_config", self.speculative_config))
        if self.speculative_method is not None:
            raise ValueError("speculative_config and speculative_method: give one, not both")
        keys = {
            "method": "speculative_method",
            "num_speculative_tokens": "num_speculative_tokens",
            "prompt_lookup_min": "ngram_min",
            "prompt_lookup_max": "ngram_max",
            "model": "speculative_model",
            "quantization": "speculative_model_quantization",
        }
        unknown = sorted(set(config) - set(keys))
        if unknown:
            raise ValueError(f"speculative_config takes {sorted(keys)}; {unknown} not supported")
        if "model" in config:  # vLLM's too: a model names the method
            config.setdefault("method", "draft_model")
        if config.get("method") not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {SPECULATIVE_METHODS} (ngram: drafts "
                "from the prompt and output; draft_model: a smaller model's, named by "
                f'"model"; eagle, eagle3: an EAGLE-1 or EAGLE-3 head\'s, named by "model"), got '
                f"{config.get('method')!r}"
            )
        for key in ("model", "quantization"):
            if key in config and (type(config[key]) is not str or not config[key]):
                raise ValueError(f"speculative_config {key} must be a non-empty string")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            if key in config:  # the roles would refuse a number's text at their start
                _check_int(f"speculative_config {key}", config[key], 1)
        # vLLM's: one bound given is the other too.
        bounds = ("prompt_lookup_min", "prompt_lookup_max")
        for key, other in (bounds, bounds[::-1]):
            if key in config:
                config.setdefault(other, config[key])
        for key, value in config.items():
            name = keys[key]
            given = getattr(self, name)
            if given != _default_of(EngineArgs, name) and given != value:
                raise ValueError(
                    f"speculative_config {key} {value!r} and {name} {given!r}: give it in one place"
                )
            object.__setattr__(self, name, value)  # frozen
        object.__setattr__(self, "speculative_config", None)

    def _resolve_load_format(self) -> None:
        """vLLM's names of what auto does (LOAD_FORMAT_ALIASES) as auto: every role is then
        given one format."""
        if self.load_format == "gguf" and not str(self.model or "").endswith(".gguf"):
            raise ValueError(
                "load_format gguf reads a .gguf file: give one as the model (Weir reads it as "
                "such by its name, without --load-format)"
            )
        if self.load_format in LOAD_FORMAT_ALIASES:
            object.__setattr__(self, "load_format", "auto")  # frozen

    def _check_draft_model(self) -> None:
        """A draft model names the method (vLLM's rule); the method needs one, and no other
        method takes one."""
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            # The command line's choices say so; LLM(...) and a config file come here.
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        if self.speculative_model is not None and self.speculative_method is None:
            object.__setattr__(self, "speculative_method", "draft_model")  # frozen
        if self.speculative_method in MODEL_SPECULATIVE_METHODS:
            if self.speculative_model is None:
                raise ValueError(
                    f"speculative_method {self.speculative_method} needs speculative_model: the "
                    "draft model's directory or .gguf file (an EAGLE head's directory)"
                )
        elif self.speculative_model is not None:
            raise ValueError(
                "speculative_model is the draft of speculative_method draft_model, eagle or "
                f"eagle3, not of {self.speculative_method!r}: drop one of them"
            )
        if self.speculative_method in EAGLE_METHODS:
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    f"speculative_method {self.speculative_method} under tensor parallelism is "
                    "not supported yet: use tensor_parallel_size 1, or draft_model"
                )
            if self.speculative_model_quantization is not None:
                raise ValueError(
                    "speculative_model_quantization is for draft_model: an EAGLE head is not "
                    "quantized"
                )
        quantization = self.speculative_model_quantization
        if quantization is not None:
            if self.speculative_model is None:
                raise ValueError("speculative_model_quantization needs a speculative_model")
            if quantization not in QUANTIZATION_METHODS:
                raise ValueError(
                    f"speculative_model_quantization must be one of {QUANTIZATION_METHODS}, "
                    f"got {quantization!r}"
                )

    def _check_tokenizer(self, path: str) -> None:
        """``tokenizer`` (``path``) names a directory with a tokenizer.json; the model itself
        (vLLM's default) is no other tokenizer. Whether its ids fit the model's embeddings
        is told once the model is found (``tokenizer.served_tokenizer``)."""
        if self.model is not None and os.path.realpath(path) == os.path.realpath(self.model):
            object.__setattr__(self, "tokenizer", None)  # frozen
            return
        if not os.path.isdir(path):
            why = "not a directory" if os.path.exists(path) else "no such directory"
            raise ValueError(
                f"tokenizer {path!r}: {why}; give a directory holding a Hugging Face "
                "tokenizer (tokenizer.json, tokenizer_config.json)"
            )
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(
                f"tokenizer {path!r}: no tokenizer.json in it; Weir reads a fast tokenizer's "
                "tokenizer.json (transformers' save_pretrained writes one), not a slow "
                "tokenizer's files alone"
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, role: str) -> None:
        """Add the flags of ``role`` (``scheduler``, ``executor``, or ``serve`` = both)."""
        for f in _engine_fields(role):
            flag = "--" + f.name.replace("_", "-")
            kwargs = dict(f.metadata["argparse"])
            help_text = f.metadata["help"]
            if f.type == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
                help_text += f" (default: {'on' if f.default else 'off'})"
            elif f.default is not None and "default" not in help_text:
                help_text += f" (default: {f.default})"
            parser.add_argument(
                *_OTHER_SPELLINGS.get(f.name, ()),
                flag,
                dest=f.name,
                default=f.default,
                help=help_text,
                **kwargs,
            )

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine arguments among parsed flags (those a role lacks keep their default)."""
        values = vars(args)
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    def model_names(self, directory_name: str) -> tuple[str, ...]:
        """The names the model answers to: ``served_model_name``'s, else its directory's
        (the first names it in metrics and in replies to requests that name none)."""
        return self.served_model_name or (directory_name,)

    def to_argv(self, role: str) -> list[str]:
        """The flags that give ``role`` these arguments (None, every such option's default, is
        left out)."""
        argv: list[str] = []
        for f in _engine_fields(role):
            value = getattr(self, f.name)
            if value is None or value == ():
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, tuple):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value)]
        return argv

    def with_step_limits(self, gpu: GpuInfo | None, offline: bool = False) -> EngineArgs:
        """These arguments with the step limits not given set for the device the executors
        will run on (default_step_limits): what a launcher gives every process it starts."""
        tokens, seqs = self._step_limits(default_step_limits(self.device, gpu, offline))
        return replace(self, max_num_batched_tokens=tokens, max_num_seqs=seqs)

    @property
    def step_limits(self) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs); unset, a device's that no process knows
        (2048, 256): what a scheduler and its executors started apart (Kubernetes) both
        take, so they agree."""
        return self._step_limits(default_step_limits(None, None, offline=False))

    def _step_limits(self, defaults: tuple[int, int]) -> tuple[int, int]:
        tokens, seqs = self.max_num_batched_tokens, self.max_num_seqs
        return (defaults[0] if tokens is None else tokens, defaults[1] if seqs is None else seqs)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's knobs; ``max_model_len`` already resolved against the model."""
        max_num_batched_tokens, max_num_seqs = self.step_limits
        return SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill,
            watermark=self.watermark,
            policy=self.policy,
            num_speculative_tokens=self.num_speculative_tokens if self.speculative_method else 0,
            num_lookahead_tokens=(
                self.num_speculative_tokens
                if self.speculative_method in MODEL_SPECULATIVE_METHODS
                else 0
            ),
            async_scheduling=self.async_scheduling and not self.speculative_method,
            max_loras=self.max_loras if self.lora_enabled else 0,
        )

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules) or self.allow_runtime_lora_updating

    @property
    def loras(self) -> list[LoraModule]:
        """The adapters of ``lora_modules``, in their order."""
        return parse_lora_modules(self.lora_modules, self.served_model_name)

    @property
    def max_images_per_prompt(self) -> int:
        """What --limit-mm-per-prompt lets a prompt send of images."""
        limits = json.loads(self.limit_mm_per_prompt or "{}")
        return int(limits.get("image", MAX_IMAGES))

    @property
    def kv_events(self) -> KVEventsConfig:
        return KVEventsConfig.parse(self.kv_events_config or "{}")

    def cache_config(
        self, num_blocks: int, long_prompt_threshold: int | None, prefix_caching: bool = True
    ) -> CacheConfig:
        """``long_prompt_threshold``: the model's (`RopeConfig.long_prompt_threshold`);
        ``prefix_caching``: whether the model's KV alone is a prefix's state (not Qwen 3.5's)."""
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.enable_prefix_caching and prefix_caching,
            long_prompt_threshold=long_prompt_threshold,
        )


# vLLM's other spellings of the flags.
_OTHER_SPELLINGS = {"tensor_parallel_size": ("-tp",), "policy": ("--scheduling-policy",)}


def _engine_fields(role: str) -> list[Field[Any]]:
    return [f for f in fields(EngineArgs) if role == "serve" or role in f.metadata["roles"]]


ENGINE_DEFAULTS = EngineArgs()
