"""An independent model of the executor side, for scheduler tests.

``FakeExecutor`` keeps the per-request state that step plans describe as diffs and
a paged "KV cache" whose every slot records the (token, position) it was computed
from. Each step it checks that the request's block table holds exactly the KV of
its own tokens for every position the plan says is computed (this catches a block
shared, evicted or reused while still needed, and a prefix-cache hit on wrong
content), writes the KV of the scheduled positions, and "samples" with a toy
deterministic model that depends only on token content, so identical prompts
generate identically. ``reference_generate`` is the plain one-request loop the
scheduler's outputs must reproduce, whatever chunking, preemption, caching or
speculation happened. A pooling request gets ``toy_pool`` of its prompt, and only if this
executor computed every position its pooling type reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.scheduler import Scheduler
from weir.services.scheduler.output import EngineOutput
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol.step import StepPlan, StepResult

VOCAB = 64
EOS = 0


def toy_next_token(tokens: list[int]) -> int:
    """Greedy 'model': next token from content only (last token, length, first token)."""
    return (tokens[-1] * 1103515245 + len(tokens) * 12345 + tokens[0] * 7 + 11) % VOCAB


def reference_generate(
    prompt: list[int],
    max_tokens: int,
    min_tokens: int = 0,
    eos: int | None = EOS,
    stop_token_ids: tuple[int, ...] = (),
    max_model_len: int = 10**9,
) -> tuple[list[int], str]:
    tokens = list(prompt)
    out: list[int] = []
    while True:
        token = toy_next_token(tokens)
        tokens.append(token)
        out.append(token)
        if len(out) >= min_tokens and (token == eos or token in stop_token_ids):
            return out, "stop"
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out, "length"


def toy_pool(prompt: list[int], kind: str) -> bytes:
    """What a pooling request of ``kind`` gets back: its last token, the mean of its prompt
    or its first token, as float32 bytes (the executor's wire form)."""
    value = {"LAST": prompt[-1], "MEAN": sum(prompt) / len(prompt), "CLS": prompt[0]}[kind]
    return np.array([value], dtype="<f4").tobytes()


@dataclass
class _State:
    prompt: list[int]
    tokens: list[int]
    block_table: list[int]
    in_batch: bool = True
    num_computed_tokens: int = 0
    pooling: str | None = None
    from_zero: bool = False  # every position since 0 was computed here (MEAN and CLS read them)


class FakeExecutor:
    """With ``lookahead`` > 0 it also writes as a draft model does after a step: a marker in
    the slots of up to ``lookahead`` positions from each sampled request's next one, as far
    as its blocks reach, which must be its own (a later check of another request's KV
    would find the marker)."""

    def __init__(self, num_blocks: int, block_size: int, lookahead: int = 0) -> None:
        self.block_size = block_size
        self.lookahead = lookahead
        self.kv: list[list[tuple[int, int] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]
        self.state: dict[str, _State] = {}

    def reset(self) -> None:
        self.state.clear()

    def _reach(self, state: _State) -> int:
        return len(state.block_table) * self.block_size

    def _slot(self, state: _State, position: int) -> tuple[int, int]:
        return state.block_table[position // self.block_size], position % self.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_req_ids:
            self.state.pop(rid, None)
        for rid in plan.preempted_req_ids:
            self.state[rid].in_batch = False
        starts: dict[str, int] = {}
        for new in plan.new_requests:
            assert new.request_id not in self.state, f"{new.request_id} sent as new twice"
            self.state[new.request_id] = _State(
                list(new.prompt_token_ids),
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                pooling=new.pooling,
            )
            starts[new.request_id] = new.num_computed_tokens
        for cached in plan.cached_requests:
            state = self.state[cached.request_id]
            if cached.resumed:
                assert not state.in_batch, "resumed without having been preempted"
                state.in_batch = True
                state.from_zero = False
                state.block_table = list(cached.new_block_ids)
                state.tokens = state.prompt + list(cached.output_token_ids)
            else:
                assert state.in_batch, f"{cached.request_id} scheduled while preempted"
                assert cached.num_computed_tokens == state.num_computed_tokens
                state.block_table.extend(cached.new_block_ids)
            starts[cached.request_id] = cached.num_computed_tokens
        assert set(starts) == set(plan.num_scheduled_tokens)

        sampled: dict[str, list[int]] = {}
        pooled: dict[str, bytes] = {}
        for rid, num_new in plan.num_scheduled_tokens.items():
            state = self.state[rid]
            start = starts[rid]
            drafts = plan.scheduled_spec_decode_tokens.get(rid, [])
            sequence = state.tokens + list(drafts)
            end = start + num_new
            assert end <= len(sequence), f"{rid}: scheduled past its tokens"
            assert not drafts or end == len(sequence), f"{rid}: drafts during a prefill"
            assert len(state.block_table) * self.block_size >= end, f"{rid}: too few blocks"
            for position in range(start):
                block, offset = self._slot(state, position)
                assert self.kv[block][offset] == (sequence[position], position), (
                    f"{rid}: KV at position {position} (block {block}) is not its own"
                )
            for position in range(start, end):
                block, offset = self._slot(state, position)
                self.kv[block][offset] = (sequence[position], position)
            state.from_zero = start == 0 or (state.from_zero and start == state.num_computed_tokens)
            state.num_computed_tokens = end
            if end < len(state.tokens):
                continue  # partial prefill
            if state.pooling is not None:
                assert state.pooling == "LAST" or state.from_zero, f"{rid}: pooled unseen tokens"
                pooled[rid] = toy_pool(state.prompt, state.pooling)
                continue
            out: list[int] = []
            for draft in drafts:
                token = toy_next_token(state.tokens + out)
                out.append(token)
                if token != draft:
                    break
            else:
                out.append(toy_next_token(state.tokens + out))
            state.tokens.extend(out)
            state.num_computed_tokens = len(state.tokens) - 1
            sampled[rid] = out
            ahead = state.num_computed_tokens
            for position in range(ahead, min(ahead + self.lookahead, self._reach(state))):
                block, offset = self._slot(state, position)
                self.kv[block][offset] = (-1, position)
        return StepResult(sampled, pooled=pooled or None)


def make_scheduler(
    block_size: int = 16,
    num_blocks: int = 1000,
    enable_prefix_caching: bool = True,
    **scheduler_kwargs,
) -> tuple[Scheduler, EngineCore]:
    """A Scheduler, and the engine core that runs it on a FakeExecutor of the same cache
    geometry (``core.executor.runner``)."""
    scheduler = Scheduler(
        SchedulerConfig(**scheduler_kwargs),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
    )
    return scheduler, EngineCore(scheduler, InProcessExecutor(FakeExecutor(num_blocks, block_size)))


def run_step(scheduler: Scheduler, core: EngineCore) -> tuple[StepPlan, list[EngineOutput]]:
    """One ``core.step()``; returns (plan, outputs), an empty plan when nothing could run."""
    assert core.scheduler is scheduler
    step = step_now(core)
    return (StepPlan(), []) if step is None else (step.plan, step.outputs)
