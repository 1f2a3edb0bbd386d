"""Prompt logprobs (vLLM's ``prompt_logprobs``, and the completions API's ``echo``): each
prompt token's logprob under the model, against transformers' log-softmax, through chunked
prefill, preemption and a prefix-cache hit that such a request must not take."""

import random

import pytest
import torch
from serving_helpers import hf_greedy

from weir.services import LLM
from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.executor.model_runner import ModelRunner
from weir.services.scheduler import Request, Scheduler
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.sampling import SamplingParams

TOP = 3


def _reference(hf_model, prompt: list[int]) -> tuple[list[float], list[list[int]], list[int]]:
    """Each prompt token's logprob after the first, the top ids at its position and its rank
    there (one more than the tokens likelier)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].double(), -1)
    targets = torch.tensor(prompt[1:])
    chosen = logprobs[:-1].gather(1, targets[:, None])[:, 0]
    ranks = (logprobs[:-1] > chosen[:, None]).sum(-1) + 1
    return chosen.tolist(), logprobs[:-1].topk(TOP, dim=-1).indices.tolist(), ranks.tolist()


def test_prompt_logprobs_through_chunks_preemption_and_the_prefix_cache(
    tiny_model_dir, tiny_hf_model
):
    rng = random.Random(4)
    shared = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = {
        "first": shared,
        "again": list(shared),  # would hit the cache "first" filled
        "plain": [rng.randrange(3, 49152) for _ in range(30)],
        "short": [rng.randrange(3, 49152) for _ in range(1)],
    }
    runner = ModelRunner(
        tiny_model_dir,
        device="cpu",
        block_size=4,
        kv_cache_memory_bytes=20 * 2 * 2 * 4 * 2 * 8 * 4,  # 20 blocks: preemption
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=runner.num_blocks),
    )
    core = EngineCore(scheduler, InProcessExecutor(runner))
    with_logprobs = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP
    )
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        scheduler.add_request(Request(rid, prompt, plain if rid == "plain" else with_logprobs))
    outputs: dict[str, list] = {rid: [] for rid in prompts}
    while core.has_work():
        step = step_now(core)
        for out in step.outputs if step else ():
            outputs[out.request_id].append(out)
    step_now(core)
    for rid, prompt in prompts.items():
        outs = outputs[rid]
        assert sum(len(o.new_token_ids) for o in outs) == 8
        assert hf_greedy(tiny_hf_model, prompt, 8) == [t for o in outs for t in o.new_token_ids]
        if rid == "plain":
            assert all(o.prompt_logprobs is None for o in outs)
            continue
        [rows] = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert outs[0].prompt_logprobs is rows, "sent with the first output"
        want, want_top, want_ranks = _reference(tiny_hf_model, prompt)
        assert [r[0] for r in rows.token_ids] == prompt[1:]
        assert [r[0] for r in rows.logprobs] == pytest.approx(want, abs=1e-4)
        assert [r[1:] for r in rows.token_ids] == want_top
        assert rows.ranks == want_ranks
    assert scheduler.kv_cache_manager.num_free_blocks == runner.num_blocks
    assert scheduler.stats().num_preemptions > 0, "the workload must preempt"


def test_prompt_logprobs_reach_the_sdk_with_the_first_token_none(tiny_model_dir, tiny_hf_model):
    """vLLM's rows: per prompt token after the first, {token id: logprob} of it and of the
    TOP likeliest there."""
    prompt = [5, 900, 17, 3000, 42, 7, 7, 7]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    with LLM(str(tiny_model_dir), kv_cache_memory="1MiB") as llm:
        [completion] = llm.generate(prompt, params)
    want, want_top, _ = _reference(tiny_hf_model, prompt)
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf_model(torch.tensor([prompt])).logits[0].double(), -1)
    first, *rows = completion.prompt_logprobs
    assert first is None and len(rows) == len(prompt) - 1
    assert [row[token] for row, token in zip(rows, prompt[1:])] == pytest.approx(want, abs=1e-4)
    for i, (row, token, top) in enumerate(zip(rows, prompt[1:], want_top)):
        assert set(row) == {token, *top}
        assert [row[t] for t in top] == pytest.approx([ref[i, t].item() for t in top], abs=1e-4)
