"""Attention implementations, one module per platform, behind `infjax.models.attention.attention`.

    masks.py      what a query attends to (boolean masks, key ranges, positions in a segment): shared
    reference.py  the portable XLA paths: "explicit" (the reference, flash-style in plain ops) and "xla"
    cpu.py        "kernel": the fused C++ kernel through the XLA FFI (cpu_attention.cc), built on first use
    gpu.py        "cudnn": cuDNN's packed flash attention through JAX; "pallas": gpu_flash.py's kernel
    tpu.py        "splash": the Pallas TPU splash kernel
    sharded.py    running a per-device kernel under shard_map in a sharded step

Only these modules (and infjax.runtime.cpu for process settings) ask which platform the program runs on.
"""
from __future__ import annotations

import jax


def platform() -> str:
    """The default backend's platform: "cpu", "gpu" or "tpu" (or another plugin's name)."""
    return jax.default_backend()
