"""Which devices the program runs on, in words: for logs and benchmark reports.

With `infjax.models.kernels` (attention per platform) and `infjax.runtime.cpu` (process settings on CPU),
the only module that asks which platform the program runs on (tests/test_architecture.py).
"""
from __future__ import annotations

import jax


def name() -> str:
    """The devices' platform: "cpu", "gpu", "tpu"."""
    return jax.devices()[0].platform


def device_kind() -> str:
    return jax.devices()[0].device_kind


def describe() -> str:
    """E.g. "8 x cpu (cpu)" or "1 x NVIDIA H100 80GB HBM3 (gpu)"."""
    return f"{jax.device_count()} x {device_kind()} ({name()})"
