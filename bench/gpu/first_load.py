"""A pytest plugin for the worker tests on a GPU (bench/gpu/device.sh: `-p bench.gpu.first_load`): the model is
loaded on the GPU once before any test module is collected, so that the process's first CUDA model load comes before
its first import of llguidance (worker/guide.py says why; bench/gpu/context_probe.py's import cases say whether it
matters)."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if not (gpu := os.environ.get("KVROUTE_GPU")):
        return
    from common.model import resolve_model
    from worker.llama import Llama

    Llama(resolve_model(None), slots=1, ctx_per_slot=256, n_batch=32, threads=2, gpu=int(gpu)).close()
