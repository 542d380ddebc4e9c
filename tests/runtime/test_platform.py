"""infjax/runtime/platform.py: an accelerator plugin without its hardware, or that cannot start, is one warning."""
from tests.helpers.plugins import CUDA, TPU, fake_plugins


def test_a_plugin_without_its_hardware_keeps_jax_to_the_cpu_saying_so_once(monkeypatch, caplog):
    """Accelerator plugins installed where their hardware is not: JAX is kept to the CPU before it tries them
    and one warning says so, once."""
    import logging

    from infjax.runtime import platform

    class Config:                                          # jax.config, before JAX starts its backends
        def __init__(self):
            self.jax_platforms, self.updates = None, []

        def update(self, key, value):
            self.updates.append((key, value))
            setattr(self, key, value)

    config = Config()
    monkeypatch.setattr(platform, "backends_started", lambda: False)
    monkeypatch.setattr(platform, "_said", [])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    fake_plugins(monkeypatch, {CUDA: False, TPU: False})
    with caplog.at_level(logging.WARNING, logger="infjax"):
        platform.choose(config)
        platform.choose(config)
    assert config.updates == [("jax_platforms", "cpu")]
    assert [r.getMessage() for r in caplog.records] == [
        "JAX's accelerator plugins jax_plugins.xla_cuda13 and libtpu are installed, but this machine shows no NVIDIA "
        "GPU or TPU chip, so this run is on the CPU; set JAX_PLATFORMS=cpu to choose the CPU and silence this line"]
    assert platform.cpu_only([CUDA, TPU], [TPU]) is None                # a GPU is there: JAX chooses
    assert platform.cpu_only([], []) is None


def test_a_plugin_that_fails_to_start_is_one_warning_without_jax_s_traceback(monkeypatch, caplog):
    """A GPU machine whose CUDA install is broken: JAX logs the plugin's failure as a traceback and trains on the
    CPU, unnoticed at INFO. The same records, as JAX's plugin discovery emits them, become one warning."""
    import logging

    from infjax.runtime import platform

    monkeypatch.setattr(platform, "_said", [])
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")            # choose() only installs the filter
    fake_plugins(monkeypatch, {CUDA: True, TPU: False})
    platform.choose()
    jax_log = logging.getLogger(platform.JAX_LOGGER)
    with caplog.at_level(logging.INFO):
        jax_log.setLevel(logging.INFO)
        for _ in range(2):                                 # as jax._src.xla_bridge.discover_pjrt_plugins does
            try:
                try:
                    raise RuntimeError("jaxlib/cuda/versions_helpers.cc:52: operation cuptiGetVersion(&version) "
                                       "failed: Unknown CUPTI error 999. This probably means that JAX was unable to "
                                       "load cupti.")
                except RuntimeError as cause:
                    raise RuntimeError("Unable to load cuPTI. Is it installed?") from cause
            except RuntimeError:
                jax_log.exception("Jax plugin configuration error: Exception when calling %s.initialize()", CUDA)
        jax_log.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: cannot "
                     "open shared object file: No such file or directory")
        jax_log.warning("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed. "
                        "Falling back to cpu.")
        jax_log.warning("Platform 'x' is experimental and not all JAX functionality may be correctly supported!")
    jax_log.setLevel(logging.NOTSET)
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("infjax.platform", "WARNING", "JAX's accelerator plugin jax_plugins.xla_cuda13 is installed but could not "
         "start (Unable to load cuPTI. Is it installed?), so this run is on the CPU; repair the plugin's install, or "
         "set JAX_PLATFORMS=cpu to run on the CPU without trying it"),
        (platform.JAX_LOGGER, "WARNING", "Platform 'x' is experimental and not all JAX functionality may be "
         "correctly supported!")]
    assert not any(r.exc_info for r in caplog.records)
