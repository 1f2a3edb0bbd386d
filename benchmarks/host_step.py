"""The host's work per decode step at many running requests: what a GPU waits for between
two steps unless the executor launches the next before it finishes the last (issue 10).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_step.py [--num-requests 256] [--layers 2]

The default model's shape with ``--layers`` layers and random weights runs on the CPU, so
the forward pass is cheap and, in any case, not counted. ``--num-requests`` requests with
32-token prompts decode together; once all are decoding, each part of ``--steps`` steps is
timed in place: the scheduler's ``schedule()`` and ``update_from_output()``, the step
codec on both sides (as the wire does), the scheduler's publishing of the outputs
(detokenizing, stop strings, one frame to the one client, as behind the HTTP gateway or
``LLM``; requests arrive through that client over a real ZeroMQ socket), and the
executor's parts of ``launch`` and ``finish`` that are not device work.

Then the executor's admission of requests into slots no request used before, as after a
start (``apply_plan`` of plans that each bring 64 new 32-token requests, into a persistent
batch whose rows are ``--admit-max-model-len`` tokens wide: a row's first write maps its
first pages, which takes microseconds at 4 KiB and milliseconds where the kernel maps 2 MiB).
"""

import argparse
import asyncio
import gc
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import zmq
import zmq.asyncio
from executor_step import Timers

from weir.services.engine.core import EngineCore, EngineStep, InProcessExecutor, step_now
from weir.services.engine.frontend import ClientFrontend
from weir.services.engine.metrics import SchedulerMetrics
from weir.services.executor.input_batch import InputBatch
from weir.services.executor.model_runner import ModelRunner
from weir.services.scheduler import Scheduler
from weir.services.scheduler.output import EngineOutput
from weir.services.startup_heap import freeze_startup_heap
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.model_store import resolve_model
from weir.shared.protocol import client as client_protocol
from weir.shared.protocol import step_codec
from weir.shared.protocol.step import NewRequest, StepPlan
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import Tokenizer

# New requests a plan brings in the admission measurement (a 2048-token prefill step of
# 32-token prompts).
ADMITTED_PER_PLAN = 64

PARTS = (
    ("scheduler: schedule()", "schedule"),
    ("scheduler: update_from_output()", "update"),
    ("scheduler: plan encode", "plan_encode"),
    ("scheduler: result decode", "result_decode"),
    ("scheduler: publish outputs", "publish"),
    ("executor: plan decode", "plan_decode"),
    ("executor: apply plan to the persistent batch", "apply_plan"),
    ("executor: prepare inputs", "prepare_inputs"),
    ("executor: sampling parameters", "sampling_batch"),
    ("executor: collect the result", "collect"),
    ("executor: result encode", "result_encode"),
)


class GcTimes:
    """Count and time the garbage collector's passes, by generation, until ``stop()``."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._on_pass)

    def _on_pass(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def stop(self) -> None:
        gc.callbacks.remove(self._on_pass)

    def summary(self) -> str:
        return ", ".join(
            f"gen{g} {n} ({s * 1e3:.1f} ms)"
            for g, (n, s) in enumerate(zip(self.count, self.seconds))
        )


def shallow_model(layers: int, into: Path) -> Path:
    """The default model's config (with ``layers`` layers) and tokenizer, no weights."""
    source = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, into / name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (into / "config.json").write_text(json.dumps(config))
    return into


def main() -> None:
    asyncio.run(run())


async def run() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--admit-max-model-len",
        type=int,
        default=131_072,
        help="max_model_len of the admission measurement (Llama-3.2's: a 512 KiB token row)",
    )
    parser.add_argument(
        "--freeze-heap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="freeze the start-up heap before the timed steps, as the serving processes do",
    )
    parser.add_argument(
        "--detokenize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the requests' SamplingParams.detokenize (off: no text is published, as vLLM's "
        "throughput benchmark's --disable-detokenize)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shallow_model(args.layers, Path(tmp))
        n = args.num_requests
        runner = ModelRunner(
            model_dir,
            device="cpu",
            load_format="dummy",
            max_num_batched_tokens=32 * n,
            max_num_seqs=n,
            max_model_len=512,
            seed=0,
        )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=32 * n, max_num_seqs=n, max_model_len=512, async_scheduling=True
        ),
        CacheConfig(block_size=runner.block_size, num_blocks=runner.num_blocks),
    )
    timers = Timers()
    batch = runner.batch
    batch.apply_plan = timers.wrap("apply_plan", batch.apply_plan)
    batch.prepare_inputs = timers.wrap("prepare_inputs", batch.prepare_inputs)
    runner._sampling_batch = timers.wrap("sampling_batch", runner._sampling_batch)
    runner._collect = timers.wrap("collect", runner._collect)
    codec = {
        name: timers.wrap(name, getattr(step_codec, function))
        for name, function in (
            ("plan_encode", "encode_step_plan"),
            ("plan_decode", "decode_step_plan"),
            ("result_encode", "encode_step_result"),
            ("result_decode", "decode_step_result"),
        )
    }

    def execute(plan):
        plan = codec["plan_decode"](codec["plan_encode"](plan))
        result = runner.finish(runner.launch(plan))
        return codec["result_decode"](codec["result_encode"](result))

    def observe(phase: str, seconds: float) -> None:
        timers.seconds[phase] += seconds

    core = EngineCore(
        scheduler, InProcessExecutor(SimpleNamespace(execute=execute, reset=runner.reset)), observe
    )
    context = zmq.asyncio.Context()
    server_sock = context.socket(zmq.ROUTER)
    port = server_sock.bind_to_random_port("tcp://127.0.0.1")
    client = context.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    frontend = ClientFrontend(
        server_sock,
        Tokenizer.from_model_dir(resolve_model(None)),
        runner.config.vocab_size,
        512,
        SchedulerMetrics("bench"),
        wake=lambda: None,
        requests_ended=lambda: None,
        health=lambda stream_ids: {},
        model_info=lambda: {},
    )
    frontend.core = core
    receiving = asyncio.create_task(frontend.run())
    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True, detokenize=args.detokenize
    )
    for i in range(n):
        prompt = [rng.randrange(3, runner.config.vocab_size) for _ in range(32)]
        request = client_protocol.GenerateRequest(f"r{i}", prompt, params)
        await client.send(client_protocol.encode_client_message(request))
    while len(frontend.streams) < n:
        await asyncio.sleep(0.01)
    publish = timers.wrap("publish", frontend.publish)

    last_step_id = 0

    async def step() -> int:
        nonlocal last_step_id
        done = step_now(core)
        assert done is not None
        last_step_id = done.plan.step_id
        publish([done])
        while await client.poll(0):  # the client's reading is another process's work
            await client.recv()
        return done.plan.total_num_scheduled_tokens

    while len(scheduler.running) < n or any(not r.output_token_ids for r in scheduler.running):
        await step()
    if args.freeze_heap:
        freeze_startup_heap()  # as the serving processes do once started
    collections = GcTimes()
    timers.seconds.clear()
    for _ in range(args.steps):
        assert await step() == n, "not all decoding"
    collections.stop()
    core.abandon_next()
    text = "" if args.detokenize else ", no detokenization"
    print(f"{n} running decodes, {args.steps} steps, {args.layers}-layer model on the CPU{text}\n")
    print("| part | ms per step |\n|---|---:|")
    for label, key in PARTS:
        print(f"| {label} | {timers.seconds[key] / args.steps * 1e3:.3f} |")
    print()
    for side in ("scheduler", "executor"):
        total = sum(timers.seconds[key] for label, key in PARTS if label.startswith(side))
        print(f"{side} host work: {total / args.steps * 1e3:.3f} ms per step")
    print(
        f"garbage collections during the timed steps (inside the parts above): "
        f"{collections.summary()}"
    )
    # Publishing several steps at once (what the server does while behind its executor):
    # the same streams' outputs carrying 1, 2 and 4 tokens each.
    rng = random.Random(1)
    plan = SimpleNamespace(step_id=last_step_id + 1, new_requests=[])
    for tokens in (1, 2, 4):
        times = []
        for _ in range(30):
            outputs = [
                EngineOutput(f"r{i}", [rng.randrange(300, 20000) for _ in range(tokens)])
                for i in range(n)
            ]
            start = time.perf_counter()
            frontend.publish([EngineStep(plan, outputs, time.monotonic())])
            times.append(time.perf_counter() - start)
            while await client.poll(0):
                await client.recv()
        median = statistics.median(times)
        print(
            f"publishing {n} outputs of {tokens} token(s): {median * 1e3:.3f} ms "
            f"({median * 1e6 / n / tokens:.2f} us per token)"
        )
    receiving.cancel()
    context.destroy(linger=0)
    admit(n, args.admit_max_model_len, runner.block_size, rng)


def admit(n: int, max_model_len: int, block_size: int, rng: random.Random) -> None:
    """Print the time ``apply_plan`` takes to bring n new requests into unused slots."""
    batch = InputBatch(max_model_len, block_size, n, eos_token_ids=(2,))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    times = []
    for first in range(0, n, ADMITTED_PER_PLAN):
        new = [
            NewRequest(f"a{i}", [rng.randrange(3, 20000) for _ in range(32)], params, [i], 0)
            for i in range(first, min(first + ADMITTED_PER_PLAN, n))
        ]
        start = time.perf_counter()
        batch.apply_plan(StepPlan(new_requests=new))
        times.append(time.perf_counter() - start)
    print(
        f"admitting {n} requests into unused slots ({ADMITTED_PER_PLAN} a plan, max_model_len "
        f"{max_model_len}): {sum(times) * 1e3:.2f} ms, slowest plan {max(times) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
