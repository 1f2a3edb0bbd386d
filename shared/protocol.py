"""Messages between the scheduler and the executors, and their msgpack wire format.

A step plan is a *diff* against what the executor already holds:

* ``new_requests``: requests the executor has never seen (first scheduling). They
  carry the prompt, the sampling parameters and the whole block table.
* ``cached_requests``: requests the executor already holds, in the scheduler's
  running order. Normally they carry only newly allocated blocks; the executor
  appends the token it sampled itself last step (and, for a speculative decode,
  the draft tokens in ``scheduled_spec_decode_tokens``). A request resumed after a
  preemption has ``resumed=True``: ``new_block_ids`` is then its *whole* new block
  table (replace, don't append) and ``output_token_ids`` every output token so far
  (its token list becomes prompt + these); for other requests that field is None.
* ``preempted_req_ids``: drop these from the batch but keep their state (prompt,
  sampling parameters, RNG): they come back as ``resumed`` cached requests.
* ``finished_req_ids``: forget these (finished, aborted, or stopped by the scheduler
  process since the last plan).

In both request records ``num_computed_tokens`` counts the tokens whose KV is
already in the cache *before* this step, so this step computes positions
``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[id])``. After a
speculative decode with rejected drafts, the next plan's ``num_computed_tokens`` is
smaller than the executor's own count: the scheduler's number is authoritative.

Wire format: one msgpack array per message, ``[type_tag, PROTOCOL_VERSION, ...]``,
with lists of ints as plain msgpack arrays and repeated records sent column by
column (one array per field) because building per-record arrays costs more than
the whole rest of the encoding. Never pickle. Every decoder checks types and
raises ``ProtocolError`` (a ``ValueError``) naming the first problem it finds.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any, Iterable, Iterator

import msgpack

from weir.shared.sampling import SamplingParams

PROTOCOL_VERSION = 1

_LITTLE_ENDIAN = sys.byteorder == "little"  # the wire's uint32 order: decode by a cast

_STEP_PLAN = "StepPlan"
_STEP_RESULT = "StepResult"
_REQUEST_OUTPUTS = "RequestOutputs"


class ProtocolError(ValueError):
    """A message that cannot be decoded: bad msgpack, wrong version, wrong types."""


@dataclass(slots=True)
class NewRequest:
    """Everything an executor needs the first time it sees a request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit tokens: KV already in ``block_ids``


@dataclass(slots=True)
class CachedRequest:
    """One request the executor already holds (see the module docstring)."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False
    output_token_ids: list[int] | None = None  # set only when ``resumed``


@dataclass(slots=True, eq=False)
class CachedRequests:
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
    def from_records(cls, records: Iterable[CachedRequest]) -> CachedRequests:
        out = cls()
        for r in records:
            out.append(r.request_id, r.new_block_ids, r.num_computed_tokens,
                       r.output_token_ids if r.resumed else None)
        return out

    def append(self, request_id: str, new_block_ids: list[int], num_computed_tokens: int,
               resumed_output_token_ids: list[int] | None = None) -> None:
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
        return CachedRequest(rid, self.new_block_ids.get(rid, []),
                             self.num_computed_tokens[index], outputs is not None, outputs)

    def __iter__(self) -> Iterator[CachedRequest]:
        return map(self.__getitem__, range(len(self.req_ids)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CachedRequests):
            return (self.req_ids == other.req_ids
                    and self.num_computed_tokens == other.num_computed_tokens
                    and self.new_block_ids == other.new_block_ids
                    and self.resumed_output_token_ids == other.resumed_output_token_ids)
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"CachedRequests({list(self)!r})"


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
    cached_requests: CachedRequests = field(default_factory=CachedRequests)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    step_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.cached_requests, CachedRequests):
            self.cached_requests = CachedRequests.from_records(self.cached_requests)


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

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> SampleLogprobs:
        """The first ``n`` rows (used when output is truncated at a stop)."""
        return SampleLogprobs(self.token_ids[:n], self.logprobs[:n])


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


@dataclass(slots=True)
class RequestOutput:
    """Streamed to the client side after each step that produced tokens or ended a
    request. ``finish_reason`` is "stop", "length" or "abort" once ``finished``.
    ``num_cached_tokens`` is the prefix-cache hit length at (first) admission."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: SampleLogprobs | None = None


FINISH_REASONS = ("stop", "length", "abort")


# ----------------------------------------------------------------------------- helpers
# Per-request columns dominate a decode-heavy step (256 ids, counts, tokens), so they
# travel in the cheapest forms msgpack can carry: ids as one "\0"-joined string and
# non-negative ints as little-endian uint32 bytes. Neither needs the per-element type
# check a msgpack array of ints or strings would; benchmarks/scheduler_overhead.py
# measures the result.

def _unpack(data: Any, tag: str, num_fields: int) -> list[Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{tag}: expected bytes, got {type(data).__name__}")
    try:
        msg = msgpack.unpackb(data)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"{tag}: not valid msgpack ({type(exc).__name__}: {exc})") from None
    if type(msg) is not list or len(msg) < 2:
        raise ProtocolError(f"{tag}: expected a [type, version, ...] array")
    if msg[0] != tag:
        raise ProtocolError(f"expected a {tag} message, got type tag {msg[0]!r}")
    if msg[1] != PROTOCOL_VERSION:
        raise ProtocolError(f"{tag}: unsupported protocol version {msg[1]!r} "
                            f"(this side speaks {PROTOCOL_VERSION})")
    if len(msg) != num_fields + 2:
        raise ProtocolError(f"{tag}: expected {num_fields} fields, got {len(msg) - 2}")
    return msg


def _pack(tag: str, fields: list[Any]) -> bytes:
    try:
        return msgpack.packb([tag, PROTOCOL_VERSION, *fields])
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{tag}: cannot encode ({exc})") from None


def _bad_element(name: str, values: Any, kind: type) -> ProtocolError:
    for i, v in enumerate(values):
        if type(v) is not kind:
            return ProtocolError(f"{name}[{i}]: expected {kind.__name__}, got {type(v).__name__}")
    return ProtocolError(f"{name}: bad value")


def _list(name: str, value: Any) -> list[Any]:
    if type(value) is not list:
        raise ProtocolError(f"{name}: expected an array, got {type(value).__name__}")
    return value


def _dict(name: str, value: Any) -> dict[Any, Any]:
    if type(value) is not dict:
        raise ProtocolError(f"{name}: expected a map, got {type(value).__name__}")
    return value


def _int(name: str, value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{name}: expected a non-negative int, got {value!r}")
    return value


def _strs(name: str, value: Any) -> list[str]:
    value = _list(name, value)
    if value and set(map(type, value)) != {str}:
        raise _bad_element(name, value, str)
    return value


def _ints(name: str, value: Any) -> list[int]:
    value = _list(name, value)
    if value:
        if set(map(type, value)) != {int}:
            raise _bad_element(name, value, int)
        if min(value) < 0:
            raise ProtocolError(f"{name}: negative value {min(value)}")
    return value


def _check_rows(name: str, rows: Any, labels: Any) -> None:
    """Every row a list of non-negative ints; checked over the flattened rows in C,
    walking row by row only to name the culprit."""
    if set(map(type, rows)) != {list}:
        for label, row in zip(labels, rows):
            _list(f"{name}[{label!r}]", row)
    flat = list(chain.from_iterable(rows))
    if flat and (set(map(type, flat)) != {int} or min(flat) < 0):
        for label, row in zip(labels, rows):
            _ints(f"{name}[{label!r}]", row)


def _int_lists(name: str, value: Any) -> list[list[int]]:
    value = _list(name, value)
    if value:
        _check_rows(name, value, range(len(value)))
    return value


def _request_id_map(name: str, value: Any) -> dict[str, Any]:
    value = _dict(name, value)
    if value and set(map(type, value)) != {str}:
        raise ProtocolError(f"{name}: keys must be request id strings")
    return value


def _int_list_map(name: str, value: Any) -> dict[str, list[int]]:
    value = _request_id_map(name, value)
    if value:
        _check_rows(name, value.values(), value.keys())
    return value


def _join_ids(name: str, ids: list[str]) -> str | None:
    if not ids:
        return None
    try:
        joined = "\0".join(ids)
    except TypeError:
        raise _bad_element(name, ids, str) from None
    if joined.count("\0") != len(ids) - 1:
        raise ProtocolError(f"{name}: a request id contains a NUL character")
    return joined


def _split_ids(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if type(value) is not str:
        raise ProtocolError(f"{name}: expected a string, got {type(value).__name__}")
    return value.split("\0")


def _u32(name: str, values: list[int]) -> bytes:
    try:
        return struct.pack(f"<{len(values)}I", *values)
    except struct.error as exc:
        raise ProtocolError(f"{name}: cannot encode as uint32 ({exc})") from None


def _from_u32(name: str, value: Any, length: int, minimum: int = 0) -> list[int]:
    if type(value) is not bytes or len(value) != 4 * length:
        raise ProtocolError(f"{name}: expected {length} uint32 values")
    values = (memoryview(value).cast("I").tolist() if _LITTLE_ENDIAN
              else list(struct.unpack(f"<{length}I", value)))
    if minimum and values and min(values) < minimum:
        raise ProtocolError(f"{name}: value {min(values)} below {minimum}")
    return values


def _pack_rows(name: str, rows: Iterable[list[int]], num_rows: int) -> list[Any]:
    """Rows of ints as [flat uint32, row lengths uint32 or nil when every row has one]."""
    flat = list(chain.from_iterable(rows))
    if len(flat) == num_rows and all(rows):
        return [_u32(name, flat), None]
    return [_u32(name, flat), _u32(name, list(map(len, rows)))]


def _unpack_rows(name: str, value: Any, num_rows: int) -> list[list[int]]:
    value = _list(name, value)
    if len(value) != 2:
        raise ProtocolError(f"{name}: expected [flat, lengths]")
    if value[1] is None:
        return [[t] for t in _from_u32(name, value[0], num_rows)]
    lengths = _from_u32(f"{name} lengths", value[1], num_rows)
    flat = _from_u32(name, value[0], sum(lengths))
    ends = list(accumulate(lengths))
    return [flat[end - n:end] for n, end in zip(lengths, ends)]


def _sampling_params(name: str, value: Any) -> SamplingParams:
    try:
        return SamplingParams.from_dict(value)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"{name}: {exc}") from None


def _logprobs_to_wire(lp: SampleLogprobs | None) -> list[Any] | None:
    return None if lp is None else [lp.token_ids, lp.logprobs]


def _logprobs_from_wire(name: str, value: Any) -> SampleLogprobs | None:
    if value is None:
        return None
    value = _list(name, value)
    if len(value) != 2:
        raise ProtocolError(f"{name}: expected [token_ids, logprobs]")
    token_ids = _int_lists(f"{name}.token_ids", value[0])
    logprobs = _list(f"{name}.logprobs", value[1])
    if len(logprobs) != len(token_ids):
        raise ProtocolError(f"{name}: {len(token_ids)} token rows but {len(logprobs)} logprob rows")
    for i, (ids, lps) in enumerate(zip(token_ids, logprobs)):
        _list(f"{name}.logprobs[{i}]", lps)
        if len(ids) != len(lps) or not ids:
            raise ProtocolError(f"{name}: row {i} has {len(ids)} token ids and {len(lps)} logprobs")
        if set(map(type, lps)) != {float}:
            raise _bad_element(f"{name}.logprobs[{i}]", lps, float)
    return SampleLogprobs(token_ids, logprobs)


def _logprobs_map_to_wire(logprobs: dict[str, SampleLogprobs] | None) -> Any:
    if logprobs is None:
        return None
    return {rid: _logprobs_to_wire(lp) for rid, lp in logprobs.items()}


def _logprobs_map_from_wire(name: str, value: Any) -> dict[str, SampleLogprobs] | None:
    if value is None:
        return None
    return {rid: _logprobs_from_wire(f"{name}[{rid!r}]", lp)
            for rid, lp in _request_id_map(name, value).items()}


# ----------------------------------------------------------------------------- StepPlan
# [tag, v, step_id, total, cached_ids, num_scheduled (cached then new, uint32; nil = all 1),
#  cached_num_computed (uint32), cached_new_block_ids {id: [..]}, resumed {id: [outputs]},
#  new: [ids, prompts, sampling_params, block_ids, num_computed],
#  spec {id: [tok]}, preempted_ids, finished_ids]

def encode_step_plan(plan: StepPlan) -> bytes:
    cached = plan.cached_requests
    new = plan.new_requests
    new_ids = [r.request_id for r in new]
    scheduled = plan.num_scheduled_tokens
    if len(scheduled) != len(cached.req_ids) + len(new_ids):
        raise ProtocolError("num_scheduled_tokens: keys differ from the scheduled requests")
    ordered_ids = chain(cached.req_ids, new_ids)
    if plan.total_num_scheduled_tokens == len(scheduled):
        # One token each (every count is >= 1): a pure decode step sends no counts.
        counts = None
        if not all(map(scheduled.__contains__, ordered_ids)):
            raise ProtocolError("num_scheduled_tokens: keys differ from the scheduled requests")
    else:
        try:
            counts = _u32("num_scheduled_tokens", list(map(scheduled.__getitem__, ordered_ids)))
        except KeyError as exc:
            raise ProtocolError(f"num_scheduled_tokens: no entry for scheduled request {exc}") \
                from None
    return _pack(_STEP_PLAN, [
        plan.step_id, plan.total_num_scheduled_tokens,
        _join_ids("cached_requests.req_ids", cached.req_ids), counts,
        _u32("cached_requests.num_computed_tokens", cached.num_computed_tokens),
        cached.new_block_ids, cached.resumed_output_token_ids,
        [new_ids, [r.prompt_token_ids for r in new],
         [r.sampling_params.to_dict() for r in new], [r.block_ids for r in new],
         [r.num_computed_tokens for r in new]],
        plan.scheduled_spec_decode_tokens, plan.preempted_req_ids, plan.finished_req_ids,
    ])


def _decode_new_requests(value: Any) -> list[NewRequest]:
    cols = _list("new_requests", value)
    if len(cols) != 5:
        raise ProtocolError("new_requests: expected 5 columns")
    ids = _strs("new_requests.request_id", cols[0])
    prompts = _int_lists("new_requests.prompt_token_ids", cols[1])
    params = _list("new_requests.sampling_params", cols[2])
    blocks = _int_lists("new_requests.block_ids", cols[3])
    computed = _ints("new_requests.num_computed_tokens", cols[4])
    if not len(ids) == len(prompts) == len(params) == len(blocks) == len(computed):
        raise ProtocolError("new_requests: columns have different lengths")
    return [NewRequest(rid, prompt, _sampling_params(f"new_requests[{rid!r}].sampling_params", sp),
                       blk, n)
            for rid, prompt, sp, blk, n in zip(ids, prompts, params, blocks, computed)]


def decode_step_plan(data: bytes) -> StepPlan:
    msg = _unpack(data, _STEP_PLAN, 11)
    step_id = _int("step_id", msg[2])
    total = _int("total_num_scheduled_tokens", msg[3])
    cached_ids = _split_ids("cached_requests.req_ids", msg[4])
    new_requests = _decode_new_requests(msg[9])
    scheduled_ids = cached_ids + [r.request_id for r in new_requests] if new_requests \
        else cached_ids
    if msg[5] is None:
        counts_sum = len(scheduled_ids)
        num_scheduled = dict.fromkeys(scheduled_ids, 1)
    else:
        counts = _from_u32("num_scheduled_tokens", msg[5], len(scheduled_ids), minimum=1)
        counts_sum = sum(counts)
        num_scheduled = dict(zip(scheduled_ids, counts))
    if counts_sum != total:
        raise ProtocolError(f"total_num_scheduled_tokens is {total} but the per-request "
                            f"counts sum to {counts_sum}")
    if len(num_scheduled) != len(scheduled_ids):
        raise ProtocolError("num_scheduled_tokens: a request is scheduled twice")
    cached = CachedRequests(
        cached_ids,
        _from_u32("cached_requests.num_computed_tokens", msg[6], len(cached_ids)),
        _int_list_map("cached_requests.new_block_ids", msg[7]),
        _int_list_map("cached_requests.resumed_output_token_ids", msg[8]))
    for name, sparse in (("new_block_ids", cached.new_block_ids),
                         ("resumed_output_token_ids", cached.resumed_output_token_ids)):
        if not all(map(num_scheduled.__contains__, sparse)):
            raise ProtocolError(f"cached_requests.{name}: names a request that is not scheduled")
    spec = _int_list_map("scheduled_spec_decode_tokens", msg[10])
    if not all(map(num_scheduled.__contains__, spec)):
        raise ProtocolError("scheduled_spec_decode_tokens: names a request that is not scheduled")
    return StepPlan(num_scheduled, total, spec, new_requests, cached,
                    _strs("preempted_req_ids", msg[11]), _strs("finished_req_ids", msg[12]),
                    step_id)


# ----------------------------------------------------------------------------- StepResult
# [tag, v, step_id, ids, sampled rows, logprobs {id: [token_rows, logprob_rows]} | nil]

def encode_step_result(result: StepResult) -> bytes:
    sampled = result.sampled_token_ids
    return _pack(_STEP_RESULT, [
        result.step_id, _join_ids("sampled_token_ids", list(sampled)),
        _pack_rows("sampled_token_ids", sampled.values(), len(sampled)),
        _logprobs_map_to_wire(result.logprobs)])


def decode_step_result(data: bytes) -> StepResult:
    msg = _unpack(data, _STEP_RESULT, 4)
    step_id = _int("step_id", msg[2])
    ids = _split_ids("sampled_token_ids", msg[3])
    sampled = dict(zip(ids, _unpack_rows("sampled_token_ids", msg[4], len(ids))))
    if len(sampled) != len(ids):
        raise ProtocolError("sampled_token_ids: a request id appears twice")
    return StepResult(sampled, _logprobs_map_from_wire("logprobs", msg[5]), step_id)


# ----------------------------------------------------------------------------- RequestOutput
# [tag, v, ids, new_token_ids rows, finished [bool], finish_reason [str|nil],
#  num_cached_tokens (uint32), logprobs [..|nil]]

def encode_request_outputs(outputs: list[RequestOutput]) -> bytes:
    tokens = [o.new_token_ids for o in outputs]
    return _pack(_REQUEST_OUTPUTS, [
        _join_ids("outputs.request_id", [o.request_id for o in outputs]),
        _pack_rows("outputs.new_token_ids", tokens, len(tokens)),
        [o.finished for o in outputs], [o.finish_reason for o in outputs],
        _u32("outputs.num_cached_tokens", [o.num_cached_tokens for o in outputs]),
        [_logprobs_to_wire(o.logprobs) for o in outputs]])


def decode_request_outputs(data: bytes) -> list[RequestOutput]:
    msg = _unpack(data, _REQUEST_OUTPUTS, 6)
    ids = _split_ids("outputs.request_id", msg[2])
    n = len(ids)
    tokens = _unpack_rows("outputs.new_token_ids", msg[3], n)
    finished = _list("outputs.finished", msg[4])
    reasons = _list("outputs.finish_reason", msg[5])
    cached = _from_u32("outputs.num_cached_tokens", msg[6], n)
    logprobs = _list("outputs.logprobs", msg[7])
    if not n == len(finished) == len(reasons) == len(logprobs):
        raise ProtocolError("outputs: columns have different lengths")
    if finished and set(map(type, finished)) != {bool}:
        raise _bad_element("outputs.finished", finished, bool)
    for i, (done, reason) in enumerate(zip(finished, reasons)):
        if (reason in FINISH_REASONS) if done else (reason is None):
            continue
        raise ProtocolError(f"outputs[{i}]: finish_reason {reason!r} with finished={done}")
    return [RequestOutput(rid, toks, done, reason, num_cached,
                          _logprobs_from_wire(f"outputs[{rid!r}].logprobs", lp))
            for rid, toks, done, reason, num_cached, lp in
            zip(ids, tokens, finished, reasons, cached, logprobs)]
