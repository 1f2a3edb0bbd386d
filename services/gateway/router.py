"""Route each request to one of several engine replicas (schedulers).

The choice, per request:

* only replicas whose last health check answered ``ok`` are candidates, and whose
  connection has not closed since; if none is, those that answered ``recovering`` (their
  executor is being replaced: they queue requests and run them once it is back, a pause
  rather than a refusal);
* **prefix affinity**: the prompt's text is cut into 64-character chunks whose chained
  hashes name its prefixes; the replica that served the longest such prefix most
  recently holds its KV blocks in its prefix cache, so it is preferred;
* **load**: unless that replica's outstanding tokens (prompt estimate + max_tokens of
  its unfinished requests) exceed the least loaded one's by more than
  ``balance_slack`` tokens, in which case the least loaded replica gets the request.

A replica whose health check fails, or that fails a request as unavailable (its
connection was lost, it timed out, or it refused the request because it drains or has no
executor), leaves the rotation until a health check answers again. The gateway then sends
a request that had no output yet to another replica (``exclude``); so too the requests
waiting there for a first output once it stalls (no health answer, or its executor lost):
they would otherwise wait out the client's timeout, or the executor's replacement.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import TypeVar

from weir.shared.client import AsyncWeirClient, ServerUnavailableError, WeirError
from weir.shared.config import check_connect_address, tcp_address
from weir.shared.protocol.client import Prompt

_log = logging.getLogger(__name__)

PREFIX_CHUNK_CHARS = 64
_MAX_PREFIX_CHUNKS = 64  # prefixes longer than 4k characters share their first 4k
_PREFIXES_PER_REPLICA = 50_000
_CHARS_PER_TOKEN = 4  # a prompt's token estimate before the scheduler tokenizes it
# A replica unreachable this long after the gateway started is worth a warning (before
# that, an engine still starting is the usual reason).
_QUIET_START_S = 30.0
# A serving replica that stops answering its health checks (a long pause, a starved CPU)
# takes requests this long while no replica is ready; silent longer, it is down (a dead
# node's connection may never close).
_STALL_CANDIDATE_S = 10.0

T = TypeVar("T")


class NoReplicaError(RuntimeError):
    """No replica is healthy."""


@dataclass(slots=True)
class Replica:
    address: str
    client: AsyncWeirClient
    # What its last health check answered ("ok", "recovering", ...); None: no answer.
    status: str | None = None
    outstanding_tokens: int = 0
    # A warning said it is out of rotation (so its return is said at the same level).
    warned: bool = False
    # The status of its last answer, kept through a silence, and when the silence began.
    last_answer: str | None = None
    silent_since: float = 0.0
    # Prefix hash -> None, least recently served first (an LRU set).
    prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    # Set while it cannot run what it holds: its health check went unanswered (hung or
    # gone) or it lost its executor. A request waiting there for a first output then
    # goes to another replica rather than waiting out the client's timeout.
    stalled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def healthy(self) -> bool:
        return self.status == "ok"

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > _PREFIXES_PER_REPLICA:
            self.prefixes.popitem(last=False)

    def matched_chunks(self, hashes: list[bytes]) -> int:
        matched = 0
        for h in hashes:
            if h not in self.prefixes:
                break
            matched += 1
        return matched


def expand_addresses(addresses: list[str]) -> list[str]:
    """``tcp://NAME:PORT`` -> one address per IP that NAME resolves to now; other addresses
    are kept as given. Names are resolved once, at start: a headless Service's pod IPs would
    go stale when a pod restarts (a ClusterIP Service's address does not). ValueError for an
    address no socket connects to (check_connect_address)."""
    expanded: list[str] = []
    for address in addresses:
        check_connect_address(address)
        scheme, _, rest = address.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme != "tcp":
            expanded.append(address)
            continue
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        ips = sorted({str(info[4][0]) for info in infos})
        expanded += [tcp_address(ip, port) for ip in ips]
    return list(dict.fromkeys(expanded))


def prompt_text(prompt: Prompt) -> str:
    """The text the affinity hashes: the prompt itself, token ids as text, or the
    chat messages joined with their roles."""
    if isinstance(prompt, str):
        return prompt
    parts = [
        f"<{item['role']}>{item['content']}" if isinstance(item, dict) else str(item)
        for item in prompt
    ]
    return ("" if prompt and isinstance(prompt[0], dict) else ",").join(parts)


def prefix_hashes(
    text: str, cache_salt: str | None = None, lora_name: str | None = None
) -> list[bytes]:
    """Chained hashes of the text's whole 64-character chunks (a hash names the prefix),
    apart for each ``cache_salt`` and LoRA adapter, as the replicas' caches keep them."""
    hashes: list[bytes] = []
    parent = (
        b""
        if cache_salt is None and lora_name is None
        else blake2b(f"{cache_salt!r}\0{lora_name!r}".encode(), digest_size=16).digest()
    )
    for start in range(
        0, min(len(text), _MAX_PREFIX_CHUNKS * PREFIX_CHUNK_CHARS), PREFIX_CHUNK_CHARS
    ):
        chunk = text[start : start + PREFIX_CHUNK_CHARS]
        if len(chunk) < PREFIX_CHUNK_CHARS:
            break
        parent = blake2b(parent + chunk.encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class Router:
    def __init__(
        self,
        addresses: list[str],
        *,
        timeout: float = 30.0,
        health_interval: float = 1.0,
        balance_slack: int = 4096,
        keys_dir: str | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("at least one scheduler address is needed")
        self.replicas = [
            Replica(a, AsyncWeirClient(a, timeout=timeout, keys_dir=keys_dir)) for a in addresses
        ]
        self._health_interval = health_interval
        self._health_timeout = min(timeout, max(health_interval * 2, 1.0))
        self.balance_slack = balance_slack
        self._quiet_until = time.monotonic() + _QUIET_START_S

    def candidates(self, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        """The replicas a request may go to now, none of ``exclude`` (addresses)."""
        reachable = [
            r for r in self.replicas if not r.client.connection_lost and r.address not in exclude
        ]
        # Without one ready, those that will be, which keep what they are sent meanwhile:
        # an engine replacing its executor, else one serving until it went silent a short
        # while ago, its connection up (stalled).
        now = time.monotonic()
        return (
            [r for r in reachable if r.healthy]
            or [r for r in reachable if r.status == "recovering"]
            or [
                r
                for r in reachable
                if r.status is None
                and r.last_answer in ("ok", "recovering")
                and now - r.silent_since < _STALL_CANDIDATE_S
            ]
        )

    def choose(self, hashes: list[bytes], exclude: frozenset[str] = frozenset()) -> Replica:
        """The replica for a prompt of these prefix hashes."""
        candidates = self.candidates(exclude)
        if not candidates:
            raise NoReplicaError("no engine replica is ready; try again shortly")
        least = min(candidates, key=lambda r: r.outstanding_tokens)
        best, best_match = least, 0
        for replica in candidates:
            matched = replica.matched_chunks(hashes)
            if matched > best_match:
                best, best_match = replica, matched
        if best.outstanding_tokens - least.outstanding_tokens > self.balance_slack:
            return least
        return best

    @asynccontextmanager
    async def reserve(
        self,
        prompt: Prompt,
        max_tokens: int,
        exclude: frozenset[str] = frozenset(),
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[Replica]:
        """A replica for one request, counted as outstanding until the block exits."""
        text = prompt_text(prompt)
        hashes = prefix_hashes(text, cache_salt, lora_name)
        replica = self.choose(hashes, exclude)
        cost = len(text) // _CHARS_PER_TOKEN + max_tokens
        replica.outstanding_tokens += cost
        replica.remember(hashes)
        try:
            yield replica
        finally:
            replica.outstanding_tokens -= cost

    def request_failed(self, replica: Replica, exc: ServerUnavailableError) -> None:
        """A request failed there as unavailable: the replica leaves the rotation, unless a
        health check has said why already (it stalled: a request's failure says less)."""
        if not replica.stalled.is_set():
            self.mark_down(replica, str(exc))

    def mark_down(self, replica: Replica, reason: str, status: str | None = None) -> None:
        unreachable_past_start = status is None and time.monotonic() > self._quiet_until
        if replica.healthy or (unreachable_past_start and not replica.warned):
            _log.warning("replica %s out of rotation: %s", replica.address, reason)
            replica.warned = True
        if status is None and replica.status is not None:
            replica.silent_since = time.monotonic()
        replica.status = status
        if status in (None, "recovering"):
            replica.stalled.set()

    async def check_health(self) -> None:
        async def one(replica: Replica) -> None:
            try:
                info = await asyncio.wait_for(replica.client.health(), self._health_timeout)
            except (WeirError, TimeoutError) as exc:
                why = exc if isinstance(exc, WeirError) else f"no answer in {self._health_timeout}s"
                self.mark_down(replica, f"health check failed: {why}")
                return
            status = replica.last_answer = info.get("status")
            if status != "ok":
                self.mark_down(replica, f"status {status!r}", str(status))
            elif not replica.healthy:
                log = _log.warning if replica.warned else _log.info
                log("replica %s in rotation", replica.address)
                replica.warned = False
                replica.status = status
                replica.stalled.clear()

        await asyncio.gather(*(one(r) for r in self.replicas))

    async def unless_stalled(
        self, work: Awaitable[T], replica: Replica, tried: frozenset[str]
    ) -> T:
        """``work``'s result (a request's first output, or its answer) from ``replica``,
        unless the replica stalls first while another is ready to take the request: then
        ``ServerUnavailableError`` (``work`` is cancelled, which aborts the request there,
        and the caller sends it elsewhere). With no other replica ready it waits on, as the
        stalled engine keeps its requests through a recovery, looking again at each health
        check."""
        if len(self.replicas) == 1:
            return await work
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                if not replica.stalled.is_set():
                    stalled = asyncio.ensure_future(replica.stalled.wait())
                    try:
                        await asyncio.wait((task, stalled), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        stalled.cancel()
                elif any(r.healthy for r in self.candidates(tried | {replica.address})):
                    raise ServerUnavailableError(
                        f"{replica.address} stalled ({replica.status or 'no health answer'}) "
                        "before the request's first output"
                    )
                else:
                    await asyncio.wait((task,), timeout=self._health_interval)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task

    async def every_replica(self) -> list[Replica]:
        """Every replica, each having answered a health check just now, for an action that
        must reach them all (pause, sleep, new weights or adapters): one that does not
        answer fails it before any replica changes, rather than after the ones before it
        did, with a wait for the one that is gone."""
        await self.check_health()
        silent = [r.address for r in self.replicas if r.status is None]
        if silent:
            raise NoReplicaError(
                f"replica {', '.join(silent)} does not answer, so no replica was changed; "
                "try again once it is back"
            )
        return self.replicas

    async def watch_health(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self._health_interval)

    async def model_info(self) -> dict[str, object]:
        """The served model's info, from whichever replica a request could go to answers
        first (asked together: one that is down costs no timeout while another is up)."""
        candidates = self.candidates()
        if not candidates:
            raise NoReplicaError("no engine replica is ready; try again shortly")
        asked = {asyncio.ensure_future(r.client.model_info()): r for r in candidates}
        errors = []
        try:
            while asked:
                done, _ = await asyncio.wait(asked, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    replica = asked.pop(task)
                    try:
                        return task.result()
                    except WeirError as exc:
                        errors.append(f"{replica.address}: {exc}")
        finally:
            for task in asked:
                task.cancel()
        raise NoReplicaError("no replica answered: " + "; ".join(errors))

    async def close(self) -> None:
        await asyncio.gather(*(r.client.close() for r in self.replicas))
