"""The devices a test with a CUDA case runs on: the CPU always, CUDA where there is one
(`benchmarks/gpu_checks.sh` runs such cases on the GPU machine)."""

import pytest
import torch

CPU_AND_CUDA = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
