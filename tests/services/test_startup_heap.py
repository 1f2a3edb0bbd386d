"""The collector settings a serving process takes once started (in a child process: freezing
the test process's heap would outlive the test)."""

import subprocess
import sys

_CHILD = """
import gc, weakref
from weir.services.startup_heap import freeze_startup_heap

class Output:  # as a step's per-request objects: an instance holding a list
    def __init__(self, i):
        self.tokens = [i]

frozen_before = gc.get_freeze_count()
freeze_startup_heap()
young = []
gc.callbacks.append(lambda phase, info: phase == "start" and young.append(info["generation"]))
for step in range(64):  # a step's outputs of 1,024 requests, freed once published
    outputs = [Output(i) for i in range(1024)]
    frames = [[o.tokens, {"id": i}] for i, o in enumerate(outputs)]
    del outputs, frames
quiet_steps = len(young)
freed = []
for _ in range(30_000):  # cycles: only the collector frees them
    a, b = Output(0), Output(1)
    a.other, b.other = b, a
    weakref.finalize(a, freed.append, 1)
    del a, b
print(gc.get_freeze_count() > frozen_before, quiet_steps, len(young) > 0, len(freed) > 0)
"""


def test_steps_of_short_lived_objects_start_no_collection_and_cycles_are_still_freed():
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    frozen, collections_in_steps, collected_later, cycles_freed = proc.stdout.split()
    assert frozen == "True"
    assert collections_in_steps == "0"  # at CPython's default 700: 64 steps, ~190 collections
    assert collected_later == "True" and cycles_freed == "True"
