"""Wire messages: round trips, and a clear ProtocolError for every malformed input."""

import msgpack
import pytest

from weir.shared.protocol.envelope import PROTOCOL_VERSION, ProtocolError
from weir.shared.protocol.step import (
    CachedRequest,
    CachedRequestData,
    NewRequest,
    SampleLogprobs,
    StepPlan,
    StepResult,
)
from weir.shared.protocol.step_codec import (
    decode_step_plan,
    decode_step_result,
    encode_step_plan,
    encode_step_result,
)
from weir.shared.sampling import SamplingParams


def _plan() -> StepPlan:
    new = [
        NewRequest("n1", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, stop=("x",)), [3, 4], 4),
        NewRequest("n2", [1], SamplingParams(seed=7, logprobs=2), [9], 0, lora_name="sql#2"),
        NewRequest("n3", [4, 4], SamplingParams(), [8], 0, pooling="MEAN"),
        NewRequest("n4", [7, 7, 7], SamplingParams(), [2], 0, images=[b"\x89PNG", b"\xff\xd8"]),
    ]
    cached = [
        CachedRequest("c1", [], 40),
        CachedRequest("c2", [11], 17),
        CachedRequest("c3", [12, 13, 14], 16, resumed=True, output_token_ids=[2, 3]),
    ]
    return StepPlan(
        num_scheduled_tokens={"c1": 3, "c2": 1, "c3": 20, "n1": 1, "n2": 1, "n3": 2, "n4": 3},
        total_num_scheduled_tokens=31,
        scheduled_spec_decode_tokens={"c1": [100, 101]},
        new_requests=new,
        cached_requests=cached,
        preempted_req_ids=["p1"],
        finished_req_ids=["f1", "f2"],
        step_id=12,
        grammar_bitmask={"n1": b"\xff\x00\x00\x01" * 3},
        lora_adapters={"sql": ["/adapters/sql", "fa"], "sql#2": ["/adapters/sql-v2", "fb"]},
        load_weights="/checkpoints/step-200",
        sleep_level=0,
        wake_tags=["weights"],
        profile="stop",
    )


def test_step_plan_round_trip():
    plan = _plan()
    back = decode_step_plan(encode_step_plan(plan))
    assert back == plan
    assert [c.request_id for c in back.cached_requests] == ["c1", "c2", "c3"]
    c3 = back.cached_requests[2]
    assert (c3.new_block_ids, c3.num_computed_tokens, c3.resumed, c3.output_token_ids) == (
        [12, 13, 14],
        16,
        True,
        [2, 3],
    )
    c1 = back.cached_requests[0]
    assert (c1.new_block_ids, c1.resumed, c1.output_token_ids) == ([], False, None)
    assert back.new_requests[0].sampling_params == SamplingParams(temperature=0.0, stop=("x",))


def test_cached_requests_columns_match_records():
    plan = _plan()
    cached = plan.cached_requests
    assert isinstance(cached, CachedRequestData)
    assert cached.req_ids == ["c1", "c2", "c3"]
    assert cached.num_computed_tokens == [40, 17, 16]
    assert cached.new_block_ids == {"c2": [11], "c3": [12, 13, 14]}
    assert cached.resumed_output_token_ids == {"c3": [2, 3]}
    assert len(cached) == 3 and list(cached) == [cached[0], cached[1], cached[2]]


def test_empty_messages_round_trip():
    assert decode_step_plan(encode_step_plan(StepPlan())) == StepPlan()
    assert decode_step_result(encode_step_result(StepResult())) == StepResult()


def test_step_result_round_trip_with_variable_lengths_and_logprobs():
    result = StepResult(
        sampled_token_ids={"a": [1], "b": [2, 3, 4], "c": [], "": [0]},
        logprobs={
            "b": SampleLogprobs(
                [[2, 2, 9], [3, 1, 3], [4, 4, 0]],
                [[-0.5, -0.5, -1.5], [-2.0, -0.1, -2.0], [-0.25, -0.25, float("-inf")]],
            )
        },
        step_id=3,
    )
    assert decode_step_result(encode_step_result(result)) == result
    ranked = StepResult(
        {"x": [7]},
        prompt_logprobs={
            "x": SampleLogprobs([[5, 1], [6, 6]], [[-3.0, -0.5], [-0.1, -0.1]], [9, 1])
        },
    )
    assert decode_step_result(encode_step_result(ranked)) == ranked
    wire = msgpack.unpackb(encode_step_result(ranked))
    wire[6]["x"][2] = [9]  # a rank short
    with pytest.raises(ProtocolError, match="2 token rows but 1 ranks"):
        decode_step_result(msgpack.packb(wire))
    pooled = StepResult({"x": [7]}, pooled={"e": b"\x00\x00\x80?" * 3})
    assert decode_step_result(encode_step_result(pooled)) == pooled
    single = StepResult({"x": [7], "y": [8]})
    assert decode_step_result(encode_step_result(single)) == single
    drafted = StepResult({"x": [7], "y": [8, 9]}, draft_token_ids={"x": [1, 2, 3], "y": []})
    assert decode_step_result(encode_step_result(drafted)) == drafted
    none_proposed = StepResult({"x": [7]}, draft_token_ids={})
    assert decode_step_result(encode_step_result(none_proposed)) == none_proposed


def _raw(message: list) -> bytes:
    return msgpack.packb(message)


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"\xc1", "not valid msgpack"),
        (_raw({"v": 1}), "[type, version"),
        (_raw(["StepResult", PROTOCOL_VERSION, 0, None, [b"", None], None]), "StepPlan message"),
        (_raw(["StepPlan", 99]), "version 99"),
        (_raw(["StepPlan", PROTOCOL_VERSION, 0]), "expected 17 fields"),
    ],
)
def test_step_plan_rejects_bad_envelopes(data, fragment):
    with pytest.raises(ProtocolError, match=fragment.replace("[", r"\[")):
        decode_step_plan(data)


def _plan_fields() -> list:
    return msgpack.unpackb(encode_step_plan(_plan()))


@pytest.mark.parametrize(
    "index, value, fragment",
    [
        (2, -1, "step_id"),
        (3, 27, "total_num_scheduled_tokens"),
        (4, 5, "cached_requests.req_ids"),
        (5, b"\x00" * 3, "num_scheduled_tokens"),
        (6, [1, 2, 3], "cached_requests.num_computed_tokens"),
        (7, {"c2": ["x"]}, "new_block_ids"),
        (7, {"zz": [1]}, "not scheduled"),
        (8, {"c3": [-1]}, "resumed_output_token_ids"),
        (10, {"c1": [1.5]}, "scheduled_spec_decode_tokens"),
        (12, ["f1", 2], r"finished_req_ids\[1\]"),
        (14, {"sql": "/a"}, "lora_adapters: expected {adapter id: \\[path, fingerprint\\]}"),
        (14, {"sql": ["/a", 3]}, "lora_adapters: expected"),
        (14, ["sql"], "lora_adapters: expected"),
        (15, "", "load_weights: expected a directory's path or nil"),
        (15, ["/a"], "load_weights: expected"),
        (16, 3, "sleep_level: expected"),
        (17, [], "wake_tags: expected"),
        (17, ["weights", "gpu"], "wake_tags: expected"),
        (17, "weights", "wake_tags: expected"),
        (17, [["weights"]], "wake_tags: expected"),
        (18, "pause", "profile: expected"),
        (18, 1, "profile: expected"),
    ],
)
def test_step_plan_rejects_wrong_types(index, value, fragment):
    fields = _plan_fields()
    fields[index] = value
    with pytest.raises(ProtocolError, match=fragment):
        decode_step_plan(_raw(fields))


def test_step_plan_rejects_bad_sampling_params_and_new_request_columns():
    fields = _plan_fields()
    fields[9][2][0]["temperature"] = "hot"
    with pytest.raises(ProtocolError, match="n1.*temperature"):
        decode_step_plan(_raw(fields))
    fields = _plan_fields()
    fields[9][1].pop()
    with pytest.raises(ProtocolError, match="different lengths"):
        decode_step_plan(_raw(fields))
    fields = _plan_fields()
    fields[9][1][1] = [1, "2"]
    with pytest.raises(ProtocolError, match=r"prompt_token_ids\[1\]"):
        decode_step_plan(_raw(fields))
    fields = _plan_fields()
    fields[9][7]["n3"] = "MAX"
    with pytest.raises(ProtocolError, match="pooling: each must be one of"):
        decode_step_plan(_raw(fields))
    for images in ([b"png", "png"], b"png"):
        fields = _plan_fields()
        fields[9][8]["n4"] = images
        with pytest.raises(ProtocolError, match="images: each must be a list of bytes"):
            decode_step_plan(_raw(fields))


def test_encoder_rejects_inconsistent_plan():
    plan = _plan()
    del plan.num_scheduled_tokens["n2"]
    with pytest.raises(ProtocolError, match="num_scheduled_tokens"):
        encode_step_plan(plan)
    plan = _plan()
    plan.cached_requests.req_ids[0] = "c\x001"
    plan.num_scheduled_tokens["c\x001"] = plan.num_scheduled_tokens.pop("c1")
    with pytest.raises(ProtocolError, match="NUL"):
        encode_step_plan(plan)


def test_step_result_rejects_wrong_types():
    good = msgpack.unpackb(encode_step_result(StepResult({"a": [1, 2], "b": [3]})))
    for index, value, fragment in [
        (3, 7, "expected a string"),
        (4, [b"\x01\x00\x00\x00", None], "uint32"),
        (4, [b"\x01\x00\x00\x00" * 3, b"\x02\x00\x00\x00\xff\xff\xff\xff"], "uint32"),
        (5, {"a": [[[1]], [[1]]]}, r"logprobs\['a'\].logprobs\[0\]"),
        (5, {"a": [[[1, 2]], [[-0.5]]]}, "row 0"),
        (7, {"a": b"\x00\x00\x80"}, "pooled"),
        (7, [b"\x00\x00\x80?"], "pooled"),
        (8, {"a": [1]}, "draft_token_ids"),
        (8, ["a", [b"\x01\x00\x00\x00", None], None], r"draft_token_ids: expected \[ids, rows\]"),
        (8, ["a\0a", [b"\x01\x00\x00\x00" * 2, None]], "appears twice"),
        (8, ["a", [b"\x01\x00", None]], "uint32"),
    ]:
        fields = list(good)
        fields[index] = value
        with pytest.raises(ProtocolError, match=fragment):
            decode_step_result(_raw(fields))


def test_protocol_error_is_value_error():
    assert issubclass(ProtocolError, ValueError)
    with pytest.raises(ValueError):
        decode_step_result("not bytes")  # type: ignore[arg-type]


def test_pure_decode_plan_round_trip_and_key_check():
    ids = [f"r{i}" for i in range(5)]
    plan = StepPlan(
        {rid: 1 for rid in ids},
        5,
        cached_requests=[
            CachedRequest(rid, [i] if i == 2 else [], 30 + i) for i, rid in enumerate(ids)
        ],
    )
    assert decode_step_plan(encode_step_plan(plan)) == plan
    plan.num_scheduled_tokens = {**{rid: 1 for rid in ids[:4]}, "other": 1}
    with pytest.raises(ProtocolError, match="keys differ"):
        encode_step_plan(plan)
    fields = msgpack.unpackb(encode_step_plan(_plan()))
    fields[5] = None  # "all ones" does not add up to the total
    with pytest.raises(ProtocolError, match="total_num_scheduled_tokens"):
        decode_step_plan(_raw(fields))
