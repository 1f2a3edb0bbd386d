"""The scheduler <-> executor control channel: frame kinds, handshake, heartbeats.

Each executor rank opens two DEALER sockets to the scheduler's executor-facing
ROUTER:

* the **step socket** carries the handshake (``hello`` -> ``welcome`` or
  ``reject``), then step plans in and, from rank 0, step results out;
* the **heartbeat socket**, driven by a thread, sends ``heartbeat`` every
  ``HEARTBEAT_INTERVAL_S``, so a long forward pass never looks like a dead
  executor while a killed one is noticed within the scheduler's timeout. A
  scheduler that does not know the heartbeat's session (it restarted) answers
  ``reset`` and the executor exits, to be restarted clean.

Every frame is ``[kind, payload]``: plans and results use the encoding of
``weir.shared.protocol``; everything else is a msgpack map.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack

HELLO = b"hello"
WELCOME = b"welcome"
REJECT = b"reject"
PLAN = b"plan"
RESULT = b"result"
STEP_ERROR = b"step_error"
HEARTBEAT = b"heartbeat"
RESET = b"reset"

HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0


class LinkError(ValueError):
    """A control frame that does not parse."""


@dataclass(slots=True)
class ExecutorHello:
    """What an executor rank tells the scheduler once its model and KV cache are ready."""

    session: str  # random per executor process: tells a restarted executor from the old one
    rank: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    model_name: str
    vocab_size: int
    pid: int
    metrics_address: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # ModelRunner.handshake_info()


@dataclass(slots=True)
class StepFailure:
    step_id: int
    rank: int
    message: str


def pack(record: ExecutorHello | StepFailure | dict[str, Any]) -> bytes:
    data = record if isinstance(record, dict) else asdict(record)
    return msgpack.packb(data, use_bin_type=True)


def unpack_map(payload: bytes) -> dict[str, Any]:
    try:
        data = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise LinkError(f"control frame is not valid msgpack: {exc}") from None
    if not isinstance(data, dict):
        raise LinkError(f"control frame must be a map, got {type(data).__name__}")
    return data


def _record(cls: type, payload: bytes) -> Any:
    data = unpack_map(payload)
    names = {f.name for f in fields(cls)}
    try:
        record = cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as exc:
        raise LinkError(f"{cls.__name__}: {exc}") from None
    for f in fields(cls):
        value = getattr(record, f.name)
        expected = {"int": int, "str": str, "dict[str, Any]": dict}.get(str(f.type))
        if expected is not None and (type(value) is not expected):
            raise LinkError(f"{cls.__name__}.{f.name}: expected {expected.__name__}, "
                            f"got {type(value).__name__}")
    return record


def unpack_hello(payload: bytes) -> ExecutorHello:
    return _record(ExecutorHello, payload)


def unpack_step_failure(payload: bytes) -> StepFailure:
    return _record(StepFailure, payload)
