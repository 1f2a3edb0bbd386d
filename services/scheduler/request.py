"""A request as the scheduler tracks it: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Sequence
from typing import Protocol

from weir.shared.protocol.step import SampleLogprobs
from weir.shared.sampling import SamplingParams


class Grammar(Protocol):
    """A request's structured-output constraint (``engine.structured_output``)."""

    def bitmask(self, drafts: Sequence[int] = ()) -> bytes | None:
        """The tokens allowed next: bit ``t % 32`` of little-endian int32 word ``t // 32``;
        with ``drafts`` (those ``allowed_drafts`` kept), one such mask more after each of
        them, concatenated; None while any token is (the model is still reasoning)."""
        ...

    def allowed_drafts(self, drafts: Sequence[int]) -> list[int]:
        """The longest prefix of ``drafts`` it allows from here (no end token among them)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the constraint does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """Whether an end token completed it (the request ends, even before min_tokens)."""
        ...

    @property
    def too_costly(self) -> bool:
        """Whether following it has cost so long a token for a while that the request is to
        end: the scheduler waits on it between every two steps of every request."""
        ...

    # Seconds its last mask or accepted token took.
    last_cost_s: float


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request.

    ``num_computed_tokens`` counts tokens whose KV is in the cache;
    ``num_tokens_with_spec - num_computed_tokens`` is what the request wants next
    step. ``all_token_ids`` is prompt + outputs (the sequence the KV describes);
    draft tokens live apart in ``spec_token_ids`` until verified.
    ``arrival_time`` is seconds on any one clock (default ``time.monotonic()``);
    under the priority policy lower ``priority`` values are served first.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "cache_salt",
        "lora_name",
        "pooling",
        "images",
        "image_starts",
        "status",
        "all_token_ids",
        "output_token_ids",
        "spec_token_ids",
        "num_output_placeholders",
        "num_computed_tokens",
        "num_preemptions",
        "admitted_step",
        "num_cached_tokens",
        "block_ids",
        "block_hashes",
        "num_cached_blocks",
        "stop_ids",
        "prompt_logprobs",
        "grammar",
        "max_tokens",
        "min_tokens",
        "seq",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        pooling: str | None = None,
        images: Sequence[bytes] = (),
        image_starts: Sequence[int] = (),
    ) -> None:
        if type(request_id) is not str or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        if set(map(type, prompt)) != {int} or min(prompt) < 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-negative ints")
        if sampling_params is None:
            sampling_params = SamplingParams()
        elif not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"request {request_id!r}: sampling_params must be SamplingParams")
        if eos_token_id is not None and (type(eos_token_id) is not int or eos_token_id < 0):
            raise ValueError(f"request {request_id!r}: eos_token_id must be a non-negative int")
        if type(priority) is not int:
            raise ValueError(f"request {request_id!r}: priority must be an int")
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else float(arrival_time)
        self.priority = priority
        self.cache_salt = cache_salt  # its prefix-cache blocks are shared only under it
        self.lora_name = lora_name  # its LoRA adapter (None: the base model)
        # A pooling request's pooling type: it ends once its prompt is computed, with its
        # pooled hidden states for an output, and never samples.
        self.pooling = pooling
        # Encoded images whose features take the places of its prompt's image tokens: they
        # travel to the executors with its prompt (again after an executor is replaced).
        # ``image_starts``: the position of each one's first token (its digest is mixed into
        # the prefix-cache hash of the block there, and so of every later block).
        if len(image_starts) != len(images):
            raise ValueError(f"request {request_id!r}: images and image_starts differ in number")
        self.images = tuple(images)
        self.image_starts = tuple(image_starts)
        self.status = RequestStatus.WAITING
        self.all_token_ids = list(prompt)
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []
        self.num_output_placeholders = 0  # tokens an in-flight step samples (async scheduling)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # The step it was last admitted into: a result of an earlier step, in flight when it
        # was preempted, or when another request of the same id ended, is not its own.
        self.admitted_step = 0
        self.num_cached_tokens = 0  # prefix-cache hit tokens at first admission
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, grown lazily
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        stop_ids = set(sampling_params.stop_token_ids)
        if eos_token_id is not None and not sampling_params.ignore_eos:
            stop_ids.add(eos_token_id)
        self.stop_ids = frozenset(stop_ids)
        # Rows for prompt tokens 1, 2, ... as they are computed, when asked for (sent with
        # the first output).
        self.prompt_logprobs = (
            None if sampling_params.prompt_logprobs is None else SampleLogprobs([], [], [])
        )
        # Its structured output's state, set by whoever compiles the constraint (the front end).
        self.grammar: Grammar | None = None
        # None: as many as fit; every request also stops at max_model_len.
        max_tokens = sampling_params.max_tokens
        self.max_tokens = sys.maxsize if max_tokens is None else max_tokens
        if pooling is not None:
            # Its pooled vector takes the place of one output: no step is planned past it.
            self.max_tokens = 1
        self.min_tokens = sampling_params.min_tokens
        self.seq = 0  # arrival-order tie breaker, set by Scheduler.add_request

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, "
            f"outputs={len(self.output_token_ids)}, spec={len(self.spec_token_ids)})"
        )
