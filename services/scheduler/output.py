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
    # Why the scheduler ended the request for a fault of its own ("abort"): its client's error.
    error: str | None = None


def coalesce(steps: list[list[EngineOutput]]) -> list[EngineOutput]:
    """The outputs of consecutive steps as one step's: each request once (in the order it
    first appears) with its tokens and logprobs of every step in order, its end from the
    last. A publisher behind the executor sends several steps at the cost of one."""
    if len(steps) == 1:
        return steps[0]
    merged: dict[str, EngineOutput] = {}
    for outputs in steps:
        for out in outputs:
            have = merged.get(out.request_id)
            merged[out.request_id] = (
                out
                if have is None
                else EngineOutput(
                    out.request_id,
                    have.new_token_ids + out.new_token_ids,
                    out.finished,
                    out.finish_reason,
                    have.num_cached_tokens,
                    _joined(have.logprobs, out.logprobs),
                    have.prompt_logprobs or out.prompt_logprobs,
                    have.pooled or out.pooled,
                    out.error,
                )
            )
    return list(merged.values())


def _joined(first: SampleLogprobs | None, then: SampleLogprobs | None) -> SampleLogprobs | None:
    if first is None or then is None:
        return first or then
    return SampleLogprobs(first.token_ids + then.token_ids, first.logprobs + then.logprobs)
