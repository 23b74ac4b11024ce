"""Triton runs on the GPU when there is one, else in its interpreter (``TRITON_INTERPRET=1``).

Triton reads the variable when a kernel is decorated, so it is set here, before any test
module imports ``model_runner.attention_backends.triton_kernels`` (the attention backends'
tests, and ``bench_gpu``'s attention section in its dry run)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
