"""Draft-model speculative decoding (vLLM's ``draft_model`` method): a smaller model of the
served model's vocabulary proposes each decoding request's next k tokens; the next step's
forward pass verifies them (``ModelRunner._collect``), so outputs are the served model's.

The draft keeps its own paged KV cache indexed by the served model's block ids: one block
table and slot mapping serve both, so the scheduler's block accounting and the prefix cache
cover both (a block costs both models' bytes). After each step the draft computes exactly
the positions the served model computed and kept (rejected drafts left out) plus the token
just sampled, so its cache holds every token the served model's holds, those of prefix-cache
hits included (the draft computed them when the served model did). The sampled token's
logits give the first proposal; k - 1 one-token passes give the rest, each the draft's
argmax (deterministic drafts, which ``_collect``'s compare-and-accept verifies for sampled
requests too: a draft is kept with the probability the served model gives it, and a
rejection samples from the served model's distribution without it).

Proposals at positions P, P + 1, ... past the last computed token write the draft's KV
there: the scheduler allocates those slots ahead (``num_lookahead_tokens``) where blocks are
free, and a request proposes only as far as its blocks reach. The draft remembers what it
fed at those positions; after the next step it computes again only from the first position
whose kept token is not the one it fed (after a step that kept every draft, 2 positions of
k + 2), so what the proposals wrote never outlives a token that replaced it.

An EAGLE head (vLLM's ``eagle``, ``eagle.py``) runs the same loop over the same cache with
its inputs shifted: at position q it reads the token at q + 1 and the served model's final
hidden state at q (the step's row there), so it computes the positions the served model
computed and kept, the last of them with the token just sampled, whose output gives the
first proposal; each later pass reads the proposal before and the head's own output. Its
KV at a position depends on the served model's hidden state there, which a proposal did
not have: every step computes all the step's kept positions again (nothing is held). An
EAGLE-3 head (``eagle3``) reads the inputs of three of the served model's layers instead
of its final hidden state (``fc`` turns them into its first pass's context), and its argmax
over a draft vocabulary maps to the served model's token through ``d2t``.
"""

import numpy as np
import torch

from weir.services.executor.attention import AttentionMetadata
from weir.services.executor.eagle import Eagle3Head, EagleHead
from weir.services.executor.input_batch import InputBatch, Spans, StepInputs
from weir.services.executor.model import CausalLM
from weir.services.executor.parallel import TensorParallel
from weir.services.executor.sampler import greedy_tokens
from weir.services.executor.transfer import to_device


class Drafter:
    """The draft model (or EAGLE head), its KV cache and the proposing loop of one executor
    rank."""

    def __init__(
        self,
        model: CausalLM | EagleHead,
        num_speculative_tokens: int,
        vocab_size: int,
        device: torch.device,
        tp: TensorParallel | None,
    ) -> None:
        self.model = model
        self.eagle = isinstance(model, EagleHead)
        self.k = num_speculative_tokens
        # Tokens the served model knows: a draft with a larger (padded) vocabulary never
        # proposes past it (an EAGLE-1 head's logits are the served model's, whatever its
        # config.json says; an EAGLE-3 head's, its draft vocabulary's).
        self.vocab_size = (
            model.draft_vocab_size
            if isinstance(model, Eagle3Head)
            else vocab_size
            if self.eagle
            else min(vocab_size, model.config.vocab_size)
        )
        self.tp = tp
        self.device = device
        self.context_len = model.config.context_len
        self.long_prompt_threshold = model.config.rope.long_prompt_threshold
        self.kv_caches: list[torch.Tensor] = []
        self.forget()

    def forget(self) -> None:
        """Hold no proposal (the persistent batch was replaced). Of each batch slot, the
        draft's last proposal: the tokens it fed from ``_fed_start`` on (``_fed_count`` of
        them, into its cache), and the slot's generation then."""
        self._fed = np.zeros((0, self.k), dtype=np.int32)
        self._fed_start = np.zeros(0, dtype=np.int64)
        self._fed_count = np.zeros(0, dtype=np.int64)
        self._fed_generation = np.zeros(0, dtype=np.int64)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.kv_caches = self.model.allocate_kv_caches(num_blocks, block_size)

    @torch.inference_mode()
    def propose(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        sampled: set[str],
        target_hidden: torch.Tensor | None = None,
    ) -> dict[str, list[int]]:
        """Compute a finished step's kept tokens (``batch`` holds its verified outputs) and
        propose up to k drafts for each request of ``sampled``, the requests it sampled
        for: {request id: drafts}, on every rank. ``target_hidden``: an EAGLE head's, the
        served model's rows of the step that it reads (``ModelRunner._eagle_rows``)."""
        slots = inputs.slots
        qsl = inputs.query_start_loc
        starts = inputs.positions[qsl[:-1]]
        proposing = np.fromiter((rid in sampled for rid in inputs.req_ids), bool, len(slots))
        # Kept tokens, and the one sampled: a sampling request's whole known sequence; EAGLE's
        # last input is the sampled token, at the position before it.
        shift = int(self.eagle)
        ends = np.where(proposing, batch.num_tokens[slots] - shift, starts + np.diff(qsl))
        limit = np.minimum(
            batch.num_blocks[slots].astype(np.int64) * batch.block_size,
            min(batch.max_model_len, self.context_len),
        )
        # The last input sits at ends - 1: proposal j is computed from position ends - 2 + j.
        num_drafts = np.where(proposing, np.clip(limit - ends + 1, 0, self.k), 0)
        if not self.eagle:
            beyond = ends > limit  # no slot for the sampled token: it proposes nothing
            ends = np.where(beyond, ends - 1, ends)
            # Positions the draft computed while proposing with the tokens kept there need
            # not be computed again: after a step that kept every draft, 2 of k + 2.
            starts = np.minimum(
                np.maximum(starts, self._held_until(batch, slots, starts, ends)), ends - 1
            )
        spans = batch.spans(slots, starts, ends - starts, self.long_prompt_threshold)
        input_ids = batch.token_ids.reshape(-1)[
            spans.token_slot * batch.max_model_len + spans.positions + shift
        ]
        context = None
        if target_hidden is not None:  # the served model's rows of the positions computed
            lengths = np.diff(spans.query_start_loc)
            offsets = np.repeat(qsl[:-1] - spans.query_start_loc[:-1], lengths)
            context = target_hidden[self._dev(np.arange(len(input_ids)) + offsets)]
        hidden = self.first_pass(
            self._dev(input_ids),
            context,
            self._dev(spans.rope_positions),
            self._metadata(spans, int((ends - starts).max())),
            self.kv_caches,
        )
        rows = np.flatnonzero(num_drafts > 0)
        if not self.eagle:
            self._fed_count[slots] = 0
        if not len(rows):
            return {}
        sampled_rows = spans.query_start_loc[1:][rows].astype(np.int64) - 1
        hidden = hidden[self._dev(sampled_rows)]
        tokens = self._argmax(hidden)
        drafts = [tokens]
        positions = ends[rows]  # of each proposing request's latest proposal
        live = np.arange(len(rows))  # of ``rows``, the requests still proposing
        for j in range(2, self.k + 1):
            keep = num_drafts[rows[live]] >= j
            kept = self._dev(np.flatnonzero(keep))
            live, tokens = live[keep], tokens[kept]
            if not len(live):
                break
            one = np.ones(len(live), dtype=np.int64)
            spans = batch.spans(slots[rows[live]], positions[live], one, self.long_prompt_threshold)
            hidden = self.run(
                tokens,
                hidden[kept] if self.eagle else None,
                self._dev(spans.rope_positions),
                self._metadata(spans, 1),
                self.kv_caches,
            )
            positions[live] += 1
            tokens = self._argmax(hidden)
            column = torch.full((len(rows),), -1, dtype=tokens.dtype, device=tokens.device)
            column[self._dev(live)] = tokens
            drafts.append(column)
        table = torch.stack(drafts, dim=1).cpu().numpy()  # the proposals' one wait
        if not self.eagle:
            self._remember(batch, slots[rows], ends[rows] - 1, num_drafts[rows], table)
        return {
            inputs.req_ids[r]: row[: int(num_drafts[r])]
            for r, row in zip(rows.tolist(), table.tolist())
        }

    def run(
        self,
        input_ids: torch.Tensor,
        context: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """One pass of the draft over ``kv_caches``; ``context``: an EAGLE head's hidden rows."""
        if isinstance(self.model, EagleHead):
            assert context is not None, "an EAGLE head reads the served model's hidden states"
            return self.model(input_ids, context, positions, meta, kv_caches)
        return self.model(input_ids, positions, meta, kv_caches)

    def first_pass(
        self,
        input_ids: torch.Tensor,
        target_rows: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """A pass over positions the served model computed: an EAGLE head's context is
        its ``target_rows`` there (as ``combine_hidden_states`` makes them its own)."""
        context = None
        if isinstance(self.model, EagleHead):
            assert target_rows is not None, "an EAGLE head reads the served model's hidden states"
            context = self.model.combine_hidden_states(target_rows)
        return self.run(input_ids, context, positions, meta, kv_caches)

    def warm_up_pass(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """A pass of made-up tokens (an EAGLE head's context rows zero), which launches the
        kernels a step's pass does."""
        rows = None
        if isinstance(self.model, EagleHead):
            shape = (len(input_ids), self.model.context_size)
            rows = torch.zeros(shape, dtype=self.model.dtype, device=self.device)
        return self.first_pass(input_ids, rows, positions, meta, kv_caches)

    def _remember(
        self,
        batch: InputBatch,
        fed: np.ndarray,
        last: np.ndarray,
        num_drafts: np.ndarray,
        table: np.ndarray,
    ) -> None:
        """Of the proposing requests' slots ``fed``: what the draft fed from position
        ``last`` on (the sampled token, then its proposals but the last)."""
        self._fed[fed, 0] = batch.token_ids[fed, last]
        self._fed[fed, 1 : table.shape[1]] = table[:, :-1]
        self._fed_start[fed] = last
        self._fed_count[fed] = num_drafts
        self._fed_generation[fed] = batch.generation[fed]

    def _held_until(
        self, batch: InputBatch, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray
    ) -> np.ndarray:
        """Of each request, the first position from ``starts`` on whose draft KV its last
        proposal did not write with the token the batch now holds there (before ``ends``)."""
        if len(self._fed) < batch.capacity:  # the batch grew: so do the slots' records
            grown = batch.capacity - len(self._fed)
            self._fed = np.pad(self._fed, ((0, grown), (0, 0)))
            for name in ("_fed_start", "_fed_count", "_fed_generation"):
                setattr(self, name, np.pad(getattr(self, name), (0, grown)))
        start, count = self._fed_start[slots], self._fed_count[slots]
        # A resumed request's slot has a new generation (and new blocks).
        held = (self._fed_generation[slots] == batch.generation[slots]) & (starts >= start)
        column = np.arange(self.k)
        positions = start[:, None] + column
        written = (column < count[:, None]) & (positions < ends[:, None])
        tokens = batch.token_ids[slots[:, None], np.minimum(positions, batch.max_model_len - 1)]
        same = written & (tokens == self._fed[slots])
        first_other = np.where(same.all(axis=1), self.k, same.argmin(axis=1))
        return np.where(held, start + first_other, starts)

    def _metadata(self, spans: Spans, max_query_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._dev(spans.query_start_loc),
            seq_lens=self._dev(spans.seq_lens),
            block_table=self._dev(spans.block_table),
            slot_mapping=self._dev(spans.slot_mapping),
            max_query_len=max_query_len,
            max_seq_len=spans.max_seq_len,
        )

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's greedy token of each hidden row, on every rank (rank 0 holds the
        logits under tensor parallelism and broadcasts)."""
        logits = self.model.compute_logits(hidden, widen=False)
        tokens = None if logits is None else greedy_tokens(logits[:, : self.vocab_size])
        if self.tp is not None:
            tokens = self.tp.broadcast_tokens(tokens, len(hidden), self.device)
        assert tokens is not None
        return self.model.to_target(tokens) if isinstance(self.model, EagleHead) else tokens

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
