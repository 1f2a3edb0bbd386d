"""The executor's persistent batch: per-request state kept across steps, updated from plan diffs.

Each request the executor holds owns a slot, a row in preallocated NumPy arrays (token ids,
block table, counts, sampling parameters). A step's flat inputs are gathered from those rows
with a handful of vectorized NumPy operations, so building a batch costs the same few
operations whether it holds 1 request or 256.

A step launched while the previous one still runs on the device is planned on tokens the host
does not know yet: the previous step reserves one token per request it samples for
(``reserve_tokens``), and fills the ids in when its result reaches the host.
"""

import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from weir.shared.arith import cdiv
from weir.shared.pooling import POOLING_TYPES
from weir.shared.protocol.step import NewRequest, StepPlan
from weir.shared.rope_config import LONG_ROTATION
from weir.shared.sampling import SamplingParams

# A slot's pooling type, as stored: 0 for a request that samples, else 1 + its index.
POOLING_CODES = {kind: code for code, kind in enumerate(POOLING_TYPES, 1)}
LAST, MEAN, CLS = (POOLING_CODES[kind] for kind in ("LAST", "MEAN", "CLS"))


@dataclass(slots=True)
class StepInputs:
    """Host-side flat inputs of one step (all NumPy), in the plan's request order."""

    req_ids: list[str]
    slots: np.ndarray  # [R] slot of each scheduled request
    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int64
    # What the model rotates by: ``positions``, with LONG_ROTATION added to the tokens
    # LongRoPE's long factors rotate (the same array for other models).
    rope_positions: np.ndarray
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, max_blocks] int32
    slot_mapping: np.ndarray  # [T] int64
    num_spec: np.ndarray  # [R] draft tokens scheduled per request
    num_logits: (
        np.ndarray
    )  # [R] logits rows per request: 1 + drafts if its prefill completes, else 0
    logits_indices: np.ndarray  # [N] rows of the flat batch to compute logits at
    max_query_len: int
    max_seq_len: int
    # Of requests asking for prompt logprobs: the rows of the flat batch whose next token is
    # a prompt token ([M]), that token ([M]), and how many such rows each request has ([R]).
    prompt_logits_indices: np.ndarray
    prompt_targets: np.ndarray
    num_prompt_logits: np.ndarray
    # Of pooling requests ([R], 0 for the others): the pooling type's code, and whether this
    # step completes the prompt (its pooled state is then the request's output); None when
    # the batch holds no pooling request.
    pooling: np.ndarray | None = None
    pooling_done: np.ndarray | None = None


@dataclass(slots=True)
class Spans:
    """Where the tokens of some requests' position ranges sit in a flat batch (``InputBatch.spans``)."""

    query_start_loc: np.ndarray  # [R + 1] int32
    token_slot: np.ndarray  # [T] the slot of each token
    positions: np.ndarray  # [T] int64
    rope_positions: np.ndarray  # [T] what the model rotates by (see ``StepInputs``)
    slot_mapping: np.ndarray  # [T] int64
    seq_lens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, max blocks] int32
    max_seq_len: int


@dataclass(slots=True)
class Reservation:
    """Tokens counted in the batch before their ids are known (``InputBatch.reserve_tokens``)."""

    slots: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64: where each token goes in its slot's row
    generations: np.ndarray  # [N] int64: the slots' generations when reserved


@dataclass(slots=True)
class PenaltyTokens:
    """The tokens that penalize some logits rows, as pairs (index of the row among them, token):
    each row's request's outputs before the token the row samples, those known on the host
    (``output``) and those the step itself feeds (``fed``: indices into its flat input ids,
    which a step overlapped with the one before reads on the device), and the prompts of the
    rows with a repetition penalty (``prompt``)."""

    output: tuple[np.ndarray, np.ndarray]
    fed: tuple[np.ndarray, np.ndarray]
    prompt: tuple[np.ndarray, np.ndarray] | None


def lazy_zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Zeros in an anonymous mapping that the kernel backs 4 KiB at a time, on first write,
    never with transparent huge pages.

    A slot's row of token ids is max_model_len wide (512 KiB at 131,072 tokens) and a request
    writes the first few KiB of it. np.zeros advises huge pages for arrays this large, and the
    kernel then faults in 2 MiB (compacting memory for it first, under the default `defrag`
    setting) at the first write to a slot: a served executor's plan of 64 new requests took
    150-260 ms on a 2-core VM (admitting 256: 7-520 ms in `benchmarks/host_step.py`, 2 ms
    now), and every slot used once kept 2 MiB per 4 rows resident. 4 KiB pages: microseconds,
    and kilobytes a request."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere the mapping is as it comes
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).reshape(shape)


class InputBatch:
    """Per-request state in slot-indexed arrays. Slots grow on demand; preempted requests keep theirs."""

    # The slot arrays, which ``_grow`` sets by name from ``_arrays`` (rows by slot).
    token_ids: npt.NDArray[np.int32]  # [capacity, max_model_len]
    block_table: npt.NDArray[np.int32]  # [capacity, max_blocks_per_req]
    num_blocks: npt.NDArray[np.int32]
    num_tokens: npt.NDArray[np.int32]
    num_prompt_tokens: npt.NDArray[np.int32]
    num_computed_tokens: npt.NDArray[np.int32]
    temperature: npt.NDArray[np.float32]
    top_k: npt.NDArray[np.int64]
    top_p: npt.NDArray[np.float32]
    min_p: npt.NDArray[np.float32]
    seed: npt.NDArray[np.object_]
    has_seed: npt.NDArray[np.bool_]
    num_logprobs: npt.NDArray[np.int32]
    num_prompt_logprobs: npt.NDArray[np.int32]
    min_tokens: npt.NDArray[np.int32]
    presence_penalty: npt.NDArray[np.float32]
    frequency_penalty: npt.NDArray[np.float32]
    repetition_penalty: npt.NDArray[np.float32]
    lora_id: npt.NDArray[np.int32]
    pooling: npt.NDArray[np.int8]
    generation: npt.NDArray[np.int64]

    def __init__(
        self,
        max_model_len: int,
        block_size: int,
        capacity: int,
        eos_token_ids: tuple[int, ...],
        lora_ids: dict[str, int] | None = None,
        long_prompt_threshold: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.long_prompt_threshold = long_prompt_threshold  # `RopeConfig`'s
        self.lora_ids = {} if lora_ids is None else lora_ids  # adapter -> its id (0: none)
        self.block_size = block_size
        self.max_blocks_per_req = cdiv(max_model_len, block_size)
        self.eos_token_ids = list(eos_token_ids)
        self.slot_of: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        self.capacity = 0
        self._free: list[int] = []
        self.stop_ids: dict[int, np.ndarray] = {}  # slot -> ids banned before min_tokens
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot -> (ids, biases)
        # slot -> packed int32 bitmask of its allowed_token_ids (``sampler.unpack_bitmask``)
        self.allowed_tokens: dict[int, bytes] = {}
        # slot -> its bad words (``bad_word_arrays``)
        self.bad_words: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.vocab_size = vocab_size  # needed only for allowed_token_ids
        self.num_pooling = 0  # pooling requests held: none, and a step's inputs skip pooling
        self._grow(capacity)

    def _arrays(self) -> tuple[tuple[str, type, tuple[int, ...], int], ...]:
        """(name, dtype, shape of one slot's row, value of an unused row) of every slot array."""
        return (
            ("token_ids", np.int32, (self.max_model_len,), 0),
            ("block_table", np.int32, (self.max_blocks_per_req,), 0),
            ("num_blocks", np.int32, (), 0),
            ("num_tokens", np.int32, (), 0),  # prompt + outputs the executor knows
            ("num_prompt_tokens", np.int32, (), 0),
            ("num_computed_tokens", np.int32, (), 0),
            ("temperature", np.float32, (), 0),
            ("top_k", np.int64, (), 0),
            ("top_p", np.float32, (), 1),
            ("min_p", np.float32, (), 0),
            ("seed", object, (), 0),  # Python ints: seeds span 64 bits, signed or not
            ("has_seed", bool, (), 0),
            ("num_logprobs", np.int32, (), -1),
            ("num_prompt_logprobs", np.int32, (), -1),
            ("min_tokens", np.int32, (), 0),
            ("presence_penalty", np.float32, (), 0),
            ("frequency_penalty", np.float32, (), 0),
            ("repetition_penalty", np.float32, (), 1),
            ("lora_id", np.int32, (), 0),
            ("pooling", np.int8, (), 0),
            # Bumped whenever a slot's tokens are set from a plan: a reservation made before
            # is void (`fill_reserved`).
            ("generation", np.int64, (), 0),
        )

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name, dtype, row_shape, fill in self._arrays():
            if row_shape:
                grown = lazy_zeros((capacity, *row_shape), dtype)
            else:
                grown = np.zeros(capacity, dtype=dtype)
            if fill:
                grown[old:] = fill
            if old and row_shape:
                # Only the columns some slot uses: copying whole rows would touch every page.
                used = {"token_ids": self.num_tokens, "block_table": self.num_blocks}[name]
                width = int(used.max(initial=0))
                grown[:old, :width] = getattr(self, name)[:, :width]
            elif old:
                grown[:old] = getattr(self, name)
            setattr(self, name, grown)
        self._free.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self.slot_of)

    # ------------------------------------------------------------------ plan diff

    def apply_plan(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self._remove(req_id)
        # Preempted requests keep their slot (prompt, parameters); they return as resumed.
        for req in plan.new_requests:
            self._add(req)
        cached = plan.cached_requests
        if not cached.req_ids:
            return
        slot_of = self.slot_of
        missing = [r for r in cached.req_ids if r not in slot_of]
        if missing:
            raise ValueError(f"cached requests {missing[:5]} are not in the batch")
        for req_id, outputs in cached.resumed_output_token_ids.items():
            slot = slot_of[req_id]
            self._set_tokens(slot, self.prompts[req_id], outputs)
            self.num_blocks[slot] = 0  # a resumed request's new_block_ids is its whole table
        for req_id, block_ids in cached.new_block_ids.items():
            self._append_blocks(slot_of[req_id], block_ids)
        slots = np.fromiter(
            map(slot_of.__getitem__, cached.req_ids), dtype=np.int64, count=len(cached.req_ids)
        )
        self.num_computed_tokens[slots] = cached.num_computed_tokens

    def _remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is None:
            return
        del self.params[req_id], self.prompts[req_id]
        self.num_pooling -= bool(self.pooling[slot])
        self.stop_ids.pop(slot, None)
        self.logit_bias.pop(slot, None)
        self.allowed_tokens.pop(slot, None)
        self.bad_words.pop(slot, None)
        self._free.append(slot)

    def _add(self, req: NewRequest) -> None:
        if req.request_id in self.slot_of:
            raise ValueError(f"request {req.request_id!r} is already in the batch")
        lora_id = 0 if req.lora_name is None else self.lora_ids.get(req.lora_name)
        if lora_id is None:
            raise ValueError(
                f"request {req.request_id!r}: this executor holds no LoRA adapter "
                f"{req.lora_name!r}: its files could not be loaded here, or differ from those "
                "the scheduler read (the executor's log says which)"
            )
        if not self._free:
            self._grow(2 * self.capacity)
        slot = self._free.pop()
        self.slot_of[req.request_id] = slot
        self.params[req.request_id] = sp = req.sampling_params
        self.prompts[req.request_id] = req.prompt_token_ids
        self._set_tokens(slot, req.prompt_token_ids, req.output_token_ids)
        self.num_prompt_tokens[slot] = len(req.prompt_token_ids)
        self.num_blocks[slot] = 0
        self._append_blocks(slot, req.block_ids)
        self.num_computed_tokens[slot] = req.num_computed_tokens
        self.temperature[slot] = sp.temperature
        self.top_k[slot] = sp.top_k
        self.top_p[slot] = sp.top_p
        self.min_p[slot] = sp.min_p
        self.has_seed[slot] = sp.seed is not None
        self.seed[slot] = sp.seed or 0
        self.num_logprobs[slot] = -1 if sp.logprobs is None else sp.logprobs
        self.num_prompt_logprobs[slot] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        self.min_tokens[slot] = sp.min_tokens
        self.presence_penalty[slot] = sp.presence_penalty
        self.frequency_penalty[slot] = sp.frequency_penalty
        self.repetition_penalty[slot] = sp.repetition_penalty
        self.lora_id[slot] = lora_id
        self.pooling[slot] = 0 if req.pooling is None else POOLING_CODES[req.pooling]
        self.num_pooling += req.pooling is not None
        if sp.logit_bias:
            ids, biases = zip(*sp.logit_bias)
            self.logit_bias[slot] = (np.array(ids, np.int64), np.array(biases, np.float32))
        if sp.bad_words_token_ids:
            self.bad_words[slot] = bad_word_arrays(sp.bad_words_token_ids)
        if sp.allowed_token_ids is not None:
            self.allowed_tokens[slot] = token_bitmask(sp.allowed_token_ids, self.vocab_size)
        if sp.min_tokens > 0:
            # The model's ends too under ignore_eos, which only says they do not stop it:
            # vLLM's min_tokens bans them all the same.
            self.stop_ids[slot] = np.fromiter(
                dict.fromkeys((*sp.stop_token_ids, *self.eos_token_ids)), dtype=np.int64
            )

    def _set_tokens(self, slot: int, prompt: list[int], outputs: list[int]) -> None:
        n = len(prompt) + len(outputs)
        if n > self.max_model_len:
            raise ValueError(f"{n} tokens exceed max_model_len {self.max_model_len}")
        self.token_ids[slot, : len(prompt)] = prompt
        self.token_ids[slot, len(prompt) : n] = outputs
        self.num_tokens[slot] = n
        self.generation[slot] += 1

    def _append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = self.num_blocks[slot]
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"block table of {end} blocks exceeds {self.max_blocks_per_req} (max_model_len)"
            )
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    # ------------------------------------------------------------------ step inputs

    def prepare_inputs(self, plan: StepPlan) -> StepInputs:
        req_ids = list(plan.num_scheduled_tokens)
        try:
            slots = np.fromiter(
                map(self.slot_of.__getitem__, req_ids), dtype=np.int64, count=len(req_ids)
            )
        except KeyError as exc:
            raise ValueError(f"scheduled request {exc.args[0]!r} is not in the batch") from None
        num_sched = np.fromiter(
            plan.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids)
        )
        num_spec = np.zeros(len(req_ids), dtype=np.int64)
        num_tokens = self.num_tokens[slots].astype(np.int64)
        if plan.scheduled_spec_decode_tokens:
            index = {r: i for i, r in enumerate(req_ids)}
            for req_id, drafts in plan.scheduled_spec_decode_tokens.items():
                i = index[req_id]
                num_spec[i] = len(drafts)
                start = num_tokens[i]
                if start + len(drafts) > self.max_model_len:
                    raise ValueError(f"request {req_id!r}: drafts run past max_model_len")
                # Drafts sit after the known tokens; accepted ones are kept there, rejected ones overwritten.
                self.token_ids[slots[i], start : start + len(drafts)] = drafts
        computed = self.num_computed_tokens[slots].astype(np.int64)
        # Tokens the step computes must be known: prompt/outputs up to num_tokens, then drafts.
        real_end = computed + num_sched - num_spec
        if (real_end > num_tokens).any() or (num_spec >= num_sched).any():
            bad = req_ids[int(np.argmax((real_end > num_tokens) | (num_spec >= num_sched)))]
            raise ValueError(f"request {bad!r}: plan schedules tokens the executor does not know")

        spans = self.spans(slots, computed, num_sched, self.long_prompt_threshold)
        query_start_loc, positions = spans.query_start_loc, spans.positions
        token_slot = spans.token_slot
        input_ids = self.token_ids.reshape(-1)[token_slot * self.max_model_len + positions]

        prefill_done = real_end >= num_tokens
        pooling = pooling_done = None
        if self.num_pooling:
            pooling = self.pooling[slots]
            pooling_done = prefill_done & (pooling > 0)
            prefill_done &= pooling == 0  # a pooling request's rows are never sampled
        num_logits = np.where(prefill_done, num_spec + 1, 0)
        logits_indices = _ranges(query_start_loc[1:] - num_logits, num_logits)
        # Rows at positions whose next token is a prompt token, of requests that ask.
        num_prompt = self.num_prompt_tokens[slots].astype(np.int64)
        num_prompt_logits = np.where(
            self.num_prompt_logprobs[slots] >= 0,
            np.clip(np.minimum(real_end, num_prompt - 1) - computed, 0, None),
            0,
        )
        prompt_logits_indices = _ranges(query_start_loc[:-1], num_prompt_logits)
        prompt_targets = self.token_ids.reshape(-1)[
            token_slot[prompt_logits_indices] * self.max_model_len
            + positions[prompt_logits_indices]
            + 1
        ]
        return StepInputs(
            req_ids=req_ids,
            slots=slots,
            input_ids=input_ids,
            positions=positions,
            rope_positions=spans.rope_positions,
            query_start_loc=query_start_loc,
            seq_lens=spans.seq_lens,
            block_table=spans.block_table,
            slot_mapping=spans.slot_mapping,
            num_spec=num_spec,
            num_logits=num_logits,
            logits_indices=logits_indices,
            max_query_len=int(num_sched.max(initial=0)),
            max_seq_len=spans.max_seq_len,
            prompt_logits_indices=prompt_logits_indices,
            prompt_targets=prompt_targets.astype(np.int64),
            num_prompt_logits=num_prompt_logits,
            pooling=pooling,
            pooling_done=pooling_done,
        )

    def spans(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        long_prompt_threshold: int | None,
    ) -> Spans:
        """The flat layout of positions ``[starts[i], starts[i] + lengths[i])`` of the
        requests in ``slots`` (every length >= 1), rotated for a model whose LongRoPE
        threshold is ``long_prompt_threshold``."""
        total = int(lengths.sum())
        query_start_loc = np.zeros(len(slots) + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start_loc[1:])
        token_slot = np.repeat(slots, lengths)
        positions = np.arange(total, dtype=np.int64) + np.repeat(
            starts - query_start_loc[:-1], lengths
        )
        rope_positions = positions
        if long_prompt_threshold is not None:
            # Long-rotated: every token of a prompt over the threshold, else those past it.
            long_from = np.where(
                self.num_prompt_tokens[slots] > long_prompt_threshold, 0, long_prompt_threshold
            )
            rope_positions = (
                positions + (positions >= np.repeat(long_from, lengths)) * LONG_ROTATION
            )
        blocks = self.block_table.reshape(-1)[
            token_slot * self.max_blocks_per_req + positions // self.block_size
        ]
        seq_lens = (starts + lengths).astype(np.int32)
        max_seq_len = int(seq_lens.max(initial=0))
        return Spans(
            query_start_loc=query_start_loc,
            token_slot=token_slot,
            positions=positions,
            rope_positions=rope_positions,
            slot_mapping=blocks.astype(np.int64) * self.block_size + positions % self.block_size,
            seq_lens=seq_lens,
            block_table=self.block_table[slots, : cdiv(max_seq_len, self.block_size)],
            max_seq_len=max_seq_len,
        )

    def _output_spans(
        self, inputs: StepInputs, rows: np.ndarray
    ) -> Iterator[tuple[int, int, int, int, int, int]]:
        """For each of the step's logits rows ``rows``, where the outputs before the token it
        samples are: (its index among ``rows``, its slot, the slot's prompt length, tokens
        computed before the step: outputs from the prompt's end up to here are on the host,
        and the flat input indices first .. last: the outputs this step feeds, the last the
        row's own input)."""
        request = np.repeat(np.arange(len(inputs.slots)), inputs.num_logits)[rows]
        flat = inputs.logits_indices[rows]
        for i, (r, last) in enumerate(zip(request.tolist(), flat.tolist())):
            slot = int(inputs.slots[r])
            num_prompt = int(self.num_prompt_tokens[slot])
            computed = int(self.num_computed_tokens[slot])
            first = int(inputs.query_start_loc[r]) + max(0, num_prompt - computed)
            yield i, slot, num_prompt, computed, first, last

    def penalty_tokens(self, inputs: StepInputs, rows: np.ndarray) -> PenaltyTokens:
        """The tokens behind the penalties of the step's logits rows ``rows``."""
        out: list[tuple[int, np.ndarray]] = []
        fed: list[tuple[int, np.ndarray]] = []
        prompt: list[tuple[int, np.ndarray]] = []
        for i, slot, num_prompt, computed, first, last in self._output_spans(inputs, rows):
            out.append((i, self.token_ids[slot, num_prompt:computed]))
            fed.append((i, np.arange(first, last + 1)))
            if self.repetition_penalty[slot] != 1:
                prompt.append((i, self.token_ids[slot, :num_prompt]))
        return PenaltyTokens(_pairs(out), _pairs(fed), _pairs(prompt) if prompt else None)

    def bad_word_history(
        self, inputs: StepInputs, rows: np.ndarray, length: int
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The last ``length`` outputs before the token each of the step's logits rows
        ``rows`` samples ([len(rows), length], -1 where the output is shorter), those the
        host knows, and (history row, column, flat input index) of those only this step's
        input ids hold on the device (a step overlapped with the one before feeds them)."""
        history = np.full((len(rows), length), -1, dtype=np.int64)
        fed: list[tuple[int, np.ndarray, np.ndarray]] = []
        for i, slot, num_prompt, computed, first, last in self._output_spans(inputs, rows):
            num_fed = min(length, max(0, last + 1 - first))
            if num_fed:
                columns = np.arange(length - num_fed, length)
                fed.append((i, columns, np.arange(last + 1 - num_fed, last + 1)))
            room = length - num_fed
            if room:
                known = self.token_ids[slot, max(num_prompt, computed - room) : computed]
                history[i, room - len(known) : room] = known
        if not fed:
            empty = np.zeros(0, dtype=np.int64)
            return history, (empty, empty, empty)
        return history, (
            np.concatenate([np.full(len(c), i) for i, c, _ in fed]),
            np.concatenate([c for _, c, _ in fed]),
            np.concatenate([f for _, _, f in fed]),
        )

    def reserve_tokens(self, slots: np.ndarray) -> Reservation:
        """Count one more token for each of ``slots``, sampled by a step still on the device:
        the next step can be planned on it, reading its id on the device, before
        ``fill_reserved`` writes it here."""
        positions = self.num_tokens[slots].astype(np.int64)
        if (positions >= self.max_model_len).any():
            raise ValueError(f"output runs past max_model_len {self.max_model_len}")
        self.num_tokens[slots] = positions + 1
        return Reservation(slots, positions, self.generation[slots].copy())

    def reserved_now(self, reservation: Reservation) -> np.ndarray:
        """Which of a reservation's tokens are still this batch's: not since freed, taken by
        another request or set again from a plan (a resumed request's outputs)."""
        now: npt.NDArray[np.bool_] = self.generation[reservation.slots] == reservation.generations
        return now

    def fill_reserved(self, reservation: Reservation, token_ids: np.ndarray) -> None:
        keep = self.reserved_now(reservation)
        self.token_ids[reservation.slots[keep], reservation.positions[keep]] = token_ids[keep]

    def append_tokens(self, slot: int, token_ids: list[int]) -> None:
        start = self.num_tokens[slot]
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(f"output runs past max_model_len {self.max_model_len}")
        self.token_ids[slot, start:end] = token_ids
        self.num_tokens[slot] = end


def _pairs(parts: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(row, values) parts as two flat arrays: each value's row, and the values."""
    rows = np.repeat([i for i, _ in parts], [len(v) for _, v in parts]).astype(np.int64)
    return rows, np.concatenate([v for _, v in parts]).astype(np.int64)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ranges ``[start, start + length)``, as int64."""
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    ranges: npt.NDArray[np.int64] = np.arange(total, dtype=np.int64) + np.repeat(
        starts.astype(np.int64) - offsets, lengths
    )
    return ranges


# A bad word's entry before its last token that matches whatever output stands there (its
# words are right-aligned: a shorter one leaves the left columns to this).
ANY_TOKEN = -2


def bad_word_arrays(sequences: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each bad word sequence's last token [P], and the tokens before it [P, width] right-
    aligned, ANY_TOKEN to their left (width: the longest's, at least 1)."""
    width = max(1, max(map(len, sequences)) - 1)
    before = np.full((len(sequences), width), ANY_TOKEN, dtype=np.int64)
    for p, seq in enumerate(sequences):
        if len(seq) > 1:
            before[p, width - len(seq) + 1 :] = seq[:-1]
    return np.array([seq[-1] for seq in sequences], dtype=np.int64), before


def token_bitmask(token_ids: tuple[int, ...], vocab_size: int | None) -> bytes:
    """The packed int32 bitmask (little-endian words, token t at bit t % 32 of word t // 32)
    of ``token_ids``, as structured outputs' bitmasks are packed."""
    if vocab_size is None:
        raise ValueError("allowed_token_ids needs the batch's vocab_size")
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.max() >= vocab_size:
        raise ValueError(f"allowed_token_ids holds {int(ids.max())}, past the vocabulary")
    words = np.zeros(cdiv(vocab_size, 32), dtype=np.uint32)
    np.bitwise_or.at(words, ids >> 5, np.left_shift(1, ids & 31).astype(np.uint32))
    return words.astype("<u4").tobytes()
