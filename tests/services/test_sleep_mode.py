"""vLLM's sleep mode: the executors give their memory back until woken, requests wait
meanwhile, and outputs after waking are those before; through `LLM` and the HTTP routes."""

import threading

import httpx
import pytest
from serving_helpers import small_server

from weir.services.llm import LLM
from weir.shared.client import InvalidRequestError
from weir.shared.protocol.client import (
    ClientProtocolError,
    EngineControlRequest,
    decode_client_message,
    encode_client_message,
)
from weir.shared.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmRSS:"))
    return int(kib) * 1024


def test_sleeping_executors_free_their_memory_and_wake_to_the_same_outputs(default_model_dir):
    """The default model (540 MB of float32 weights): level 2 gives them back to the system
    (the executor's resident set falls by most of it), a request sent while asleep waits,
    and after waking (weights read again from disk) and after a level-1 sleep the greedy
    outputs are those before."""
    prompt = "The capital of France is"
    with LLM(str(default_model_dir), kv_cache_memory="64MiB") as llm:
        before = llm.generate([prompt], GREEDY)[0].token_ids
        executor = llm.server_info["executors"][0]["pid"]
        awake = _rss_bytes(executor)
        llm.sleep(level=2)
        assert llm.is_sleeping()
        assert _rss_bytes(executor) < awake - 300e6
        with pytest.raises(InvalidRequestError, match="wake it up"):
            llm.sleep(level=1)
        waiting: list[list[int]] = []
        sent = threading.Thread(
            target=lambda: waiting.append(llm.generate([prompt], GREEDY)[0].token_ids)
        )
        sent.start()
        sent.join(timeout=1.0)
        assert sent.is_alive() and not waiting  # it waits for the engine to wake
        llm.wake_up()
        sent.join(timeout=60)
        assert waiting == [before] and not llm.is_sleeping()
        llm.sleep(level=1)
        llm.wake_up()
        assert llm.generate([prompt], GREEDY)[0].token_ids == before


def test_the_sleep_routes_of_the_gateway(tiny_model_dir):
    with small_server(tiny_model_dir, "tiny") as processes:
        base = processes.info["http_address"]
        with httpx.Client(base_url=base, timeout=60) as http:
            assert http.get("/is_sleeping").json() == {"is_sleeping": False}
            assert http.post("/sleep", params={"level": 3}).status_code == 400
            assert http.post("/sleep", params={"level": 2}).json() == {"is_sleeping": True}
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            resumed = http.post("/resume")
            assert resumed.status_code == 400 and "wake it up" in resumed.text
            assert http.post("/wake_up", params={"tags": "optimizer"}).status_code == 400
            assert http.post("/wake_up", params={"tags": "kv_cache"}).status_code == 400
            weights = http.post("/wake_up", params={"tags": "weights"})
            assert weights.json() == {"is_sleeping": True}
            assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {
                "is_sleeping": False
            }
            assert http.post("/sleep", params={"level": 1}).json() == {"is_sleeping": True}
            assert http.post("/wake_up").json() == {"is_sleeping": False}
            reply = http.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
            )
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_a_sleep_request_on_the_wire_takes_level_1_or_2_and_waking_its_tags():
    request = EngineControlRequest("s1", "sleep", level=2)
    assert decode_client_message(encode_client_message(request)) == request
    wake = EngineControlRequest("w1", "wake_up", tags=["weights"])
    assert decode_client_message(encode_client_message(wake)) == wake
    for tags, action in (([], "wake_up"), (["gpu"], "wake_up"), ([1], "wake_up")):
        wrong = EngineControlRequest("w2", action, tags=tags)  # type: ignore[list-item]
        with pytest.raises(ClientProtocolError, match="tags are wake_up's"):
            decode_client_message(encode_client_message(wrong))
    with pytest.raises(ClientProtocolError, match="tags are wake_up's"):
        decode_client_message(
            encode_client_message(EngineControlRequest("w3", "sleep", tags=["weights"]))
        )
    for level in (3, 0, True, "1"):
        wrong = EngineControlRequest("s2", "sleep", level=level)  # type: ignore[arg-type]
        with pytest.raises(ClientProtocolError, match=r"level must be one of \(1, 2\)"):
            decode_client_message(encode_client_message(wrong))
