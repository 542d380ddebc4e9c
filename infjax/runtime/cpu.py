"""Process-level settings of runs on the CPU: huge pages for malloc, XLA:CPU's compiler options, the encoder call size.

The one place outside the attention kernels (`infjax.models.kernels`) that looks at the platform.

## Host memory: map each step's temporary buffer in huge pages


XLA:CPU allocates an execution's temporary buffer (a MiniLM train step at 48 rows: ~2 GB) with malloc
on a worker thread and frees it at the end. glibc maps a block that large afresh and unmaps it on
free, so with 4 KiB pages every step faults in ~520,000 new pages: ~1 s of kernel time in a
5-6 s step on 2 cores. With glibc's `glibc.malloc.hugetlb=1` tunable, malloc asks for transparent
huge pages (2 MiB) on its mappings (madvise), which takes the faults to ~1,000-5,000 per step, and
the block is still handed back at the end of the step (the process's peak memory is unchanged).

Keeping the freed block in malloc's heap instead (mallopt: one arena, no mmap, no trimming) removes
the faults altogether but fragments the heap: measured at 48 rows the process's max RSS grew by one
to two temporary buffers (3.4 -> 5.4 GB at 64/256, 3.7 -> 7.4 GB at 256/512), so it is not used.

glibc reads its tunables once, at process start, so `restart_with_huge_pages` re-executes the
command (same process id, argv and environment plus the tunable) when the tunable is missing. The
module entry points (`python -m infjax.train`, `infjax.evaluate`, `infjax.bench`) call it before
anything else; library callers are left alone. It does nothing where it would not help: JAX on an
accelerator (its host memory is not the step's), not Linux/glibc, transparent huge pages "always"
(every mapping has them already) or "never", a GLIBC_TUNABLES that already sets glibc.malloc.hugetlb,
or INFJAX_HUGE_PAGES=0.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil
import platform
import sys

from infjax import errors
from infjax.errors import ConfigError

ENV = "INFJAX_HUGE_PAGES"
TUNABLE = "glibc.malloc.hugetlb"
ADDED = "INFJAX_HUGE_PAGES_ADDED"      # set in the restarted process: the tunable is infjax's, not the user's
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def enabled(env) -> bool:
    """INFJAX_HUGE_PAGES: "1" (default) or "0"."""
    value = env.get(ENV, "1")
    if value not in ("0", "1"):
        raise ConfigError(f"{ENV}={value!r}: expected 0 or 1")
    return value == "1"


def thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def accelerator_plugins() -> list[str]:
    """JAX's accelerator plugins installed here, found as JAX finds them (without starting it): the modules of
    the `jax_plugins` namespace and of its entry points (e.g. "jax_plugins.xla_cuda13"), and "libtpu"."""
    spec = importlib.util.find_spec("jax_plugins")
    names = {f"jax_plugins.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)} if spec else set()
    names |= {entry.value for entry in importlib.metadata.entry_points(group="jax_plugins")}
    if importlib.util.find_spec("libtpu") is not None:
        names.add("libtpu")
    return sorted(names)


def plugin_platform(plugin: str) -> str | None:
    """The platform an accelerator plugin serves: "cuda", "rocm", "tpu", or None where its name does not say."""
    for platform_name in ("cuda", "rocm", "tpu"):
        if platform_name in plugin.lower():
            return platform_name
    return None


HARDWARE = {"cuda": "NVIDIA GPU", "rocm": "AMD GPU", "tpu": "TPU chip"}     # what each platform's plugin drives


def hardware_visible(plugin: str) -> bool | None:
    """Whether this machine shows the hardware `plugin` drives, by JAX's own probes (no driver call).

    The probes: an NVIDIA GPU device file for CUDA, a TPU chip on the PCI bus for libtpu. None where that cannot be
    told (another plugin, another JAX): such a plugin counts as usable."""
    try:
        from jax._src import hardware_utils     # stdlib-only probes; importing it imports jax, not its backends
    except ImportError:
        return None
    platform_name = plugin_platform(plugin)
    try:
        if platform_name == "cuda":
            return bool(hardware_utils.has_visible_nvidia_gpu())
        if platform_name == "tpu":
            return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except (AttributeError, OSError):
        return None
    return None


def unusable_plugins() -> tuple[list[str], list[str]]:
    """(the accelerator plugins installed, those of them whose hardware this machine does not show)."""
    plugins = accelerator_plugins()
    return plugins, [p for p in plugins if hardware_visible(p) is False]


def runs_on_cpu(env) -> bool:
    """Whether JAX's default backend will be the CPU, decided without starting its backends.

    JAX_PLATFORMS when set, else whether no accelerator plugin is installed whose hardware this machine shows (an
    installed CUDA plugin on a machine without an NVIDIA GPU, or libtpu off a TPU VM, runs on the CPU:
    `platform.choose`)."""
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    plugins, unusable = unusable_plugins()
    return len(unusable) == len(plugins)


def huge_pages_env(env, system: str | None = None, libc: str | None = None, mode: str | None = None) -> dict | None:
    """The environment to restart with (`env` plus the tunable), or None where nothing is to change."""
    system = platform.system() if system is None else system
    libc = platform.libc_ver()[0] if libc is None else libc
    mode = thp_mode() if mode is None else mode
    tunables = env.get("GLIBC_TUNABLES", "")
    if (not enabled(env) or system != "Linux" or libc != "glibc" or mode != "madvise"
            or f"{TUNABLE}=" in tunables or not runs_on_cpu(env)):
        return None
    return dict(env, GLIBC_TUNABLES=f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1", **{ADDED: "1"})


def restart_with_huge_pages() -> None:
    """Re-execute this command with glibc's huge-page tunable where it helps (see the module docstring);
    returns only where nothing is to change."""
    try:
        env = huge_pages_env(os.environ)
    except ConfigError as e:                      # one line and exit 2, as the entry points report bad input
        sys.exit(errors.report("infjax", e))
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def plain_env(env=None) -> dict:
    """`env` (default: this process's) without the tunable infjax added: for a peer process that is to
    run as the user would run it (the PyTorch loop of `bench train --vs_torch`)."""
    env = dict(os.environ if env is None else env)
    if env.pop(ADDED, None) is not None:
        kept = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t != f"{TUNABLE}=1"]
        if kept:
            env["GLIBC_TUNABLES"] = ":".join(kept)
        else:
            env.pop("GLIBC_TUNABLES", None)
    return env


def describe(env=None) -> str:
    """One line for a run's log: how malloc maps large blocks in this process."""
    env = os.environ if env is None else env
    mode = thp_mode()
    if f"{TUNABLE}=1" in env.get("GLIBC_TUNABLES", "").split(":") and mode in ("madvise", "always"):
        return f"host malloc: transparent huge pages ({TUNABLE}=1{', set by infjax' if env.get(ADDED) else ''})"
    return f"host malloc: the platform's default pages (transparent huge pages: {mode or 'unknown'})"


def on_cpu(mesh) -> bool:
    """Whether `mesh` (a jax.sharding.Mesh) is made of CPU devices."""
    return mesh.devices.flat[0].platform == "cpu"


# XLA:CPU schedules a program to run independent ops side by side by default, which keeps more of the
# step's buffers alive at once. Scheduled for memory instead, MiniLM's step (48 rows, 256/512 tokens) peaks
# at 4.4 instead of 5.1 GiB, its process max RSS drops by 0.9 GB and it runs ~10% faster on 2 cores (fewer
# fresh pages to fault in per step). The option is XLA:CPU's, so it is passed on CPU meshes only.
COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def compiler_options(mesh) -> dict | None:
    """`jax.jit(..., compiler_options=)` for a train step on `mesh`: XLA:CPU's memory-optimised schedule on
    CPU, nothing elsewhere."""
    return COMPILER_OPTIONS if on_cpu(mesh) else None


TOKENS_PER_SHARD = 1024    # on CPU, at most this many tokens per batch shard in one packed encoder call


def cap_call_tokens(tokens: int, mesh, shards: int) -> int:
    """`tokens` of one packed encoder call, capped on CPU at 1,024 per batch shard (`shards` of them).

    The cap keeps a call's activations in the caches (MiniLM at max_len 128 on 2 cores: 8,192-token calls encode ~62
    docs/s, 1,024-token calls ~85); accelerators take big calls that keep their matrix units busy."""
    return min(tokens, TOKENS_PER_SHARD * shards) if on_cpu(mesh) else tokens


def use_collectives(env) -> None:
    """Before `jax.distributed.initialize` on CPU (the default platform, or JAX_PLATFORMS=cpu): cross-process
    collectives through gloo (XLA:CPU has none of its own)."""
    import jax      # here: the entry points call this module's restart before JAX is imported
    if jax.config.jax_platforms in (None, "", "cpu") or env.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
