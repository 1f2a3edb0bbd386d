"""What a serving process does with the objects it built while starting."""

import gc


def freeze_startup_heap() -> None:
    """Leave every object alive now out of all later garbage collections.

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
