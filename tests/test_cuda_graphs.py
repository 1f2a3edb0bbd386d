"""Steps on persistent, padded input buffers (`cuda_graphs.StepGraphs`).

On a CPU the padded path runs eagerly on the same buffers a CUDA graph replays: it must give
the unpadded path's tokens. On CUDA, graphs on and off must give the same greedy tokens
(float32, so no reduced-precision rounding differs between the two).
"""

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from test_model_runner import Driver, hf_greedy

from weir.services.executor.cuda_graphs import (
    GraphShape,
    StepGraphs,
    capture_sizes,
    graph_shapes,
    mixed_sizes,
)
from weir.services.executor.model_runner import GRAPH_COPIES, ModelRunner
from weir.shared.sampling import SamplingParams

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPEC_LEN = 3  # 1 + 2 drafts
PLAIN = SamplingParams(max_tokens=64, temperature=0.0, logprobs=3)
# Penalties count each row's outputs among the step's input ids: the padded buffer's, there.
# Negative ones, so the model goes on repeating its last token, which the input ids hold.
PENALIZED = SamplingParams(
    max_tokens=64, temperature=0.0, presence_penalty=-2.0, frequency_penalty=-1.0
)
PENALIZED_NAMES = ("r1", "r3")


def test_capture_sizes_are_capped_by_the_step_limits():
    sizes = capture_sizes(256, 2048, 1)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-2:] == [248, 256]
    # Every step of 8 requests or more pads by at most 7.
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    # Past 256, every 16 requests up to 512, then every 32 up to vLLM's H200 limit of 1,024.
    wide = capture_sizes(1024, 2048, 1)
    assert wide[wide.index(256) :][:3] == [256, 272, 288] and wide[-3:] == [960, 992, 1024]
    assert [b - a for a, b in zip(wide, wide[1:])][-17:] == [16] + [32] * 16
    assert capture_sizes(256, 100, 1)[-1] == 96
    assert capture_sizes(16, 2048, 1) == [1, 2, 4, 8, 16]
    assert capture_sizes(256, 2048, 4)[-1] == 256  # 1,024 tokens at most
    assert capture_sizes(256, 512, 4)[-1] == 128


def test_mixed_sizes_reach_the_step_budget():
    assert mixed_sizes(2048) == [128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert mixed_sizes(300) == [128, 256, 300]
    assert mixed_sizes(100) == [100]
    assert mixed_sizes(16384)[-1] == 8192  # larger steps run eagerly
    assert mixed_sizes(2048, 1000) == [128, 256, 512, 768, 1000]
    assert mixed_sizes(2048, 0) == []  # --max-mixed-graph-tokens 0: decode graphs only
    assert not any(s.mixed for s in graph_shapes(16, 2048, (1,), 0))
    shapes = graph_shapes(16, 300, (1, 3))
    assert [s for s in shapes if s.mixed] == [
        GraphShape(16, n, n, mixed=True) for n in (128, 256, 300)
    ]
    assert all(s.num_logits == 16 for s in shapes if s.mixed)
    # A step of P tokens holds at most P requests: smaller mixed shapes need no more slots.
    assert [(s.num_reqs, s.num_tokens) for s in graph_shapes(256, 1024, (1,)) if s.mixed] == [
        (128, 128), (256, 256), (256, 512), (256, 768), (256, 1024)
    ]  # fmt: skip


def test_a_step_pads_to_the_smallest_shape_that_holds_it():
    from dataclasses import replace

    from weir.services.executor.cuda_graphs import _no_requests

    cache = torch.zeros(2, 4, 16, 1, 8)
    graphs = StepGraphs(
        None,  # type: ignore[arg-type]  # choosing a shape reads no model
        [cache],
        max_num_seqs=16,
        max_num_batched_tokens=300,
        max_blocks_per_req=8,
        query_lens=(1, 3),
        capture=False,
    )

    def step(query_lens: list[int], num_logits: int, prompt_logits: int = 0):
        tokens = np.zeros(sum(query_lens), dtype=np.int64)
        return replace(
            _no_requests(max(query_lens)),
            req_ids=[f"r{i}" for i in range(len(query_lens))],
            input_ids=tokens,
            logits_indices=np.zeros(num_logits, dtype=np.int64),
            prompt_logits_indices=np.zeros(prompt_logits, dtype=np.int64),
        )

    assert graphs.shape_for(step([1] * 5, 5)) == GraphShape(8, 8, 1, mixed=False)
    assert graphs.shape_for(step([3] * 3, 9)) == GraphShape(4, 12, 3, mixed=False)
    # Decodes without logits at every token, unequal queries, a query length not captured:
    # mixed shapes, by token count.
    assert graphs.shape_for(step([3] * 3, 3)) == GraphShape(16, 128, 128, mixed=True)
    assert graphs.shape_for(step([1, 3, 1], 5)) == GraphShape(16, 128, 128, mixed=True)
    assert graphs.shape_for(step([2] * 4, 8)) == GraphShape(16, 128, 128, mixed=True)
    assert graphs.shape_for(step([100, 29, 1], 3)) == GraphShape(16, 256, 256, mixed=True)
    assert graphs.shape_for(step([299, 1], 2)) == GraphShape(16, 300, 300, mixed=True)
    # Eager: more tokens than any shape, more logits rows than requests a shape holds,
    # prompt logprobs (they need every token's hidden state).
    assert graphs.shape_for(step([300, 1], 2)) is None
    assert graphs.shape_for(step([1, 3] * 4, 17)) is None
    assert graphs.shape_for(step([40, 1], 2, prompt_logits=39)) is None


def run_workload(runner: ModelRunner, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Prefills, then decodes at 5 and 3 running requests (padded to 8 and 4), one uniform
    speculative step, a prefill chunk alone and two mixed steps (a chunk beside decodes,
    then its rest)."""
    d = Driver(runner)
    d.free.remove(0)  # block 0, which padding requests read, stays unused: writes show there
    names = sorted(prompts)
    for name in names:
        d.add(name, prompts[name], PENALIZED if name in PENALIZED_NAMES else PLAIN)
    d.step({name: None for name in names[:3]})
    d.step({name: None for name in names[3:]})
    for _ in range(4):
        d.step({name: None for name in names})
    # Drafts: the last output repeated, so some are accepted and some rejected.
    d.step(
        {name: None for name in names},
        drafts={name: [d.outputs[name][-1]] * (SPEC_LEN - 1) for name in names},
    )
    for _ in range(3):
        d.step({name: None for name in names[:3]})
    d.add("late", list(range(40, 60)), SamplingParams(max_tokens=64, temperature=0.0))
    d.step({"late": 6})  # a prefill chunk alone: nothing sampled
    d.step({"late": 6, **{name: None for name in names[:3]}})
    d.step({name: None for name in ["late", *names[:3]]})
    # Padding requests write no K/V: blocks no request holds are still zero.
    used = set().union(*d.blocks.values())
    unused = [b for b in range(runner.num_blocks) if b not in used]
    assert unused and all(not kv[:, unused].any() for kv in runner.kv_caches)
    return {name: d.outputs[name] for name in [*names, "late"]}


# The shapes run_workload's steps pad to with at most 16 requests and 256 tokens a step.
WORKLOAD_SHAPES = ["mixed 128"] * 2 + [8] * 5 + [4] * 3 + ["mixed 128"] * 3


def count_padded_steps(runner: ModelRunner) -> list[int | str]:
    """Wrap the runner's graphs so each padded step appends its padded request count (a
    decode shape) or "mixed <tokens>"."""
    padded: list[int | str] = []
    graphs = runner.graphs
    assert graphs is not None
    stage = graphs.stage

    def counting_stage(inputs, shape, fed=None):
        padded.append(f"mixed {shape.num_tokens}" if shape.mixed else shape.num_reqs)
        return stage(inputs, shape, fed)

    graphs.stage = counting_stage  # type: ignore[method-assign]
    return padded


def record_graphed(runner: ModelRunner) -> list[bool]:
    """Wrap the runner's launch so each step appends whether it replayed a CUDA graph."""
    graphed: list[bool] = []
    launch = runner.launch

    def recording_launch(plan):
        step = launch(plan)
        graphed.append(step.timings.graphed)
        return step

    runner.launch = recording_launch  # type: ignore[method-assign]
    return graphed


def random_prompts(seed: int, vocab: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"r{i}": [rng.randrange(100, vocab) for _ in range(rng.randrange(5, 40))] for i in range(5)
    }


def test_padded_steps_give_the_eager_tokens_on_cpu(default_model_dir):
    """Also with 160 requests a step allowed, where a mixed step of up to 128 tokens pads to
    128 request slots (a shape of 128 tokens holds no more requests), not 160."""

    def make_runner(max_num_seqs: int = 16) -> ModelRunner:
        return ModelRunner(
            default_model_dir,
            device="cpu",
            block_size=16,
            kv_cache_memory_bytes=64 << 20,
            max_num_batched_tokens=256,
            max_num_seqs=max_num_seqs,
            num_threads=1,
            seed=0,
            num_speculative_tokens=SPEC_LEN - 1,  # graphs' shapes for 1 + 2 tokens too
        )

    prompts = random_prompts(0, 40000)
    eager = make_runner()
    assert eager.graphs is None  # never on a CPU
    want = run_workload(eager, prompts)

    # Request slots of the mixed shapes of 128 and 256 tokens.
    for max_num_seqs, mixed_slots in ((16, [16, 16]), (160, [128, 160])):
        padded = make_runner(max_num_seqs)
        padded.capture_graphs(capture=False)
        assert padded.graphs is not None
        assert [s.num_reqs for s in padded.graphs.shapes if s.mixed] == mixed_slots
        steps = count_padded_steps(padded)
        graphed = record_graphed(padded)
        got = run_workload(padded, prompts)
        assert got == want, max_num_seqs
        # Prefills and the mixed step pad to 128 tokens; 5 running -> 8, 3 running -> 4; the
        # speculative step pads 5 -> 8 too.
        assert steps == WORKLOAD_SHAPES
        assert len(graphed) == 13 and not any(graphed)  # nothing captured: no replay
    # And both are transformers' greedy tokens on the same weights (drafts never change them).
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32
    )
    all_prompts = {**prompts, "late": list(range(40, 60))}
    for name, tokens in got.items():
        if name not in PENALIZED_NAMES:  # penalties are held to transformers elsewhere
            assert tokens == hf_greedy(hf_model, all_prompts[name], len(tokens)), name


@pytest.fixture(scope="module")
def dummy_model_dir(tmp_path_factory, request):
    """A Llama shape with head_dim 64 (what the Triton kernels are built for), no weights, and
    the default model's tokenizer (from $WEIR_TEST_TOKENIZER_DIR where the model cannot be
    fetched, as on the GPU machine: see benchmarks/gpu_checks.sh)."""
    tokenizer_dir = os.environ.get("WEIR_TEST_TOKENIZER_DIR")
    source = Path(tokenizer_dir) if tokenizer_dir else request.getfixturevalue("default_model_dir")
    path = tmp_path_factory.mktemp("dummy") / "small-llama"
    path.mkdir()
    config = {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, path / name)
    return path


def cuda_runner(model_dir: Path, enforce_eager: bool, **options) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device="cuda",
        block_size=16,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=16,
        seed=0,
        load_format="dummy",
        enforce_eager=enforce_eager,
        **options,
    )


@NEEDS_CUDA
def test_cuda_graphs_give_the_eager_tokens(dummy_model_dir):
    def make_runner(enforce_eager: bool) -> ModelRunner:
        return cuda_runner(
            dummy_model_dir,
            enforce_eager,
            dtype="float32",
            num_speculative_tokens=SPEC_LEN - 1,
        )

    prompts = random_prompts(1, 49152)
    eager = make_runner(True)
    assert eager.graphs is None
    want = run_workload(eager, prompts)
    graphed = make_runner(False)
    assert graphed.graphs is not None
    assert set(graphed.graphs._graphs) == set(graph_shapes(16, 256, (1, SPEC_LEN)))
    assert {s.num_tokens for s in graphed.graphs._graphs if s.mixed} == {128, 256}
    # A graph's output is the hidden states of its rows to sample from, not their logits.
    for shape, copies in graphed.graphs._graphs.items():
        assert all(out.shape == (shape.num_logits, 256) for _, out in copies)
    assert all(len(copies) == GRAPH_COPIES for copies in graphed.graphs._graphs.values())
    steps = count_padded_steps(graphed)
    replayed = record_graphed(graphed)
    assert run_workload(graphed, prompts) == want
    assert steps == WORKLOAD_SHAPES
    assert replayed == [True] * 13  # every step replayed its graph


@NEEDS_CUDA
def test_served_greedy_outputs_are_the_same_with_and_without_graphs_and_overlap(dummy_model_dir):
    from weir.services.llm import LLM

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], "Hello there", list(range(100, 160)), [9] * 3]
    runs = []
    # Async scheduling (the first two) makes the executor launch steps ahead; lockstep not.
    for enforce_eager, async_scheduling in ((True, True), (False, True), (False, False)):
        with LLM(
            str(dummy_model_dir),
            load_format="dummy",
            device="cuda",
            dtype="float32",
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
            max_num_seqs=8,
            gpu_memory_utilization=0.2,  # the KV cache budget is profiled, graphs included
        ) as llm:
            runs.append([c.token_ids for c in llm.generate(prompts, params)])
    assert runs[0] == runs[1] == runs[2]
    assert all(len(ids) == 24 for ids in runs[0])


@NEEDS_CUDA
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_step_waits_for_the_device_only_on_its_event(dummy_model_dir, enforce_eager):
    """torch's sync debug mode raises at every synchronizing call (not at an event's wait),
    where it is made: neither launch nor finish makes one, whatever the sampling parameters
    and logprobs; the host waits for a step once, on the event after its non-blocking copies
    back."""
    runner = cuda_runner(dummy_model_dir, enforce_eager)
    waits: list[bool] = []
    launch, finish = runner.launch, runner.finish

    def checked_execute(plan):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = launch(plan)
            waits.append(step.ready is not None and step.ids.device.type == "cpu")
            return finish(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.execute = checked_execute  # type: ignore[method-assign]
    d = Driver(runner)
    all_params = [
        SamplingParams(max_tokens=64, temperature=0.0),
        SamplingParams(max_tokens=64, temperature=0.8, top_k=20, top_p=0.9, seed=7),
        SamplingParams(max_tokens=64, temperature=1.0, min_p=0.05, min_tokens=4),
        SamplingParams(max_tokens=64, temperature=0.0, logprobs=3),
    ]
    for i, params in enumerate(all_params):
        d.add(f"r{i}", list(range(10 + i, 30 + 2 * i)), params)
    d.step({f"r{i}": None for i in range(3)})  # prefills without logprobs
    d.step({"r0": None, "r1": None, "r2": None})  # decodes
    d.step({"r3": 5, "r0": None})  # a prefill chunk (no logits for r3) and a decode
    for _ in range(3):
        d.step({f"r{i}": None for i in range(4)})  # with r3's logprobs: ids and logprobs
    assert waits == [True] * 6
