"""The waiting queue: arrival order (FCFS) or (priority, arrival) order."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from weir.services.scheduler.request import Request


def priority_key(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.seq)


class WaitingQueue:
    """FCFS keeps arrival order and puts a preempted request back at the head. Under
    ``policy="priority"`` the queue stays sorted by (priority, arrival_time, admission
    sequence), and a preempted request goes back to its place by that key, not ahead of
    more urgent ones."""

    def __init__(self, policy: str) -> None:
        self._queue: deque[Request] = deque()
        self._by_priority = policy == "priority"

    def add(self, request: Request) -> None:
        if self._by_priority:
            self._queue.insert(
                bisect.bisect(self._queue, priority_key(request), key=priority_key), request
            )
        else:
            self._queue.append(request)

    def requeue(self, request: Request) -> None:
        if self._by_priority:
            self.add(request)
        else:
            self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_all(self, requests: list[Request]) -> None:
        """One pass for many (a client leaving with thousands queued: one `remove` each
        was quadratic, and the loop stalled for seconds)."""
        if len(requests) == 1:
            self.remove(requests[0])
        elif requests:
            leaving = set(requests)
            self._queue = deque(r for r in self._queue if r not in leaving)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
