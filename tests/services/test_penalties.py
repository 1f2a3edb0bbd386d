"""Logit biases and presence, frequency and repetition penalties in the executor, against
transformers' own processors and against OpenAI's definition applied token by token
(``serving_helpers.hf_greedy``), through chunking, drafts, preemption and mixed batches."""

import random

import torch
import transformers
from serving_helpers import PENALTIES, TINY_BIAS, hf_greedy, penalized
from test_model_runner import Driver

from weir.services.executor.model_runner import ModelRunner
from weir.shared.sampling import SamplingParams

NUM_NEW = 12


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device="cpu",
        block_size=4,
        kv_cache_memory_bytes=1 << 20,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def test_repetition_penalty_and_biases_match_transformers_generate(tiny_model_dir, tiny_hf_model):
    prompts = _prompts(1, (9, 17, 30))
    prompts[1][:4] = [7, 8, 9, 10]  # the prompt's tokens count for the repetition penalty
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=NUM_NEW,
        eos_token_id=None,
        pad_token_id=0,
        repetition_penalty=1.7,
        sequence_bias={(token,): bias for token, bias in TINY_BIAS.items()},
    )
    tiny_hf_model.generation_config.eos_token_id = None
    want = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = tiny_hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            want.append(out[0, len(prompt) :].tolist())
    params = SamplingParams(
        max_tokens=NUM_NEW,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.7,
        logit_bias=TINY_BIAS,
    )
    driver = Driver(_runner(tiny_model_dir))
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, params)
    while any(len(driver.outputs[f"r{i}"]) < NUM_NEW for i in range(len(prompts))):
        driver.step({f"r{i}": None for i in range(len(prompts))})
    assert [driver.outputs[f"r{i}"] for i in range(len(prompts))] == want
    biased_only = [hf_greedy(tiny_hf_model, p, NUM_NEW, logit_bias=TINY_BIAS) for p in prompts]
    assert want != biased_only, "the repetition penalty must change what greedy decoding picks"


def test_each_draft_row_is_penalized_by_the_drafts_before_it(tiny_model_dir, tiny_hf_model):
    """A penalized request verifying drafts (row j counts drafts 1..j as outputs), a chunked
    one preempted and resumed, and a plain one, in the same batches."""
    params = penalized(NUM_NEW)
    plain = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    a, b, c = _prompts(2, (10, 21, 6))
    want = {
        "A": hf_greedy(tiny_hf_model, a, NUM_NEW, **PENALTIES),
        "B": hf_greedy(tiny_hf_model, b, NUM_NEW, **PENALTIES),
        "C": hf_greedy(tiny_hf_model, c, NUM_NEW),
    }
    assert want["A"] != hf_greedy(tiny_hf_model, a, NUM_NEW, logit_bias=TINY_BIAS)
    driver = Driver(_runner(tiny_model_dir))
    driver.add("A", a, params)
    driver.add("B", b, params)
    driver.add("C", c, plain)
    driver.step({"A": None, "B": 8, "C": None})
    driver.step({"A": None, "B": None, "C": None})
    driver.step({"A": None, "C": None}, preempt=("B",))
    while len(driver.outputs["A"]) < NUM_NEW:
        done = len(driver.outputs["A"])
        # Right drafts, so all are accepted unless a row forgets the drafts before it.
        drafts = {"A": want["A"][done : min(done + 3, NUM_NEW - 1)]}
        work = {r: None for r in "ABC" if len(driver.outputs[r]) < NUM_NEW}
        driver.step(work, drafts=drafts if drafts["A"] else None)
    while any(len(driver.outputs[r]) < NUM_NEW for r in "BC"):
        driver.step({r: None for r in "BC" if len(driver.outputs[r]) < NUM_NEW})
    assert {r: driver.outputs[r][:NUM_NEW] for r in "ABC"} == want
