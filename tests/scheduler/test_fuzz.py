"""Random traffic through a tiny cache, in lockstep and with async scheduling, with drafts
(and a draft model's writes ahead): budget/leak invariants and exact outputs."""

import random
from collections import Counter
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.scheduler import Request, RequestStatus, Scheduler
from weir.services.scheduler.kv_events import KVEventLog, external_hash
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.pooling import POOLING_TYPES
from weir.shared.protocol.step_codec import (
    decode_step_plan,
    decode_step_result,
    encode_step_plan,
    encode_step_result,
)
from weir.shared.sampling import SamplingParams

from .fake_executor import EOS, FakeExecutor, reference_generate, toy_next_token, toy_pool


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(16, 48))
    chunked = draw(st.booleans()) or draw(st.booleans())
    budget = draw(st.integers(8, 64))
    overlapped = draw(st.booleans())
    num_speculative_tokens = 0 if overlapped else draw(st.sampled_from([0, 2, 3]))
    config = SchedulerConfig(
        max_num_batched_tokens=budget if chunked else max(budget, max_model_len),
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])) if chunked else 0,
        enable_chunked_prefill=chunked,
        watermark=draw(st.sampled_from([0.0, 0.1])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        num_speculative_tokens=num_speculative_tokens,
        # a draft model's: its executor writes ahead of the tokens it computes
        num_lookahead_tokens=num_speculative_tokens if draw(st.booleans()) else 0,
        async_scheduling=overlapped,
        max_loras=draw(st.integers(0, 2)),
    )
    num_blocks = -(-config.max_model_len // block_size) + draw(st.integers(0, 12))
    cache = CacheConfig(
        block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=draw(st.booleans())
    )
    return config, cache, draw(st.integers(0, 2**32 - 1))


class _FollowingGrammar:
    """A structured output that allows every token and records the ones it is told of; it
    cuts drafts before a 7 (as a real one cuts those it does not allow)."""

    too_costly = False
    last_cost_s = 0.0

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def bitmask(self, drafts=()) -> bytes:
        assert 7 not in drafts
        return b"\xff" * 8 * (1 + len(drafts))

    def allowed_drafts(self, drafts):
        return list(drafts[: drafts.index(7)] if 7 in drafts else drafts)

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False


def _check_plan(plan, config, scheduler):
    counts = plan.num_scheduled_tokens
    assert sum(counts.values()) == plan.total_num_scheduled_tokens
    assert plan.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(counts) <= config.max_num_seqs and len(scheduler.running) <= config.max_num_seqs
    if config.long_prefill_token_threshold:
        assert max(counts.values(), default=0) <= max(
            config.long_prefill_token_threshold, 1 + config.num_speculative_tokens
        )
    if not config.enable_chunked_prefill:
        for new in plan.new_requests:
            assert counts[new.request_id] == len(new.prompt_token_ids) - new.num_computed_tokens
    if plan.preempted_req_ids:
        assert not plan.new_requests
        assert not any(c.resumed for c in plan.cached_requests)
    kv = scheduler.kv_cache_manager
    references = Counter(b for r in scheduler.running for b in r.block_ids)
    assert all(block.ref_cnt == references[block.block_id] for block in kv.pool.blocks)
    assert kv.num_free_blocks == kv.num_blocks - len(references)
    assert all(block.block_hash == key for key, block in kv.pool.cached_blocks.items())
    assert not any(r.block_ids for r in scheduler.waiting)
    widest = -(-config.max_model_len // kv.block_size)  # an executor's block table
    assert all(len(r.block_ids) <= widest for r in scheduler.running)
    adapters = {r.lora_name for r in scheduler.running} - {None}
    assert len(adapters) <= config.max_loras
    for new in plan.new_requests:
        request = scheduler.requests.get(new.request_id)
        if request is not None and request.admitted_step == plan.step_id:
            assert new.lora_name == request.lora_name


def _follow(events: list, stored: set[int]) -> None:
    for event in events:
        if event[0] == "BlockStored":
            _, hashes, _, token_ids, block_size, *_ = event
            assert len(token_ids) == block_size * len(hashes)
            stored.update(hashes)
        elif event[0] == "BlockRemoved":
            assert stored.issuperset(event[1]), "a block removed that was never stored"
            stored.difference_update(event[1])
        else:
            stored.clear()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_traffic(scenario):
    config, cache, seed = scenario
    rng = random.Random(seed)
    # The prefix cache's events, as a KV-cache-aware router follows them: what they say is
    # cached is what is, after every step.
    events = KVEventLog(cache.block_size)
    routed: set[int] = set()
    scheduler = Scheduler(config, cache, events)
    expected: dict[str, tuple[list[int], str]] = {}
    produced: dict[str, list[int]] = {}
    ended: dict[str, str] = {}
    reusable: list[str] = []  # ids of requests ended from outside, for a new request to take
    fake = FakeExecutor(cache.num_blocks, cache.block_size, config.num_lookahead_tokens)
    grammars: dict[str, _FollowingGrammar] = {}
    pooled: dict[str, bytes | None] = {}  # of pooling requests: what they pooled (None yet)

    def end_from_outside(rid: str, how: str) -> None:
        ended[rid] = how
        reusable.append(rid)

    def check(rid: str) -> None:
        tokens, reason = expected.pop(rid)
        output, how = produced.pop(rid), ended.pop(rid)
        if rid in pooled:  # an embedding: its vector, unless it ended before
            vector = pooled.pop(rid)
            # Ended from outside (an abort, a "stop string"), it may have pooled nothing.
            assert vector == tokens if how == "stop" else vector is None, rid
            assert output == [], rid
            return
        if rid in grammars:  # told of each token it output, once, in order
            assert grammars[rid].accepted == output, rid
        if how in ("abort", "stop string"):
            assert output == tokens[: len(output)], rid
        else:
            assert (output, how) == (tokens, reason), rid

    def execute(plan):
        """The fake executor behind the real wire codec."""
        plan = decode_step_plan(encode_step_plan(plan))
        _check_plan(plan, config, scheduler)
        result = decode_step_result(encode_step_result(fake.execute(plan)))
        for rid in result.sampled_token_ids:
            request = scheduler.requests.get(rid)
            if (
                request is None
                or request.status is not RequestStatus.RUNNING
                or request.admitted_step > plan.step_id
            ):
                continue  # ended, preempted or its id reused while the step was in flight
            # A structured output's mask went with the step, one for each position it
            # samples, and no other samples for it.
            assert (rid in plan.grammar_bitmask) == (request.grammar is not None), rid
            if request.grammar is not None:
                drafts = plan.scheduled_spec_decode_tokens.get(rid, [])
                assert len(plan.grammar_bitmask[rid]) == 8 * (1 + len(drafts)), rid
            assert request.grammar is None or request.num_output_placeholders <= 1, rid
        if rng.random() < 0.03 and plan.num_scheduled_tokens:
            # An abort arriving while the step is in flight: its late tokens are dropped.
            victim = rng.choice(sorted(plan.num_scheduled_tokens))
            for out in scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED):
                end_from_outside(out.request_id, "abort")
        return result

    core = EngineCore(scheduler, InProcessExecutor(SimpleNamespace(execute=execute)))
    shared_prefix = [rng.randrange(1, 64) for _ in range(12)]
    num_requests = rng.randint(4, 30)
    next_id = 0

    for _ in range(400):
        if next_id < num_requests and rng.random() < 0.6:
            if reusable and rng.random() < 0.5:
                # The id of a request ended from outside, perhaps still in an in-flight step.
                rid = reusable.pop(rng.randrange(len(reusable)))
                check(rid)
            else:
                rid = f"r{next_id}"
            next_id += 1
            length = rng.randint(1, config.max_model_len)
            if rng.random() < 0.5:
                prompt = (shared_prefix + [rng.randrange(1, 64) for _ in range(length)])[:length]
            else:
                prompt = [rng.randrange(1, 64) for _ in range(length)]
            pooling = rng.choice(POOLING_TYPES) if rng.random() < 0.2 else None
            max_tokens = rng.randint(1, 12)
            params = SamplingParams(
                max_tokens=max_tokens,
                min_tokens=min(max_tokens, rng.choice([0, 0, 2])),
                ignore_eos=rng.random() < 0.2,
                stop_token_ids=rng.choice([(), (5,)]),
            )
            request = Request(
                rid,
                prompt,
                params,
                eos_token_id=EOS,
                priority=rng.randint(0, 2),
                lora_name=rng.choice([None, "A", "B", "C"]) if config.max_loras else None,
                pooling=pooling,
            )
            grammars.pop(rid, None)
            if pooling is None and rng.random() < 0.3:
                request.grammar = grammars[rid] = _FollowingGrammar()
            try:
                scheduler.add_request(request)
            except ValueError:
                continue  # refused up front: could never fit the cache
            expected[rid] = reference_generate(
                prompt,
                params.max_tokens,
                params.min_tokens,
                None if params.ignore_eos else EOS,
                params.stop_token_ids,
                config.max_model_len,
            )
            if pooling is not None:
                expected[rid] = (toy_pool(prompt, pooling), "stop")  # type: ignore[assignment]
                pooled[rid] = None
            produced[rid] = []
        if rng.random() < 0.05 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            for out in scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED):
                assert out.request_id not in ended
                end_from_outside(out.request_id, "abort")
        if rng.random() < 0.03 and scheduler.running:
            # A stop string found by the detokenizer ends a running request from outside.
            victim = rng.choice(scheduler.running).request_id
            for out in scheduler.finish_requests([victim], RequestStatus.FINISHED_STOPPED):
                end_from_outside(out.request_id, "stop string")

        engine_step = step_now(core)
        _follow(events.take(), routed)
        cached = scheduler.kv_cache_manager.pool.cached_blocks
        assert routed == {external_hash(h) for h in cached}
        for out in engine_step.outputs if engine_step else ():
            assert out.request_id not in ended, f"{out.request_id} answered after it ended"
            produced[out.request_id].extend(out.new_token_ids)
            if out.pooled is not None:
                assert out.finished and pooled[out.request_id] is None, out.request_id
                pooled[out.request_id] = out.pooled
            if out.finished:
                ended[out.request_id] = out.finish_reason
        if config.num_speculative_tokens:
            drafts = {}
            for request in scheduler.running:
                tokens = list(request.all_token_ids)
                guess = []
                for _ in range(config.num_speculative_tokens):
                    good = toy_next_token(tokens + guess)
                    guess.append(good if rng.random() < 0.6 else (good + 1) % 64)
                drafts[request.request_id] = guess
            scheduler.update_draft_token_ids(drafts)
        if next_id >= num_requests and not core.has_work():
            break

    assert not core.has_work(), "requests left unfinished after 400 steps"
    assert set(ended) == set(expected), "every admitted request ends exactly once"
    for rid in list(expected):
        check(rid)
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)
    assert scheduler.stats().num_running == 0
