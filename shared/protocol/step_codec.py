"""The msgpack wire format of step plans and step results (see ``step``).

One msgpack array per message, ``[type_tag, PROTOCOL_VERSION, ...]`` (see
``envelope``), with lists of ints as plain msgpack arrays and repeated records
sent column by column (one array per field) because building per-record arrays
costs more than the whole rest of the encoding. Every decoder checks types and
raises ``ProtocolError`` naming the first problem it finds.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable
from itertools import accumulate, chain
from typing import Any

from weir.shared.pooling import POOLING_TYPES
from weir.shared.protocol.checks import (
    array,
    bad_element,
    int_list_map,
    int_lists,
    ints,
    non_negative_int,
    request_id_map,
    strs,
)
from weir.shared.protocol.envelope import ProtocolError, pack_array, unpack_array
from weir.shared.protocol.step import (
    PROFILE_ACTIONS,
    WAKE_TAGS,
    CachedRequestData,
    NewRequest,
    SampleLogprobs,
    StepPlan,
    StepResult,
)
from weir.shared.sampling import SamplingParams

_LITTLE_ENDIAN = sys.byteorder == "little"  # the wire's uint32 order: decode by a cast

_STEP_PLAN = "StepPlan"
_STEP_RESULT = "StepResult"

# Per-request columns dominate a decode-heavy step (256 ids, counts, tokens), so they
# travel in the cheapest forms msgpack can carry: ids as one "\0"-joined string and
# non-negative ints as little-endian uint32 bytes. Neither needs the per-element type
# check a msgpack array of ints or strings would; benchmarks/scheduler_overhead.py
# measures the result.


def _join_ids(name: str, ids: list[str]) -> str | None:
    if not ids:
        return None
    try:
        joined = "\0".join(ids)
    except TypeError:
        raise bad_element(name, ids, str) from None
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
    values = (
        memoryview(value).cast("I").tolist()
        if _LITTLE_ENDIAN
        else list(struct.unpack(f"<{length}I", value))
    )
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
    value = array(name, value)
    if len(value) != 2:
        raise ProtocolError(f"{name}: expected [flat, lengths]")
    if value[1] is None:
        return [[t] for t in _from_u32(name, value[0], num_rows)]
    lengths = _from_u32(f"{name} lengths", value[1], num_rows)
    flat = _from_u32(name, value[0], sum(lengths))
    ends = list(accumulate(lengths))
    return [flat[end - n : end] for n, end in zip(lengths, ends)]


def _sampling_params(name: str, value: Any) -> SamplingParams:
    try:
        return SamplingParams.from_dict(value)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"{name}: {exc}") from None


def _logprobs_to_wire(lp: SampleLogprobs | None) -> list[Any] | None:
    if lp is None:
        return None
    return [lp.token_ids, lp.logprobs] + ([] if lp.ranks is None else [lp.ranks])


def _logprobs_from_wire(name: str, value: Any) -> SampleLogprobs | None:
    if value is None:
        return None
    value = array(name, value)
    if len(value) not in (2, 3):
        raise ProtocolError(
            f"{name}: expected [token_ids, logprobs] or [token_ids, logprobs, ranks]"
        )
    token_ids = int_lists(f"{name}.token_ids", value[0])
    logprobs = array(f"{name}.logprobs", value[1])
    if len(logprobs) != len(token_ids):
        raise ProtocolError(f"{name}: {len(token_ids)} token rows but {len(logprobs)} logprob rows")
    for i, (ids, lps) in enumerate(zip(token_ids, logprobs)):
        array(f"{name}.logprobs[{i}]", lps)
        if len(ids) != len(lps) or not ids:
            raise ProtocolError(f"{name}: row {i} has {len(ids)} token ids and {len(lps)} logprobs")
        if set(map(type, lps)) != {float}:
            raise bad_element(f"{name}.logprobs[{i}]", lps, float)
    ranks = None if len(value) == 2 else ints(f"{name}.ranks", value[2])
    if ranks is not None and len(ranks) != len(token_ids):
        raise ProtocolError(f"{name}: {len(token_ids)} token rows but {len(ranks)} ranks")
    return SampleLogprobs(token_ids, logprobs, ranks)


def _logprobs_map_to_wire(logprobs: dict[str, SampleLogprobs] | None) -> Any:
    if logprobs is None:
        return None
    return {rid: _logprobs_to_wire(lp) for rid, lp in logprobs.items()}


def _logprobs_map_from_wire(name: str, value: Any) -> dict[str, SampleLogprobs] | None:
    if value is None:
        return None
    by_id: dict[str, SampleLogprobs] = {}
    for rid, wire in request_id_map(name, value).items():
        logprobs = _logprobs_from_wire(f"{name}[{rid!r}]", wire)
        if logprobs is None:
            raise ProtocolError(f"{name}[{rid!r}]: expected [token_ids, logprobs], got nil")
        by_id[rid] = logprobs
    return by_id


# ----------------------------------------------------------------------------- StepPlan
# [tag, v, step_id, total, cached_ids, num_scheduled (cached then new, uint32; nil = all 1),
#  cached_num_computed (uint32), cached_new_block_ids {id: [..]}, resumed {id: [outputs]},
#  new: [ids, prompts, sampling_params, block_ids, num_computed, {id: [outputs]},
#        {id: lora_name}, {id: pooling type}, {id: [image bytes]}],
#  spec {id: [tok]}, preempted_ids, finished_ids, grammar_bitmask {id: bytes},
#  lora_adapters {adapter id: [path, fingerprint]} | nil, load_weights path | nil]


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
            raise ProtocolError(
                f"num_scheduled_tokens: no entry for scheduled request {exc}"
            ) from None
    return pack_array(
        _STEP_PLAN,
        [
            plan.step_id,
            plan.total_num_scheduled_tokens,
            _join_ids("cached_requests.req_ids", cached.req_ids),
            counts,
            _u32("cached_requests.num_computed_tokens", cached.num_computed_tokens),
            cached.new_block_ids,
            cached.resumed_output_token_ids,
            [
                new_ids,
                [r.prompt_token_ids for r in new],
                [r.sampling_params.to_dict() for r in new],
                [r.block_ids for r in new],
                [r.num_computed_tokens for r in new],
                {r.request_id: r.output_token_ids for r in new if r.output_token_ids},
                {r.request_id: r.lora_name for r in new if r.lora_name is not None},
                {r.request_id: r.pooling for r in new if r.pooling is not None},
                {r.request_id: r.images for r in new if r.images},
            ],
            plan.scheduled_spec_decode_tokens,
            plan.preempted_req_ids,
            plan.finished_req_ids,
            plan.grammar_bitmask,
            plan.lora_adapters,
            plan.load_weights,
            plan.sleep_level,
            plan.wake_tags,
            plan.profile,
        ],
    )


def _decode_new_requests(value: Any) -> list[NewRequest]:
    cols = array("new_requests", value)
    if len(cols) != 9:
        raise ProtocolError("new_requests: expected 9 columns")
    ids = strs("new_requests.request_id", cols[0])
    prompts = int_lists("new_requests.prompt_token_ids", cols[1])
    params = array("new_requests.sampling_params", cols[2])
    blocks = int_lists("new_requests.block_ids", cols[3])
    computed = ints("new_requests.num_computed_tokens", cols[4])
    outputs = int_list_map("new_requests.output_token_ids", cols[5])
    loras = request_id_map("new_requests.lora_name", cols[6])
    if not all(type(name) is str for name in loras.values()):
        raise bad_element("new_requests.lora_name", list(loras.values()), str)
    pooling = request_id_map("new_requests.pooling", cols[7])
    if not all(kind in POOLING_TYPES for kind in pooling.values()):
        raise ProtocolError(f"new_requests.pooling: each must be one of {POOLING_TYPES}")
    images = request_id_map("new_requests.images", cols[8])
    if not all(
        type(encoded) is list and all(type(image) is bytes for image in encoded)
        for encoded in images.values()
    ):
        raise ProtocolError("new_requests.images: each must be a list of bytes")
    if not len(ids) == len(prompts) == len(params) == len(blocks) == len(computed):
        raise ProtocolError("new_requests: columns have different lengths")
    return [
        NewRequest(
            rid,
            prompt,
            _sampling_params(f"new_requests[{rid!r}].sampling_params", sp),
            blk,
            n,
            outputs.get(rid, []),
            loras.get(rid),
            pooling.get(rid),
            images.get(rid, []),
        )
        for rid, prompt, sp, blk, n in zip(ids, prompts, params, blocks, computed)
    ]


def decode_step_plan(data: bytes) -> StepPlan:
    msg = unpack_array(data, _STEP_PLAN, 17)
    step_id = non_negative_int("step_id", msg[2])
    total = non_negative_int("total_num_scheduled_tokens", msg[3])
    cached_ids = _split_ids("cached_requests.req_ids", msg[4])
    new_requests = _decode_new_requests(msg[9])
    scheduled_ids = (
        cached_ids + [r.request_id for r in new_requests] if new_requests else cached_ids
    )
    if msg[5] is None:
        counts_sum = len(scheduled_ids)
        num_scheduled = dict.fromkeys(scheduled_ids, 1)
    else:
        counts = _from_u32("num_scheduled_tokens", msg[5], len(scheduled_ids), minimum=1)
        counts_sum = sum(counts)
        num_scheduled = dict(zip(scheduled_ids, counts))
    if counts_sum != total:
        raise ProtocolError(
            f"total_num_scheduled_tokens is {total} but the per-request counts sum to {counts_sum}"
        )
    if len(num_scheduled) != len(scheduled_ids):
        raise ProtocolError("num_scheduled_tokens: a request is scheduled twice")
    cached = CachedRequestData(
        cached_ids,
        _from_u32("cached_requests.num_computed_tokens", msg[6], len(cached_ids)),
        int_list_map("cached_requests.new_block_ids", msg[7]),
        int_list_map("cached_requests.resumed_output_token_ids", msg[8]),
    )
    for name, sparse in (
        ("new_block_ids", cached.new_block_ids),
        ("resumed_output_token_ids", cached.resumed_output_token_ids),
    ):
        if not all(map(num_scheduled.__contains__, sparse)):
            raise ProtocolError(f"cached_requests.{name}: names a request that is not scheduled")
    spec = int_list_map("scheduled_spec_decode_tokens", msg[10])
    if not all(map(num_scheduled.__contains__, spec)):
        raise ProtocolError("scheduled_spec_decode_tokens: names a request that is not scheduled")
    return StepPlan(
        num_scheduled,
        total,
        spec,
        new_requests,
        cached,
        strs("preempted_req_ids", msg[11]),
        strs("finished_req_ids", msg[12]),
        step_id,
        _bitmasks(msg[13], num_scheduled),
        _lora_adapters(msg[14]),
        _path("load_weights", msg[15]),
        _sleep_level(msg[16]),
        _wake_tags(msg[17]),
        _profile(msg[18]),
    )


def _sleep_level(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value not in (0, 1, 2)):
        raise ProtocolError("sleep_level: expected 0 (wake up), 1, 2 or nil")
    return value


def _profile(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in PROFILE_ACTIONS:
        raise ProtocolError(f"profile: expected one of {PROFILE_ACTIONS}, or nil")
    return value


def _wake_tags(value: Any) -> list[str] | None:
    if value is not None and (
        type(value) is not list or not value or not all(tag in WAKE_TAGS for tag in value)
    ):
        raise ProtocolError(f"wake_tags: expected some of {WAKE_TAGS}, or nil for both")
    return value


def _path(name: str, value: Any) -> str | None:
    if value is not None and (type(value) is not str or not value):
        raise ProtocolError(f"{name}: expected a directory's path or nil")
    return value


def _lora_adapters(value: Any) -> dict[str, list[str]] | None:
    if value is not None and (
        type(value) is not dict
        or not all(
            type(k) is str and type(v) is list and len(v) == 2 and set(map(type, v)) == {str}
            for k, v in value.items()
        )
    ):
        raise ProtocolError("lora_adapters: expected {adapter id: [path, fingerprint]} or nil")
    return value


def _bitmasks(value: Any, num_scheduled: dict[str, int]) -> dict[str, bytes]:
    if type(value) is not dict or not all(
        type(k) is str and type(v) is bytes and len(v) % 4 == 0 for k, v in value.items()
    ):
        raise ProtocolError("grammar_bitmask: expected {request id: bytes of int32 words}")
    if not all(map(num_scheduled.__contains__, value)):
        raise ProtocolError("grammar_bitmask: names a request that is not scheduled")
    return value


# ----------------------------------------------------------------------------- StepResult
# [tag, v, step_id, ids, sampled rows, logprobs {id: [token_rows, logprob_rows]} | nil,
#  prompt logprobs (the same) | nil, pooled {id: float32 bytes} | nil,
#  drafts [ids, rows] | nil]


def encode_step_result(result: StepResult) -> bytes:
    sampled = result.sampled_token_ids
    return pack_array(
        _STEP_RESULT,
        [
            result.step_id,
            _join_ids("sampled_token_ids", list(sampled)),
            _pack_rows("sampled_token_ids", sampled.values(), len(sampled)),
            _logprobs_map_to_wire(result.logprobs),
            _logprobs_map_to_wire(result.prompt_logprobs),
            result.pooled,
            _drafts_to_wire(result.draft_token_ids),
        ],
    )


def _drafts_to_wire(drafts: dict[str, list[int]] | None) -> list[Any] | None:
    if drafts is None:
        return None
    return [
        _join_ids("draft_token_ids", list(drafts)),
        _pack_rows("draft_token_ids", drafts.values(), len(drafts)),
    ]


def _drafts(value: Any) -> dict[str, list[int]] | None:
    if value is None:
        return None
    value = array("draft_token_ids", value)
    if len(value) != 2:
        raise ProtocolError("draft_token_ids: expected [ids, rows] or nil")
    ids = _split_ids("draft_token_ids", value[0])
    drafts = dict(zip(ids, _unpack_rows("draft_token_ids", value[1], len(ids))))
    if len(drafts) != len(ids):
        raise ProtocolError("draft_token_ids: a request id appears twice")
    return drafts


def decode_step_result(data: bytes) -> StepResult:
    msg = unpack_array(data, _STEP_RESULT, 7)
    step_id = non_negative_int("step_id", msg[2])
    ids = _split_ids("sampled_token_ids", msg[3])
    sampled = dict(zip(ids, _unpack_rows("sampled_token_ids", msg[4], len(ids))))
    if len(sampled) != len(ids):
        raise ProtocolError("sampled_token_ids: a request id appears twice")
    return StepResult(
        sampled,
        _logprobs_map_from_wire("logprobs", msg[5]),
        step_id,
        _logprobs_map_from_wire("prompt_logprobs", msg[6]),
        _pooled(msg[7]),
        _drafts(msg[8]),
    )


def _pooled(value: Any) -> dict[str, bytes] | None:
    if value is not None and (
        type(value) is not dict
        or not all(
            type(k) is str and type(v) is bytes and len(v) % 4 == 0 for k, v in value.items()
        )
    ):
        raise ProtocolError("pooled: expected {request id: float32 bytes} or nil")
    return value
