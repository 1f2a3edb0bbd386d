"""vLLM's ``--kv-events-config``: where the scheduler publishes its prefix cache's changes.

KV-cache-aware routers (llm-d's KV cache indexer, NVIDIA Dynamo's KV router) learn which
prompt prefixes each engine holds from these events, in vLLM's wire format
(``weir.services.engine.kv_event_publisher``). The options are vLLM's, with its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from weir.shared.config_fields import json_object

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # vLLM's default: zmq where events are enabled, else null (nothing is published).
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"  # bound where it holds a wildcard, else connected to
    replay_endpoint: str | None = None  # a ROUTER socket that sends buffered batches again
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    # vLLM's bound on batches queued for its publisher thread; Weir sends each batch as the
    # step's outputs are sent, from the scheduler's loop, so none queue.
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> KVEventsConfig:
        """From the flag's JSON text (or ``LLM``'s dict); ValueError says what is wrong."""
        given = json_object("kv_events_config", value)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config takes {sorted(known)}; {unknown} not supported")
        for name, wanted in (
            ("enable_kv_cache_events", bool),
            ("endpoint", str),
            ("topic", str),
        ):
            if name in given and type(given[name]) is not wanted:
                raise ValueError(
                    f"kv_events_config {name} must be a {wanted.__name__}, got {given[name]!r}"
                )
        for name in ("publisher", "replay_endpoint"):
            if given.get(name) is not None and type(given[name]) is not str:
                raise ValueError(f"kv_events_config {name} must be a string, got {given[name]!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if name in given and (type(given[name]) is not int or given[name] < 1):
                raise ValueError(
                    f"kv_events_config {name} must be an integer >= 1, got {given[name]!r}"
                )
        config = cls(**given)
        if config.publisher is not None and config.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config publisher must be one of {PUBLISHERS}, got {config.publisher!r}"
            )
        for name in ("endpoint", "replay_endpoint"):
            endpoint = getattr(config, name)
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv_events_config {name} must be a ZeroMQ address (tcp://*:5557, "
                    f"tcp://HOST:PORT, ipc://PATH), got {endpoint!r}"
                )
        return config

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def for_replica(self, replica: int) -> KVEventsConfig:
        """Replica ``replica``'s endpoints under data parallelism: vLLM's rule, the port plus
        the replica's index (an ipc or inproc name gets ``_dp<i>``)."""
        if replica == 0:
            return self
        return replace(
            self,
            endpoint=_offset(self.endpoint, replica),
            replay_endpoint=(
                None if self.replay_endpoint is None else _offset(self.replay_endpoint, replica)
            ),
        )


def _offset(endpoint: str, replica: int) -> str:
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{replica}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():  # a wildcard port: each replica binds its own anyway
        return endpoint
    return f"{base}:{int(port) + replica}"
