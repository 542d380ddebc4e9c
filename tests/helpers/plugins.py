"""Accelerator plugins faked for the tests: which are installed, and whether this machine shows their hardware."""
from infjax.runtime import cpu as hm


CUDA, TPU = "jax_plugins.xla_cuda13", "libtpu"


def fake_plugins(monkeypatch, hardware: dict):
    """Installed accelerator plugins and whether this machine shows their hardware (None: cannot be told)."""
    monkeypatch.setattr(hm, "accelerator_plugins", lambda: sorted(hardware))
    monkeypatch.setattr(hm, "hardware_visible", lambda plugin: hardware[plugin])
