"""Kernel tests run the Triton kernels natively on a GPU, or under the Triton interpreter on CPU.

Triton decides per kernel, when `@triton.jit` runs, whether to compile or interpret, so the
variable must be set before any Triton kernel module is imported; pytest imports this file
before the test modules of this folder. It stays set for the rest of the pytest process.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
