"""The engine core: one ``step()`` = schedule -> execute -> update.

This is Weir's loop, and the only place it is written. The scheduler process
drives it against the remote executor group (``executor_group``); tests and
benchmarks drive the same core against an executor in their own process
(``InProcessExecutor`` around a ``ModelRunner`` or a test's fake) with
``step_now``.

An executor is anything with ``submit(plan) -> Awaitable[StepResult]`` that runs the
plans it is given in order. With ``async_scheduling`` the core keeps two steps submitted:
step N+1 is planned and sent before step N's result is awaited (the executor feeds step
N's sampled tokens into step N+1 itself), and step N+2 as soon as step N's result is
applied, before ``step()`` returns it. So scheduling, sending and the caller's output
work (detokenizing, stop strings, client pushes) all overlap the executor's: it always
has the next step queued. Awaiting a result may raise
``StepFailedError`` (this step raised on the executor, which then holds no request
and keeps serving: the scheduler sends every request again and looks for the one
that made the step raise, ``Scheduler.on_step_failed``) or ``ExecutorLostError``
(no more steps can run until its owner brings a new executor).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from weir.services.engine.ngram import NgramProposer
from weir.services.scheduler.output import EngineOutput
from weir.services.scheduler.scheduler import Scheduler
from weir.shared.protocol.step import StepPlan, StepResult


class Executor(Protocol):
    def submit(self, plan: StepPlan) -> Awaitable[StepResult]: ...


class SyncExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...

    def reset(self) -> None:
        """Drop every request (after ``execute`` raised)."""


class StepFailedError(RuntimeError):
    """The executor reported that a step raised. ``request_ids`` are the requests the
    core ended because of it: the one found to make steps raise, or none yet."""

    def __init__(self, message: str, request_ids: list[str] | None = None) -> None:
        super().__init__(message)
        self.request_ids = request_ids or []


class ExecutorLostError(RuntimeError):
    """The executor can no longer run steps."""


@dataclass(slots=True)
class EngineStep:
    """One executed step: its plan, what it did to each request, and when it was planned
    (``time.monotonic()``, the end of queueing for its new requests)."""

    plan: StepPlan
    outputs: list[EngineOutput]
    scheduled_at: float


@dataclass(slots=True)
class _Submitted:
    plan: StepPlan
    result: Awaitable[StepResult]
    scheduled_at: float


class EngineCore:
    """A ``Scheduler``, the executor that runs its plans, and optionally a draft
    proposer whose drafts the next step verifies (or the executor's own, from a draft model,
    which come with each step's result). ``observe_phase(name, seconds)`` receives
    the time of the ``schedule``, ``update`` and ``propose`` phases of every step."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        observe_phase: Callable[[str, float], None] | None = None,
        proposer: NgramProposer | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.proposer = proposer
        self._observe_phase = observe_phase or _ignore
        self._depth = 2 if scheduler.scheduler_config.async_scheduling else 1
        self._submitted: deque[_Submitted] = deque()  # sent to the executor, oldest first
        # While set no step is planned; those planned before still run (``settled`` once
        # none is left). vLLM's pause_generation, for weight updates between steps.
        self.paused = False
        self._stepping = False  # inside step(), whose step left _submitted when it began

    def has_work(self) -> bool:
        return bool(self._submitted) or (
            not self.paused and self.scheduler.has_unfinished_requests()
        )

    @property
    def settled(self) -> bool:
        """Paused, and no step is planned, running or being applied: the executor holds
        still and the scheduler's state is its own."""
        return self.paused and not self._submitted and not self._stepping

    async def step(self) -> EngineStep | None:
        """Run one step; None when nothing can run until a request arrives or ends."""
        scheduler = self.scheduler
        self._fill()
        if not self._submitted:
            return None
        submitted = self._submitted.popleft()
        self._stepping = True
        try:
            try:
                result = await submitted.result
            except StepFailedError as exc:
                await self._discard_submitted()
                raise StepFailedError(str(exc), scheduler.on_step_failed(submitted.plan)) from exc
            except ExecutorLostError:
                await self._discard_submitted()
                raise
            start = time.perf_counter()
            outputs = scheduler.update_from_output(submitted.plan, result)
            updated = time.perf_counter()
            self._observe_phase("update", updated - start)
            if result.draft_token_ids is not None:  # a draft model's, run by the executor
                scheduler.update_draft_token_ids(result.draft_token_ids)
            elif self.proposer is not None:
                scheduler.update_draft_token_ids(self.proposer.propose(scheduler.running))
                self._observe_phase("propose", time.perf_counter() - updated)
            if self._depth > 1 and scheduler.has_unfinished_requests():
                self._fill()  # before the caller's output work, which then overlaps the executor's
            return EngineStep(submitted.plan, outputs, submitted.scheduled_at)
        finally:
            self._stepping = False

    async def next_result_in(self, wait: float) -> bool:
        """Whether the next step's result has come (waiting up to ``wait`` seconds for it),
        so the caller can apply it before work that can wait (publishing outputs). False
        with nothing in flight or an in-process executor (it runs when awaited)."""
        if not self._submitted:
            return False
        result = self._submitted[0].result
        if not isinstance(result, asyncio.Future):
            return False
        if not result.done():
            await asyncio.wait((result,), timeout=wait)
        return result.done()

    async def control(
        self,
        load_weights: str | None = None,
        sleep_level: int | None = None,
        wake_tags: list[str] | None = None,
        profile: str | None = None,
    ) -> None:
        """Have the executors wake up (``sleep_level`` 0: ``wake_tags``, None for all), serve
        the weights of model directory ``load_weights``, sleep (1, 2), or start or stop their
        profilers (``profile``); the core must be
        ``settled``. Raises
        ``StepFailedError`` where an executor could not (the others may have: with weights,
        load those served before to agree again); that executor then holds no request, so
        every request is sent again, as after a failed step (no culprit to look for: the plan
        scheduled none)."""
        if not self.settled:
            raise RuntimeError("executors change state while the engine is paused and settled")
        self._stepping = True
        try:
            plan = self.scheduler.control_plan(load_weights, sleep_level, wake_tags, profile)
            await self.executor.submit(plan)
        except StepFailedError:
            self.scheduler.reset_executor_state()
            raise
        finally:
            self._stepping = False

    def _fill(self) -> None:
        while not self.paused and len(self._submitted) < self._depth:
            start = time.perf_counter()
            plan = self.scheduler.schedule()
            self._observe_phase("schedule", time.perf_counter() - start)
            if not (plan.num_scheduled_tokens or plan.finished_req_ids or plan.preempted_req_ids):
                return
            self._submitted.append(_Submitted(plan, self.executor.submit(plan), time.monotonic()))

    def abandon_next(self) -> None:
        """The executor that was to run the steps planned ahead is gone (its group was
        lost while no step was awaited): forget those steps. Call before
        ``Scheduler.reset_executor_state``, which sends their requests again."""
        while self._submitted:
            result = self._submitted.popleft().result
            if isinstance(result, asyncio.Future):
                if result.done():
                    result.exception()  # retrieved: the loss is handled here
                else:
                    result.cancel()
            elif inspect.iscoroutine(result):
                result.close()

    async def _discard_submitted(self) -> None:
        """The steps planned after a failed one ran on an executor that had dropped its
        batch (or none): their results mean nothing."""
        while self._submitted:
            try:
                await self._submitted.popleft().result
            except (StepFailedError, ExecutorLostError):
                pass


class InProcessExecutor:
    """An executor in this process (a ``ModelRunner``, or a test's fake)."""

    def __init__(self, runner: SyncExecutor) -> None:
        self.runner = runner

    def submit(self, plan: StepPlan) -> Awaitable[StepResult]:
        # Runs when awaited: the core awaits its steps in the order it submits them.
        return self._run(plan)

    async def _run(self, plan: StepPlan) -> StepResult:
        try:
            return self.runner.execute(plan)
        except Exception as exc:  # as the executor process does: report, reset, keep serving
            self.runner.reset()
            raise StepFailedError(f"{type(exc).__name__}: {exc}") from exc


def step_now(core: EngineCore) -> EngineStep | None:
    """``core.step()`` without an event loop, for an executor that never suspends
    (``InProcessExecutor``): tests and benchmarks run thousands of steps, and an event
    loop round per step would cost more than the scheduler itself."""
    coroutine = core.step()
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("the executor suspended: drive this core from an event loop")


def _ignore(phase: str, seconds: float) -> None:
    pass
