"""What one step did to one request, as the scheduler reports it: token ids, no text."""

from __future__ import annotations

from dataclasses import dataclass

from weir.shared.protocol.step import SampleLogprobs


@dataclass(slots=True)
class EngineOutput:
    """New tokens of one request after a step, or its end. ``finish_reason`` is "stop",
    "length" or "abort" once ``finished``; ``num_cached_tokens`` is the prefix-cache hit
    length at (first) admission. The scheduler process turns it into the client's
    ``StreamOutput`` (with text)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: SampleLogprobs | None = None
    # With the first output of a request that asked: a row for each prompt token after the first.
    prompt_logprobs: SampleLogprobs | None = None
    # A pooling request's only output: its pooled hidden state, float32 little-endian bytes.
    pooled: bytes | None = None
