"""infjax/runtime/cpu.py: when the entry points restart with glibc's huge-page tunable, and that it cuts the
faults; the CPU settings follow the platform a run uses."""
import os
import subprocess
import sys
import textwrap

import pytest

from infjax.errors import ConfigError
from infjax.runtime import cpu as hm
from tests.helpers.plugins import CUDA, TPU, fake_plugins

LINUX = dict(system="Linux", libc="glibc", mode="madvise")
CPU = {"JAX_PLATFORMS": "cpu"}


def test_the_tunable_is_added_only_where_it_helps():
    env = hm.huge_pages_env(CPU, **LINUX)
    assert env == {"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", hm.ADDED: "1"}
    # appended to the user's own tunables
    env = hm.huge_pages_env(dict(CPU, GLIBC_TUNABLES="glibc.malloc.arena_max=2"), **LINUX)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert hm.huge_pages_env(dict(CPU, GLIBC_TUNABLES="glibc.malloc.hugetlb=0"), **LINUX) is None  # the user's
    assert hm.huge_pages_env(dict(CPU, INFJAX_HUGE_PAGES="0"), **LINUX) is None
    assert hm.huge_pages_env({"JAX_PLATFORMS": "cuda"}, **LINUX) is None          # the step's memory is the GPU's
    assert hm.huge_pages_env({"JAX_PLATFORMS": "tpu,cpu"}, **LINUX) is None
    for other in (dict(system="Darwin"), dict(libc="musl"), dict(mode="always"), dict(mode="never")):
        assert hm.huge_pages_env(CPU, **dict(LINUX, **other)) is None, other


def test_a_bad_switch_is_named():
    with pytest.raises(ConfigError, match="INFJAX_HUGE_PAGES='yes'"):
        hm.huge_pages_env(dict(CPU, INFJAX_HUGE_PAGES="yes"), **LINUX)
    out = subprocess.run([sys.executable, "-m", "infjax.bench", "--help"], env=_env(INFJAX_HUGE_PAGES="yes"),
                         capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stderr.strip()) == (2, "infjax: error: INFJAX_HUGE_PAGES='yes': expected 0 or 1")


def test_the_peer_process_gets_the_environment_without_infjax_s_tunable():
    added = hm.huge_pages_env(dict(CPU, GLIBC_TUNABLES="glibc.malloc.arena_max=2"), **LINUX)
    assert hm.plain_env(added) == dict(CPU, GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    assert hm.plain_env(hm.huge_pages_env(CPU, **LINUX)) == CPU
    users = dict(CPU, GLIBC_TUNABLES="glibc.malloc.hugetlb=1")              # set by the user: kept
    assert hm.plain_env(users) == users


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert hm.thp_mode(str(path)) == "madvise"
    assert hm.thp_mode(str(tmp_path / "missing")) is None


def _run(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hm.ADDED, hm.ENV, "XLA_FLAGS")}
    return dict(env, JAX_PLATFORMS="cpu", **extra)


needs_madvise = pytest.mark.skipif(hm.huge_pages_env(CPU) is None,
                                   reason="not Linux/glibc with transparent huge pages in madvise mode")


@needs_madvise
def test_restart_keeps_the_process_and_its_arguments_and_adds_the_tunable():
    out = _run("""
        import os, sys
        print("start", os.getpid(), sys.argv[1:], flush=True)
        from infjax.runtime.cpu import restart_with_huge_pages, describe
        restart_with_huge_pages()
        print("after", os.getpid(), os.environ["GLIBC_TUNABLES"], describe())
    """, _env(GLIBC_TUNABLES="glibc.malloc.arena_max=4")).split("\n")
    starts = [line.split() for line in out if line.startswith("start")]
    after = [line for line in out if line.startswith("after")]
    assert len(starts) == 2 and starts[0][1] == starts[1][1]              # ran twice, one process id
    assert len(after) == 1
    pid, tunables = after[0].split()[1:3]
    assert pid == starts[0][1] and tunables == "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"
    assert "transparent huge pages (glibc.malloc.hugetlb=1, set by infjax)" in after[0]


FAULTS = """
    import resource, jax, jax.numpy as jnp
    def step(x, w):
        t = jnp.tanh(x @ w)                # [16384, 1024], 64 MiB: a temporary (the sort needs it whole: XLA:CPU
        return (t @ w.T).sum() + jnp.sort(t[:, :8], axis=0).sum()    # cannot tile it away into one fusion)
    f = jax.jit(step)
    x, w = jnp.ones((16384, 256)), jnp.ones((256, 1024)) / 256
    temp = f.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x, w).block_until_ready()
    print(temp, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@needs_madvise
def test_with_the_tunable_a_step_faults_its_temporary_in_by_huge_pages():
    pages = 16384 * 1024 * 4 // 4096                                    # 16,384 small pages
    temp, plain = map(int, _run(FAULTS, _env()).split())
    _, huge = map(int, _run(FAULTS, _env(GLIBC_TUNABLES="glibc.malloc.hugetlb=1")).split())
    assert temp >= pages * 4096, temp                                   # the program has the temporary
    assert plain >= pages // 2, plain                                   # mapped afresh each call, 4 KiB at a time
    assert huge <= plain // 10, (huge, plain)
def test_the_cpu_settings_follow_the_platform_the_run_uses_not_the_plugins_installed(monkeypatch):
    """The huge pages follow the platform the run uses: on for a CPU run even with accelerator plugins
    installed (a `gpu` install on a machine without a GPU), off where a plugin's hardware is there or cannot
    be told."""
    fake_plugins(monkeypatch, {CUDA: False, TPU: False})
    assert hm.runs_on_cpu({}) and hm.huge_pages_env({}, **LINUX) is not None
    fake_plugins(monkeypatch, {CUDA: True, TPU: False})                 # a GPU machine
    assert not hm.runs_on_cpu({}) and hm.huge_pages_env({}, **LINUX) is None
    fake_plugins(monkeypatch, {"jax_plugins.other": None})             # a plugin whose hardware cannot be told
    assert not hm.runs_on_cpu({})
    fake_plugins(monkeypatch, {})
    assert hm.runs_on_cpu({})
