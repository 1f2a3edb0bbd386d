"""The waiting queue against a plain list kept in the order its docstring promises."""

import random

import pytest

from weir.services.scheduler import Request
from weir.services.scheduler.request_queue import WaitingQueue


def _request(i: int, rng: random.Random) -> Request:
    request = Request(f"r{i}", [1], priority=rng.randint(-2, 2), arrival_time=rng.random())
    request.seq = i
    return request


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(20))
def test_random_operations_keep_the_promised_order(policy, seed):
    """Arrivals (out of arrival_time order), requeues of popped requests (preemption),
    removals anywhere (aborts, also of requeued ones) and pops, interleaved; the
    reference re-sorts a list."""
    rng = random.Random(seed)
    queue, reference, popped = WaitingQueue(policy), [], []
    requeued = set()  # FCFS: at the head, the latest requeued first

    def order(requests):
        if policy == "priority":
            requests.sort(key=lambda r: (r.priority, r.arrival_time, r.seq))
        else:  # requeued ones stay at the head, in their order; arrivals by arrival_time
            head = [r for r in requests if r in requeued]
            requests[len(head) :] = sorted(
                (r for r in requests if r not in requeued), key=lambda r: (r.arrival_time, r.seq)
            )
            requests[: len(head)] = head

    for i in range(400):
        action = rng.random()
        if action < 0.45 or not reference:
            request = _request(i, rng)
            queue.add(request)
            reference.append(request)
        elif action < 0.6 and popped:
            request = popped.pop(rng.randrange(len(popped)))
            queue.requeue(request)
            reference.insert(0, request)
            requeued.add(request)
        elif action < 0.8:
            request = rng.choice(reference)
            queue.remove(request)
            reference.remove(request)
            requeued.discard(request)
        else:
            assert queue.peek() is reference[0]
            popped.append(queue.pop())
            assert popped[-1] is reference.pop(0)
            requeued.discard(popped[-1])
        order(reference)
        assert len(queue) == len(reference)
        if i % 25 == 0:
            assert list(queue) == reference
    assert list(queue) == reference


def test_many_removals_do_not_keep_the_removed():
    """Removed entries are forgotten lazily; the heap does not grow with them."""
    queue = WaitingQueue("fcfs")
    rng = random.Random(0)
    kept = _request(0, rng)
    queue.add(kept)
    for i in range(1, 10_000):
        request = _request(i, rng)
        queue.add(request)
        queue.remove(request)
    assert len(queue._heap) < 200
    assert list(queue) == [kept] and queue.pop() is kept and not len(queue)
