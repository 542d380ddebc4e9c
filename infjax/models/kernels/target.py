"""The devices programs are compiled for, and their platform: JAX's own, or a target's (`kernels.targeting`)."""
from __future__ import annotations

import contextvars
from typing import Sequence

import jax

_TARGET: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("infjax_target_devices", default=None)


def devices() -> Sequence:
    """The devices programs are compiled for: `kernels.targeting`'s, else JAX's own."""
    return _TARGET.get() or jax.devices()


def platform() -> str:
    """Their platform: "cpu", "gpu" or "tpu" (or another plugin's name)."""
    target = _TARGET.get()
    return target[0].platform if target else jax.default_backend()


def targeted():
    """The target devices set by `kernels.targeting` (None: JAX's own)."""
    return _TARGET.get()


def set_target(target_devices: tuple | None):
    return _TARGET.set(target_devices)


def reset_target(token) -> None:
    _TARGET.reset(token)
