"""Kernel tests run the Triton kernels on CPU tensors under the Triton interpreter.

Triton decides per kernel, when `@triton.jit` runs, whether to compile or interpret,
so the variable must be set before any Triton kernel module is imported; pytest
imports this file before the test modules of this folder.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
