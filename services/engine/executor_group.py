"""The scheduler process's side of its executor ranks: handshakes, heartbeats, steps.

Ranks connect to one ROUTER socket (see ``weir.shared.protocol.control``). A rank's
hello is checked against the scheduler's engine arguments; once ``num_executors``
ranks are in, the group is formed and ``on_formed(num_blocks)`` is called with the
smallest KV block count over ranks. ``submit(plan)`` sends the plan to every rank
and returns the future of rank 0's result (ranks run plans in the order sent, so
several may be in flight), so the group is the ``EngineCore``'s executor. When a
rank stops answering (no heartbeat for ``timeout`` seconds, or a plan cannot be
sent, or a new executor takes its rank after it fell silent), every rank is
forgotten and ``on_lost(message, pids)`` is called (the pids of the ranks given up, some
of which may still run, hung); a new group forms as ranks say hello again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from weir.services.engine.core import ExecutorLostError, StepFailedError
from weir.shared.config import MAX_NUM_KV_BLOCKS, EngineArgs
from weir.shared.log_limit import limited_logger
from weir.shared.protocol import control
from weir.shared.protocol.envelope import ProtocolError
from weir.shared.protocol.step import StepPlan, StepResult
from weir.shared.protocol.step_codec import decode_step_result, encode_step_plan
from weir.shared.zmq_send import send_now

_log = logging.getLogger(__name__)
# What any peer of the socket can cause (no keys: any local process), at most once a second.
_peer_log = limited_logger(f"{__name__}.peers")

_WATCHDOG_INTERVAL_S = 0.5
# A watchdog tick this late means the loop itself was held (a GC pause, a long tokenization).
_STALLED_S = 2 * _WATCHDOG_INTERVAL_S
# A rank this long without a heartbeat gives its place to a new executor saying hello.
_SILENT_RANK_S = 4 * control.HEARTBEAT_INTERVAL_S


@dataclass(slots=True)
class ExpectedExecutor:
    """What every rank's hello must match."""

    num_executors: int
    model_name: str
    vocab_size: int
    max_model_len: int
    engine_args: EngineArgs
    lora_fingerprints: dict[str, str] = field(default_factory=dict)  # --lora-modules' files


@dataclass(slots=True)
class _Rank:
    hello: control.ExecutorHello
    identity: bytes  # routing id of the rank's step socket
    last_seen: float


class ExecutorGroup:
    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        expected: ExpectedExecutor,
        timeout: float,
        on_formed: Callable[[int], None],
        on_lost: Callable[[str, list[int]], None],
        observe_phase: Callable[[str, float], None],
    ) -> None:
        self._sock = sock
        self._expected = expected
        self._timeout = timeout
        self._on_formed = on_formed
        self._on_lost = on_lost
        self._observe_phase = observe_phase
        self.ranks: dict[int, _Rank] = {}  # handshaken ranks, by rank
        self.formed = False
        # The watchdog's last tick, and when this loop last came out of a stall: while it
        # stalls, heartbeats wait unread in the socket, so a rank's silence proves nothing.
        self._last_tick = self._free_since = time.monotonic()
        # Steps sent and not answered: step id -> (result future, when it was sent).
        self._in_flight: dict[int, tuple[asyncio.Future[StepResult], float]] = {}
        self._last_result_at = 0.0  # perf_counter

    def describe(self) -> list[dict[str, Any]]:
        """Each rank's hello, rank order (for the ready report; clients never see it)."""
        return [
            {
                "rank": r.hello.rank,
                "pid": r.hello.pid,
                "num_blocks": r.hello.num_blocks,
                "metrics_address": r.hello.metrics_address,
                "model": r.hello.model_name,
                "max_model_len": r.hello.max_model_len,
                "dtype": r.hello.dtype,
                "device": r.hello.device,
                "attention_backend": r.hello.attention_backend,
                "eos_token_ids": r.hello.eos_token_ids,
            }
            for r in sorted(self.ranks.values(), key=lambda r: r.hello.rank)
        ]

    # ------------------------------------------------------------------ steps

    def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        encoded = encode_step_plan(plan)
        sent = time.perf_counter()
        self._observe_phase("plan_encode", sent - start)
        for rank in sorted(self.ranks.values(), key=lambda r: r.hello.rank):
            if not self._send(rank.identity, control.PLAN, encoded):
                message = f"executor rank {rank.hello.rank} (pid {rank.hello.pid}) is unreachable"
                self.lose(message)
                future.set_exception(ExecutorLostError(message))
                return future
        if not self.ranks:
            future.set_exception(ExecutorLostError("no executor group"))
            return future
        self._in_flight[plan.step_id] = future, sent
        return future

    def lose(self, message: str) -> None:
        """Every rank is forgotten; the step in flight fails; ``on_lost`` fails the requests."""
        _log.error("%s", message)
        for future, _ in self._in_flight.values():
            if not future.done():
                future.set_exception(ExecutorLostError(message))
        self._in_flight.clear()
        pids = [rank.hello.pid for rank in self.ranks.values()]
        self.ranks.clear()
        if self.formed:
            self.formed = False
            self._on_lost(message, pids)

    def tell_draining(self) -> None:
        """Tell every rank the scheduler drains (said each ``control.DRAINING_INTERVAL_S``
        while it does, so a rank joining meanwhile hears it too): a rank sent SIGTERM
        meanwhile (its pod stopped with this one's) serves on until ``goodbye``."""
        for rank in self.ranks.values():
            self._send(rank.identity, control.DRAINING)

    def goodbye(self) -> None:
        """Tell every rank the scheduler stops: a rank sent SIGTERM may go."""
        for rank in self.ranks.values():
            with suppress(zmq.ZMQError):  # a rank already gone
                send_now(self._sock, [rank.identity, control.GOODBYE, b""])

    # ------------------------------------------------------------------ frames in

    async def run(self) -> None:
        while True:
            identity, *frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                _peer_log.warning("ignoring an executor message of %d frame(s)", len(frames))
                continue
            kind, payload = frames
            try:
                if kind == control.HEARTBEAT:
                    self._on_heartbeat(identity, control.unpack(control.Heartbeat, payload))
                elif kind == control.HELLO:
                    self._on_hello(identity, control.unpack(control.ExecutorHello, payload))
                elif kind == control.RESULT:
                    self._on_result(identity, payload)
                elif kind == control.STEP_ERROR:
                    self._on_step_error(identity, control.unpack(control.StepFailure, payload))
                else:
                    _peer_log.warning("ignoring executor frame of kind %r", kind[:32])
            except ProtocolError as exc:
                _peer_log.warning("bad executor frame %r: %.200s", kind[:32], exc)
            except Exception:
                # Whoever reaches this socket (no keys: any local process) must not end the
                # scheduler, and with it every client's requests, with one frame.
                _peer_log.exception("executor frame %r could not be handled; ignored", kind[:32])
            # A receive that finds a frame waiting returns without yielding: a peer sending
            # without pause would otherwise hold the loop, and every step, for itself.
            await asyncio.sleep(0)

    def _send(self, identity: bytes, kind: bytes, payload: bytes = b"") -> bool:
        """False when the peer is gone (its heartbeats stop too: the watchdog handles it)."""
        try:
            send_now(self._sock, [identity, kind, payload])
            return True
        except zmq.ZMQError as exc:
            _log.warning("cannot send %r to executor %s: %s", kind, identity.hex(), exc)
            return False

    def _on_heartbeat(self, identity: bytes, beat: control.Heartbeat) -> None:
        rank = next((r for r in self.ranks.values() if r.hello.session == beat.session), None)
        if rank is None:
            # An executor of a previous scheduler (or group): it must restart clean. Its
            # heartbeats queued while this scheduler was away come from gone peers: quietly.
            with suppress(zmq.ZMQError):
                send_now(self._sock, [identity, control.RESET, b""])
            return
        rank.last_seen = time.monotonic()

    def _on_hello(self, identity: bytes, hello: control.ExecutorHello) -> None:
        current = self.ranks.get(hello.rank)
        if current is not None and current.hello.session == hello.session:
            current.identity = identity  # a resent hello: answer it again
            self._send(identity, control.WELCOME)
            return
        problem = self._check_hello(hello)
        if problem is None and current is not None:
            now = time.monotonic()
            silence = now - current.last_seen
            if silence > _SILENT_RANK_S and self._heard_everything(now):
                # Its restart is here before the watchdog noticed it die.
                self.lose(
                    f"executor rank {hello.rank} (pid {current.hello.pid}) is replaced by pid "
                    f"{hello.pid} after {silence:.1f}s without a heartbeat"
                )
            else:
                problem = f"rank {hello.rank} is already served by executor pid {current.hello.pid}"
        if problem is not None:
            _peer_log.error("rejecting executor rank %d: %s", hello.rank, problem)
            self._send(identity, control.REJECT, control.pack(control.Rejection(problem)))
            return
        self.ranks[hello.rank] = _Rank(hello, identity, time.monotonic())
        self._send(identity, control.WELCOME)
        _log.info(
            "executor rank %d (pid %d) joined: %d KV blocks",
            hello.rank,
            hello.pid,
            hello.num_blocks,
        )
        if len(self.ranks) == self._expected.num_executors:
            self.formed = True
            num_blocks = min(r.hello.num_blocks for r in self.ranks.values())
            _log.info("executor group ready: %d rank(s), %d KV blocks", len(self.ranks), num_blocks)
            self._on_formed(num_blocks)

    def _heard_everything(self, now: float) -> bool:
        """Whether this loop has run freely for the last ``_SILENT_RANK_S``: only then has
        it read every heartbeat sent meanwhile (a hello read right after a stall must not
        take the place of a rank whose heartbeats still wait behind it)."""
        stalled = now - self._last_tick > _STALLED_S
        return not stalled and now - self._free_since > _SILENT_RANK_S

    def _check_hello(self, hello: control.ExecutorHello) -> str | None:
        want = self._expected
        args = want.engine_args
        if not 0 <= hello.rank < want.num_executors:
            return f"rank {hello.rank} is outside [0, {want.num_executors})"
        if not 1 <= hello.num_blocks <= MAX_NUM_KV_BLOCKS:
            return (
                f"executor has {hello.num_blocks} KV blocks; it needs at least 1 and may "
                f"offer at most {MAX_NUM_KV_BLOCKS}"
            )
        if hello.tensor_parallel_size != args.tensor_parallel_size:
            return (
                f"executor tensor_parallel_size {hello.tensor_parallel_size} != scheduler "
                f"tensor_parallel_size {args.tensor_parallel_size}"
            )
        if hello.block_size != args.block_size:
            return (
                f"executor block_size {hello.block_size} != scheduler block_size {args.block_size}"
            )
        if hello.model_name != want.model_name or hello.vocab_size != want.vocab_size:
            return (
                f"executor serves {hello.model_name[:200]} (vocab {hello.vocab_size}), "
                f"scheduler serves {want.model_name} (vocab {want.vocab_size})"
            )
        held, wanted = hello.lora_adapters, want.lora_fingerprints
        if set(held) != set(wanted):
            return (
                f"executor serves LoRA adapters {sorted(held)[:20]}, scheduler serves "
                f"{sorted(wanted)}: give both the same --lora-modules"
            )
        differ = sorted(name for name in wanted if held[name] != wanted[name])
        if differ:
            return (
                f"executor's LoRA adapter files of {differ} differ from the scheduler's: "
                "give both the same adapters"
            )
        max_num_batched_tokens, max_num_seqs = args.step_limits
        for name, theirs, ours in (
            ("max_num_batched_tokens", hello.max_num_batched_tokens, max_num_batched_tokens),
            ("max_num_seqs", hello.max_num_seqs, max_num_seqs),
            ("max_model_len", hello.max_model_len, want.max_model_len),
        ):
            if theirs < ours:
                return f"executor {name} {theirs} < scheduler's {ours}"
        return None

    def _on_result(self, identity: bytes, payload: bytes) -> None:
        rank = next((r for r in self.ranks.values() if r.identity == identity), None)
        if rank is None or rank.hello.rank != 0:
            return  # a late result of a lost group
        try:
            result = decode_step_result(payload)
        except ProtocolError as exc:
            self.lose(f"executor sent an undecodable result: {exc}")
            return
        waiting = self._in_flight.pop(result.step_id, None)
        if waiting is None:
            _log.warning("ignoring the result of step %d: no such step in flight", result.step_id)
            return
        future, sent = waiting
        # A step sent while the one before ran (async scheduling) is timed from that one's
        # result, when the executor could start it: from its sending, the phase counted
        # the step before again and summed to twice the executor's time.
        now = time.perf_counter()
        self._observe_phase("executor", now - max(sent, self._last_result_at))
        self._last_result_at = now
        if not future.done():
            future.set_result(result)

    def _on_step_error(self, identity: bytes, failure: control.StepFailure) -> None:
        if not any(r.identity == identity for r in self.ranks.values()):
            _log.debug("ignoring a step_error from a peer that is no rank of the group")
            return
        waiting = self._in_flight.pop(failure.step_id, None)
        if waiting is not None and not waiting[0].done():
            waiting[0].set_exception(
                StepFailedError(
                    f"executor rank {failure.rank} failed step {failure.step_id}: {failure.message}"
                )
            )

    # ------------------------------------------------------------------ liveness

    async def watchdog(self) -> None:
        """Lose the group when a rank's heartbeats stop."""
        timeout = self._timeout
        self._last_tick = time.monotonic()
        while True:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            now = time.monotonic()
            if now - self._last_tick > _STALLED_S:
                self._free_since = now
            if now - self._last_tick > timeout / 2:
                # This loop itself was stalled: heartbeats may be waiting unread in
                # the socket, so silence proves nothing this time.
                for rank in self.ranks.values():
                    rank.last_seen = now
            self._last_tick = now
            for rank in list(self.ranks.values()):
                if now - rank.last_seen > timeout:
                    message = (
                        f"executor rank {rank.hello.rank} (pid {rank.hello.pid}) stopped "
                        f"responding: no heartbeat for {timeout:g}s"
                    )
                    if self.formed:
                        self.lose(message)
                    else:
                        _log.error("%s; it left before the group formed", message)
                        del self.ranks[rank.hello.rank]
                    break
