"""Batched token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs,
logit biases and presence, frequency and repetition penalties.

Order follows vLLM: a structured output's mask, banned tokens and logit biases, then penalties
(all of these apply to greedy rows too), then temperature, min-p, top-k and top-p. A sampled
token is `argmax(probs / q)` with `q ~ Exp(1)` per vocab entry (the exponential race, which
draws exactly from `probs`). Rows of seeded requests draw `q` from their own generator seeded
from (seed, output position), so their tokens do not depend on what else is in the batch, on
how the prompt was chunked, or on preemption; other rows share the sampler's generator.
Logprobs are those of the raw model distribution (before temperature and filters).

Nothing here reads a device value on the host: the per-step parameters are decided from the
host arrays in `SamplingBatch.build` and copied to the device without waiting (`to_device`),
so sampling is queued behind the forward pass and the step's one device-to-host copy (the
sampled tokens, `ModelRunner._collect`) is the only point the host waits.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weir.services.executor.input_batch import ANY_TOKEN
from weir.services.executor.transfer import to_device

_MASK64 = (1 << 64) - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def row_seed(seed: int, position: int) -> int:
    """Generator seed for output position `position` of a request seeded with `seed` (splitmix64)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step's logits rows (N rows; a request may own several)."""

    temperature: torch.Tensor | None  # [N] fp32, 0 = greedy; None when every row is greedy
    top_k: torch.Tensor | None  # [N] int64, 0 = off; None when no row filters
    top_p: torch.Tensor | None  # [N] fp32, 1 = off
    min_p: torch.Tensor | None  # [N] fp32, 0 = off
    generators: dict[int, torch.Generator]  # row -> generator of a seeded row
    num_logprobs: int  # top-n alternatives to return per row; -1 = no logprobs
    # (rows, token ids) pairs a row may not produce, e.g. EOS before min_tokens; None = none
    banned: tuple[torch.Tensor, torch.Tensor] | None
    logit_bias: "LogitBias | None" = None
    penalties: "Penalties | None" = None
    # (rows, packed int32 bitmasks [rows, words]) of the only tokens rows may produce: a
    # structured output's, ANDed with allowed_token_ids
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    bad_words: "BadWords | None" = None
    # The structured outputs' masks alone, where logprobs are asked for: vLLM masks the
    # logits with them before the sampler, so its logprobs see them (and nothing after)
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def changes_logits(self) -> bool:
        """Whether something changes logits before they are sampled from."""
        return (
            self.banned is not None
            or self.logit_bias is not None
            or self.penalties is not None
            or self.allowed is not None
            or self.bad_words is not None
        )

    @property
    def all_greedy(self) -> bool:
        return self.temperature is None

    @property
    def argmax_only(self) -> bool:
        """Whether every row's token is its raw logits' argmax and nothing else is asked for
        (no logprobs): the logits may then stay in the model's dtype."""
        return self.all_greedy and self.num_logprobs < 0 and not self.changes_logits

    @classmethod
    def build(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        min_p: np.ndarray,
        *,
        device: torch.device | str,
        seeds: Sequence[tuple[int, int, int]] = (),
        num_logprobs: int = -1,
        banned: Sequence[tuple[int, Sequence[int] | np.ndarray]] = (),
        logit_bias: Sequence[tuple[int, np.ndarray, np.ndarray]] = (),
        penalties: "Penalties | None" = None,
        allowed: Sequence[tuple[int, bytes]] = (),
        bad_words: "BadWords | None" = None,
        grammar: Sequence[tuple[int, bytes]] = (),
    ) -> "SamplingBatch":
        """From host arrays; `seeds` holds (row, seed, output position) for seeded rows,
        `banned` (row, token ids it may not produce), `logit_bias` (row, token ids, biases),
        `allowed` (row, the packed bitmask of the only tokens it may produce) and `grammar`
        (the same, of its structured output alone: read only for logprobs)."""
        device = torch.device(device)
        # SamplingParams (also on the wire: from_dict) already made a tiny temperature 0, but
        # takes any finite one: past float32 it would turn the logits into NaN.
        temperature = np.minimum(temperature, _FLOAT32_MAX)
        all_greedy = not temperature.any()
        sampling = temperature > 0
        # Filters of greedy rows are irrelevant; leave them out so an all-greedy batch stays one argmax.
        use_top_k = bool((top_k[sampling] > 0).any())
        use_top_p = bool((top_p[sampling] < 1).any())
        use_min_p = bool((min_p[sampling] > 0).any())
        generators = {}
        for row, seed, position in seeds:
            if temperature[row] > 0:
                generators[row] = torch.Generator(device=device).manual_seed(
                    row_seed(seed, position)
                )
        banned_index = None
        if banned:
            ids = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in banned])
            rows = np.repeat(np.array([row for row, _ in banned]), [len(i) for _, i in banned])
            banned_index = (to_device(rows, device), to_device(ids, device))
        return cls(
            # Nothing reads a greedy batch's temperatures: not copied to the device.
            temperature=None if all_greedy else to_device(temperature.astype(np.float32), device),
            top_k=to_device(top_k.astype(np.int64), device) if use_top_k else None,
            top_p=to_device(top_p.astype(np.float32), device) if use_top_p else None,
            min_p=to_device(min_p.astype(np.float32), device) if use_min_p else None,
            generators=generators,
            num_logprobs=num_logprobs,
            banned=banned_index,
            logit_bias=LogitBias.build(logit_bias, device) if logit_bias else None,
            penalties=penalties,
            bad_words=bad_words,
            allowed=_row_masks(allowed, device),
            grammar=_row_masks(grammar, device) if num_logprobs >= 0 else None,
        )


def _row_masks(
    masks: Sequence[tuple[int, bytes]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, packed int32 bitmasks [rows, words]) on ``device`` of (row, bitmask) pairs."""
    if not masks:
        return None
    rows = np.array([row for row, _ in masks], dtype=np.int64)
    words = np.stack([np.frombuffer(mask, dtype="<i4") for _, mask in masks])
    return to_device(rows, device), to_device(words, device)


@dataclass(slots=True)
class BadWords:
    """Tokens that would end a bad word: pair p bans token ``last[p]`` in row ``rows[p]``
    when that row's last outputs (``history[p]``, right-aligned, -1 before the first output)
    are ``prefix[p]`` (right-aligned, ``input_batch.ANY_TOKEN`` where the word is shorter)."""

    rows: torch.Tensor  # [P] int64
    last: torch.Tensor  # [P] int64
    prefix: torch.Tensor  # [P, M] int64
    history: torch.Tensor  # [P, M] int64

    def apply_(self, logits: torch.Tensor) -> None:
        """-inf at every matched (row, token), without reading the match on the host."""
        match = ((self.history == self.prefix) | (self.prefix == ANY_TOKEN)).all(dim=1)
        ban = torch.where(match, float("-inf"), 0.0).to(logits.dtype)
        logits.index_put_((self.rows, self.last), ban, accumulate=True)


@dataclass(slots=True)
class LogitBias:
    """Additions to some logits: ``values[i]`` to row ``rows[i]``'s logit of ``token_ids[i]``."""

    rows: torch.Tensor  # [B] int64
    token_ids: torch.Tensor  # [B] int64
    values: torch.Tensor  # [B] fp32

    @classmethod
    def build(
        cls, biases: Sequence[tuple[int, np.ndarray, np.ndarray]], device: torch.device
    ) -> "LogitBias":
        rows = np.repeat([row for row, _, _ in biases], [len(ids) for _, ids, _ in biases])
        return cls(
            to_device(rows.astype(np.int64), device),
            to_device(np.concatenate([ids for _, ids, _ in biases]), device),
            to_device(np.concatenate([values for _, _, values in biases]), device),
        )


@dataclass(slots=True)
class Penalties:
    """Presence, frequency and repetition penalties of the logits rows ``rows`` (P of them).
    ``output`` pairs (index into ``rows``, token id) for every token each row's request has
    output before the token it samples; ``prompt`` the same for its prompt's tokens, where
    its repetition penalty needs them (None where no row's does)."""

    rows: torch.Tensor  # [P] int64
    presence: torch.Tensor  # [P] fp32
    frequency: torch.Tensor  # [P] fp32
    repetition: torch.Tensor  # [P] fp32
    output: tuple[torch.Tensor, torch.Tensor]
    prompt: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(slots=True)
class Logprobs:
    token_logprobs: torch.Tensor  # [N] logprob of the sampled token
    top_ids: torch.Tensor  # [N, n]
    top_logprobs: torch.Tensor  # [N, n]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: Logprobs | None


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima; a NaN before any number, as argmax). On
    a CPU, `max`'s indices: its vectorized reduction runs 2.7x `argmax`'s (0.49 vs 1.33 ms
    over 38 rows of a 49,152-token vocabulary, 2 threads) with the same ties (tested); the
    GPU keeps the argmax its graphs and tests were measured with."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size] of packed int32 rows: token t is bit t % 32 of word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()


def mask_rows_(logits: torch.Tensor, masks: tuple[torch.Tensor, torch.Tensor]) -> None:
    """-inf in place for each token a row's packed bitmask does not allow."""
    rows, words = masks
    logits[rows] = logits[rows].masked_fill(~unpack_bitmask(words, logits.shape[1]), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th kept) and its smallest nucleus of mass >= p."""
    if logits.device.type != "cpu":
        return _sort_and_filter(logits, top_k, top_p)
    # Reading the parameters and the candidates' mass is free on a CPU (on a GPU a wait).
    kept, unsure = _filter_candidates(logits, top_k, top_p)
    if unsure.any():
        kept[unsure] = _sort_and_filter(
            logits[unsure],
            None if top_k is None else top_k[unsure],
            None if top_p is None else top_p[unsure],
        )
    return kept


def _sort_and_filter(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """``apply_top_k_top_p`` over whole sorted rows."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


# The largest logits a CPU takes (`topk`) to filter a row by top-k and top-p, sorted alone:
# a full sort of 256 rows of 49,152 took 419 ms on 2 cores, `topk` of 1,025 48 ms. A row
# whose filters may keep a logit past them is sorted whole.
CPU_FILTER_CANDIDATES = 1024


def _filter_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_top_k_top_p`` from each row's largest logits alone, and the rows they do not
    decide (their filters may keep a logit past them: top-k over more than the candidates,
    ties at the k-th reaching past them, a nucleus that their mass does not hold)."""
    rows, vocab = logits.shape
    k = torch.full((rows,), vocab) if top_k is None else torch.where(top_k > 0, top_k, vocab)
    k = k.clamp(max=vocab)
    # A p that float32 rounds to 0 still keeps the likeliest token, as a sorted row does.
    p = torch.ones(rows) if top_p is None else top_p.clamp(min=torch.finfo(top_p.dtype).tiny)
    limited, nucleus = k < vocab, p < 1
    filtered = limited | nucleus
    if not filtered.any():
        return logits, filtered
    needed = torch.where(limited, k, CPU_FILTER_CANDIDATES)
    count = min(int(needed[filtered].max()), CPU_FILTER_CANDIDATES, vocab - 1)
    # One more than needed: the first logit left out tells whether a filter reaches it.
    values, order = logits.topk(count + 1, dim=-1)
    kth = values.gather(1, (k.clamp(max=count) - 1).unsqueeze(1)).squeeze(1)
    kth = torch.where(limited, kth, float("-inf"))
    unsure = filtered & (needed > count)
    unsure |= limited & kth.isfinite() & (values[:, count] >= kth)
    values = values.masked_fill(values < kth.unsqueeze(1), float("-inf"))
    # A top-k row's nucleus is of its kept logits (all among the candidates); another's, of the
    # whole row.
    whole = nucleus & ~limited
    total = torch.logsumexp(values, dim=-1)
    if whole.any():
        total = torch.where(whole, torch.logsumexp(logits, dim=-1), total)
    probs = torch.exp(values - total.unsqueeze(1))
    above = probs.cumsum(dim=-1) - probs  # each candidate's mass ranked above it
    unsure |= whole & (above[:, count] < p)
    values = values.masked_fill((above >= p.unsqueeze(1)) & nucleus.unsqueeze(1), float("-inf"))
    kept = torch.full_like(logits, float("-inf")).scatter_(1, order, values)
    return torch.where(filtered.unsqueeze(1), kept, logits), unsure


def apply_penalties_(logits: torch.Tensor, penalties: Penalties) -> None:
    """vLLM's (and OpenAI's) penalties: a repeated token's logit is divided by the repetition
    penalty when positive (multiplied when not), then lowered by the presence penalty once
    and the frequency penalty per occurrence in the output.

    Only the logits of tokens that occurred are touched (no pass over the vocabulary: on a
    CPU, 64 penalized rows cost 20-30 ms a step that way). A token's pairs may repeat: each
    writes the same value. Occurrences are counted by sorting, not ``unique`` (whose size
    the host would have to wait for). In place."""
    p = penalties
    vocab = logits.shape[1]
    flat = logits.view(-1)
    out_row, out_token = p.output
    outputs = p.rows[out_row] * vocab + out_token
    seen, seen_row = outputs, out_row
    if p.prompt is not None:
        seen = torch.cat((outputs, p.rows[p.prompt[0]] * vocab + p.prompt[1]))
        seen_row = torch.cat((out_row, p.prompt[0]))
    x = flat[seen]
    repetition = p.repetition[seen_row]
    flat[seen] = torch.where(x > 0, x / repetition, x * repetition)
    ordered = outputs.sort().values
    counts = torch.searchsorted(ordered, outputs, right=True) - torch.searchsorted(ordered, outputs)
    flat[outputs] = flat[outputs] - p.presence[out_row] - p.frequency[out_row] * counts


# What a token the logits rule out (-inf) reports, as vLLM's API writes it: JSON has no -inf.
MIN_LOGPROB = -9999.0


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> Logprobs:
    logprobs = torch.log_softmax(logits, dim=-1).clamp_(min=MIN_LOGPROB)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return Logprobs(token_logprobs, top_ids, top_logprobs)


def token_ranks(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's token's rank in its row, 1 for the likeliest (vLLM's: the tokens at least
    as likely, itself included, so a tie ranks each of its tokens last among them)."""
    token_logits = logits.gather(1, token_ids.unsqueeze(1))
    return (logits >= token_logits).sum(-1)


class Sampler:
    """Samples one token per logits row. Holds the generator shared by unseeded rows."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, vocab] raw model logits, fp32 (or any dtype if ``batch.argmax_only``)."""
        raw = logits
        if batch.changes_logits:
            logits = logits.clone()  # the raw logits stay for the logprobs
        if batch.allowed is not None:
            mask_rows_(logits, batch.allowed)
        if batch.bad_words is not None:
            batch.bad_words.apply_(logits)
        if batch.banned is not None:
            logits.index_put_(batch.banned, torch.full((), float("-inf"), device=logits.device))
        if batch.logit_bias is not None:
            bias = batch.logit_bias
            logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
        if batch.penalties is not None:
            apply_penalties_(logits, batch.penalties)
        greedy = greedy_tokens(logits)
        if batch.all_greedy:
            token_ids = greedy
        else:
            # A batch that is not all greedy has its temperatures (``build``).
            token_ids = torch.where(
                batch.temperature == 0,  # type: ignore[arg-type]
                greedy,
                self._sample(logits, batch),
            )
        logprobs = None
        if batch.num_logprobs >= 0:
            if batch.grammar is not None:  # vLLM's logprobs: after the grammar, before the rest
                raw = raw.clone()
                mask_rows_(raw, batch.grammar)
            logprobs = compute_logprobs(raw, token_ids, batch.num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        assert batch.temperature is not None
        temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
        logits = logits / temperature.unsqueeze(1)
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.top_k is not None or batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        draw = draw_by_inverse_cdf if probs.device.type == "cpu" else draw_by_race
        return draw(probs, self.generator, batch.generators)


def draw_by_race(
    probs: torch.Tensor, generator: torch.Generator, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """One token a row, each with its probability: the argmax of probs / q, q exponential
    draws (one a logit, from ``generators[row]`` for its rows, else ``generator``). No
    cumulative sums, all at once: the GPU's."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    for row, row_generator in generators.items():
        q[row].exponential_(generator=row_generator)
    # A zero draw would turn a filtered-out token's 0/0 into NaN, which argmax prefers.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def draw_by_inverse_cdf(
    probs: torch.Tensor, generator: torch.Generator, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """One token a row, each with its probability: where one uniform draw a row falls in its
    cumulative probabilities. The CPU's: its generator makes one number at a time, and the
    race's number a logit took 207 ms for 256 rows of 49,152 on 2 cores, against 18 ms for the
    sums (a temperature-only sampler call: 255 ms with the race, 49 ms with this)."""
    draws = torch.rand(len(probs), 1, generator=generator, dtype=probs.dtype)
    for row, row_generator in generators.items():
        draws[row] = torch.rand(1, generator=row_generator, dtype=probs.dtype)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Below the total, so that a token is found, and one of positive probability: the first
    # whose cumulative sum exceeds the point has more than the token before it.
    point = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(1)
