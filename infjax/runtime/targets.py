"""Accelerators to compile for from any machine: JAX's compile-only devices of a GPU or TPU topology.

JAX compiles a program for devices it does not have: the CUDA plugin describes a GPU from a target description
(`GpuTargetConfigProto`, the fields XLA's own specs under xla/backends/gpu/target_config/specs/ carry), and
libtpu a TPU slice from its topology name. Their devices run nothing; `jit(...).trace(...).lower().compile()`
for arrays placed on them runs the target's whole compiler (XLA's GPU pipeline with Triton and ptxas for a
GPU; XLA:TPU with Mosaic for Pallas kernels on a TPU) and `memory_analysis()` gives its memory per device.

    python -m infjax.bench compile --config=configs/multi_pi.py --target=h100      # one H100
    python -m infjax.bench compile --config=... --target=h100x8                   # 8 H100s of one host
    python -m infjax.bench compile --config=... --target=h100x8 --hosts=4         # 4 hosts of 8 H100s: 32 GPUs
    python -m infjax.bench compile --config=... --target=v5e-16                   # a TPU v5e slice, 16 chips

Needs the target's JAX plugin: `pip install -e ".[gpu-compile]"` (the CUDA plugin and its NVIDIA wheels, no
driver needed) or `".[tpu-compile]"` (libtpu), on Python >= 3.12: the jax that GPU and TPU installs get.
`kernels.targeting(devices)` makes infjax's attention choices answer for the devices (models/kernels/__init__.py).
"""
from __future__ import annotations

import dataclasses
import os
import re

from infjax.errors import UserError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU model: what the CUDA plugin needs to describe it, and what a report needs of it."""
    kind: str                     # its device_kind, as the driver names it
    capability: tuple[int, int]
    cores: int                    # streaming multiprocessors
    memory: int                   # device memory in bytes
    bandwidth: int                # bytes/s
    l2: int                       # bytes
    clock_ghz: float
    shared_per_core: int
    shared_per_block_optin: int
    fpus_per_core: int
    peak_bf16: float              # dense bf16 FLOP/s

    def description(self) -> str:
        """The GpuTargetConfigProto text of this GPU (the fields that jaxlib 0.10 and later all parse)."""
        major, minor = self.capability
        return (
            "gpu_device_info {\n"
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
            "  threads_per_block_limit: 1024\n  threads_per_warp: 32\n  shared_memory_per_block: 49152\n"
            f"  shared_memory_per_block_optin: {self.shared_per_block_optin}\n"
            f"  shared_memory_per_core: {self.shared_per_core}\n  threads_per_core_limit: 2048\n"
            f"  core_count: {self.cores}\n  fpus_per_core: {self.fpus_per_core}\n"
            "  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n  block_dim_limit_z: 65535\n"
            f"  memory_bandwidth: {self.bandwidth}\n  l2_cache_size: {self.l2}\n  clock_rate_ghz: {self.clock_ghz}\n"
            f"  device_memory_size: {self.memory}\n"
            "  registers_per_core_limit: 65536\n  registers_per_block_limit: 65536\n"
            "}\n"
            'platform_name: "CUDA"\n'
            f'device_description_str: "{self.kind}"\n')


@dataclasses.dataclass(frozen=True)
class Tpu:
    """One TPU generation: its topology names, memory per chip and peak."""
    kind: str                     # device_kind of its chips
    generation: str               # libtpu's topology prefix, e.g. "v5e"
    memory: int                   # HBM per chip (bytes)
    peak_bf16: float              # dense bf16 FLOP/s per chip
    cores_per_chip: int = 1       # the "-N" of a slice name counts TensorCores (v4, v5p: 2 per chip)
    megacore: bool = False        # libtpu's chip_config_name="megacore": one device per chip


# Figures: XLA's target specs for the GPUs (xla/backends/gpu/target_config/specs/), the vendors' dense bf16 peaks.
GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 84942979072, 3352320000000, 52428800, 1.98, 233472, 232448,
                128, 989e12),
    "h200": Gpu("NVIDIA H200 141GB HBM3e", (9, 0), 132, 151397597184, 4800000000000, 52428800, 1.98, 233472, 232448,
                128, 989e12),
    "a100-80": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85100068864, 2039040000000, 41943040, 1.41, 167936, 166912,
                   64, 312e12),
    "a100-40": Gpu("NVIDIA A100-SXM4-40GB", (8, 0), 108, 42331013120, 1555200000000, 41943040, 1.41, 167936, 166912,
                   64, 312e12),
}
TPUS = {
    "v4": Tpu("TPU v4", "v4", 32 * GIB, 275e12, cores_per_chip=2, megacore=True),
    "v5e": Tpu("TPU v5 lite", "v5e", 16 * GIB, 197e12),
    "v5p": Tpu("TPU v5", "v5p", 95 * GIB, 459e12, cores_per_chip=2, megacore=True),
    "v6e": Tpu("TPU v6 lite", "v6e", 32 * GIB, 918e12),
}
# Chips of a slice -> libtpu's topology (2D for v5e/v6e, 3D for v4/v5p)
SLICES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
SLICES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}
GPUS_PER_HOST = (1, 2, 4, 8)      # what an H100/H200/A100 SXM host (HGX board) holds; more GPUs: more hosts
TPU_CHIPS_PER_HOST = 4            # a multi-host slice's hosts (libtpu's compile-only topologies too)


@dataclasses.dataclass(frozen=True)
class Target:
    """A named target: `--target=h100`, `h100x8`, `v5e-16` ..."""
    name: str
    family: str                    # "cuda" | "tpu": the JAX plugin that describes it
    count: int                     # devices, all hosts together
    model: Gpu | Tpu
    topology: str                  # "1xHxN" (GPU: partitions x hosts x devices per host) or libtpu's, e.g. "v5e:4x4"
    hosts: int = 1                 # processes of a run on it (one per host)

    @property
    def kind(self) -> str:
        return self.model.kind

    @property
    def memory(self) -> int:
        return self.model.memory

    @property
    def peak_flops(self) -> float:
        return self.model.peak_bf16

    @property
    def extra(self) -> str:
        return "gpu-compile" if self.family == "cuda" else "tpu-compile"

    def describe(self) -> str:
        """E.g. "32 x NVIDIA H100 80GB HBM3 (h100x8, 4 hosts)"."""
        hosts = f", {self.hosts} hosts" if self.hosts > 1 else ""
        return f"{self.count} x {self.kind} ({self.name}{hosts})"


def compile_only_process() -> None:
    """Keep this process's own devices to the CPU (`JAX_PLATFORMS=cpu` unless set), before JAX starts.

    A compile for a target needs no local device, and an installed CUDA plugin on a machine without a GPU (or libtpu
    off a TPU VM) would otherwise fail to start as a backend. The plugin still describes its targets."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def names() -> list[str]:
    """Examples of every accepted form."""
    return [*GPUS, *(f"{g}x8" for g in GPUS), *(f"{t}-{4 * TPUS[t].cores_per_chip}" for t in TPUS), "v5e-16",
            "v5p-128", "v5e-256"]


def parse(name: str, hosts: int = 1) -> Target:
    """`name` -> Target: a GPU model with an optional device count per host, or a TPU slice.

    A GPU model (h100, h100x8) runs on `hosts` hosts; a TPU slice is named as Google names them (v5e-16: 16 chips; v4-8
    and v5p-8: 8 TensorCores, 4 chips), its hosts following from its size (4 chips each when it spans several)."""
    text = name.strip().lower()
    if hosts < 1:
        raise UserError(f"--hosts={hosts}: at least 1")
    gpu = re.fullmatch(r"([a-z0-9-]+?)(?:x(\d+))?", text)
    if gpu and gpu.group(1) in GPUS:
        per_host = int(gpu.group(2) or 1)
        if per_host not in GPUS_PER_HOST:
            counts = ", ".join(f"{gpu.group(1)}" + (f"x{n}" if n > 1 else "") for n in GPUS_PER_HOST)
            raise UserError(f"--target={name}: a {GPUS[gpu.group(1)].kind} host holds 1, 2, 4 or 8 of them "
                            f"({counts}); for more, several hosts: --target={gpu.group(1)}x8 --hosts=N")
        return Target(text, "cuda", per_host * hosts, GPUS[gpu.group(1)], f"1x{hosts}x{per_host}", hosts)
    tpu = re.fullmatch(r"(v\d+[a-z]?)-(\d+)", text)
    if tpu and tpu.group(1) in TPUS:
        model = TPUS[tpu.group(1)]
        cores = int(tpu.group(2))
        chips, rest = divmod(cores, model.cores_per_chip)
        table = SLICES_3D if model.megacore else SLICES_2D
        if rest or chips not in table:
            sizes = ", ".join(f"{model.generation}-{c * model.cores_per_chip}" for c in table)
            raise UserError(f"--target={name}: {model.generation} slices are {sizes}")
        if hosts != 1:
            raise UserError(f"--hosts={hosts}: a TPU slice's name gives its hosts ({name}: "
                            f"{max(1, chips // TPU_CHIPS_PER_HOST)}); drop --hosts")
        return Target(text, "tpu", chips, model, f"{model.generation}:{table[chips]}",
                      max(1, chips // TPU_CHIPS_PER_HOST))
    raise UserError(f"--target={name}: not a known target; choose a GPU ({', '.join(GPUS)}, with xN for N of "
                    f"one host, e.g. h100x8) or a TPU slice ({', '.join(f'{t}-N' for t in TPUS)}, e.g. v5e-16)")


def devices(target: Target) -> list:
    """The compile-only devices of `target`. Raises UserError naming the extra to install where the plugin is
    missing."""
    from jax.experimental import topologies   # here: only a compile for a target needs it

    try:
        if target.family == "cuda":
            found = topologies.get_topology_desc(platform="cuda", target_config=target.model.description(),
                                                 topology=target.topology).devices
        else:
            # libtpu looks for the TPU VM it runs on; a compile-only topology needs none (these keep it quiet)
            accelerator = (f"v5litepod-{target.count}" if target.model.generation == "v5e" else
                           f"{target.model.generation}-{target.count * target.model.cores_per_chip}")
            for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                               ("TPU_ACCELERATOR_TYPE", accelerator)):
                os.environ.setdefault(key, value)
            extra = {"chip_config_name": "megacore"} if target.model.megacore else {}
            found = topologies.get_topology_desc(platform="tpu", topology_name=target.topology, **extra).devices
    except Exception as err:      # noqa: BLE001 - the plugin is missing or refuses: one line naming the fix
        line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise UserError(f"--target={target.name}: JAX cannot describe a {target.kind} here ({line}); install the "
                        f"compiler with `pip install -e \".[{target.extra}]\"` (Python >= 3.12)") \
            from None
    if len(found) != target.count:
        raise UserError(f"--target={target.name}: JAX described {len(found)} devices, not {target.count}")
    hosts = len({d.process_index for d in found})
    if hosts != target.hosts:
        raise UserError(f"--target={target.name}: JAX described {hosts} hosts, not {target.hosts}")
    return list(found)
