"""Attention implementations, one module per platform, behind `infjax.models.attention.attention`.

    masks.py      what a query attends to (boolean masks, key ranges, positions in a segment): shared
    reference.py  the portable XLA paths: "explicit" (the reference, flash-style in plain ops) and "xla"
    cpu.py        "kernel": the fused C++ kernel through the XLA FFI (cpu_attention.cc), built on first use
    gpu.py        "cudnn": cuDNN's packed flash attention through JAX; "pallas": gpu_flash.py's kernel
    tpu.py        "splash": the Pallas TPU splash kernel
    sharded.py    running a per-device kernel under shard_map in a sharded step

Only these modules (and infjax.runtime.cpu / platform for process settings and words) ask which platform the
program runs on. They ask `devices()`: the devices the program is compiled for. Those are JAX's own devices,
except inside `targeting(devices)`, where a program is compiled for other devices than the ones at hand
(JAX's compile-only devices of a GPU or TPU topology, `python -m infjax.bench compile --target=...`): the
attention choices, the kernels' lowering and the cuDNN checks then answer as that target would (lower the
program inside `lowering()` too).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import jax

from infjax.models.kernels import gpu, target
from infjax.models.kernels.target import devices, platform  # noqa: F401 (the package's questions)


@contextlib.contextmanager
def targeting(target_devices: Sequence):
    """Compile for `target_devices` (e.g. compile-only H100s) inside the block.

    Inside it, `platform()`, the attention choices and the Pallas lowerings answer for them; on a CUDA target JAX's
    cuDNN attention checks read their compute capability too (gpu.py). Nothing runs: this is for lowering and compiling
    only."""
    target_devices = tuple(target_devices)
    token = target.set_target(target_devices)
    try:
        with gpu.answering_for(target_devices[0]) if target_devices[0].platform == "gpu" else contextlib.nullcontext():
            yield target_devices
    finally:
        target.reset_target(token)


@contextlib.contextmanager
def lowering():
    """Around `jit(...).trace(...).lower()` inside `targeting` (and nothing else: no array can be made on a
    compile-only device): jax >= 0.11 lowers Pallas for Triton for the GPU that the default device is."""
    found = target.targeted()
    with jax.default_device(found[0]) if found and found[0].platform == "gpu" else contextlib.nullcontext():
        yield
