"""Configuration records shared by the scheduler and executor processes.

Every field is validated on construction; an invalid value raises ``ValueError``
whose message starts with the field name, so a CLI or config file error points
at the exact knob.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority")


def _check_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass; True as a block count is always a mistake.
    if type(value) is not int:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _from_dict(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} must be given a dict, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known, key=str)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
    return cls(**data)


@dataclass(slots=True)
class SchedulerConfig:
    """Knobs of the token-budget scheduler (see docs/architecture.md).

    ``long_prefill_token_threshold`` caps one request's chunk per step (0 = no cap).
    ``watermark`` is the fraction of all KV blocks kept free when admitting a new
    request while others run. ``policy="priority"`` orders the waiting queue by
    ``(priority, arrival_time)`` (lower value first) and preempts the running request
    with the largest such key; ``"fcfs"`` orders by arrival and preempts the most
    recently admitted.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    watermark: float = 0.01
    policy: str = "fcfs"
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        if type(self.enable_chunked_prefill) is not bool:
            raise ValueError("enable_chunked_prefill must be a bool, "
                             f"got {type(self.enable_chunked_prefill).__name__}")
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
                    f"disabled, got {self.max_num_batched_tokens} < {self.max_model_len}")
            if self.long_prefill_token_threshold:
                raise ValueError("long_prefill_token_threshold must be 0 when chunked "
                                 "prefill is disabled (it would chunk the prefill)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SchedulerConfig:
        return _from_dict(cls, data)


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry. ``num_blocks`` has no sensible default (the executor
    sizes it from free memory) and must be given."""

    block_size: int = 16
    num_blocks: int = None  # type: ignore[assignment]  # required; None only to say so
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.num_blocks is None:
            raise ValueError("num_blocks is required")
        _check_int("num_blocks", self.num_blocks, 1)
        if type(self.enable_prefix_caching) is not bool:
            raise ValueError("enable_prefix_caching must be a bool, "
                             f"got {type(self.enable_prefix_caching).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheConfig:
        return _from_dict(cls, data)
