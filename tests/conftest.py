"""Triton runs on the GPU when there is one, else in its interpreter (``TRITON_INTERPRET=1``).

Triton reads the variable when a kernel is decorated, so it is set here, before any test
module imports ``model_runner.attention_backends.triton_kernels`` (the attention backends'
tests, and ``bench_gpu``'s attention section in its dry run)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list) -> None:  # type: ignore[type-arg]
    """Files that hold a slow test run first, in collection order otherwise (a stable sort
    of whole files). Under ``make test``'s workers (pytest-xdist, one file at a time) the
    long files then start while the short ones remain to fill the other worker, instead of
    one long file running alone at the end."""
    has_slow: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        has_slow[path] = has_slow.get(path, False) or item.get_closest_marker("slow") is not None
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(str(i.path) for i in items))}
    items.sort(key=lambda item: (not has_slow[str(item.path)], first_seen[str(item.path)]))
