"""The waiting queue: arrival order (FCFS) or (priority, arrival) order."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator

from weir.services.scheduler.request import Request

_Key = tuple[float, ...]  # FCFS: (arrival, ticket); priority: priority_key + ticket


def priority_key(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.seq)


class WaitingQueue:
    """FCFS keeps arrival order (``arrival_time``, then admission) and puts a preempted
    request back at the head. Under ``policy="priority"`` the queue is ordered by
    (priority, arrival_time, admission sequence), and a preempted request goes back to its
    place by that key, not ahead of more urgent ones. Arrival, not admission, comes first:
    a choice of ``n > 1`` sent once its first choice began arrived with it, before requests
    admitted in between (as vLLM queues the n choices together).

    One heap serves both orders (FCFS ranks a requeue before every arrival, the latest
    first, by a falling ticket). Removal only forgets the request's entry, which the head skips when
    it reaches it: aborting one of 50,000 queued requests scanned the whole queue
    (milliseconds each, one per disconnecting client)."""

    def __init__(self, policy: str) -> None:
        self._by_priority = policy == "priority"
        self._heap: list[tuple[_Key, Request]] = []
        self._live: dict[Request, _Key] = {}  # request -> key of its entry
        self._tickets = itertools.count(1)

    def add(self, request: Request) -> None:
        ticket = next(self._tickets)
        # Tickets make every key unique, so the heap never compares two requests.
        self._push(
            request,
            (*priority_key(request), ticket)
            if self._by_priority
            else (request.arrival_time, ticket),
        )

    def requeue(self, request: Request) -> None:
        if self._by_priority:
            self.add(request)
        else:
            self._push(request, (-math.inf, -next(self._tickets)))

    def _push(self, request: Request, key: _Key) -> None:
        self._live[request] = key
        heapq.heappush(self._heap, (key, request))

    def _head(self) -> tuple[_Key, Request]:
        heap, live = self._heap, self._live
        while live.get(heap[0][1]) != heap[0][0]:  # forgotten: removed since it was added
            heapq.heappop(heap)
        return heap[0]

    def peek(self) -> Request:
        return self._head()[1]

    def pop(self) -> Request:
        request = self._head()[1]
        heapq.heappop(self._heap)
        del self._live[request]
        return request

    def remove(self, request: Request) -> None:
        del self._live[request]
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [entry for entry in self._heap if self._live.get(entry[1]) == entry[0]]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def requests(self) -> list[Request]:
        """The waiting requests in no particular order, in one call (a copy)."""
        return list(self._live)

    def __iter__(self) -> Iterator[Request]:
        """In queue order, over a copy (for rare walks, not the step loop)."""
        heap, live = list(self._heap), self._live
        while heap:
            key, request = heapq.heappop(heap)
            if live.get(request) == key:
                yield request
