"""N-gram (prompt-lookup) draft proposer, as vLLM's ``ngram`` speculative method.

After a step, for each decoding request: find the longest n-gram (``n_max`` down to
``n_min`` tokens) ending its token sequence that occurred earlier in its prompt or
output, and propose the ``k`` tokens that followed the latest such occurrence. Copy-
heavy requests (repeat, quote, lightly edit a passage of the prompt) then verify
several tokens per forward pass.

Cost: each request keeps a map from every n-gram it has seen to the position after
its latest occurrence, extended only by the tokens added since the last step, so a
proposal costs O((tokens added) x (n_max - n_min + 1)) dict operations, independent of
the sequence length. The map holds n-grams of at most ``MAX_NGRAM_LENGTHS`` lengths from
``n_min`` up (a larger ``n_max`` matches as ``n_min + MAX_NGRAM_LENGTHS - 1``): each
length adds a key of that many tokens per position, so 256 lengths took a 4k-token prompt's
first proposal 3 s and 1 GB. A match that long copies as well as a longer one would.

It runs in the scheduler process, where the tokens already are (the executor would need
them sent back or kept twice), between ``update_from_output`` and the next ``schedule``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from weir.services.scheduler.request import Request
from weir.shared.config import MODEL_SPECULATIVE_METHODS, EngineArgs

# The n-gram lengths a request's map holds at most (see above).
MAX_NGRAM_LENGTHS = 16


@dataclass(slots=True)
class _Index:
    """One request's n-grams: (n-gram) -> position right after its latest occurrence."""

    after: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed_end: int = 0  # n-grams ending at positions <= this are in ``after``


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        if k < 1 or not 1 <= n_min <= n_max:
            raise ValueError(
                f"ngram: need k >= 1 and 1 <= n_min <= n_max, got {k}, {n_min}, {n_max}"
            )
        self.k, self.n_min = k, n_min
        self.n_max = min(n_max, n_min + MAX_NGRAM_LENGTHS - 1)
        # By request object, not id: a new request may reuse an ended one's id.
        self._indexes: dict[Request, _Index] = {}

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Drafts for every request that is decoding (its whole sequence computed but the
        last token); others, and requests gone since the last call, are forgotten."""
        indexes = self._indexes
        live: dict[Request, _Index] = {}
        drafts: dict[str, list[int]] = {}
        for request in requests:
            tokens = request.all_token_ids
            if request.num_computed_tokens != len(tokens) - 1:
                continue  # prefill still partial: no decode next step
            index = indexes.get(request) or _Index()
            live[request] = index
            proposal = self._propose(index, tokens)
            if proposal:
                drafts[request.request_id] = proposal
        self._indexes = live
        return drafts

    def _propose(self, index: _Index, tokens: list[int]) -> list[int]:
        end = len(tokens)
        after = index.after
        n_min, n_max = self.n_min, self.n_max
        # Index every n-gram ending before the sequence's end: the suffix itself must find
        # an earlier occurrence, not itself.
        for stop in range(max(index.indexed_end + 1, n_min), end):
            for n in range(n_min, min(n_max, stop) + 1):
                after[tuple(tokens[stop - n : stop])] = stop
        index.indexed_end = max(index.indexed_end, end - 1)
        for n in range(min(n_max, end), n_min - 1, -1):
            start = after.get(tuple(tokens[end - n :]))
            if start is not None:
                return tokens[start : start + self.k]
        return []


def make_proposer(args: EngineArgs) -> NgramProposer | None:
    """The scheduler's draft proposer the engine arguments ask for (None: no speculation, or
    a draft model's, whose drafts the executor returns with each step's tokens)."""
    if args.speculative_method is None:
        if args.num_speculative_tokens:
            raise ValueError(
                "num_speculative_tokens needs a speculative_method (ngram, draft_model, eagle or eagle3)"
            )
        return None
    if args.num_speculative_tokens < 1:
        raise ValueError(
            f"speculative_method {args.speculative_method!r} needs num_speculative_tokens >= 1"
        )
    if args.speculative_method in MODEL_SPECULATIVE_METHODS:
        return None
    return NgramProposer(args.num_speculative_tokens, args.ngram_min, args.ngram_max)
