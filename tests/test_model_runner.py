"""ModelRunner driven by hand-made step plans over a tiny random model, against transformers."""

import copy
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devices import CPU_AND_CUDA  # noqa: E402
from kv_cache_scales import save_with_kv_scales  # noqa: E402
from test_model_core import save_tiny_model  # noqa: E402
from triton import knobs  # noqa: E402
from triton_keys import LaunchKeys  # noqa: E402

from weir.kernels import cpu_native, triton_attention  # noqa: E402
from weir.services.executor.cuda_graphs import GraphShape  # noqa: E402
from weir.services.executor.kernel_compiles import KernelCompiles  # noqa: E402
from weir.services.executor.model_runner import ModelRunner  # noqa: E402
from weir.shared.protocol.step import CachedRequest, NewRequest, StepPlan, StepResult  # noqa: E402
from weir.shared.sampling import SamplingParams  # noqa: E402

BLOCK_SIZE = 4
NUM_NEW = 8
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0)


class Driver:
    """A scripted stand-in for the scheduler: tracks what it has told the executor and builds diffs."""

    def __init__(self, runner: ModelRunner, seed: int = 0, lookahead: int = 0) -> None:
        self.runner = runner
        self.lookahead = lookahead  # blocks past the tokens computed, as for a draft model
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.outputs: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.sent: set[str] = set()  # requests the executor holds
        self.preempted: set[str] = set()
        self.pooling: dict[str, str | None] = {}
        self.step_id = 0

    def add(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams = GREEDY,
        prefix_of: tuple[str, int] | None = None,
        pooling: str | None = None,
    ) -> None:
        """prefix_of=(other, n): the first n (block-aligned) tokens hit the prefix cache of `other`."""
        self.prompts[req_id], self.params[req_id], self.outputs[req_id] = prompt, params, []
        self.pooling[req_id] = pooling
        self.blocks[req_id], self.computed[req_id] = [], 0
        if prefix_of is not None:
            other, n = prefix_of
            assert (
                n % BLOCK_SIZE == 0
                and self.computed[other] >= n
                and prompt[:n] == self.prompts[other][:n]
            )
            self.blocks[req_id] = self.blocks[other][: n // BLOCK_SIZE]
            self.computed[req_id] = n

    def tokens(self, req_id: str) -> list[int]:
        return self.prompts[req_id] + self.outputs[req_id]

    def step(
        self,
        work: dict[str, int | None],
        drafts: dict[str, list[int]] | None = None,
        preempt: tuple[str, ...] = (),
    ) -> StepResult:
        """work: request -> tokens to compute (None = everything it has left: rest of prefill or 1 decode)."""
        drafts = drafts or {}
        num_scheduled, new, cached = {}, [], []
        for req_id in preempt:
            self.free.extend(b for b in self.blocks[req_id] if not self._shared(req_id, b))
            self.blocks[req_id], self.computed[req_id] = [], 0
            self.preempted.add(req_id)
        for req_id, n in work.items():
            k = len(drafts.get(req_id, []))
            n = (len(self.tokens(req_id)) - self.computed[req_id] if n is None else n) + k
            end = self.computed[req_id] + n + self.lookahead
            need = -(-end // BLOCK_SIZE) - len(self.blocks[req_id])
            new_blocks = [self.free.pop() for _ in range(need)]
            self.blocks[req_id] += new_blocks
            num_scheduled[req_id] = n
            if req_id not in self.sent:
                new.append(
                    NewRequest(
                        req_id,
                        self.prompts[req_id],
                        self.params[req_id],
                        list(self.blocks[req_id]),
                        self.computed[req_id],
                        pooling=self.pooling[req_id],
                    )
                )
                self.sent.add(req_id)
            elif req_id in self.preempted:
                cached.append(
                    CachedRequest(
                        req_id,
                        list(self.blocks[req_id]),
                        self.computed[req_id],
                        resumed=True,
                        output_token_ids=list(self.outputs[req_id]),
                    )
                )
                self.preempted.discard(req_id)
            else:
                cached.append(CachedRequest(req_id, new_blocks, self.computed[req_id]))
        plan = StepPlan(
            num_scheduled,
            sum(num_scheduled.values()),
            drafts,
            new,
            cached,
            list(preempt),
            step_id=self.step_id,
        )
        result = self.runner.execute(plan)
        assert result.step_id == self.step_id
        self.step_id += 1
        for req_id, n in plan.num_scheduled_tokens.items():
            k = len(drafts.get(req_id, []))
            out = result.sampled_token_ids.get(req_id, [])
            # KV of rejected drafts is garbage: the next step recomputes from the last accepted token.
            self.computed[req_id] += n - k + max(len(out) - 1, 0)
            self.outputs[req_id] += out
        return result

    def _shared(self, req_id: str, block: int) -> bool:
        return any(block in blocks for other, blocks in self.blocks.items() if other != req_id)

    def finish(self, req_id: str) -> None:
        self.free.extend(b for b in self.blocks.pop(req_id) if not self._shared(req_id, b))
        self.runner.execute(StepPlan(finished_req_ids=[req_id], step_id=self.step_id))
        self.step_id += 1


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    hf_model.generation_config.eos_token_id = (
        None  # generate() falls back to it when the call's is None
    )
    input_ids = torch.tensor([prompt])
    # An explicit mask, or generate() would mask prompt tokens that happen to equal pad_token_id.
    out = hf_model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model = save_tiny_model("llama", path)
    return path, hf_model


def make_runner(path, device: str = "cpu", dtype: str | None = None, **options) -> ModelRunner:
    return ModelRunner(
        path,
        device=device,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=200 * 2 * 2 * 4 * 2 * 16 * 4,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        seed=0,
        **options,
    )


def test_chunked_preempted_speculative_steps_match_transformers_greedy(tiny):
    path, hf_model = tiny
    rng = random.Random(3)
    prompts = {
        r: [rng.randrange(128) for _ in range(n)] for r, n in (("A", 11), ("B", 23), ("C", 5))
    }
    prompts["D"] = prompts["A"][:8] + [rng.randrange(128) for _ in range(6)]
    with torch.no_grad():
        want = {r: hf_greedy(hf_model, p, NUM_NEW) for r, p in prompts.items()}

    runner = make_runner(path)
    d = Driver(runner)
    for r in "ABC":
        d.add(r, prompts[r])
    assert d.step({"A": None, "B": 8}).sampled_token_ids.keys() == {"A"}  # B's prefill is partial
    d.step({"A": None, "B": None, "C": None})
    d.add("D", prompts["D"], prefix_of=("A", 8))
    # A: correct drafts (all accepted + bonus); B: first draft right, second wrong; C preempted; D joins with a prefix-cache hit and a first chunk.
    a_drafts = want["A"][len(d.outputs["A"]) : len(d.outputs["A"]) + 2]
    b_next = want["B"][len(d.outputs["B"])]
    res = d.step(
        {"A": None, "B": None, "D": 3},
        drafts={"A": a_drafts, "B": [b_next, (b_next + 1) % 128]},
        preempt=("C",),
    )
    assert len(res.sampled_token_ids["A"]) == 3 and len(res.sampled_token_ids["B"]) == 2
    # C resumes (recomputes prompt + its output); A gets a wrong first draft: only the correction comes back.
    a_next = want["A"][len(d.outputs["A"])]
    res = d.step(
        {"C": None, "A": None, "B": None, "D": None}, drafts={"A": [(a_next + 1) % 128, a_next]}
    )
    assert res.sampled_token_ids["A"] == [a_next]
    d.finish("B")  # B stops early; the others keep running
    del want["B"]
    while any(len(d.outputs[r]) < NUM_NEW for r in want):
        d.step({r: None for r in want if len(d.outputs[r]) < NUM_NEW})
    assert {r: d.outputs[r][:NUM_NEW] for r in want} == want
    assert len(runner.batch) == 3


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("level", [1, 2])
def test_a_runner_woken_from_sleep_decodes_as_transformers(tiny, device, level):
    """Sleep frees the KV caches and the CUDA graphs (level 1 moves the weights to host
    memory, level 2 drops them); waking takes them back (graphs captured again, weights read
    again from disk), and decoding is transformers' again, a draft model (the model itself)
    proposing the answer again too. The first time the weights wake alone (vLLM's tags: the
    cache stays freed), the KV cache after them, never before."""
    path, hf_model = tiny
    prompt = [3, 14, 15, 92, 65, 35]
    runner = make_runner(path, device, "float32", speculative_model=path, num_speculative_tokens=2)
    for attempt in range(2):
        d = Driver(runner, lookahead=2)  # the batch forgets its requests on sleeping
        d.add("A", prompt)
        drafts = d.step({"A": None}).draft_token_ids["A"]
        while len(d.outputs["A"]) < NUM_NEW:
            result = d.step({"A": None}, drafts={"A": drafts})
            drafts = result.draft_token_ids.get("A", [])
        assert d.outputs["A"] == hf_greedy(hf_model, prompt, len(d.outputs["A"]))
        assert len(d.outputs["A"]) >= NUM_NEW > d.step_id  # the draft's tokens were kept
        runner.sleep(level)
        assert runner.kv_caches == [] and runner.graphs is None
        if attempt == 0:
            with pytest.raises(ValueError, match="after the weights"):
                runner.wake(["kv_cache"])
            runner.wake(["weights"])
            assert runner.kv_caches == [] and runner.graphs is None
            assert runner.drafter is not None and runner.drafter.kv_caches == []
            runner.wake(["kv_cache"])
        else:
            runner.wake()


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_a_draft_caches_the_kept_tokens_not_those_it_proposed(tiny, tmp_path, device):
    """A Qwen3 drafting for a Llama, through steps that verify its own proposals and steps
    that verify others (the Llama's greedy tokens, all kept where its own were not): its
    next proposals equal those of a fresh draft given the whole sequence as a prompt. So
    its cache holds each kept token, and of what it wrote while proposing, only positions
    whose proposal was the token kept there."""
    path, hf_model = tiny
    save_tiny_model("qwen3", tmp_path / "draft")
    prompt = [7, 3, 99, 12, 64, 5, 31, 8, 77]
    want = hf_greedy(hf_model, prompt, 16)
    draft = {"speculative_model": tmp_path / "draft", "num_speculative_tokens": 3}
    d = Driver(make_runner(path, device, "float32", **draft), lookahead=3)
    d.add("A", prompt)
    proposals = d.step({"A": None}).draft_token_ids["A"]
    for own in (True, False, True, False, False):
        done = len(d.outputs["A"])
        drafts = proposals if own else want[done : done + 3]
        proposals = d.step({"A": None}, drafts={"A": drafts}).draft_token_ids["A"]
    assert d.outputs["A"] == want[: len(d.outputs["A"])]
    fresh = Driver(make_runner(path, device, "float32", **draft), lookahead=3)
    fresh.add("A", d.tokens("A")[:-1])
    assert fresh.step({"A": None}).draft_token_ids["A"] == proposals


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_pooling_requests_beside_a_generating_one_pool_transformers_hidden_states(tiny, device):
    """Each pooling type over chunks, a preemption mid-prompt (MEAN starts again from 0) and
    a step shared with a request that samples, whose tokens stay transformers'."""
    path, hf_model = tiny
    rng = random.Random(5)
    prompts = {r: [rng.randrange(128) for _ in range(n)] for r, n in (("last", 9), ("mean", 21))}
    prompts |= {"cls": [rng.randrange(128) for _ in range(14)], "gen": prompts["last"][:6]}
    d = Driver(make_runner(path, device, "float32"))
    for name, kind in (("last", "LAST"), ("mean", "MEAN"), ("cls", "CLS"), ("gen", None)):
        d.add(name, prompts[name], pooling=kind)
    pooled: dict[str, bytes] = {}
    for work, preempt in (
        ({"last": 4, "mean": 8, "cls": 5, "gen": None}, ()),
        ({"last": None, "mean": 8, "cls": None, "gen": None}, ()),
        ({"mean": 4, "gen": None}, ("mean",)),  # recomputed from its start
        ({"mean": None, "gen": None}, ()),
    ):
        result = d.step(work, preempt=preempt)
        assert not set(result.sampled_token_ids) & {"last", "mean", "cls"}
        assert not set(pooled) & set(result.pooled or {})  # each pools once
        pooled |= result.pooled or {}
    assert sorted(pooled) == ["cls", "last", "mean"]
    with torch.no_grad():
        for name, pick in (("last", -1), ("cls", 0), ("mean", None)):
            states = hf_model.model(torch.tensor([prompts[name]])).last_hidden_state[0]
            want = states.mean(0) if pick is None else states[pick]
            got = torch.frombuffer(bytearray(pooled[name]), dtype=torch.float32)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert d.outputs["gen"] == hf_greedy(hf_model, prompts["gen"], len(d.outputs["gen"]))


def test_seeded_sampling_survives_chunking_preemption_and_neighbours(tiny):
    path, hf_model = tiny
    rng = random.Random(4)
    prompt = [rng.randrange(128) for _ in range(10)]
    other = [rng.randrange(128) for _ in range(7)]
    seeded = SamplingParams(max_tokens=6, temperature=1.5, top_p=0.95, seed=1234)

    alone = Driver(make_runner(path))
    alone.add("S", prompt, seeded)
    while len(alone.outputs["S"]) < 6:
        alone.step({"S": None})

    busy = Driver(make_runner(path), seed=1)
    busy.add("S", prompt, seeded)
    busy.add("X", other, SamplingParams(max_tokens=6, temperature=1.0))
    busy.step({"X": None, "S": 4})
    busy.step({"S": None, "X": None})
    busy.step({"S": None, "X": None})
    busy.step({"X": None}, preempt=("S",))
    while len(busy.outputs["S"]) < 6:
        busy.step({"S": None, "X": None})
    assert busy.outputs["S"][:6] == alone.outputs["S"]


def test_logprobs_match_transformers_distribution(tiny):
    path, hf_model = tiny
    prompt = list(range(3, 15))
    d = Driver(make_runner(path))
    d.add("L", prompt, SamplingParams(max_tokens=3, temperature=0.0, logprobs=4))
    results = [d.step({"L": None}) for _ in range(3)]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([d.tokens("L")])).logits[0].double(), dim=-1)
    for i, res in enumerate(results):
        lp = res.logprobs["L"]
        pos = len(prompt) - 1 + i
        token = d.outputs["L"][i]
        assert lp.token_ids[0][0] == token
        assert lp.token_ids[0][1:] == ref[pos].topk(4).indices.tolist()
        torch.testing.assert_close(
            torch.tensor(lp.logprobs[0], dtype=torch.float64),
            torch.cat([ref[pos, token : token + 1], ref[pos].topk(4).values]),
            atol=1e-4,
            rtol=0,
        )


def test_min_tokens_bans_stop_token_ids_as_transformers_masking_them(tiny):
    path, hf_model = tiny
    prompt = list(range(20, 32))
    free = hf_greedy(hf_model, prompt, 6)
    # The unbanned choices, repeated (each id is banned once), and a wide range besides.
    banned = free[:3] * 5 + list(range(40, 100))
    params = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=4, stop_token_ids=banned)
    want, ids = [], list(prompt)
    with torch.no_grad():
        for i in range(6):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            if i < 4:
                logits[sorted(set(banned))] = float("-inf")
            ids.append(int(logits.argmax()))
            want.append(ids[-1])
    assert want[:3] != free[:3]  # the ban changes the output

    d = Driver(make_runner(path))
    d.add("M", prompt, params)
    while len(d.outputs["M"]) < 6:
        d.step({"M": None})
    assert d.outputs["M"][:6] == want


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_only_steps_that_take_an_argmax_alone_sample_the_lm_heads_bfloat16(
    tiny, device, monkeypatch
):
    """Widening the logits to float32 doubles the bytes the LM head wrote, for nothing an
    argmax needs: a bf16 runner samples its LM head's logits while every row is greedy and
    asks for nothing more, float32 ones once a row samples, wants logprobs or has its logits
    changed; the greedy tokens are those of the float32 logits. (On a CPU, unpacked weights:
    packed bfloat16 ones run over a float32 model.)"""
    monkeypatch.setenv("WEIR_PACK_CPU_WEIGHTS", "0")
    path, _ = tiny
    prompt = list(range(3, 15))

    def run(widen_all: bool) -> tuple[dict[str, list[int]], list[torch.dtype]]:
        runner = make_runner(path, device=device, dtype="bfloat16")
        dtypes = []
        sample = runner.sampler.__call__

        def recording(logits, batch):
            dtypes.append(logits.dtype)
            return sample(logits, batch)

        runner.sampler = recording
        if widen_all:
            compute = runner.model.compute_logits
            runner.model.compute_logits = lambda hidden, widen=True: compute(hidden)
        d = Driver(runner)
        d.add("G", prompt)
        for _ in range(3):
            d.step({"G": None})
        for name, params in (
            ("S", SamplingParams(max_tokens=8, temperature=1.0, seed=1)),
            ("L", SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)),
            ("B", SamplingParams(max_tokens=8, temperature=0.0, logit_bias={7: 5.0})),
        ):
            d.add(name, prompt, params)
            d.step({"G": None, name: None})
            d.finish(name)
        d.step({"G": None})
        return d.outputs, dtypes

    outputs, dtypes = run(widen_all=False)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert dtypes == [bf16, bf16, bf16, fp32, fp32, fp32, bf16]
    widened, widened_dtypes = run(widen_all=True)
    assert set(widened_dtypes) == {fp32}
    assert outputs["G"] == widened["G"] and outputs["L"] == widened["L"]


@pytest.mark.skipif(cpu_native.load() is None, reason="bf16 weight panels need the native kernels")
def test_bfloat16_on_a_cpu_is_bfloat16_weights_and_cache_over_a_float32_model(tiny):
    """The same memory holds twice a float32 cache's tokens, and the served steps (a prefill,
    then decodes over the bfloat16 cache) keep the greedy tokens of transformers in float32
    with every Linear's weight and input rounded to bfloat16. (The arithmetic itself is
    checked closer in test_packed_weights, test_cpu_attention and test_quantization: on
    this tiny model the unrounded tokens are the same.)"""
    path, hf_model = tiny
    runner = make_runner(path, dtype="bfloat16")
    assert (runner.dtype, runner.weight_dtype) == (torch.float32, torch.bfloat16)
    assert runner.model.kv_cache_dtype == torch.bfloat16
    assert runner.precision.startswith("float32, bfloat16 weights (")
    assert runner.attention.name == "native"
    assert runner.num_blocks == 2 * make_runner(path).num_blocks
    # The torch attention backend has no native kernels: bfloat16 is the whole model's dtype.
    operators = make_runner(path, dtype="bfloat16", attention_backend="torch")
    assert (operators.dtype, operators.precision) == (torch.bfloat16, "bfloat16")
    reference = copy.deepcopy(hf_model)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.bfloat16().float())
                module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    rng = random.Random(5)
    d = Driver(runner)
    prompts = {r: [rng.randrange(128) for _ in range(n)] for r, n in (("A", 9), ("B", 21))}
    for r, prompt in prompts.items():
        d.add(r, prompt)
    while len(d.outputs["A"]) < NUM_NEW:
        d.step({"A": None, "B": None})
    with torch.no_grad():
        for r, prompt in prompts.items():
            assert d.outputs[r][:NUM_NEW] == hf_greedy(reference, prompt, NUM_NEW), r


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_device_without_cuda_is_one_clear_error(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match=r"--device cuda: (this torch has no CUDA|no GPU)"):
        ModelRunner(path, device="cuda", block_size=BLOCK_SIZE, kv_cache_memory_bytes=1 << 20)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_new_weights_must_fill_the_served_parameters(tiny, tmp_path, device):
    """With an fp8 cache, a checkpoint that brings KV cache scales (compressed-tensors'
    kv_cache_scheme) has parameters the served model lacks: refused whole, before any
    served weight changes (on a GPU they would be copied in one by one), and the runner
    decodes on as before."""
    path, _ = tiny
    scaled = tmp_path / "scaled"
    num_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    scales = {
        f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(0.5)
        for i in range(num_layers)
        for kind in "kv"
    }
    save_with_kv_scales(path, scaled, scales)
    outputs = []
    for refused in (True, False):
        runner = make_runner(path, device, "float32", kv_cache_dtype="fp8")
        if refused:
            with pytest.raises(ValueError, match="not the served model's parameters"):
                runner.load_weights(str(scaled))
            assert runner.weights_dir == path
        d = Driver(runner)
        d.add("A", [3, 14, 15, 92, 65, 35])
        while len(d.outputs["A"]) < 8:
            d.step({"A": None})
        outputs.append(d.outputs["A"])
    assert outputs[0] == outputs[1]  # as a runner that was never asked


def serve_every_step_kind(runner: ModelRunner) -> None:
    """A long prefill, short prompts, chunks beside decodes, speculative decodes, decodes,
    one request alone."""
    rng = random.Random(5)
    d = Driver(runner)
    for req_id, length in (("long", 44), ("a", 3), ("b", 12), ("c", 20), ("d", 9)):
        d.add(req_id, [rng.randrange(128) for _ in range(length)])
    d.step({"long": None})
    d.step({"long": None, "a": None, "b": 5})
    d.step({"long": None, "a": None, "b": None, "c": None})
    d.step({"long": None, "a": None}, drafts={"long": [1, 2], "a": [3, 4, 5]})
    d.step({"c": None, "d": None})
    d.step({"d": None})


def test_steps_padded_as_cuda_graphs_replay_them_launch_only_startups_kernels(tiny):
    """The same on the CPU through the padded buffers CUDA graphs replay (run eagerly):
    their hints (max_model_len's keys for decode shapes, the padded token count for mixed
    shapes) choose no variant the startup did not compile."""
    path, _ = tiny
    with LaunchKeys() as startup:
        runner = make_runner(path, attention_backend="triton")
    runner.capture_graphs(capture=False)
    assert runner.graphs is not None
    shapes: list[GraphShape] = []
    stage = runner.graphs.stage

    def recording_stage(inputs, shape, fed=None):
        shapes.append(shape)
        return stage(inputs, shape, fed)

    runner.graphs.stage = recording_stage  # type: ignore[method-assign]
    with LaunchKeys() as serving:
        serve_every_step_kind(runner)
    assert serving.keys and serving.keys <= startup.keys, serving.keys - startup.keys
    # Every step but the speculative one (7 logits rows: more than a mixed shape's 4) padded.
    assert [s.mixed for s in shapes] == [True, True, True, True, False]


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_serving_launches_only_attention_kernels_compiled_at_startup(tiny, device):
    """Steps of every kind (a long prefill, short prompts, chunks beside decodes, speculative
    decodes, one request alone) launch no attention kernel variant that the runner's startup
    did not: Triton's keys of serving's launches are all among startup's. On a GPU a new key
    is a compilation that stalls the batch."""
    path, _ = tiny
    with LaunchKeys() as startup:
        runner = make_runner(path, device=device, attention_backend="triton")
    compiled: list[str] = []  # on a GPU, what Triton's compile hooks report (as the executor's)
    if device == "cuda":
        KernelCompiles(lambda kernel, seconds: compiled.append(kernel)).watch()
    with LaunchKeys() as serving:
        serve_every_step_kind(runner)
    assert serving.keys and serving.keys <= startup.keys, serving.keys - startup.keys
    if device == "cuda":
        try:
            assert compiled == []
            # A variant no test launches (heads of 40 channels): the watch sees it compile.
            query = torch.zeros(1, 2, 40, device=device)
            ones = torch.ones(1, dtype=torch.int32, device=device)
            triton_attention.paged_attention(
                query, torch.zeros(2, 1, BLOCK_SIZE, 2, 40, device=device),
                torch.tensor([0, 1], dtype=torch.int32, device=device), ones,
                torch.zeros(1, 1, dtype=torch.int32, device=device), 1.0, split_kv=False,
            )  # fmt: skip
            assert [k.split("[")[0] for k in compiled] == ["_decode_attention_kernel"]
        finally:
            knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
