"""A CPU step's freed buffers stay mapped for the next layer: layers that allocate and free
a step's largest tensor (and smaller ones around it) fault no pages in once the heap has
settled (after three layers here), where glibc's defaults map and fault in the largest one
in every layer."""

import subprocess
import sys

import pytest

from weir.services.executor.cpu_heap import is_glibc

SIZE = 40 << 20  # above glibc's largest dynamic mmap threshold (32 MiB)

LAYERS = f"""
import resource, sys, torch
from weir.services.executor.cpu_heap import keep_step_buffers
if sys.argv[1] == "keep":
    assert keep_step_buffers({SIZE})
def layer():  # a gated MLP's shapes: the gate/up output, the down projection's, the residual's
    gate_up = torch.empty({SIZE} // 4).fill_(1)
    down = torch.empty({SIZE} // 16).fill_(2)
    del gate_up
    residual = torch.empty({SIZE} // 20).fill_(3)
    del down, residual
for _ in range(4):  # the heap settles into the layers' pattern
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", LAYERS, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(not is_glibc(), reason="glibc's malloc only")
def test_freed_step_buffers_are_reused_without_page_faults():
    pages = 8 * SIZE // 4096  # the largest tensor of every layer
    assert page_faults("default") > pages // 2
    assert page_faults("keep") < pages // 100
