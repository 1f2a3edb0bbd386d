"""A client that has a step's outputs finds that step counted in /metrics: the scheduler's
metrics endpoint answers from its own thread, so whatever a step changes there is updated
before the step's outputs leave (a fresh-clone CI once read a prefix-cache hit counter that
lagged the completion it had just received).

A real ``ClientFrontend`` over a real ``Scheduler`` serves a real ZeroMQ client; a step of
made-up tokens is published as an executor's would be, and what ``/metrics`` would say is
read at the moment the first frame is sent.
"""

import asyncio

import zmq
import zmq.asyncio
from serving_helpers import frontend_over, published_step

from weir.services.scheduler import Scheduler
from weir.services.scheduler.output import EngineOutput
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol import client as client_protocol
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import Tokenizer


async def _publish_one_step(tokenizer: Tokenizer) -> tuple[list, list]:
    context = zmq.asyncio.Context()
    server = context.socket(zmq.ROUTER)
    server.bind("inproc://publish-order")
    client = context.socket(zmq.DEALER)
    client.connect("inproc://publish-order")
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=128),
        CacheConfig(block_size=16, num_blocks=32),
    )
    frontend = frontend_over(server, tokenizer, scheduler, "publish_order")
    receiving = asyncio.create_task(frontend.run())
    request = client_protocol.GenerateRequest("r", [300, 301], SamplingParams(max_tokens=3))
    await client.send(client_protocol.encode_client_message(request))
    while "r" not in frontend.streams:
        await asyncio.sleep(0.01)
    registry = frontend.metrics.registry
    labels = {"model_name": "publish_order"}
    events: list[tuple[str, float | None]] = []
    send = frontend._send

    def observed_send(identity: bytes, frame: bytes) -> None:
        tokens = registry.get_sample_value("weir_generation_tokens_total", labels)
        events.append(("send", tokens))
        send(identity, frame)

    frontend._send = observed_send  # type: ignore[method-assign]
    step = published_step(0, [EngineOutput("r", [400, 401, 402], True, "length")], ["r"])
    frontend.publish([step], before_send=lambda: events.append(("before_send", None)))
    received = client_protocol.decode_server_message(await client.recv())
    receiving.cancel()
    frontend.close()
    context.destroy(linger=0)
    return events, received


def test_metrics_are_updated_before_a_steps_outputs_are_sent(default_model_dir) -> None:
    events, received = asyncio.run(_publish_one_step(Tokenizer.from_model_dir(default_model_dir)))
    # The three tokens are counted, and the scheduler's gauges refreshed, before the frame
    # carrying them leaves.
    assert events == [("before_send", None), ("send", 3.0)]
    assert [t for out in received for t in out.new_token_ids] == [400, 401, 402]
