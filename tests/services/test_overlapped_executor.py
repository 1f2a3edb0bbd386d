"""The executor's overlapped loop: step N+1 launched before step N is finished.

On a GPU the executor launches a plan that is already waiting before it waits for the step
in flight, and the new step reads the tokens the previous one samples on the device. A CPU
computes inside ``launch``, so the server never overlaps there; these tests force the same
loop (``ExecutorWorker.serve(overlap=True)``) on a real model over a real ZeroMQ socket,
with the real scheduler in async mode planning ahead, and compare with transformers and
with the plain loop.
"""

import random
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import zmq
from serving_helpers import PENALTIES, TINY_BIAS, hf_constrained, hf_greedy, penalized

from weir.services.engine.core import EngineCore, StepFailedError, step_now
from weir.services.executor.metrics import ExecutorMetrics
from weir.services.executor.model_runner import ModelRunner
from weir.services.executor.worker import ExecutorOptions, ExecutorWorker
from weir.services.scheduler import Request, Scheduler
from weir.services.supervised import StatusReporter
from weir.shared.config import CacheConfig, EngineArgs, SchedulerConfig
from weir.shared.protocol import control
from weir.shared.protocol.step_codec import decode_step_result, encode_step_plan
from weir.shared.sampling import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# Bytes per block of the tiny model: K and V x 2 layers x 4 tokens x 2 KV heads x 8 dims x 4 bytes.
KV_BYTES = NUM_BLOCKS * 2 * 2 * BLOCK_SIZE * 2 * 8 * 4
BUDGET = 16


# How long each step seems to run on the device after its launch returns: on a CPU the
# work is done by then, and without this the loop would overlap only when the next plan
# happened to be there already.
STEP_SECONDS = 0.02


class _DeviceTime:
    """A step's completion event, as a CUDA event reports it: done ``seconds`` after launch."""

    def __init__(self, seconds: float) -> None:
        self.done_at = time.monotonic() + seconds

    def query(self) -> bool:
        return time.monotonic() >= self.done_at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.done_at - time.monotonic()))


class _SocketExecutor:
    """The scheduler's side of one executor: plans out, results back in order."""

    def __init__(self, sock: zmq.Socket, identity: bytes) -> None:
        self.sock, self.identity = sock, identity

    def submit(self, plan):
        self.sock.send_multipart([self.identity, control.PLAN, encode_step_plan(plan)])
        return self._result()

    async def _result(self):
        if not self.sock.poll(60_000):
            raise TimeoutError("the executor did not answer")
        _, kind, body = self.sock.recv_multipart()
        if kind == control.STEP_ERROR:
            raise StepFailedError(control.unpack(control.StepFailure, body).message)
        assert kind == control.RESULT, kind
        return decode_step_result(body)


class _Served:
    """A real ModelRunner served by ``ExecutorWorker.serve`` in a thread, the order of its
    launches and finishes recorded, and an engine core with an async scheduler driving it."""

    def __init__(
        self, model_dir, *, overlap: bool, poison: str | None = None, padded: bool = False
    ) -> None:
        self.runner = runner = ModelRunner(
            model_dir,
            device="cpu",
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=KV_BYTES,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=8,
            max_model_len=64,
            seed=0,
        )
        self.fed_stages = 0  # padded steps staged with tokens fed from the step ahead
        if padded:  # through the staging area and padded shapes CUDA graphs replay
            runner.capture_graphs(capture=False)
            assert runner.graphs is not None
            stage = runner.graphs.stage

            def counted_stage(inputs, shape, fed=None):
                self.fed_stages += fed is not None
                return stage(inputs, shape, fed)

            runner.graphs.stage = counted_stage  # type: ignore[method-assign]
        self.events: list[tuple[str, int]] = []
        self.failures = 0
        launch, finish = runner.launch, runner.finish

        def recorded_launch(plan):
            self.events.append(("launch", plan.step_id))
            if poison is not None and poison in plan.num_scheduled_tokens:
                self.failures += 1
                raise RuntimeError("boom")
            step = launch(plan)
            step.ready = _DeviceTime(STEP_SECONDS)
            return step

        def recorded_finish(step):
            self.events.append(("finish", step.plan.step_id))
            return finish(step)

        runner.launch, runner.finish = recorded_launch, recorded_finish
        self.ctx = zmq.Context()
        router = self.ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"rank0")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        # A router drops frames for a peer it has not heard from yet: hear from it first.
        dealer.send(control.HELLO)
        router.recv_multipart()
        self.router, self.dealer = router, dealer
        self.worker = worker = ExecutorWorker(
            ExecutorOptions(f"tcp://127.0.0.1:{port}", EngineArgs(model=str(model_dir))),
            StatusReporter(None),
        )
        # The heartbeat thread's one field the loop reads (never set: no scheduler resets us).
        heartbeat = SimpleNamespace(reset=threading.Event())
        self.thread = threading.Thread(
            target=worker.serve,
            args=(dealer, runner, ExecutorMetrics("tiny", 0, "cpu"), heartbeat),
            kwargs={"overlap": overlap},
            daemon=True,
        )
        self.thread.start()
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=BUDGET,
                max_num_seqs=8,
                max_model_len=64,
                async_scheduling=True,
            ),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=runner.num_blocks),
        )
        self.core = EngineCore(scheduler, _SocketExecutor(router, b"rank0"))

    def run(self, requests: list[Request]) -> tuple[dict[str, list], dict[str, str], bool]:
        """Every request to its end: (outputs by request, failures by request, preempted)."""
        for request in requests:
            self.core.scheduler.add_request(request)
        outputs: dict[str, list] = {r.request_id: [] for r in requests}
        failed: dict[str, str] = {}
        preempted = False
        while self.core.has_work():
            try:
                step = step_now(self.core)
            except StepFailedError as exc:
                failed.update(dict.fromkeys(exc.request_ids, str(exc)))
                continue
            preempted |= bool(step.plan.preempted_req_ids)
            for out in step.outputs:
                outputs[out.request_id].append(out)
        kv = self.core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
        return outputs, failed, preempted

    def launched_ahead(self) -> int:
        """How many steps were launched while the step before them was unfinished."""
        unfinished: set[int] = set()
        ahead = 0
        for event, step_id in self.events:
            if event == "launch":
                ahead += bool(unfinished)
                unfinished.add(step_id)
            else:
                unfinished.discard(step_id)
        return ahead

    def close(self) -> None:
        # As a stopping server: the executor's SIGTERM, then its scheduler's goodbye, which
        # wakes the loop at once (a reset is only looked at after a second without frames).
        self.worker.stopping.request(signal.SIGTERM, None)
        self.router.send_multipart([b"rank0", control.GOODBYE, b""])
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self.router.close()
        self.dealer.close()
        self.ctx.term()


@pytest.fixture
def served(tiny_model_dir):
    opened: list[_Served] = []

    def open_served(**kwargs) -> _Served:
        opened.append(_Served(tiny_model_dir, **kwargs))
        return opened[-1]

    yield open_served
    for s in opened:
        s.close()


def _prompts(seed: int, n: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def _tokens(outputs: dict[str, list]) -> dict[str, list[int]]:
    return {r: [t for out in outs for t in out.new_token_ids] for r, outs in outputs.items()}


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_overlapped_steps_keep_greedy_outputs_through_chunking_and_preemption(
    served, tiny_hf_model, padded
):
    s = served(overlap=True, padded=padded)
    prompts = _prompts(3, 8, (5, 30))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs, failed, preempted = s.run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert not failed and preempted, "the workload must preempt"
    # Steps were launched before the step ahead of them finished: the overlap under test.
    assert s.launched_ahead() >= len(s.events) // 2 // 2
    assert (s.fed_stages >= s.launched_ahead() // 2) if padded else not s.fed_stages
    for i, prompt in enumerate(prompts):
        assert _tokens(outputs)[f"r{i}"] == hf_greedy(tiny_hf_model, prompt, 12), f"r{i}"


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_penalties_count_the_token_the_step_ahead_samples_on_the_device(
    served, tiny_hf_model, padded
):
    """Each overlapped decode step reads its input token (the previous step's output) on the
    device, before the host knows it: presence, frequency and repetition penalties must
    still count it, through chunking and preemption (also from the staged input ids CUDA
    graphs read)."""
    prompts = _prompts(13, 8, (5, 30))
    params = penalized(12)
    s = served(overlap=True, padded=padded)
    outputs, failed, preempted = s.run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert not failed and preempted and s.launched_ahead()
    assert bool(s.fed_stages) == padded
    tokens = _tokens(outputs)
    changed = 0
    for i, prompt in enumerate(prompts):
        want = hf_greedy(tiny_hf_model, prompt, 12, **PENALTIES)
        assert tokens[f"r{i}"] == want, f"r{i}"
        changed += want != hf_greedy(tiny_hf_model, prompt, 12, logit_bias=TINY_BIAS)
    assert changed >= len(prompts) // 2, "the penalties must change what greedy decoding picks"


def test_bad_words_match_the_tokens_the_step_ahead_samples_on_the_device(served, tiny_hf_model):
    """A bad word's last token is banned when the outputs before it match the rest, the
    latest of them the overlapped step's input, read on the device: each request bans a
    pair and a triple of its own greedy output (and one token), so the ban binds."""
    prompts = _prompts(17, 8, (5, 30))
    requests, want = [], {}
    for i, prompt in enumerate(prompts):
        plain = hf_greedy(tiny_hf_model, prompt, 12)
        words = (tuple(plain[3:5]), tuple(plain[6:9]), (plain[10],))
        params = SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, bad_words_token_ids=words
        )
        requests.append(Request(f"r{i}", prompt, params))
        want[f"r{i}"] = hf_greedy(tiny_hf_model, prompt, 12, bad_words=words)
        assert want[f"r{i}"] != plain
    s = served(overlap=True)
    outputs, failed, preempted = s.run(requests)
    assert not failed and preempted and s.launched_ahead()
    assert _tokens(outputs) == want


def test_structured_outputs_follow_xgrammar_in_transformers_while_others_overlap(
    served, tiny_model_dir, tiny_hf_model
):
    """A request held to a constraint waits for its token in flight (its next mask depends
    on it) while the others run overlapped: every output is transformers' greedy decoding
    with xgrammar's own logits processor, ending on the end token once complete."""
    import transformers
    import xgrammar as xgr

    from weir.services.engine.structured_output import GrammarCompiler, choice_grammar
    from weir.shared.tokenizer import Tokenizer

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = hf_tokenizer.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=49152, stop_token_ids=[eos])
    reference_compiler = xgr.GrammarCompiler(info)
    specs = [
        {"regex": r"(yes|no), [0-9]{3}"},
        {"choice": ["red apple", "green pear", "blue plum"]},
        {"grammar": 'root ::= "x" [a-c] [a-c]? "!"'},
    ]
    compiled = [
        reference_compiler.compile_regex(specs[0]["regex"]),
        reference_compiler.compile_grammar(choice_grammar(specs[1]["choice"])),
        reference_compiler.compile_grammar(specs[2]["grammar"]),
    ]
    prompts = _prompts(21, 6, (5, 20))
    tiny_hf_model.generation_config.eos_token_id = None
    want = [
        hf_constrained(tiny_hf_model, prompt, 12, compiled[i], eos)
        if i < len(specs)
        else hf_greedy(tiny_hf_model, prompt, 12)
        for i, prompt in enumerate(prompts)
    ]
    compiler = GrammarCompiler(Tokenizer.from_model_dir(tiny_model_dir), 49152, [eos])
    requests = []
    for i, prompt in enumerate(prompts):
        constrained = i < len(specs)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=not constrained)
        request = Request(f"r{i}", prompt, params, eos_token_id=eos)
        request.grammar = compiler.matcher(specs[i]) if constrained else None
        requests.append(request)
    s = served(overlap=True)
    outputs, failed, _ = s.run(requests)
    assert not failed and s.launched_ahead()
    tokens = _tokens(outputs)
    for i in range(len(prompts)):
        assert tokens[f"r{i}"] == want[i], f"r{i}"
    for i in range(len(specs)):
        assert want[i][-1] == eos and outputs[f"r{i}"][-1].finish_reason == "stop"
    assert hf_tokenizer.decode(want[0][:-1]) in {
        f"{a}, {n:03d}" for a in ("yes", "no") for n in range(1000)
    }
    assert hf_tokenizer.decode(want[1][:-1]) in specs[1]["choice"]


def test_a_slot_freed_while_its_token_is_in_flight_is_not_written_by_that_token(
    served, tiny_hf_model
):
    """A stop token is learnt a step late: the step after it still samples for the request,
    and the plan after that frees its slot and gives it to a waiting request with a long,
    chunked prompt. The late token must not land in the new request's prompt."""
    # The stoppers' late tokens fall at positions 18-21, inside the waiting prompts' second chunk.
    prompts = _prompts(11, 4, (16, 20)) + _prompts(12, 8, (30, 45))
    references = [hf_greedy(tiny_hf_model, p, 10) for p in prompts]
    greedy = {"max_tokens": 10, "temperature": 0.0}
    stoppers = [
        Request(f"r{i}", prompts[i], SamplingParams(**greedy, stop_token_ids=[references[i][2]]))
        for i in range(4)
    ]
    waiting = [
        Request(f"r{i}", prompts[i], SamplingParams(**greedy, ignore_eos=True))
        for i in range(4, 12)
    ]
    s = served(overlap=True)
    outputs, failed, _ = s.run(stoppers + waiting)
    assert not failed and s.launched_ahead()
    tokens = _tokens(outputs)
    for i, ref in enumerate(references):
        expected = ref[: ref.index(ref[2]) + 1] if i < 4 else ref
        assert tokens[f"r{i}"] == expected, f"r{i}"


def test_seeded_sampling_and_logprobs_are_the_same_overlapped_or_not(served):
    prompts = _prompts(7, 6, (5, 25))

    def requests():
        return [
            Request(
                f"r{i}",
                p,
                SamplingParams(
                    max_tokens=9, temperature=0.8, top_p=0.9, seed=100 + i, logprobs=2, min_tokens=4
                ),
            )
            for i, p in enumerate(prompts)
        ]

    plain, _, _ = served(overlap=False).run(requests())
    overlapped_served = served(overlap=True)
    overlapped, failed, _ = overlapped_served.run(requests())
    assert not failed and overlapped_served.launched_ahead()

    def flatten(outputs):
        return {
            r: [(out.new_token_ids, out.logprobs) for out in outs] for r, outs in outputs.items()
        }

    assert flatten(overlapped) == flatten(plain)
    assert all(len(tokens) >= 4 for tokens in _tokens(plain).values())


def test_a_failed_launch_fails_only_its_request_and_the_step_ahead_still_answers(
    served, tiny_hf_model
):
    s = served(overlap=True, poison="r5")
    prompts = _prompts(5, 8, (5, 12))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs, failed, _ = s.run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert list(failed) == ["r5"] and "boom" in failed["r5"]
    assert s.failures <= 8
    tokens = _tokens(outputs)
    for i, prompt in enumerate(prompts):
        if i != 5:
            assert tokens[f"r{i}"] == hf_greedy(tiny_hf_model, prompt, 10), f"r{i}"


def test_a_choice_holds_characters_past_the_bmp_as_their_utf8(tiny_model_dir):
    """A choice's emoji is the tokens transformers writes it as (xgrammar once read its JSON
    escape as two surrogates, and forced their bytes instead: invalid UTF-8)."""
    from transformers import AutoTokenizer

    from weir.services.engine.structured_output import GrammarCompiler
    from weir.shared.tokenizer import Tokenizer

    choice = "ça 🌍 日本語🙂"
    ids = AutoTokenizer.from_pretrained(tiny_model_dir).encode(choice, add_special_tokens=False)
    eos = 2
    grammar = GrammarCompiler(Tokenizer.from_model_dir(tiny_model_dir), 49152, [eos]).matcher(
        {"choice": [choice]}
    )
    assert all(grammar.accept(token) for token in ids)
    assert grammar.accept(eos) and grammar.is_terminated()
