"""Beam search, as vLLM runs it: over the engine's requests, not inside its step.

Each step asks for one token of every live beam (its prompt the request's prompt and the
beam's tokens, so the prefix cache holds what the beams share), with the ``2 x width`` most
likely next tokens' logprobs; every beam's extensions are ranked by their cumulative logprob
and the best ``width`` go on. A beam that samples the end-of-sequence token is complete
(unless ``ignore_eos``). At the end, the complete and the live beams are ranked by
``cum_logprob / length ** length_penalty`` (the length counts the prompt, not a final EOS,
as vLLM's ``get_beam_search_score``) and the best ``width`` returned, best first.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from weir.shared.sampling import DEFAULT_MAX_LOGPROBS, SamplingParams

# Each step asks for 2 x width logprobs: within the servers' default --max-logprobs.
MAX_BEAM_WIDTH = DEFAULT_MAX_LOGPROBS // 2


@dataclass(slots=True, frozen=True)
class BeamSearchParams:
    """vLLM's: the number of beams kept (and returned), the most tokens a beam takes (None:
    as many as fit the context after the prompt), and how the final ranking weighs length
    (> 1 favours longer beams)."""

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if type(self.beam_width) is not int or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an int in [1, {MAX_BEAM_WIDTH}]")
        if self.max_tokens is not None and (
            type(self.max_tokens) is not int or self.max_tokens < 1
        ):
            raise ValueError("max_tokens must be a positive int or None")
        if not math.isfinite(self.length_penalty):
            raise ValueError("length_penalty must be a finite number")
        SamplingParams(temperature=self.temperature)  # the same bounds as a request's


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's and its own (vLLM's), ``text`` its own tokens'
    text (a final EOS left out), ``finish_reason`` ``stop`` for one that ended on EOS."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str = ""
    finish_reason: str = "length"
    # The beam's own tokens (its output): tokens[num_prompt_tokens:].
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int]


# One token of a prompt (token ids) with this many logprobs: (token id, logprob) pairs of the
# sampled token and the most likely others.
NextTokens = Callable[[list[int], int], Awaitable[list[tuple[int, float]]]]


async def beam_search(
    prompt_ids: list[int],
    params: BeamSearchParams,
    max_tokens: int,
    eos_token_id: int | None,
    next_tokens: NextTokens,
    gather: Callable[[list[Awaitable[Any]]], Awaitable[list[Any]]],
    decode: Callable[[list[int]], Awaitable[str]],
) -> BeamSearchOutput:
    """The best beams of ``prompt_ids``, each of at most ``max_tokens`` tokens (the
    params', resolved); ``gather`` awaits one step's requests together and ``decode`` gives
    a beam's text."""
    width = params.beam_width
    live = [BeamSearchSequence(list(prompt_ids))]
    complete: list[BeamSearchSequence] = []
    for _ in range(max_tokens):
        if not live:
            break
        options = await gather([next_tokens(beam.tokens, 2 * width) for beam in live])
        extended = []
        for beam, candidates in zip(live, options, strict=True):
            for token, logprob in dict(candidates).items():
                child = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + logprob)
                if token == eos_token_id and not params.ignore_eos:
                    child.finish_reason = "stop"
                    complete.append(child)
                else:
                    extended.append(child)
        live = sorted(extended, key=lambda b: b.cum_logprob, reverse=True)[:width]

    def score(beam: BeamSearchSequence) -> float:
        """cum_logprob / length ** length_penalty (never positive), as an order: its log's
        negation, which no penalty overflows."""
        length = len(beam.tokens) - (beam.finish_reason == "stop")
        if beam.cum_logprob == 0.0:
            return math.inf
        return params.length_penalty * math.log(length) - math.log(-beam.cum_logprob)

    best = sorted(complete + live, key=score, reverse=True)[:width]
    for beam in best:
        beam.output_token_ids = beam.tokens[len(prompt_ids) :]
        shown = beam.output_token_ids[: len(beam.output_token_ids) - (beam.finish_reason == "stop")]
        beam.text = await decode(shown)
    return BeamSearchOutput(best, list(prompt_ids))


async def first_token_logprobs(outputs: AsyncIterator[Any]) -> list[tuple[int, float]]:
    """The (token id, logprob) pairs of a one-token request's stream: its sampled token's
    and the top alternatives'."""
    pairs: list[tuple[int, float]] = []
    async for out in outputs:
        if out.logprobs is not None and out.logprobs["token_ids"]:
            ids, logprobs = out.logprobs["token_ids"][0], out.logprobs["logprobs"][0]
            pairs += list(zip(ids, logprobs, strict=True))
    return pairs
