"""Stop strings as the scheduler process publishes a stream, against a reference that
decodes one token at a time, as a server without speculation does (vLLM's rule).

A real ``ClientFrontend`` over a real ``Scheduler`` takes each request from a real ZeroMQ
client; steps of chosen token ids (what an executor would have sampled, one to three per
step, as speculative steps bring) are published as ``EngineStep``s, and the client reads
the frames back. The reference keeps the whole text, appends each token's text (the same
detokenizer), and after every token past the first ``min_tokens`` cuts it at the earliest
stop string that ends in the text of those later tokens: what the client receives, joined,
must be exactly that, with exactly the tokens (and logprob rows) up to the one that
completed the stop, ending as the reference ends; without min_tokens no output may carry a stop string. Stops
are drawn from each case's own text so that most cases stop, some across steps.
"""

import asyncio
import dataclasses
import random

import pytest
import zmq
import zmq.asyncio
from serving_helpers import frontend_over, published_step

from weir.services.engine import frontend as frontend_module
from weir.services.engine.core import EngineStep
from weir.services.engine.frontend import ClientFrontend
from weir.services.scheduler import Scheduler
from weir.services.scheduler.output import EngineOutput
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol import client as client_protocol
from weir.shared.protocol.step import SampleLogprobs
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import IncrementalDetokenizer, Tokenizer

CASES = 150


def _chunks(rng: random.Random, vocab: int) -> tuple[list[int], list[list[int]]]:
    """A prompt, and output tokens in steps of one to three."""
    prompt = [rng.randrange(200, vocab) for _ in range(6)]
    ids = [rng.randrange(200, vocab) for _ in range(rng.randint(1, 24))]
    chunks, i = [], 0
    while i < len(ids):
        chunks.append(ids[i : i + rng.randint(1, 3)])
        i += len(chunks[-1])
    return prompt, chunks


def _case(rng: random.Random, tokenizer: Tokenizer, vocab: int) -> dict:
    prompt, chunks = _chunks(rng, vocab)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detokenizer.add(chunk) for chunk in chunks)
    stops = []
    for _ in range(rng.randint(1, 3)):
        if text and rng.random() < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 8)])
        else:
            stops.append(rng.choice(["zq#", "\n\n\n", "~~"]))
    if rng.random() < 0.3:
        stops.append("zq#" * 40)  # never matches, and holds all the text back
    min_tokens = rng.choice([0, 0, 0, rng.randint(1, 6)])
    params = SamplingParams(
        max_tokens=32, stop=tuple(stops), ignore_eos=True, min_tokens=min_tokens, logprobs=0
    )
    return {
        "prompt": prompt,
        "chunks": chunks,
        "stops": stops,
        "min_tokens": min_tokens,
        "params": params,
    }


def _reference(tokenizer: Tokenizer, case: dict) -> tuple[str, str, int]:
    """The text, the finish reason and the number of tokens counted."""
    detokenizer = IncrementalDetokenizer(tokenizer, case["prompt"])
    text, protected = "", 0
    ids = [t for chunk in case["chunks"] for t in chunk]
    for count, token_id in enumerate(ids, 1):
        text += detokenizer.add([token_id])
        if count <= case["min_tokens"]:
            protected = len(text)
            continue
        hits = [
            i
            for stop in case["stops"]
            for i in range(len(text) - len(stop) + 1)
            if text.startswith(stop, i) and i + len(stop) > protected
        ]
        if hits:
            return text[: min(hits)], "stop", count
    return text, "length", len(ids)


async def _published(tokenizer: Tokenizer, cases: list[dict], steps_per_publish: int) -> list[list]:
    context = zmq.asyncio.Context()
    server = context.socket(zmq.ROUTER)
    client = context.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}")
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=len(cases), max_model_len=64),
        CacheConfig(block_size=16, num_blocks=4 * len(cases)),
    )
    frontend = frontend_over(server, tokenizer, scheduler, "stops")
    receiving = asyncio.create_task(frontend.run())
    for i, case in enumerate(cases):
        request = client_protocol.GenerateRequest(f"r{i}", case["prompt"], case["params"])
        await client.send(client_protocol.encode_client_message(request))
    while len(frontend.streams) < len(cases):
        await asyncio.sleep(0.01)
    received: list[list] = [[] for _ in cases]
    num_steps = max(len(case["chunks"]) for case in cases)
    steps: list[EngineStep] = []
    for step in range(num_steps):
        outputs = []
        for i, case in enumerate(cases):
            if step < len(case["chunks"]) and f"r{i}" in frontend.streams:
                last = step == len(case["chunks"]) - 1
                chunk = case["chunks"][step]
                rows = None
                if case["params"].logprobs is not None:
                    rows = SampleLogprobs([[t] for t in chunk], [[-1.0] for _ in chunk])
                outputs.append(
                    EngineOutput(f"r{i}", chunk, last, "length" if last else None, logprobs=rows)
                )
        admitted = [f"r{i}" for i in range(len(cases))] if step == 0 else []
        steps.append(published_step(step, outputs, admitted))
        if len(steps) < steps_per_publish and step < num_steps - 1:
            continue  # published with the steps after it, as a server behind its executor does
        frontend.publish(steps)
        steps = []
        while await client.poll(50):
            for out in client_protocol.decode_server_message(await client.recv()):
                received[int(out.request_id[1:])].append(out)
    receiving.cancel()
    frontend.close()
    context.destroy(linger=0)
    return received


@pytest.mark.parametrize("steps_per_publish", [1, 2, 3])
def test_published_text_ends_where_the_whole_text_first_holds_a_stop(
    default_model_dir, steps_per_publish
) -> None:
    """Also where several steps' outputs go out together (the steps after a stop, planned
    before it was seen, are cut as the reference cuts them)."""
    tokenizer = Tokenizer.from_model_dir(default_model_dir)
    rng = random.Random(7)
    cases = [_case(rng, tokenizer, tokenizer.vocab_size) for _ in range(CASES)]
    for case in cases[1::2]:  # outputs without logprobs take publishing's short path elsewhere
        case["params"] = dataclasses.replace(case["params"], logprobs=None)
    received = asyncio.run(_published(tokenizer, cases, steps_per_publish))
    stopped = protected = 0
    for case, outs in zip(cases, received):
        text, reason, count = _reference(tokenizer, case)
        stopped += reason == "stop"
        protected += case["min_tokens"] > 0 and reason == "length" and count > case["min_tokens"]
        assert "".join(o.text for o in outs) == text, (case, outs)
        ids = [t for o in outs for t in o.new_token_ids]
        assert ids == [t for chunk in case["chunks"] for t in chunk][:count], (case, outs)
        assert outs[-1].completion_tokens == count
        if case["params"].logprobs is not None:
            assert [row[0] for o in outs for row in o.logprobs["token_ids"]] == ids
        else:
            assert all(o.logprobs is None for o in outs)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], outs
        assert outs[-1].finish_reason == reason
        if not case["min_tokens"]:
            assert not any(stop in o.text for o in outs for stop in case["stops"])
    assert CASES // 2 < stopped < CASES  # both endings are exercised
    assert protected  # some stop strings were ignored in the first min_tokens tokens' text


@pytest.mark.parametrize("steps_per_publish", [1, 3])
def test_streams_without_stop_strings_get_every_token_and_its_text(
    default_model_dir, steps_per_publish
) -> None:
    """Most outputs skip the stop-string path (no text held back, none looked for): the text
    must still be the reference detokenizer's, and none at all with detokenize=False (vLLM's);
    the prompt's ids come with the first output only; with or without logprobs."""
    tokenizer = Tokenizer.from_model_dir(default_model_dir)
    rng = random.Random(11)
    cases = []
    for i in range(60):
        prompt, chunks = _chunks(rng, tokenizer.vocab_size)
        params = SamplingParams(
            max_tokens=32,
            ignore_eos=True,
            detokenize=i % 3 != 0,
            logprobs=0 if i % 4 == 1 else None,
        )
        cases.append({"prompt": prompt, "chunks": chunks, "params": params})
    received = asyncio.run(_published(tokenizer, cases, steps_per_publish))
    for case, outs in zip(cases, received):
        ids = [t for chunk in case["chunks"] for t in chunk]
        detokenizer = IncrementalDetokenizer(tokenizer, case["prompt"])
        text = "".join(detokenizer.add([t]) for t in ids) if case["params"].detokenize else ""
        assert "".join(o.text for o in outs) == text, (case, outs)
        assert [t for o in outs for t in o.new_token_ids] == ids
        assert [o.prompt_token_ids for o in outs] == [case["prompt"]] + [None] * (len(outs) - 1)
        assert [o.completion_tokens for o in outs][-1] == len(ids)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], outs
        assert outs[-1].finish_reason == "length"
        assert (outs[0].logprobs is not None) == (case["params"].logprobs is not None)
    assert any("".join(o.text for o in outs) for outs in received)


def test_each_token_looks_for_stop_strings_in_its_own_text_only(
    default_model_dir, monkeypatch
) -> None:
    """A long stop string holds the whole output back; searching all of it for every token
    made a long output cost its length per token (quadratic, on the loop every client
    shares). The text searched per token must stay the size of one token's text."""
    tokenizer = Tokenizer.from_model_dir(default_model_dir)
    searched = []
    find_stop = frontend_module._find_stop

    def recording(text: str, stops: tuple[str, ...], end_after: int):
        searched.append(len(text) - end_after)
        return find_stop(text, stops, end_after)

    monkeypatch.setattr(frontend_module, "_find_stop", recording)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 40)
    params = SamplingParams(max_tokens=len(ids) + 1, stop=("x" * 5000, "lazy cat"))
    stream = frontend_module._Stream(
        "r", b"c", params, [1], IncrementalDetokenizer(tokenizer, [1]), 0.0
    )
    text, kept, stop = ClientFrontend._add_until_stop(stream, "", ids)
    assert (kept, stop) == (len(ids), None) and len(text) > 1500
    assert len(searched) == len(ids) and max(searched) <= 20
    stream.params = SamplingParams(max_tokens=len(ids) + 1, stop=("x" * 5000, "dog. the"))
    text, kept, stop = ClientFrontend._add_until_stop(stream, text, ids)
    assert stop == "dog. the" and text.endswith("lazy ") and kept < 15
