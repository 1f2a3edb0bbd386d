"""Speculative decoding with n-gram drafts: exact outputs, an exact sampling distribution,
and the served path (options, metrics)."""

import dataclasses

import pytest
import torch
from serving_helpers import generate_in_core, hf_greedy, metric, read_metrics

from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.engine.frontend import bad_word_sequences
from weir.services.engine.ngram import NgramProposer
from weir.services.executor.model_runner import ModelRunner
from weir.services.llm import LLM
from weir.services.scheduler import Request, Scheduler
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol.step import NewRequest, StepPlan
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import Tokenizer

PASSAGES = [
    "The river runs past the old mill, under the stone bridge, and into the quiet harbor.",
    "Copper lanterns hung from every beam, and the orchard smelled of rain and woodsmoke.",
    "Signal fires burned on the hills: one for a ship, two for a storm, three for the king.",
    "She wrote the numbers down twice: 4 8 15 16 23 42, then 4 8 15 16 23 42 again.",
]


@pytest.fixture(scope="module")
def runner(default_model_dir):
    """The default model's runner, built once: each engine core below ends all its requests,
    so the next one starts on an empty cache."""
    return ModelRunner(
        default_model_dir,
        device="cpu",
        kv_cache_memory_bytes=20 * 737_280,  # 20 blocks of 16 tokens: forces preemption
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.7, seed=7, ignore_eos=True, logprobs=1),
        # Each draft's row is penalized for the drafts before it.
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            ignore_eos=True,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            repetition_penalty=1.1,
        ),
        # Each draft's row is held to the allowed tokens too.
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            ignore_eos=True,
            allowed_token_ids=tuple(range(1000, 49152)),
        ),
        # Drafts copied from the prompt hold the bad words: the rows after a draft see it.
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            ignore_eos=True,
            bad_words=("the old mill", "rain", "15 16", " 42"),
        ),
    ],
    ids=["greedy", "seeded", "penalized", "allowed", "bad_words"],
)
def test_outputs_are_identical_with_and_without_drafts(default_model_dir, runner, params):
    tokenizer = Tokenizer.from_model_dir(default_model_dir)
    if params.bad_words:  # the server tokenizes them; this test drives the engine core
        words = bad_word_sequences(tokenizer, params.bad_words, tokenizer.vocab_size)
        params = dataclasses.replace(params, bad_words_token_ids=words)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {text}"}])
        )
        for text in PASSAGES
    ]
    outputs, stats = [], []
    for k in (0, 4):
        scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, num_speculative_tokens=k),
            CacheConfig(num_blocks=runner.num_blocks),
        )
        proposer = NgramProposer(k, 2, 4) if k else None
        core = EngineCore(scheduler, InProcessExecutor(runner), proposer=proposer)
        outputs.append(generate_in_core(core, prompts, params))
        stats.append(scheduler.stats())
    assert runner.num_blocks == 20
    assert outputs[0] == outputs[1]
    assert all(len(o) == 40 for o in outputs[1])
    spec = stats[1].spec_decode
    assert stats[1].num_preemptions > 0 and stats[1].num_free_blocks == 20
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0, spec
    assert spec.accepted_per_pos[0] >= spec.accepted_per_pos[-1]


def test_a_sampled_step_with_a_draft_draws_from_the_target_distribution(
    tiny_model_dir, tiny_hf_model
):
    """The first output token of 256 seeded requests whose step verifies a draft: its
    distribution must be the model's (chi-square against transformers' softmax). A
    residual step that resampled from the full distribution after a rejection would make
    the draft token about p + (1 - p) p likely, far outside the bound."""
    prompt = [11, 22, 33, 44, 55, 66]
    with torch.no_grad():
        logits = tiny_hf_model(torch.tensor([prompt])).logits[0, -1].double()
    # The tiny model's distribution is flat: the first temperature (down a fine grid)
    # at which its favourite token is about 1 in 3 makes a test with power.
    temperature = next(
        t for t in (0.9**j for j in range(80)) if (logits / t).softmax(-1).max() > 0.3
    )
    probs = (logits / temperature).softmax(-1)
    draft = int(probs.argmax())
    assert 0.3 < probs[draft] < 0.5
    num = 256
    runner = ModelRunner(
        tiny_model_dir,
        device="cpu",
        block_size=4,
        kv_cache_memory_bytes=2 * num * 2 * 2 * 4 * 2 * 8 * 4,
        max_num_batched_tokens=num * 8,
        max_num_seqs=num,
    )
    new = [
        NewRequest(
            f"s{i}",
            prompt,
            SamplingParams(temperature=temperature, seed=i, max_tokens=4),
            [2 * i, 2 * i + 1],
            0,
        )
        for i in range(num)
    ]
    plan = StepPlan(
        {r.request_id: len(prompt) + 1 for r in new},
        num * (len(prompt) + 1),
        {r.request_id: [draft] for r in new},
        new,
        step_id=1,
    )
    result = runner.execute(plan)
    first = [result.sampled_token_ids[r.request_id][0] for r in new]
    accepted = sum(len(result.sampled_token_ids[r.request_id]) == 2 for r in new)
    assert accepted == first.count(draft)  # accepted exactly when the draw equals the draft
    top = [int(t) for t in probs.topk(4).indices]
    observed = [first.count(t) for t in top] + [num - sum(first.count(t) for t in top)]
    expected = [num * float(probs[t]) for t in top] + [num * (1 - float(probs[top].sum()))]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    assert chi2 < 18.47, (observed, [round(e, 1) for e in expected])  # df 4, p = 0.001


def test_served_speculation_keeps_greedy_outputs_and_counts_drafts(tiny_model_dir, tiny_hf_model):
    """Served with n-gram drafts, the tiny model returns transformers' greedy tokens (what
    it returns without drafts) and the metrics count the drafts."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(tiny_hf_model, prompt, 12) for prompt in prompts]
    with LLM(
        str(tiny_model_dir),
        device="cpu",
        speculative_method="ngram",
        num_speculative_tokens=3,
        ngram_min=1,
        ngram_max=3,
    ) as spec:
        got = [c.token_ids for c in spec.generate(prompts, params)]
        samples = read_metrics(spec.server_info["metrics_address"])
    assert got == want
    drafts = metric(samples, "weir_spec_decode_draft_tokens_total")
    accepted = metric(samples, "weir_spec_decode_accepted_tokens_total")
    assert drafts > 0 and 0 <= accepted <= drafts
    assert metric(samples, "weir_spec_decode_accepted_tokens_by_position_total") == accepted


def test_bad_speculative_options_fail_start_up(tiny_model_dir):
    from weir.services.launcher import ChildFailedError

    with pytest.raises(ChildFailedError, match="num_speculative_tokens"):
        LLM(str(tiny_model_dir), device="cpu", speculative_method="ngram", startup_timeout=120)


def test_drafts_of_structured_outputs_are_cut_to_the_constraint_and_masked_per_position(
    tiny_model_dir, tiny_hf_model
):
    """Drafts of requests held to a constraint: the constrained answer itself, and every
    other step one with a token the constraint forbids in the middle. They are cut to what
    the constraint allows (never past an end token) and each verified position is masked
    as if the drafts before it were accepted, so every output is transformers' greedy
    decoding under xgrammar's logits processor, with most drafts accepted."""
    import transformers
    import xgrammar as xgr
    from serving_helpers import hf_constrained

    from weir.services.engine.structured_output import GrammarCompiler

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = hf_tokenizer.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=49152, stop_token_ids=[eos])
    reference = xgr.GrammarCompiler(info)
    specs = [{"regex": r"(yes|no), [0-9]{3}"}, {"grammar": 'root ::= "x" [a-c] [a-c]? "!"'}]
    compiled = [
        reference.compile_regex(specs[0]["regex"]),
        reference.compile_grammar(specs[1]["grammar"]),
    ]
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    tiny_hf_model.generation_config.eos_token_id = None
    want = [hf_constrained(tiny_hf_model, p, 12, c, eos) for p, c in zip(prompts, compiled)]
    forbidden = hf_tokenizer.encode("Z", add_special_tokens=False)[0]

    class Oracle:
        """Drafts from the answer; every other call, one the constraint forbids inside."""

        calls = 0

        def propose(self, running):
            self.calls += 1
            drafts = {}
            for request in running:
                done = len(request.output_token_ids)
                right = want[int(request.request_id[1:])][done : done + 3]
                drafts[request.request_id] = (
                    right[:1] + [forbidden] + right[2:] if self.calls % 2 else right
                )
            return drafts

    runner = ModelRunner(
        tiny_model_dir, device="cpu", max_num_batched_tokens=64, num_speculative_tokens=3
    )
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, num_speculative_tokens=3),
        CacheConfig(num_blocks=runner.num_blocks),
    )
    compiler = GrammarCompiler(Tokenizer.from_model_dir(tiny_model_dir), 49152, [eos])
    core = EngineCore(scheduler, InProcessExecutor(runner), proposer=Oracle())
    produced = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=12, temperature=0.0)
        request = Request(f"r{i}", prompt, params, eos_token_id=eos)
        request.grammar = compiler.matcher(specs[i])
        scheduler.add_request(request)
        produced[request.request_id] = []
    while core.has_work():
        step = step_now(core)
        for out in step.outputs if step else ():
            produced[out.request_id] += out.new_token_ids
    assert [produced["r0"], produced["r1"]] == want
    assert all(w[-1] == eos for w in want)
    spec = scheduler.stats().spec_decode
    assert spec.num_accepted_tokens >= spec.num_draft_tokens / 2 > 0, spec
