"""Waiting queues: arrival order (FCFS) or (priority, arrival) order."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from weir.services.scheduler.request import Request


class FcfsQueue:
    """Arrival order; a preempted request goes back to the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def priority_key(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.seq)


class PriorityQueue:
    """Sorted by (priority, arrival_time, admission sequence); a preempted request
    goes back to its place by that key, not ahead of more urgent ones."""

    def __init__(self) -> None:
        self._queue: list[Request] = []

    def add(self, request: Request) -> None:
        bisect.insort(self._queue, request, key=priority_key)

    requeue = add

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.pop(0)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
