"""What a serving process does with the objects it built while starting."""

import gc

# Net allocations of tracked objects (containers, instances) that start a young collection;
# CPython's default is 700. A step's short-lived objects (an output, a list, a dataclass a
# request, freed when the step is published) push the count up by thousands and back down:
# at 700, every step of 1,024 requests started several collections of objects about to be
# freed anyway (`benchmarks/host_step.py --num-requests 1024`: 5.7 young collections a step,
# 0.36 ms of them); at this, none. What survives still reaches the collector, later.
YOUNG_COLLECTION_THRESHOLD = 20_000


def freeze_startup_heap() -> None:
    """Leave every object alive now out of all later garbage collections, and collect young
    objects once per YOUNG_COLLECTION_THRESHOLD net allocations, not 700.

    A serving process starts by building what it keeps until it exits (torch's modules and
    the model, the tokenizer, the sockets, the app), and CPython's full collections walk
    every tracked object each time: 60-150 ms for a process holding torch and a model on a
    2-core VM (``benchmarks/host_step.py --no-freeze-heap``), a pause of many steps for a
    loop that plans, runs or publishes a step every few milliseconds.
    Frozen, those objects are neither walked nor freed; the collector then sees only what
    serving allocates. vLLM and SGLang freeze the same way after start-up.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, older, oldest)
