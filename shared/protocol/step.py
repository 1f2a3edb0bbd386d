"""The scheduler -> executor step plan and the executor -> scheduler step result.

A step plan is a *diff* against what the executor already holds:

* ``new_requests``: requests the executor does not hold (first scheduling, or again
  after the executor lost its state: a failed step or a new executor). They carry the
  prompt, the sampling parameters, the whole block table and, when sent again, the
  output tokens so far (its token list becomes prompt + these).
* ``cached_requests``: requests the executor already holds, in the scheduler's
  running order. Normally they carry only newly allocated blocks; the executor
  appends the token it sampled itself last step (and, for a speculative decode,
  the draft tokens in ``scheduled_spec_decode_tokens``). A request resumed after a
  preemption has ``resumed=True``: ``new_block_ids`` is then its *whole* new block
  table (replace, don't append) and ``output_token_ids`` every output token so far
  (its token list becomes prompt + these); for other requests that field is None.
* ``preempted_req_ids``: requests preempted in this step (for the record: the executor
  need not act, as they are not scheduled; they come back as ``resumed`` cached
  requests).
* ``finished_req_ids``: forget these (finished, aborted, or stopped by the scheduler
  process since the last plan).

In both request records ``num_computed_tokens`` counts the tokens whose KV is
already in the cache *before* this step, so this step computes positions
``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[id])``. After a
speculative decode with rejected drafts, the next plan's ``num_computed_tokens`` is
smaller than the executor's own count: the scheduler's number is authoritative.

The wire format is in ``step_codec``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from weir.shared.sampling import SamplingParams

# What a sleeping engine wakes (vLLM's wake_up tags): its weights, its KV cache (and CUDA
# graphs, which need the weights).
WAKE_TAGS = ("weights", "kv_cache")
# What a plan may tell the executors' profilers (vLLM's start_profile and stop_profile).
PROFILE_ACTIONS = ("start", "stop")


@dataclass(slots=True)
class NewRequest:
    """Everything an executor needs the first time it sees a request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit tokens: KV already in ``block_ids``
    output_token_ids: list[int] = field(default_factory=list)  # non-empty only when sent again
    lora_name: str | None = None  # the LoRA adapter its tokens run through (None: the base model)
    # A pooling request's pooling type (``shared.pooling.POOLING_TYPES``): its prompt's
    # hidden states come back pooled once computed, and nothing is sampled for it.
    pooling: str | None = None
    # Encoded images whose features take the places of its prompt's image tokens, in order.
    images: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequest:
    """One request the executor already holds (see the module docstring)."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False
    output_token_ids: list[int] | None = None  # set only when ``resumed``


@dataclass(slots=True, eq=False)
class CachedRequestData:
    """The plan's cached requests, stored column by column.

    Iterating or indexing yields ``CachedRequest`` records, so it reads like
    ``list[CachedRequest]``; hot paths use the columns, which cost nothing per
    request that has nothing new to say (a plain decode). ``req_ids`` and
    ``num_computed_tokens`` are aligned, in running order; ``new_block_ids`` holds
    only requests that got blocks this step, ``resumed_output_token_ids`` only
    requests resumed after a preemption (all their output tokens so far).
    """

    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    resumed_output_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def from_records(cls, records: Iterable[CachedRequest]) -> CachedRequestData:
        out = cls()
        for r in records:
            out.append(
                r.request_id,
                r.new_block_ids,
                r.num_computed_tokens,
                r.output_token_ids if r.resumed else None,
            )
        return out

    def append(
        self,
        request_id: str,
        new_block_ids: list[int],
        num_computed_tokens: int,
        resumed_output_token_ids: list[int] | None = None,
    ) -> None:
        self.req_ids.append(request_id)
        self.num_computed_tokens.append(num_computed_tokens)
        if new_block_ids:
            self.new_block_ids[request_id] = new_block_ids
        if resumed_output_token_ids is not None:
            self.resumed_output_token_ids[request_id] = resumed_output_token_ids

    def __len__(self) -> int:
        return len(self.req_ids)

    def __getitem__(self, index: int) -> CachedRequest:
        rid = self.req_ids[index]
        outputs = self.resumed_output_token_ids.get(rid)
        return CachedRequest(
            rid,
            self.new_block_ids.get(rid, []),
            self.num_computed_tokens[index],
            outputs is not None,
            outputs,
        )

    def __iter__(self) -> Iterator[CachedRequest]:
        return map(self.__getitem__, range(len(self.req_ids)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CachedRequestData):
            return (
                self.req_ids == other.req_ids
                and self.num_computed_tokens == other.num_computed_tokens
                and self.new_block_ids == other.new_block_ids
                and self.resumed_output_token_ids == other.resumed_output_token_ids
            )
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"CachedRequestData({list(self)!r})"


@dataclass(slots=True)
class StepPlan:
    """What one forward pass computes. ``num_scheduled_tokens`` has one entry per
    scheduled request (new and cached); a speculative decode counts its drafts there
    too (1 real token + ``len(scheduled_spec_decode_tokens[id])``). A list of
    ``CachedRequest`` given as ``cached_requests`` is converted to columns."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: CachedRequestData = field(default_factory=CachedRequestData)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    step_id: int = 0
    # Of requests with a structured output that this step samples for: the tokens allowed,
    # bit ``t % 32`` of little-endian int32 word ``t // 32``.
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)
    # Every LoRA adapter the executor is to hold (id -> [PEFT directory, fingerprint of its
    # files]), when that set changed since the last plan or the executor may have lost it;
    # None: as it was.
    lora_adapters: dict[str, list[str]] | None = None
    # A model directory whose weights the executor loads before this step (its
    # architecture the served one's), when they changed since the last plan or the
    # executor may have started with others; None: as they are.
    load_weights: str | None = None
    # Sleep mode (vLLM's): 1 frees the KV cache and moves the weights to host memory, 2 frees
    # both, 0 wakes up (an awake executor has nothing to do); None: as it is. Sent while the
    # engine is paused and settled, with nothing scheduled.
    sleep_level: int | None = None
    # What sleep_level 0 wakes, of WAKE_TAGS (vLLM's tags: the weights first, then the KV
    # cache, so that new weights load between the two); None: both.
    wake_tags: list[str] | None = None
    # Of PROFILE_ACTIONS: the executors start torch.profiler before this step, or stop it and
    # write what it recorded (sent while the engine is paused and settled); None: as it is.
    profile: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cached_requests, CachedRequestData):
            self.cached_requests = CachedRequestData.from_records(self.cached_requests)


@dataclass(slots=True)
class SampleLogprobs:
    """Logprobs of the tokens sampled for one request in one step, one row per token.

    Row ``i`` describes sampled token ``i``: ``token_ids[i][0]`` is the sampled token
    and ``logprobs[i][0]`` its logprob; entries ``1..n`` are the ``n`` most likely
    tokens (most likely first, ``n = SamplingParams.logprobs``), which may include
    the sampled token again.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    # A prompt's rows: each row's token's rank in its distribution (1: the likeliest).
    ranks: list[int] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> SampleLogprobs:
        """The first ``n`` rows (used when output is truncated at a stop)."""
        ranks = None if self.ranks is None else self.ranks[:n]
        return SampleLogprobs(self.token_ids[:n], self.logprobs[:n], ranks)


@dataclass(slots=True)
class StepResult:
    """What the executor (rank 0) sends back after a step.

    ``sampled_token_ids[id]`` holds one token for a normal step; for a speculative
    decode, the accepted draft tokens followed by one bonus/correction token, so the
    scheduler infers rejections from its length. A request whose prefill is still
    partial after this step produces no tokens and may be absent.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, SampleLogprobs] | None = None
    step_id: int = 0
    # Of requests asking for prompt logprobs, a row per prompt token this step's tokens
    # predict: row i of a request whose step began at num_computed_tokens c is token c + 1 + i.
    prompt_logprobs: dict[str, SampleLogprobs] | None = None
    # Of pooling requests whose prompt this step completed: the pooled hidden state,
    # float32 little-endian bytes.
    pooled: dict[str, bytes] | None = None
    # A draft model's proposals for each request it sampled for (speculative method
    # ``draft_model``): the next step's drafts, which the scheduler caps and schedules.
    draft_token_ids: dict[str, list[int]] | None = None
