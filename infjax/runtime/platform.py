"""Which devices the program runs on: chosen once at start, and said in words for logs and benchmark reports.

The choice (`choose`) is made where an accelerator plugin has no hardware.

With `infjax.models.kernels` (attention per platform) and `infjax.runtime.cpu` (process settings on CPU),
the only module that asks which platform the program runs on (tests/test_architecture.py).
"""
from __future__ import annotations

import logging
import os

from infjax.runtime import cpu as runtime_cpu

# JAX is imported inside the functions: the entry points import this module, and `bench compile` sets
# JAX_PLATFORMS, before JAX is imported (it reads the variable once, on import).

log = logging.getLogger("infjax.platform")


def name() -> str:
    """The devices' platform: "cpu", "gpu", "tpu"."""
    import jax
    return jax.devices()[0].platform


def device_kind() -> str:
    import jax
    return jax.devices()[0].device_kind


def describe() -> str:
    """E.g. "8 x cpu (cpu)" or "1 x NVIDIA H100 80GB HBM3 (gpu)"."""
    import jax
    return f"{jax.device_count()} x {device_kind()} ({name()})"


# ---- which devices a command runs on, said once ----------------------------------------------------------------

JAX_LOGGER = "jax._src.xla_bridge"       # where JAX reports plugins and backends that fail to start
_said: list[str] = []                    # the one warning of this process about an accelerator not used


def _say_once(message: str) -> None:
    if not _said:
        _said.append(message)
        log.warning("%s", message)


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")[:300]


class _AcceleratorNotStarted(logging.Filter):
    """JAX's own reports, at backend start, of an accelerator that did not start.

    A plugin that fails logs a traceback of its internals (`Jax plugin configuration error ...`: the CUDA plugin's
    cuPTI check, ~19 lines) and JAX goes on with the CPU: each such report becomes the one warning of `_say_once`,
    naming the plugin and the error's first line. `Unable to initialize backend 'X'` of a platform whose hardware this
    machine does not show (libtpu.so absent, no IFRT proxy) says nothing a user needs and is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Jax plugin configuration error"):
            plugin = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "a plugin"
            cause = _first_line(record.exc_info[1]) if record.exc_info and record.exc_info[1] else message
            _say_once(not_started(plugin, cause))
            return False
        if message.startswith("Unable to initialize backend '"):
            platform_name = message.split("'")[1]
            plugins = [p for p in runtime_cpu.accelerator_plugins() if runtime_cpu.plugin_platform(p) == platform_name
                       and runtime_cpu.hardware_visible(p) is not False]
            if plugins:
                _say_once(not_started(plugins[0], message.split(": ", 1)[-1]))
            return False
        if message.startswith(("CUDA backend failed to initialize", "An NVIDIA GPU may be present")) and _said:
            return False                 # said already, in the one warning (JAX's guess would mislead after it)
        return True


def _hardware(plugin: str) -> str:
    return runtime_cpu.HARDWARE.get(runtime_cpu.plugin_platform(plugin) or "", "accelerator")


def not_started(plugin: str, cause: str) -> str:
    """The warning for an installed accelerator `plugin` that JAX could not start (`cause`: its first line)."""
    others = [p for p in runtime_cpu.accelerator_plugins()
              if p != plugin and runtime_cpu.hardware_visible(p) is not False]
    where = "so this run is on the CPU" if not others else f"so the {_hardware(plugin)} is not used"
    return (f"JAX's accelerator plugin {plugin} is installed but could not start ({_first_line(cause)}), {where}; "
            f"repair the plugin's install, or set JAX_PLATFORMS=cpu to run on the CPU without trying it")


_FILTER = _AcceleratorNotStarted()


def choose(config=None) -> None:
    """Keep JAX to the CPU, saying so once, where an accelerator plugin is installed but its hardware is not here.

    Called before JAX starts its backends (every entry point, first thing): with an accelerator plugin installed but no
    hardware for it on this machine (the CUDA plugin of a `gpu` install on a machine without an NVIDIA GPU, libtpu off
    a TPU VM), keep JAX to the CPU, saying so once: JAX would otherwise try the plugin, log its failure as a traceback
    (or libtpu's start-up errors, and hold libtpu's lock file, /tmp/libtpu_lockfile, that other JAX processes then
    report), and go on with the CPU anyway. A plugin whose hardware is there but that fails to start is said once too,
    in one line, without JAX's traceback (`_AcceleratorNotStarted`). JAX_PLATFORMS, when set, decides alone. `config`:
    JAX's (`jax.config`)."""
    logger = logging.getLogger(JAX_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    if os.environ.get("JAX_PLATFORMS"):
        return
    if config is None:
        import jax
        config = jax.config
    if config.jax_platforms or backends_started():
        return
    reason = cpu_only(*runtime_cpu.unusable_plugins())
    if reason:
        config.update("jax_platforms", "cpu")
        _say_once(reason)


def cpu_only(plugins: list[str], unusable: list[str]) -> str | None:
    """The warning of a run kept to the CPU, where accelerator plugins are installed (`plugins`) and this machine
    shows the hardware of none of them (`unusable` holds them all); None where JAX is to choose."""
    if not plugins or len(unusable) < len(plugins):
        return None
    several = len(unusable) > 1
    return (f"JAX's accelerator plugin{'s' if several else ''} {' and '.join(unusable)} {'are' if several else 'is'} "
            f"installed, but this machine shows no {' or '.join(dict.fromkeys(_hardware(p) for p in unusable))}, so "
            f"this run is on the CPU; set JAX_PLATFORMS=cpu to choose the CPU and silence this line")


def backends_started() -> bool:
    """Whether JAX has started its backends (after that, the platform is chosen)."""
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())
