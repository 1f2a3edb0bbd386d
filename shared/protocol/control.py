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

The scheduler also tells its ranks when it starts to drain (``draining``) and when it
stops (``goodbye``): an executor sent SIGTERM while serving stops once its scheduler no
longer needs it (Kubernetes stops both pods of a node drain at once).

Every frame is ``[kind, payload]``: plans and results use ``step_codec``;
everything else is a msgpack map (``envelope.unpack_map``), decoded here into
typed records.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, TypeVar

from weir.shared.protocol.envelope import ProtocolError, pack_map, unpack_map

HELLO = b"hello"
WELCOME = b"welcome"
REJECT = b"reject"
PLAN = b"plan"
RESULT = b"result"
STEP_ERROR = b"step_error"
HEARTBEAT = b"heartbeat"
RESET = b"reset"
# Scheduler -> executors on the step socket: it drains (said every DRAINING_INTERVAL_S; an
# executor told to stop serves on until ``goodbye``, or until these stop), and it stops.
DRAINING = b"draining"
GOODBYE = b"goodbye"
DRAINING_INTERVAL_S = 1.0

HEARTBEAT_INTERVAL_S = 0.5


@dataclass(slots=True)
class ExecutorHello:
    """What an executor rank tells the scheduler once its model and KV cache are ready."""

    session: str  # random per executor process: tells a restarted executor from the old one
    rank: int
    pid: int
    model_name: str
    vocab_size: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    attention_backend: str
    metrics_address: str | None = None
    tensor_parallel_size: int = 1
    # The LoRA adapters it loaded: id -> the fingerprint of its files.
    lora_adapters: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Heartbeat:
    session: str
    rank: int


@dataclass(slots=True)
class Rejection:
    message: str


@dataclass(slots=True)
class StepFailure:
    step_id: int
    rank: int
    message: str


Record = ExecutorHello | Heartbeat | Rejection | StepFailure
R = TypeVar("R", ExecutorHello, Heartbeat, Rejection, StepFailure)


def pack(record: Record) -> bytes:
    return pack_map(asdict(record))


def _check_field(record: str, name: str, annotation: str, value: Any) -> None:
    ok = {
        "str": type(value) is str,
        "int": type(value) is int,
        "str | None": value is None or type(value) is str,
        "list[int]": type(value) is list and all(type(v) is int for v in value),
        "dict[str, str]": type(value) is dict
        and all(type(k) is str and type(v) is str for k, v in value.items()),
    }[annotation]
    if not ok:
        raise ProtocolError(f"{record}.{name}: expected {annotation}, got {type(value).__name__}")


def unpack(cls: type[R], payload: bytes) -> R:
    """Decode a control frame into ``cls``, checking every field's type."""
    data = unpack_map(payload, cls.__name__)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known), key=repr)  # keys of any msgpack type
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {unknown}")
    missing = sorted(name for name, f in known.items() if name not in data and f.default is MISSING)
    if missing:
        raise ProtocolError(f"{cls.__name__}: missing field(s) {missing}")
    for name, value in data.items():
        _check_field(cls.__name__, name, str(known[name].type), value)
    return cls(**data)
