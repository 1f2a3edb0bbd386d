"""Speculative decoding: n-gram drafts (K = 4) and a draft model's (K = ``--draft-k``)
against none (K = 0).

Workloads (``--workload``): ``copy``, each request asks the model (chat template) to repeat
a passage given in the prompt, max_tokens = the passage's token count; ``chat``, open
questions answered in 64 tokens, where little is copied. The engine core runs in this
process with the real ModelRunner on the CPU, greedy, EOS ignored. With ``--draft-model``
(a directory, or ``default`` for the default model, which then drafts for itself;
``--draft-quantization int8`` keeps the draft's weights int8) a row per draft model too.
Reported per row: output tok/s (wall time of the steps), acceptance rate (accepted /
proposed draft tokens), steps, and whether the outputs equal K = 0's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_decode.py [--concurrency 1 16]
        [--workload copy|chat] [--draft-model default --draft-quantization int8]
"""

from __future__ import annotations

import argparse
import time

from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.engine.ngram import NgramProposer
from weir.services.executor.model_runner import ModelRunner
from weir.services.scheduler import Request, Scheduler
from weir.shared.config import LOAD_FORMATS, CacheConfig, SchedulerConfig
from weir.shared.model_store import resolve_model
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import Tokenizer

PASSAGES = [
    "The river runs past the old mill, under the stone bridge, and out into the quiet "
    "harbor, where the fishing boats wait for the morning tide and the gulls argue over "
    "the nets that hang drying along the sea wall.",
    "Copper lanterns hung from every beam of the barn, and the orchard beyond smelled of "
    "rain and woodsmoke; the children counted the apples twice before the first frost.",
    "To reset the device, hold the power button for ten seconds, release it, wait for the "
    "blue light to blink three times, and then press the power button once more.",
    "Signal fires burned on the northern hills: one fire for a ship, two fires for a storm, "
    "three fires for the return of the king, and four for an enemy at the gate.",
]


QUESTIONS = [
    "Explain why the sky is blue in a few sentences.",
    "Give me three tips for learning to cook.",
    "Describe a walk through a forest in autumn.",
    "What should I pack for a weekend trip to the mountains?",
]


def run(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: list[int], k: int, concurrency: int
) -> tuple[list[list[int]], float, int, float]:
    """K = ``k`` drafts a step: the runner's draft model's if it has one, else n-grams."""
    drafted = runner.drafter is not None
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=concurrency,
            num_speculative_tokens=k,
            num_lookahead_tokens=k if drafted else 0,
        ),
        CacheConfig(num_blocks=runner.num_blocks),
    )
    proposer = NgramProposer(k, 2, 4) if k and not drafted else None
    core = EngineCore(scheduler, InProcessExecutor(runner), proposer=proposer)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        scheduler.add_request(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        )
    outputs: list[list[int]] = [[] for _ in prompts]
    steps = 0
    start = time.perf_counter()
    while core.has_work():
        step = step_now(core)
        steps += 1
        for out in step.outputs if step else ():
            outputs[int(out.request_id[1:])] += out.new_token_ids
    seconds = time.perf_counter() - start
    step_now(core)  # the executor forgets the finished requests
    spec = scheduler.stats().spec_decode
    acceptance = spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0
    return outputs, seconds, steps, acceptance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workload", choices=("copy", "chat"), default="copy")
    parser.add_argument("--draft-model", default=None, help="a directory, or default")
    parser.add_argument("--draft-quantization", choices=("int8",), default=None)
    parser.add_argument("--draft-k", type=int, default=3)
    args = parser.parse_args()
    model_dir = resolve_model(args.model, load_format=args.load_format)
    tokenizer = Tokenizer.from_model_dir(model_dir)

    def runner_for(k: int = 0, draft: str | None = None) -> ModelRunner:
        return ModelRunner(
            model_dir,
            device="cpu",
            kv_cache_memory_bytes=256 << 20,
            max_num_batched_tokens=2048,
            max_num_seqs=max(args.concurrency),
            num_threads=args.threads,
            load_format=args.load_format,
            num_speculative_tokens=k,
            speculative_model=None
            if draft is None
            else resolve_model(None if draft == "default" else draft, load_format=args.load_format),
            speculative_model_quantization=args.draft_quantization if draft else None,
        )

    runner = runner_for()
    rows = [("none", 0, runner), ("n-gram", 4, runner)]
    if args.draft_model is not None:
        name = args.draft_model + (
            f" ({args.draft_quantization})" if args.draft_quantization else ""
        )
        rows.append((f"draft {name}", args.draft_k, runner_for(args.draft_k, args.draft_model)))
    print(f"model {model_dir.name}, CPU, {args.threads} thread(s), workload {args.workload}")
    print(
        "| concurrency | drafts | K | output tok/s | steps | acceptance | same outputs as K=0 "
        "| ratio |"
    )
    print("|---:|---|---:|---:|---:|---:|---|---:|")
    for concurrency in args.concurrency:
        prompts, max_tokens = [], []
        for i in range(concurrency):
            if args.workload == "copy":
                passage = PASSAGES[i % len(PASSAGES)]
                ask = f"Repeat this text exactly:\n\n{passage}"
                max_tokens.append(len(tokenizer.encode(passage)))
            else:
                ask = QUESTIONS[i % len(QUESTIONS)]
                max_tokens.append(64)
            text = tokenizer.apply_chat_template([{"role": "user", "content": ask}])
            prompts.append(tokenizer.encode(text))
        for _, k, each in rows:
            run(each, prompts[:1], [4], k, 1)  # warm-up
        base, base_s, _, _ = run(runner, prompts, max_tokens, 0, concurrency)
        base_rate = sum(map(len, base)) / base_s
        for name, k, each in rows:
            outputs, seconds, steps, acceptance = run(each, prompts, max_tokens, k, concurrency)
            rate = sum(map(len, outputs)) / seconds
            print(
                f"| {concurrency} | {name} | {k} | {rate:.1f} | {steps} | {acceptance:.2f} | "
                f"{outputs == base} | {rate / base_rate:.2f} |"
            )


if __name__ == "__main__":
    main()
