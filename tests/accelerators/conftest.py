"""The compile-only GPU/TPU tests run the target's compiler every time: no persistent compilation cache here
(tests/conftest.py sets one for the rest of the suite), for this process and the ones it starts. Run them on
their own with INFJAX_TEST_XLA_OPT_LEVEL= (empty) to compile at XLA's default optimisation level, as CI does."""
import os

import pytest


@pytest.fixture(autouse=True, scope="package")
def _target_compiler_runs():
    import jax
    from jax._src import compilation_cache

    saved = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()        # JAX decides once per process whether to use the cache: ask it again
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
    if saved is not None:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = saved
