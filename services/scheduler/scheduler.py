"""The token-budget scheduler: one allocation loop over running, then waiting requests.

``schedule()`` and ``update_from_output()`` alternate: a plan is computed, executed,
and its result applied before the next plan. ``num_computed_tokens`` advances in
``update_from_output`` (it means "KV in the cache"), so a plan's records carry the
count from before the step.

With ``async_scheduling`` the next plan is made while a step runs, before its result
is applied: ``schedule()`` advances ``num_computed_tokens`` at once (it then means
"KV in the cache once the steps sent have run") and counts one
``num_output_placeholders`` for each request the step will sample for; the executor
feeds the token it sampled into the next step itself. ``update_from_output`` then
only appends the tokens and applies stops; a request that stopped on a token the
scheduler could not foresee (EOS, a stop token) has run one step more, whose result
is dropped. Length limits are foreseen: no step is planned past ``max_tokens`` or
``max_model_len``. ``finish_requests`` may be
called at any time, also while a step is in flight: the request's blocks are freed
at once and its late results are ignored. See docs/architecture.md for the loop.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain

from weir.services.scheduler.kv_cache_manager import KVCacheManager
from weir.services.scheduler.kv_events import KVEventLog
from weir.services.scheduler.output import EngineOutput
from weir.services.scheduler.request import FINISH_REASONS, Request, RequestStatus
from weir.services.scheduler.request_queue import WaitingQueue, priority_key
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol.step import (
    CachedRequestData,
    NewRequest,
    SampleLogprobs,
    StepPlan,
    StepResult,
)

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative speculative-decoding counts (vLLM's names): verified draft runs, their
    draft tokens, the accepted ones, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, prompt tokens looked up at first admission
    prefix_cache_hits: int  # cumulative, those found
    num_scheduled_tokens: int  # of the last plan
    num_free_blocks: int
    num_blocks: int
    spec_decode: SpecDecodeStats


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_events: KVEventLog | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.kv_events = kv_events  # the prefix cache's changes, for KV-cache-aware routers
        self._use_cache(cache_config)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []  # admission order
        self._finished_req_ids: list[str] = []  # since the last plan
        self._next_seq = 0
        self._step_id = 0
        self._num_preemptions = 0
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._last_num_scheduled_tokens = 0
        self._spec = SpecDecodeStats()
        # After a failed step, until its cause is found (``on_step_failed``): groups of
        # suspect request ids, tried one at a time, and the requests that have sampled a
        # token since (proven to run).
        self._trials: list[set[str]] = []
        self._proven: set[str] = set()
        # Async scheduling: by step id, the requests each planned step samples for.
        self._sampling: dict[int, list[Request]] = {}
        # Requests with a structured output: each step that samples for one carries its
        # bitmask of allowed tokens.
        self._grammars: set[Request] = set()
        # The LoRA adapters executors hold (id -> [directory, fingerprint of its files]),
        # once the server changes them
        # at runtime (until then executors hold those they started with), and whether the
        # next plan that reaches them must say so (the set changed, or an executor lost
        # its state).
        self.lora_adapters: dict[str, list[str]] | None = None
        self._send_lora_adapters = False
        # The model directory whose weights replaced those executors start with (None: they
        # were never replaced), and whether the next plan must carry it.
        self.weights_path: str | None = None
        self._send_weights = False

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ``ValueError`` for a duplicate id, a prompt longer
        than ``max_model_len``, or one whose longest possible KV footprint
        (``_fit_to_the_cache``) exceeds the whole cache: such a request could never finish
        and would otherwise wait forever."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request {rid!r} already exists")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} has already been scheduled")
        max_len = self.scheduler_config.max_model_len
        if request.num_prompt_tokens > max_len:
            raise ValueError(
                f"request {rid!r}: prompt has {request.num_prompt_tokens} tokens, "
                f"more than max_model_len={max_len}"
            )
        if (problem := self._fit_to_the_cache(request)) is not None:
            raise ValueError(f"request {rid!r}: {problem}")
        request.seq = self._next_seq
        self._next_seq += 1
        self.requests[rid] = request
        self.waiting.add(request)
        if request.grammar is not None:
            self._grammars.add(request)

    def finish_requests(
        self, request_ids: Iterable[str] | str, status: RequestStatus
    ) -> list[EngineOutput]:
        """End requests from outside the step loop (abort, or a stop string found by
        the detokenizer with FINISHED_STOPPED). Blocks are freed at once, the ids go
        into the next plan's ``finished_req_ids``. Unknown or already finished ids are
        ignored. Returns one final ``EngineOutput`` per request ended here."""
        if status not in FINISH_REASONS:
            raise ValueError(f"status must be a finished status, got {status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        outputs = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            if request.status is _RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            outputs.append(
                EngineOutput(rid, [], True, FINISH_REASONS[status], request.num_cached_tokens)
            )
        if self._trials:
            self._prove(o.request_id for o in outputs)
        return outputs

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._grammars.discard(request)
        request.spec_token_ids = []
        self._finished_req_ids.append(request.request_id)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Set the next step's draft tokens (call after ``update_from_output``). Drafts
        for a request that is not decoding (partial prefill, waiting, finished) are
        dropped; they are capped at ``num_speculative_tokens`` (when > 0) and at what
        ``max_tokens`` and ``max_model_len`` can still accept, the bonus token included
        (the executor holds every token it samples)."""
        cap = self.scheduler_config.num_speculative_tokens
        max_model_len = self.scheduler_config.max_model_len
        for rid, drafts in draft_token_ids.items():
            request = self.requests.get(rid)
            if request is None or request.status is not _RUNNING:
                continue
            if request.num_computed_tokens != len(request.all_token_ids) - 1:
                request.spec_token_ids = []
                continue
            room = (
                min(
                    request.max_tokens - len(request.output_token_ids),
                    max_model_len - len(request.all_token_ids),
                )
                - 1
            )
            if cap and cap < room:
                room = cap
            drafts = list(drafts[:room]) if room > 0 else []
            if drafts and request.grammar is not None:
                drafts = request.grammar.allowed_drafts(drafts)
            request.spec_token_ids = drafts

    # ------------------------------------------------------------------ the executor's state lost

    def _fit_to_the_cache(self, request: Request) -> str | None:
        """Fit ``request`` to this KV cache: without a max_tokens ("as many as fit") it is
        given what the cache holds, where that is more than its outputs so far (it ends
        there, "length"). Returns why it can never finish, or None: its longest footprint
        (prompt + max_tokens - 1 tokens: the last token is never fed back, so at most
        ``max_model_len - 1``, or a whole context's prompt) needs more blocks than the whole
        cache has."""
        max_len = self.scheduler_config.max_model_len
        longest = max(max_len - 1, request.num_prompt_tokens)
        footprint = min(request.num_prompt_tokens + request.max_tokens - 1, longest)
        kv = self.kv_cache_manager
        if kv.num_blocks_for(footprint) <= kv.num_blocks:
            return None
        room = kv.num_blocks * kv.block_size + 1 - request.num_prompt_tokens
        if request.max_tokens == sys.maxsize and room > len(request.output_token_ids):
            request.max_tokens = room
            return None
        max_tokens = "a smaller max_tokens" if request.max_tokens < max_len else "max_tokens"
        return (
            f"up to {footprint} tokens of KV need {kv.num_blocks_for(footprint)} blocks but "
            f"the cache has only {kv.num_blocks}: send a shorter prompt or {max_tokens} "
            "(or start the server with a larger --kv-cache-memory)"
        )

    def reset_executor_state(self, cache_config: CacheConfig | None = None) -> dict[str, str]:
        """The executor holds no request any more (a step raised on it, or a new executor
        group replaced a lost one). Every unfinished request goes back to waiting, in
        order, to be sent again as new and recomputed; its output tokens are kept, so no
        client sees a token twice. ``cache_config`` rebuilds the KV cache for a new
        executor (its size may differ, and it holds no KV); without it the prefix cache
        stays valid (a failed step leaves the KV of computed tokens untouched).

        Returns the requests a smaller new cache can never finish, ended (aborted), each
        with the reason: waiting, one would hold the queue for ever."""
        for request in reversed(self.running):
            self._send_again(request)
        self.running.clear()
        for request in self.waiting:
            request.status = RequestStatus.WAITING  # also the preempted ones
        # A step planned after the one that failed may have run and left requests in
        # the executor: it forgets every id it may hold before taking them again.
        self._finished_req_ids = list(self.requests)
        # A new executor holds only the adapters, and the weights, it started with.
        self._send_lora_adapters = self.lora_adapters is not None
        self._send_weights = self.weights_path is not None
        self._sampling.clear()
        if self.scheduler_config.async_scheduling and cache_config is None:
            # The failed step may have left unwritten KV in blocks already registered.
            cache_config = self.cache_config
        if cache_config is None:
            return {}
        self._use_cache(cache_config)
        if self.kv_events is not None:
            self.kv_events.cleared()
        too_big = {
            rid: problem
            for rid, request in self.requests.items()
            if (problem := self._fit_to_the_cache(request)) is not None
        }
        self.finish_requests(too_big, RequestStatus.FINISHED_ABORTED)
        return too_big

    def _use_cache(self, cache_config: CacheConfig) -> None:
        """A new, empty KV cache of ``cache_config``'s size."""
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager(cache_config, self.kv_events)
        self._watermark_blocks = int(self.scheduler_config.watermark * cache_config.num_blocks)

    def _send_again(self, request: Request) -> None:
        """Back to the head of the waiting queue, as new to the executor (recompute)."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        self.waiting.requeue(request)

    def on_step_failed(self, plan: StepPlan) -> list[str]:
        """``plan`` raised on the executor, which then dropped every request. Find the
        request that makes steps raise by bisection: the failed step's requests are split
        in halves, and steps run one half of suspects at a time (with requests proven
        since; other unproven requests wait), until a step of one unproven request
        fails. That request ends (FINISHED_ABORTED) and its id is returned; [] while it
        is not known yet. A request is proven once it samples a token (or ends)."""
        scheduled = [rid for rid in plan.num_scheduled_tokens if rid in self.requests]
        failed = [rid for rid in scheduled if rid not in self._proven] or scheduled
        self._proven.difference_update(failed)
        trials = self._trials
        if trials:
            untried = trials.pop(0).difference(failed)
            if untried:
                trials.insert(0, untried)
        culprits: list[str] = []
        if len(failed) == 1:
            culprits = failed
            self.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        elif failed:
            half = len(failed) // 2
            trials[:0] = [set(failed[:half]), set(failed[half:])]
        if not trials:
            self._proven.clear()
        self.reset_executor_state()
        return culprits

    def _prove(self, request_ids: Iterable[str]) -> None:
        proven, trials = self._proven, self._trials
        for rid in request_ids:
            proven.add(rid)
            for trial in trials:
                trial.discard(rid)
        while trials and not trials[0]:
            trials.pop(0)
        if not trials:
            proven.clear()

    def _excluded(self, rid: str) -> bool:
        """While a trial runs, an unproven request outside its group waits."""
        return rid not in self._trials[0] and rid not in self._proven

    def reset_prefix_cache(self) -> int:
        """vLLM's: no request reads a block cached before this call (see
        ``BlockPool.reset_prefix_cache``); returns how many blocks were cached."""
        return self.kv_cache_manager.pool.reset_prefix_cache()

    def set_lora_adapters(self, adapters: dict[str, list[str]]) -> None:
        """From the next plan on, executors hold these adapters (and drop any other that
        was loaded at runtime): a request may name a new one in that plan."""
        self.lora_adapters = dict(adapters)
        self._send_lora_adapters = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(len(self.waiting))

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            spec_decode=SpecDecodeStats(
                self._spec.num_drafts,
                self._spec.num_draft_tokens,
                self._spec.num_accepted_tokens,
                list(self._spec.accepted_per_pos),
            ),
        )

    # ------------------------------------------------------------------ the step

    def schedule(self) -> StepPlan:
        config = self.scheduler_config
        kv = self.kv_cache_manager
        budget = config.max_num_batched_tokens
        threshold = config.long_prefill_token_threshold
        max_model_len = config.max_model_len
        block_size = kv.block_size
        running = self.running

        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_blocks: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []

        on_trial = bool(self._trials)
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if on_trial and self._excluded(request.request_id):
                i += 1
                continue
            computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            if request.num_output_placeholders:
                if request.grammar is not None:
                    # Its next mask depends on the token in flight: it waits for it (and
                    # decodes every other step in async mode).
                    i += 1
                    continue
                num_tokens += request.num_output_placeholders
                if (
                    len(request.output_token_ids) + request.num_output_placeholders
                    >= request.max_tokens
                    or num_tokens >= max_model_len
                ):
                    i += 1  # its last token is in flight
                    continue
            num_new = num_tokens + len(request.spec_token_ids) - computed
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new > max_model_len - computed:
                num_new = max_model_len - computed

            # Fast path: the last block still has room (most decode steps).
            if computed + num_new > len(request.block_ids) * block_size:
                while (blocks := kv.allocate_slots(request, num_new)) is None:
                    victim_index = self._victim_index()
                    victim = running[victim_index]
                    budget += self._preempt(
                        victim_index, num_scheduled, spec_tokens, new_blocks, scheduled_running
                    )
                    preempted.append(victim)
                    if victim is request:
                        break
                    if victim_index < i:
                        i -= 1
                if blocks is None:
                    continue  # this request was the victim; running[i] is the next one
                if blocks:
                    new_blocks[request.request_id] = blocks
            if config.num_lookahead_tokens:
                self._allocate_lookahead(request, num_new, new_blocks)

            rid = request.request_id
            num_scheduled[rid] = num_new
            budget -= num_new
            if num_new > 1 and request.block_hashes:  # a prefill's chunk (or drafts)
                kv.computes(request, computed, num_new)
            num_drafts = computed + num_new - num_tokens
            if num_drafts > 0:
                spec_tokens[rid] = request.spec_token_ids[:num_drafts]
            scheduled_running.append(request)
            i += 1

        cached = CachedRequestData(
            [r.request_id for r in scheduled_running],
            [r.num_computed_tokens for r in scheduled_running],
            new_blocks,
        )
        new_requests: list[NewRequest] = []
        admitted: list[Request] = []
        if not preempted:
            budget = self._admit(budget, num_scheduled, new_requests, cached, admitted)
        grammar_bitmask = (
            self._grammar_bitmasks(num_scheduled, spec_tokens) if self._grammars else {}
        )
        if config.async_scheduling:
            sampling = []
            for request in chain(scheduled_running, admitted):
                request.num_computed_tokens += num_scheduled[request.request_id]
                if request.num_computed_tokens >= len(request.all_token_ids) + (
                    request.num_output_placeholders
                ):
                    request.num_output_placeholders += 1
                    sampling.append(request)
            if sampling:
                self._sampling[self._step_id + 1] = sampling

        total = config.max_num_batched_tokens - budget
        self._last_num_scheduled_tokens = total
        finished, self._finished_req_ids = self._finished_req_ids, []
        sent = bool(num_scheduled or finished or preempted)
        adapters, weights = self._executor_state(sent)
        self._step_id += 1
        return StepPlan(
            num_scheduled,
            total,
            spec_tokens,
            new_requests,
            cached,
            [r.request_id for r in preempted],
            finished,
            self._step_id,
            grammar_bitmask,
            adapters,
            weights,
        )

    def _executor_state(self, sent: bool) -> tuple[dict[str, list[str]] | None, str | None]:
        """The adapters and weights the next plan carries, if it is ``sent`` and they are due."""
        adapters = weights = None
        if sent and self._send_lora_adapters:
            adapters, self._send_lora_adapters = dict(self.lora_adapters or {}), False
        if sent and self._send_weights:
            weights, self._send_weights = self.weights_path, False
        return adapters, weights

    def control_plan(
        self,
        load_weights: str | None = None,
        sleep_level: int | None = None,
        wake_tags: list[str] | None = None,
        profile: str | None = None,
    ) -> StepPlan:
        """A plan that schedules nothing: the executors wake up (``sleep_level`` 0: what
        ``wake_tags`` names, None for all), load
        the weights of model directory ``load_weights``, go to sleep (1, 2), and start or
        stop their profilers (``profile``), as asked,
        and forget the requests ended since the last plan; for an engine whose steps are
        paused and settled (``EngineCore.settled``)."""
        if load_weights is not None:
            self.weights_path, self._send_weights = load_weights, True
        finished, self._finished_req_ids = self._finished_req_ids, []
        adapters, weights = self._executor_state(True)
        self._step_id += 1
        return StepPlan(
            finished_req_ids=finished,
            step_id=self._step_id,
            lora_adapters=adapters,
            load_weights=weights,
            sleep_level=sleep_level,
            wake_tags=wake_tags,
            profile=profile,
        )

    def _grammar_bitmasks(
        self, num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]
    ) -> dict[str, bytes]:
        """The allowed tokens of each structured-output request this step samples for (at
        each position it verifies a draft, after the drafts before)."""
        masks = {}
        for request in self._grammars:
            num_new = num_scheduled.get(request.request_id)
            if num_new and request.num_computed_tokens + num_new >= len(request.all_token_ids):
                assert request.grammar is not None
                mask = request.grammar.bitmask(spec_tokens.get(request.request_id, ()))
                if mask is not None:
                    masks[request.request_id] = mask
        return masks

    def _allocate_lookahead(
        self, request: Request, num_new: int, new_blocks: dict[str, list[int]]
    ) -> None:
        """Blocks past the ``num_new`` tokens the request computes in the step being
        planned, for the proposals a draft model writes there after it, where they are free
        (never at another request's expense: without them it proposes fewer drafts). Adds
        them to ``new_blocks``."""
        config = self.scheduler_config
        computed = request.num_computed_tokens
        end = min(computed + num_new + config.num_lookahead_tokens, config.max_model_len)
        if end <= len(request.block_ids) * self.kv_cache_manager.block_size:
            return
        blocks = self.kv_cache_manager.allocate_slots(request, end - computed)
        if blocks:
            new_blocks.setdefault(request.request_id, []).extend(blocks)

    def _victim_index(self) -> int:
        """The running request to preempt: the most recently admitted (FCFS), or the
        one with the largest (priority, arrival)."""
        running = self.running
        if self.scheduler_config.policy == "priority":
            return max(range(len(running)), key=lambda j: priority_key(running[j]))
        return len(running) - 1

    def _preempt(
        self,
        victim_index: int,
        num_scheduled: dict[str, int],
        spec_tokens: dict[str, list[int]],
        new_blocks: dict[str, list[int]],
        scheduled_running: list[Request],
    ) -> int:
        """Recompute-preemption; returns the budget the victim held in this step (only
        under the priority policy can the victim already be scheduled)."""
        victim = self.running.pop(victim_index)
        rid = victim.request_id
        returned = num_scheduled.pop(rid, 0)
        if returned:
            scheduled_running.remove(victim)
            spec_tokens.pop(rid, None)
            new_blocks.pop(rid, None)
        self._send_again(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self._num_preemptions += 1
        return returned

    def _admit(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        new_requests: list[NewRequest],
        cached: CachedRequestData,
        admitted: list[Request],
    ) -> int:
        config = self.scheduler_config
        kv = self.kv_cache_manager
        waiting = self.waiting
        running = self.running
        threshold = config.long_prefill_token_threshold
        on_trial = bool(self._trials)
        # LoRA adapters of the running requests, once a waiting request has one.
        adapters: set[str] | None = None
        # Requests held back for a pending block, and once there is one the queue walked in
        # order past them: a request that shares nothing with them is not held up.
        held: set[Request] = set()
        behind: Iterator[Request] | None = None
        while len(waiting) and budget > 0 and len(running) < config.max_num_seqs:
            by_name = on_trial  # taken out of the queue by name, not popped from its head
            if on_trial:
                request = next((r for r in waiting if not self._excluded(r.request_id)), None)
                if request is None:
                    break
            elif behind is not None:
                request = next((r for r in behind if r not in held), None)
                if request is None:
                    break
                by_name = True
            else:
                request = waiting.peek()
            if request.lora_name is not None:
                if adapters is None:
                    adapters = {r.lora_name for r in running if r.lora_name is not None}
                if request.lora_name not in adapters and len(adapters) >= config.max_loras:
                    # It waits for a running adapter to finish. Requests behind it without
                    # an adapter go first; those of running adapters do not (vLLM lets them,
                    # and a steady flow of them starves it).
                    request = next(
                        (
                            r
                            for r in waiting
                            if r.lora_name is None
                            and r not in held
                            and not (on_trial and self._excluded(r.request_id))
                        ),
                        None,
                    )
                    if request is None:
                        break
                    by_name = True
            hits = kv.get_computed_blocks(request)
            if kv.pending and not on_trial and kv.waits_for_pending(request, len(hits)):
                # It hits what a planned step computes once that step is applied.
                held.add(request)
                if behind is None:
                    behind = iter(waiting)
                continue
            num_tokens = len(request.all_token_ids)
            num_hit_tokens = len(hits) * kv.block_size
            num_new = num_tokens - num_hit_tokens
            if not config.enable_chunked_prefill:
                if num_new > budget:
                    break  # waits whole; nothing behind it jumps the queue
            else:
                if threshold and num_new > threshold:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
            reserve = self._watermark_blocks if running else 0
            if kv.num_blocks_to_admit(request, hits) > kv.num_free_blocks - reserve:
                break
            if by_name:
                waiting.remove(request)
            else:
                waiting.pop()
            if adapters is not None and request.lora_name is not None:
                adapters.add(request.lora_name)
            kv.admit(request, hits)
            kv.allocate_slots(request, num_new)  # fits: checked for the whole prompt above
            kv.computes(request, num_hit_tokens, num_new)
            if config.num_lookahead_tokens:
                self._allocate_lookahead(request, num_new, {})
            if request.admitted_step == 0 and kv.looks_up(request):
                # A prompt's lookup, as vLLM's counters: recomputing after a preemption or a
                # lost executor group hits the request's own blocks, not the cache's reuse;
                # a request that skips the cache is no lookup.
                self._prefix_cache_queries += num_tokens
                self._prefix_cache_hits += num_hit_tokens
            rid = request.request_id
            if request.status is RequestStatus.PREEMPTED:
                cached.append(
                    rid, list(request.block_ids), num_hit_tokens, list(request.output_token_ids)
                )
            else:
                outputs = request.output_token_ids
                if not outputs:
                    request.num_cached_tokens = num_hit_tokens
                new_requests.append(
                    NewRequest(
                        rid,
                        request.prompt_token_ids,
                        request.sampling_params,
                        list(request.block_ids),
                        num_hit_tokens,
                        list(outputs) if outputs else [],
                        request.lora_name,
                        request.pooling,
                        list(request.images),
                    )
                )
            request.status = _RUNNING
            request.admitted_step = self._step_id + 1  # the step being planned
            running.append(request)
            admitted.append(request)
            num_scheduled[rid] = num_new
            budget -= num_new
        return budget

    # ------------------------------------------------------------------ applying a result

    def _check_sampled(
        self, step_id: int, sampled_token_ids: dict[str, list[int]], pooled: dict[str, bytes]
    ) -> None:
        """A request the step was due to sample (or pool) for but that got nothing (an
        executor fault) is sent again to be recomputed, rather than wait for it forever."""
        for request in self._sampling.pop(step_id, ()):
            rid = request.request_id
            if request.status is _RUNNING and rid not in sampled_token_ids and rid not in pooled:
                self._recompute(request)

    def _recompute(self, request: Request) -> None:
        logger.warning("request %s got no token; recomputing it", request.request_id)
        self.running.remove(request)
        self._finished_req_ids.append(request.request_id)
        self._send_again(request)

    def _count_verified(self, num_drafts: int, num_accepted: int) -> None:
        spec = self._spec
        spec.num_drafts += 1
        spec.num_draft_tokens += num_drafts
        spec.num_accepted_tokens += num_accepted
        per_pos = spec.accepted_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1

    def _add_prompt_logprobs(self, plan: StepPlan, by_request: dict[str, SampleLogprobs]) -> None:
        """Append each request's new prompt logprob rows. A request recomputed after a
        preemption sends rows it sent before: those are dropped."""
        cached = plan.cached_requests
        for rid, rows in by_request.items():
            request = self.requests.get(rid)
            if (
                request is None
                or rid not in plan.num_scheduled_tokens
                or request.prompt_logprobs is None
                or request.status is not _RUNNING
                or request.admitted_step > plan.step_id
            ):
                continue
            start = next(
                (r.num_computed_tokens for r in plan.new_requests if r.request_id == rid), None
            )
            if start is None:
                start = cached.num_computed_tokens[cached.req_ids.index(rid)]
            # Row i is prompt token start + 1 + i, kept at index start + i.
            have = request.prompt_logprobs
            skip = len(have) - start
            if skip >= 0:
                have.token_ids += rows.token_ids[skip:]
                have.logprobs += rows.logprobs[skip:]
                if have.ranks is not None and rows.ranks is not None:
                    have.ranks += rows.ranks[skip:]

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        """Advance every request of ``plan`` by what it computed, append sampled tokens
        (rolling back rejected drafts), apply stops, free finished requests. Returns one
        ``EngineOutput`` per request that produced tokens or finished."""
        kv = self.kv_cache_manager
        caching = kv.enable_prefix_caching
        block_size = kv.block_size
        max_model_len = self.scheduler_config.max_model_len
        requests = self.requests
        sampled_token_ids = result.sampled_token_ids
        logprobs = result.logprobs
        spec_tokens = plan.scheduled_spec_decode_tokens
        outputs: list[EngineOutput] = []
        finished: list[Request] = []

        pooled = result.pooled or {}
        overlapped = self.scheduler_config.async_scheduling
        step_id = plan.step_id
        if overlapped:
            self._check_sampled(step_id, sampled_token_ids, pooled)
        if result.prompt_logprobs:
            self._add_prompt_logprobs(plan, result.prompt_logprobs)
        for rid, num_new in plan.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.status is not _RUNNING or request.admitted_step > step_id:
                # Ended (abort, stop string) while the step was in flight, or admitted since:
                # a new request of the same id, or this one after a preemption.
                continue
            sampled = sampled_token_ids.get(rid)
            vector = pooled.get(rid) if pooled and request.pooling is not None else None
            all_tokens = request.all_token_ids
            if overlapped:
                # ``schedule`` advanced the count already; only a token is news.
                if sampled or vector is not None:
                    request.num_output_placeholders -= 1
            else:
                computed = request.num_computed_tokens + num_new
                if spec_tokens and rid in spec_tokens:
                    # ``sampled`` = accepted drafts + one bonus token: the KV of every
                    # rejected draft is invalid, so roll back over them.
                    num_drafts = len(spec_tokens[rid])
                    if sampled and len(sampled) > num_drafts + 1:
                        sampled = sampled[: num_drafts + 1]
                    computed -= num_drafts + 1 - (len(sampled) if sampled else 0)
                    request.spec_token_ids = []
                    if sampled:  # else it failed (warned below): nothing was verified
                        self._count_verified(num_drafts, len(sampled) - 1)
                elif request.spec_token_ids:
                    request.spec_token_ids = []  # none fit this step; stale after it
                num_tokens = len(all_tokens)
                if computed < num_tokens:
                    sampled = vector = None  # prefill still partial: no token
                elif not sampled and vector is None:
                    if request.pooling is not None:
                        self._recompute(request)  # what it pooled so far is lost with it
                        continue
                    logger.warning("request %s completed a step but got no token; recomputing", rid)
                    request.num_computed_tokens = num_tokens - 1
                    continue
                request.num_computed_tokens = computed
            if sampled:
                outputs_so_far = request.output_token_ids
                prompt_lp = None if outputs_so_far else request.prompt_logprobs
                stop_ids = request.stop_ids
                status = None
                count = 0
                grammar = request.grammar
                for token in sampled:
                    if grammar is not None and not grammar.accept(token):
                        # The executor masks what the constraint forbids, so only its mask
                        # and the request's allowed_token_ids or bad_words, leaving no token
                        # between them, lead here: an output the format does not accept.
                        logger.error(
                            "request %s: token %d breaks its structured output (no token "
                            "its format allows was left to sample); ending it",
                            rid,
                            token,
                        )
                        status = RequestStatus.FINISHED_ABORTED
                        break
                    outputs_so_far.append(token)
                    all_tokens.append(token)
                    count += 1
                    num_outputs = len(outputs_so_far)
                    # A structured output allows an end token only where it is complete,
                    # and nothing after it: it ends the request even before min_tokens (and
                    # under ignore_eos: the front end adds its end tokens to stop_ids).
                    if token in stop_ids and (
                        num_outputs >= request.min_tokens
                        or (grammar is not None and grammar.is_terminated())
                    ):
                        status = _STOPPED
                        break
                    if num_outputs >= request.max_tokens or len(all_tokens) >= max_model_len:
                        status = _LENGTH
                        break
                error = None
                if status is None and grammar is not None and grammar.too_costly:
                    status = RequestStatus.FINISHED_ABORTED
                    error = (
                        f"its structured output took {grammar.last_cost_s * 1e3:.0f} ms a "
                        "token to follow (an ambiguous grammar, whose rules match one text "
                        "in many ways?), holding up every other request; it was ended: "
                        "send a grammar that matches a text one way"
                    )
                    logger.warning("request %s ended: %s", rid, error)
                new_tokens = sampled if count == len(sampled) else sampled[:count]
                lp = logprobs.get(rid) if logprobs else None
                if lp is not None and len(lp) > count:
                    lp = lp.head(count)
                if status is None:
                    outputs.append(
                        EngineOutput(
                            rid, new_tokens, False, None, request.num_cached_tokens, lp, prompt_lp
                        )
                    )
                else:
                    request.status = status
                    finished.append(request)
                    outputs.append(
                        EngineOutput(
                            rid,
                            new_tokens,
                            True,
                            FINISH_REASONS[status],
                            request.num_cached_tokens,
                            lp,
                            prompt_lp,
                            error=error,
                        )
                    )
            elif vector is not None:
                request.status = _STOPPED
                finished.append(request)
                outputs.append(
                    EngineOutput(rid, [], True, "stop", request.num_cached_tokens, pooled=vector)
                )
            if caching and (
                min(request.num_computed_tokens, len(all_tokens)) // block_size
                > request.num_cached_blocks
            ):
                kv.cache_blocks(request)

        if finished:
            for request in finished:
                del requests[request.request_id]
                self._release(request)
            self.running[:] = [r for r in self.running if r.status is _RUNNING]
        if self._trials:
            self._prove(o.request_id for o in outputs)
        return outputs
