"""Sequence packing: the host packer, and packed == padded for every backbone family (outputs and gradients).

The attention over packed rows (segment ids) is tested in tests/models/test_attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax.data import packing, pipeline
from infjax.models import attention as A
from infjax.models.encoder import Encoder
from infjax.models.registry import FAMILIES
from tests.helpers.backbones import VOCAB
from tests.helpers.configs import small_config
from tests.helpers.targets import tiny_folder

# Lengths of 8 texts (<= 16 tokens each): 2 shards of 4, packed into rows of 24 tokens. ModernBERT's tiny
# config has a local half window of 4, so packs (and single texts) are longer than the window.
LENGTHS = (16, 9, 3, 12, 5, 7, 1, 14)
MAX_LEN, PACK = 16, 24


def _tokens(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).astype(np.int32) for n in LENGTHS]


def _padded(tokens, side):
    ids = np.zeros((len(tokens), MAX_LEN), np.int32)
    mask = np.zeros_like(ids)
    for i, t in enumerate(tokens):
        span = slice(MAX_LEN - len(t), None) if side == "left" else slice(0, len(t))
        ids[i, span], mask[i, span] = t, 1
    return ids, mask


def _pack(tokens, shards, capacity, pad_id=0, what="texts", chunks=None):
    """`packing.pack_flat` of texts given as token arrays, in row order."""
    lengths = np.array([len(t) for t in tokens], np.int64)
    return packing.pack_flat(np.concatenate(tokens).astype(np.int32), lengths, shards, capacity, pad_id, what, chunks)


def _rows(lengths, length):
    """The rows `packing.place` makes: the text indices of each row."""
    row_of, count = packing.place(lengths, length)
    return [[i for i, r in enumerate(row_of) if r == row] for row in range(count)]


def test_first_fit_places_every_text_once_within_the_length():
    rng = np.random.default_rng(1)
    for _ in range(50):
        lengths = list(rng.integers(1, 30, size=int(rng.integers(1, 40))))
        rows = _rows(lengths, 32)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in r) <= 32 for r in rows)
        assert len(rows) >= -(-sum(lengths) // 32)


def test_pack_round_trip_and_overflow_names_the_input():
    tokens = _tokens()
    capacity = packing.capacity_for([[len(t) for t in tokens]], 2, PACK)
    out = _pack(tokens, 2, capacity, pad_id=0, what="passages")
    assert out["ids"].shape == (2, capacity.rows, PACK) and out["first"].shape == (2, 4)
    flat_ids = out["ids"].reshape(2, -1)
    for i, t in enumerate(tokens):                      # each text is found whole where first/last say
        s, j = divmod(i, 4)
        a, b = out["first"][s, j], out["last"][s, j]
        np.testing.assert_array_equal(flat_ids[s, a:b + 1], t)
        assert (out["text"].reshape(2, -1)[s, a:b + 1] == j).all()
    assert out["mask"].max() >= 2                      # several texts share a row
    assert (out["mask"] > 0).sum() == sum(LENGTHS) and (out["text"] < 4).sum() == sum(LENGTHS)
    with pytest.raises(packing.PackingOverflow, match=r"passages, shard 0: 4 texts .* capacity is 1 rows"):
        _pack(tokens, 2, packing.Capacity(1, PACK), 0, "passages")


def test_rows_hold_at_most_the_capacitys_texts_and_segments_list_their_lengths():
    tokens = _tokens()
    free = _pack(tokens, 2, packing.capacity_for([LENGTHS], 2, PACK), 0)
    assert int(free["mask"].max()) == 3 and free["segments"].shape[-1] == packing.segment_bound(3) == 4
    bounded = packing.Capacity(4, PACK, texts=2)
    out = _pack(tokens, 2, bounded, 0)
    assert out["segments"].shape == (2, 4, 2) and int(out["mask"].max()) == 2
    np.testing.assert_array_equal(out["segments"].sum(axis=(1, 2)), [sum(LENGTHS[:4]), sum(LENGTHS[4:])])
    with pytest.raises(packing.PackingOverflow, match=r"at most 1 texts a row but the capacity is 2 rows"):
        _pack(tokens, 2, packing.Capacity(2, PACK, texts=1), 0)
    assert [packing.segment_bound(n) for n in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, 16]


def test_the_encoder_bounds_each_attention_call_by_its_batch(tmp_path_factory, monkeypatch):
    """What reaches the attention kernels as the most texts a row holds: the packed batch's `segments` width,
    and 1 for a padded batch, never the row length."""
    fam = FAMILIES["qwen2"]
    module, params, _, _ = fam.load(tiny_folder("qwen2", tmp_path_factory.mktemp("bound")), weights=False)
    encoder = Encoder(module, "last", fam.padding_side, "qwen2")
    seen = []
    choose = A.choose
    monkeypatch.setattr(A, "choose", lambda *a, **k: seen.append(A._OPTIONS.get().max_segments) or choose(*a, **k))
    tokens = _tokens()
    packed = _pack(tokens, 2, packing.capacity_for([LENGTHS], 2, PACK), 0)
    jax.eval_shape(lambda p: encoder.packed(p, packed), params)
    assert seen and set(seen) == {packed["segments"].shape[-1]} == {4}
    seen.clear()
    jax.eval_shape(lambda p: encoder(p, *_padded(tokens, "left")), params)
    assert seen and set(seen) == {1}


def test_chosen_row_length_is_the_least_cost_candidate_by_a_naive_count():
    """choose_length against first-fit rows (`place`) counted by hand; texts of ~45 tokens (the longest 64) are
    packed two to a row of 96 rather than one to a row of 64."""
    rng = np.random.default_rng(4)
    steps = [list(np.clip(rng.normal(45, 8, size=48).astype(int), 20, 64)) for _ in range(6)]
    steps[0][0] = 64
    naive = {}
    for n in range(64, 129, 32):
        rows = [max(packing.place(lengths[s * 24:(s + 1) * 24], n)[1] for s in range(2)) for lengths in steps]
        naive[n] = np.mean(rows) * n * (1 + n / packing.ATTENTION_SPAN)
    assert packing.candidate_lengths(64) == [64, 96, 128]
    assert packing.choose_length(steps, shards=2) == min(naive, key=naive.get) == 96
    assert packing.candidate_lengths(500) == [512, 640, 768, 896, 1024]       # blockwise rows: multiples of 128


def test_with_attention_per_text_the_row_length_of_least_padding_wins():
    """Span infinite (the CPU kernel): a row costs its tokens, so choose_length takes the candidate of fewest
    tokens in rows (counted by hand), here longer rows than the whole-row cost model's choice."""
    rng = np.random.default_rng(5)
    steps = [list(np.clip(rng.normal(150, 50, size=48).astype(int), 30, 256)) for _ in range(6)]
    steps[0][0] = 256
    tokens = {n: np.mean([packing.place(lengths, n)[1] for lengths in steps]) * n
              for n in packing.candidate_lengths(256)}
    whole_row = {n: t * (1 + n / packing.ATTENTION_SPAN) for n, t in tokens.items()}
    per_text = packing.choose_length(steps, shards=1, span=float("inf"))
    assert per_text == min(tokens, key=lambda n: (tokens[n], n))
    assert packing.choose_length(steps, shards=1) == min(whole_row, key=whole_row.get) < per_text
    assert packing.row_cost(512, float("inf")) == 512 and packing.row_cost(512) == 512 * 1.5


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_chosen_shapes_hold_every_step_each_in_its_cheapest_shape(count):
    rng = np.random.default_rng(count)
    needs = np.stack([rng.integers(20, 35, size=200), rng.integers(5, 9, size=200), np.full(200, 4)], axis=1)
    costs = np.array([300.0, 100.0, 50.0])
    shapes, of_step = packing.choose_shapes(needs, costs, count)
    assert 1 <= len(shapes) <= count and of_step.shape == (200,)
    assert (shapes[0] == needs.max(axis=0)).all() or count > 1          # one shape: the most of every side
    for need, k in zip(needs, of_step):                                # held, and by no cheaper shape
        assert (shapes[k] >= need).all()
        assert all(shapes[j] @ costs >= shapes[k] @ costs for j in range(len(shapes)) if (shapes[j] >= need).all())
    assert set(of_step.tolist()) == set(range(len(shapes)))           # every shape is used
    def total(c):                                                     # the run's packed cost with c shapes
        rows, steps_shape = packing.choose_shapes(needs, costs, c)
        return float(sum(rows[steps_shape] @ costs))

    assert total(count) <= total(max(count - 1, 1)) and (count == 1 or total(count) < total(1))
    again = packing.choose_shapes(needs, costs, count)
    assert (again[0] == shapes).all() and (again[1] == of_step).all()
    one, _ = packing.choose_shapes(needs, costs, count, min_gain=1.0)    # no further shape saves all the cost
    assert len(one) == 1


def test_chunked_packing_holds_each_shards_strided_texts_per_chunk():
    """Gradient caching packs chunk c of shard s apart: texts s*n + c, s*n + c + C, ... (n texts per shard)."""
    tokens = _tokens() * 3                               # 24 texts, 2 shards x 3 chunks x 4 texts
    capacity = packing.capacity_for([[len(t) for t in tokens]], 2, PACK, chunks=3)
    out = _pack(tokens, 2, capacity, pad_id=0, what="passages", chunks=3)
    assert out["ids"].shape == (2, 3, capacity.rows, PACK) and out["first"].shape == (2, 3, 4)
    for s in range(2):
        for c in range(3):
            flat = out["ids"][s, c].reshape(-1)
            for j in range(4):
                a, b = out["first"][s, c, j], out["last"][s, c, j]
                np.testing.assert_array_equal(flat[a:b + 1], tokens[s * 12 + c + 3 * j])
    assert (out["mask"] > 0).sum() == 3 * sum(LENGTHS)
    tight = packing.Capacity(capacity.rows - 1, PACK)
    with pytest.raises(packing.PackingOverflow, match=r"passages, shard \d, chunk \d: 4 texts"):
        _pack(tokens, 2, tight, 0, "passages", chunks=3)
    with pytest.raises(ValueError, match="24 texts do not split into 2 batch shards x 5 chunks"):
        _pack(tokens, 2, capacity, 0, "passages", chunks=5)


_CHECKPOINTS = {}


def _checkpoint(family, tmp_path_factory):
    """A random tiny checkpoint of `family` written from numpy through infjax's name map: no torch, so
    packed == padded runs for every family on every CI leg (the families' parity with transformers is
    tests/models/test_backbones.py's and test_bert.py's)."""
    if family not in _CHECKPOINTS:
        import transformers

        from tests.helpers.backbones import _hf_config
        from tests.helpers.tiny import write_random_checkpoint

        config = (transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=48) if family == "bert"
                  else _hf_config(family)).to_dict()
        folder = str(tmp_path_factory.mktemp(f"packing_{family}"))
        _CHECKPOINTS[family] = write_random_checkpoint(family, config, folder, tokenizer=False)
    return _CHECKPOINTS[family]


@pytest.mark.parametrize("impl", ["explicit", "xla"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_equals_padded_embeddings_and_gradients(family, impl, tmp_path_factory, monkeypatch):
    monkeypatch.setenv(A.ENV, impl)
    fam = FAMILIES[family]
    module, params, _, _ = fam.load(_checkpoint(family, tmp_path_factory))
    tokens = _tokens()
    ids, mask = _padded(tokens, fam.padding_side)
    packed = _pack(tokens, 2, packing.capacity_for([LENGTHS], 2, PACK), 0)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(len(LENGTHS), module.config.hidden_size)),
                          jnp.float32)
    encoders = {pooling: Encoder(module, pooling, fam.padding_side, family) for pooling in ("mean", "cls", "last")}
    # one program for the three poolings (one encoder pass in it), padded and packed
    padded = jax.jit(lambda p: {k: e(p, ids, mask) for k, e in encoders.items()})(params)
    packed_out = jax.jit(lambda p: {k: e.packed(p, packed) for k, e in encoders.items()})(params)
    for pooling in encoders:
        np.testing.assert_allclose(packed_out[pooling], padded[pooling], atol=1e-5, err_msg=pooling)
    encoder = encoders[fam.default_pooling]
    g_pad = jax.jit(jax.grad(lambda p: jnp.sum(encoder(p, ids, mask) * weights)))(params)
    g_pack = jax.jit(jax.grad(lambda p: jnp.sum(encoder.packed(p, packed) * weights)))(params)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_pad))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), g_pack, g_pad)


@pytest.mark.parametrize("objective,interaction", [("multi_piiq", "concat"),
                                                   pytest.param("multi_piiq", "cross_attention",
                                                                marks=pytest.mark.slow)])   # slow: in CI
def test_packed_batches_give_the_padded_loss_and_gradients_on_8_devices(objective, interaction, monkeypatch):
    """The real MiniLM: a packed global batch split over data=8 gives the padded batch's loss and gradients
    computed on one device (Interaction I with instruction negatives; Interaction II), for a step whose shape was
    measured (0) and one fitted as it is built (2: the shapes are measured over one step)."""
    from infjax.data import batches
    from infjax.models.encoder import load_encoder
    from infjax.runtime import mesh as mesh_lib

    from infjax.training import embed, setup as setup_lib

    config = small_config(objective, **{"model.interaction": interaction, "train.steps": 3,
                                         "data.query_max_len": 96, "data.passage_max_len": 96})
    encoder, params, path = load_encoder(config.model)
    data = pipeline.open_training_data(config, path, encoder.padding_side)
    obj = setup_lib.make_objective(config)
    monkeypatch.setattr(batches, "MEASURED_STEPS", 1)
    packed_setup = setup_lib.make_batch_setup(config, data, encoder, path, obj, num_devices=8)
    assert packed_setup.build.packing.shapes.measured().tolist() == [0]
    padded_setup = setup_lib.make_batch_setup(config_lib_override(config, {"data.packing": False}), data, encoder,
                                              path, obj)
    caps = packed_setup.build.packing.capacities
    assert packed_setup.build.packing.shards == 8 and set(caps) == ({"i", "qo", "p"} if interaction != "concat"
                                                            else {"q", "p", "n"})
    texts = {s: 3 * (2 if s == "n" else 1) for s in caps}                          # 24 rows / 8 shards
    assert all(c.rows <= texts[s] for s, c in caps.items()) and sum(c.rows for c in caps.values()) < sum(texts.values())
    value_and_grad = jax.value_and_grad(embed.make_loss_fn(encoder, obj), has_aux=True)
    mesh = mesh_lib.make_mesh(config.mesh)
    for step in (0, 2):
        (ref, _), ref_grads = jax.jit(value_and_grad)(params, padded_setup.build(step), None)
        batch = mesh_lib.global_batch(packed_setup.build(step), mesh)
        (loss, _), grads = jax.jit(value_and_grad)(params, batch, None)
        np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
        scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), grads, ref_grads)


def config_lib_override(config, values):
    from infjax import config as config_lib

    return config_lib.override(config, values)


def test_measured_capacity_fits_every_step_and_a_small_override_names_its_key():
    from infjax.models.encoder import load_encoder
    from infjax.training import setup as setup_lib

    config = small_config("multi_pi", **{"data.query_max_len": 96, "data.passage_max_len": 96})
    encoder, _, path = load_encoder(config.model)
    data = pipeline.open_training_data(config, path, encoder.padding_side)
    obj = setup_lib.make_objective(config)
    build = setup_lib.make_batch_setup(config, data, encoder, path, obj, num_devices=8).build
    shapes = build.packing.shapes
    assert build.packing.capacities == shapes.capacities(shapes.largest) and 1 <= len(shapes.rows) <= 3
    most = {side: 0 for side in shapes.texts}
    for step in range(config.train.steps):                      # every step fits the rows of its shape
        batch = build(step)
        assert all(batch[s]["mask"].shape[1:] == (c.rows, c.length) for s, c in shapes.at(step).items())
        for side in shapes.texts:                               # `segments`: each row's texts' lengths, width M
            mask, segments = batch[side]["mask"], batch[side]["segments"]
            assert segments.shape == mask.shape[:-1] + (shapes.texts[side],)
            np.testing.assert_array_equal(segments, (mask[..., None] == np.arange(1, segments.shape[-1] + 1))
                                          .sum(axis=-2))
            most[side] = max(most[side], int(mask.max()))
    # M is the most texts any row of the run holds, rounded up to a power of two (at least 2)
    assert shapes.texts == {side: packing.segment_bound(m) for side, m in most.items()}
    assert any(m > 2 for m in most.values()) and all(shapes.texts[s] < 4 * m for s, m in most.items())
    one = setup_lib.make_batch_setup(config_lib_override(config, {"data.pack_shapes": 1}), data, encoder, path,
                                     obj, num_devices=8).build
    assert len(one.packing.shapes.rows) == 1 and one.packing.shapes.rows[0] == shapes.largest
    for side, c in build.packing.capacities.items():                    # some step fills each side of the one shape
        assert max(int((one(step)[side]["mask"].max(axis=-1) > 0).sum(axis=-1).max())
                   for step in range(config.train.steps)) == c.rows
    tight = config_lib_override(config, {"data.pack_rows_negatives": 1})
    small = setup_lib.make_batch_setup(tight, data, encoder, path, obj, num_devices=8).build
    assert small.packing.capacities["n"].rows == 1 and small.packing.capacities["q"] == build.packing.capacities["q"]
    with pytest.raises(packing.PackingOverflow, match=r"step 0, side 'n'.*raise data.pack_rows_negatives"):
        small(0)


def test_best_fit_rows_places_every_text_once_in_the_smallest_width():
    rng = np.random.default_rng(3)
    lengths = list(rng.integers(1, 129, size=300))
    rows = packing.best_fit_rows(lengths, (32, 64, 128))
    assert sorted(i for _, r in rows for i in r) == list(range(300))
    assert all(sum(lengths[i] for i in r) <= w for w, r in rows)
    for w, r in rows:                           # a row is opened by its longest text, at the smallest width
        assert w == min(x for x in (32, 64, 128) if x >= max(lengths[i] for i in r))
    with pytest.raises(packing.PackingOverflow, match="widest row"):
        packing.best_fit_rows([200], (32, 64, 128))


@pytest.mark.parametrize("n, shards", [(300, 1), (300, 8), (37, 2), (1, 4)])
def test_planned_calls_hold_every_text_once_in_few_shapes_and_only_the_last_is_short(n, shards):
    rng = np.random.default_rng(n)
    widths = (32, 64, 128, 200)
    lengths = list(rng.integers(1, 201, size=n))
    per_call = {32: 64, 64: 32, 128: 16, 200: 8}
    calls = packing.plan_calls(packing.best_fit_rows(lengths, widths), per_call, shards)
    assert sorted(i for _, rows in calls for r in rows for i in r) == list(range(n))
    for width, rows in calls:
        assert len(rows) % shards == 0
        assert all(sum(lengths[i] for i in r) <= width for r in rows)
    *full, (last_width, last) = calls
    assert all(len(rows) == per_call[w] for w, rows in full)           # one shape per width ...
    assert len(last) <= per_call[last_width]                              # ... and the short last call
    assert len(last) // shards & (len(last) // shards - 1) == 0          # of a power of two rows per shard
    assert all(all(rows) for _, rows in full)                             # no empty row before the last call
    assert [w for w, _ in calls] == sorted((w for w, _ in calls), reverse=True)
    with pytest.raises(ValueError, match="do not split over 3 shards"):
        packing.plan_calls(packing.best_fit_rows(lengths, widths), per_call, 3)


def test_cpu_calls_are_cache_sized_and_accelerator_calls_scale_with_the_batch():
    from infjax.inference import embedders
    from infjax.runtime.mesh import default_mesh, make_mesh

    eight, one = default_mesh(), make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    assert embedders.tokens_per_call(4, eight) == 4 * 128                  # small batches: as many as asked
    assert embedders.tokens_per_call(256, eight) == 1024 * 8               # capped per device on CPU
    assert embedders.tokens_per_call(256, one) == 1024

    class FakeGpu:
        platform = "gpu"

    class GpuMesh:
        devices = np.array([FakeGpu()])
        shape = {"data": 1, "fsdp": 1, "tensor": 1}
        axis_names = ("data", "fsdp", "tensor")

    assert embedders.tokens_per_call(256, GpuMesh()) == 256 * 128


def test_packed_text_embedder_equals_padded_on_8_devices(monkeypatch):
    """Corpus encoding, packed over a data=8 mesh == padded (the tiny BERT); more texts than one call holds; and
    the same in chunks of 100 texts (tokenized 7 at a time), no chunk tokenizing more."""
    from infjax.data import tokenize
    from infjax.data.tokenize import Tokenizer
    from infjax.inference.embedders import TextEmbedder
    from infjax.models.encoder import load_encoder
    from infjax.runtime.mesh import default_mesh, replicated

    encoder, params, path = load_encoder(small_config("multi_pi").model)
    mesh = default_mesh()
    params = jax.device_put(params["shared"], replicated(mesh))
    rng = np.random.default_rng(0)
    words = "instruction following retrieval models rank passages by relevance to a query".split()
    texts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(1, 90, size=150)] + [""]
    tok = Tokenizer(path)
    packed = TextEmbedder(encoder, mesh, tok, batch_size=8)
    ref = TextEmbedder(encoder, mesh, tok, batch_size=8, packed=False)(params, texts, 64)
    out = packed(params, texts, 64)
    assert len(packed.calls(tok.tokens(texts, 64), 64)) > 3
    assert packed.stats["real_tokens"] == sum(len(t) for t in tok.tokens(texts, 64))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    chunked = TextEmbedder(encoder, mesh, tok, batch_size=8)
    chunked.chunk_texts = 100
    monkeypatch.setattr(tokenize, "CHUNK", 7)
    seen = []
    monkeypatch.setattr(tok, "tokens", lambda texts, n, f=tok.tokens: seen.append(len(texts)) or f(texts, n))
    np.testing.assert_allclose(chunked(params, texts, 64), ref, atol=1e-5)
    assert seen == [100, 51] and chunked.stats["real_tokens"] == packed.stats["real_tokens"]


def _unpacked(packed):
    """Each shard's texts back from packed arrays [S, rows, length] (first/last index the flattened row)."""
    out = []
    for s in range(packed["ids"].shape[0]):
        flat = packed["ids"][s].reshape(-1)
        out += [flat[f:l + 1] for f, l in zip(packed["first"][s], packed["last"][s])]
    return out


def test_a_step_not_measured_takes_the_cheapest_shape_that_holds_it_else_the_shapes_grow():
    """`Shapes.fit` against packing itself: the shape it picks packs the batch and no cheaper shape does; a batch
    that no shape holds adds one that holds it (and every earlier shape), a text longer than the row length
    lengthens the rows; either is said in the note, and nothing else is."""
    rng = np.random.default_rng(0)
    start = packing.Shapes({"q": 32, "p": 32}, ({"q": 3, "p": 3}, {"q": 1, "p": 3}, {"q": 3, "p": 1}),
                           np.array([0, 1, 2]), {"q": 3, "p": 3}, {"q": 4, "p": 4}, np.array([0, 5, 9]))
    grown = 0
    for trial in range(60):
        shapes = start
        top = 40 if trial % 10 == 9 else 32                   # now and then a text longer than the rows
        counts = {side: rng.integers(1, rng.choice([8, 20, top]) + 1, size=2 * int(rng.integers(1, 7))).tolist()
                  for side in ("q", "p")}
        tokens = {side: [np.arange(n, dtype=np.int32) + 3 for n in c] for side, c in counts.items()}
        after, caps, note = shapes.fit(counts, 2)

        def holds(sh, rows):
            try:
                for side, t in tokens.items():
                    _pack(t, 2, sh.capacities(rows)[side], 0)
                return True
            except packing.PackingOverflow:
                return False

        assert holds(after, {s: c.rows for s, c in caps.items()})
        assert all(c.length == after.lengths[s] and c.texts == 4 for s, c in caps.items())
        if after.lengths != start.lengths:
            assert max(max(c) for c in counts.values()) > 32 and "row length" in note
            assert all(n == 64 for s, n in after.lengths.items() if max(counts[s]) > 32)
        fitting = [r for r in after.rows if holds(after, r)]
        if after.rows == start.rows:
            assert note is None or "row length" in note
            assert after.cost({s: c.rows for s, c in caps.items()}) == min(map(after.cost, fitting))
        else:
            grown += 1
            assert "a further shape" in note and after.rows[1:] == start.rows and after.largest == after.rows[0]
            assert all(after.rows[0][s] >= n for r in start.rows for s, n in r.items())
            assert after.of_step.tolist() == ([1, 2, 3] if after.lengths == start.lengths else [])
    assert 0 < grown < 60


def test_steps_beyond_the_measured_sample_are_fitted_as_built_and_processes_agree(monkeypatch):
    """A run measured over a sample of its steps: every step, measured or not, packs all its texts unchanged into
    its shape's rows (the widest a row more than the sample needs, at most a row a text), and that shape is the
    cheapest measured one that holds the step's first-fit rows, or (none holds it) a further one, said in the
    step's note; a step's batch is a pure function of the step (built in any order, the same); two processes (4
    shards each) build the halves of the batch that one process (8 shards) builds, and note alike."""
    import dataclasses

    from infjax.data import batches
    from infjax.models.encoder import load_encoder
    from infjax.training import setup as setup_lib

    config = small_config("multi_pi", **{"data.query_max_len": 96, "data.passage_max_len": 96, "train.steps": 5})
    encoder, _, path = load_encoder(config.model)
    data = pipeline.open_training_data(config, path, encoder.padding_side)
    obj = setup_lib.make_objective(config)
    monkeypatch.setattr(batches, "MEASURED_STEPS", 2)
    build = setup_lib.make_batch_setup(config, data, encoder, path, obj, num_devices=8).build
    measured, step_texts = build.packing.shapes, build.step_texts
    assert measured.measured().tolist() == [0, 4]
    tokenizer = step_texts.texts.tokenizer
    for side, rows in measured.largest.items():          # a row more than the sample's most, per side
        most = max(packing.capacity_for([[len(t) for t in tokenizer.tokens(
            step_texts.side_texts(step, local=False)[0][side], build.max_len(side))]], 8, measured.lengths[side]).rows
            for step in (0, 4))
        assert rows == min(most + 1, len(step_texts.side_texts(0, local=False)[0][side]) // 8)
    # Shapes of one row per shard: every step then needs more rows than any shape has.
    small = dataclasses.replace(measured, rows=({s: 1 for s in measured.largest},),
                                largest={s: 1 for s in measured.largest}, of_step=np.zeros(0, np.int32),
                                steps=np.zeros(0, np.int64))
    for start in (measured, small):
        one = batches.BatchBuilder(step_texts, dataclasses.replace(build.packing, shapes=start))
        two = [batches.BatchBuilder(dataclasses.replace(step_texts, process_index=i, process_count=2),
                                    dataclasses.replace(build.packing, shapes=start, shards=4)) for i in (0, 1)]
        built = {}
        for step in range(config.train.steps):
            batch, info = one.assemble(step)
            batch = {k: v for k, v in batch.items() if isinstance(v, dict)}     # the packed sides
            built[step] = batch
            texts, _ = step_texts.side_texts(step)
            needs = {}
            for side, packed in batch.items():
                tokens = tokenizer.tokens(texts[side], one.max_len(side))
                for got, want in zip(_unpacked(packed), tokens, strict=True):
                    np.testing.assert_array_equal(got, want)
                rows, length = packed["ids"].shape[1:]
                assert length == start.lengths[side]
                needs[side] = packing.capacity_for([[len(t) for t in tokens]], 8, length).rows
                assert rows >= needs[side]
            held = [r for r in start.rows if all(r[s] >= n for s, n in needs.items())]
            if held:                                          # the cheapest measured shape that holds it
                assert info["grown"] is None
                assert start.cost({s: batch[s]["ids"].shape[1] for s in batch}) == min(map(start.cost, held))
            else:
                assert "does not fit the shapes measured over" in info["grown"] and "a further shape" in info["grown"]
            halves = [b.assemble(step) for b in two]
            assert all(h[1]["grown"] == info["grown"] for h in halves)
            for side in batch:
                for key in packing.KEYS:
                    np.testing.assert_array_equal(np.concatenate([h[0][side][key] for h in halves]),
                                                  batch[side][key])
        fresh = batches.BatchBuilder(step_texts, dataclasses.replace(build.packing, shapes=start))
        for step in reversed(range(config.train.steps)):        # any order, any builder: the same batches
            for side, packed in fresh(step).items():
                if not isinstance(packed, dict):
                    continue
                for key in packing.KEYS:
                    np.testing.assert_array_equal(packed[key], built[step][side][key])
        if start is small:
            assert all(one.assemble(step)[1]["grown"] for step in range(config.train.steps))


def test_a_checkpoint_from_before_packing_resumes():
    """Packing changes buffer layout, not the math: a saved config without (or with other) packing keys resumes."""
    import json

    from infjax import config as config_lib

    current = json.loads(small_config().to_json_best_effort())
    old = json.loads(small_config().to_json_best_effort())
    for key in [k for k in old["data"] if k.startswith("pack")]:
        del old["data"][key]
    assert config_lib.incompatible_changes(old, current) == []
    other = json.loads(small_config(**{"data.packing": False, "data.pack_rows_query": 7}).to_json_best_effort())
    assert config_lib.incompatible_changes(other, current) == []


@pytest.mark.slow      # ~90 s (five compiled steps); in CI
def test_train_steps_over_several_packed_shapes_equal_one_shape():
    """data.pack_shapes: InF-IR-shaped texts on 8 devices give steps of different packed shapes (each step
    its own compiled program through the one jitted step); the losses and the parameters after 3 steps equal
    those of packing every step into the one shape that holds them all. (Passage rows of 256: rows of 512,
    the per-text cost model's choice with the CPU kernel, hold these 3 steps in one shape.)"""
    from infjax.benchmarks.train import Setup, inf_ir_shaped_records
    from infjax.training import state as state_lib

    records = inf_ir_shaped_records(256, seed=1)
    runs = {}
    for count in (3, 1):
        config = small_config("uni_p", **{"data.pack_shapes": count, "data.query_max_len": 64,
                                          "data.passage_max_len": 256, "data.pack_length_passage": 256,
                                          "train.batch_size": 16, "train.steps": 3})
        setup = Setup(config, records)
        state, _ = state_lib.create_sharded_state(setup.params, setup.optimizer, config.train.seed,
                                                  setup.encoder.module, setup.mesh)
        shapes, losses = set(), []
        for step in range(3):
            batch = setup.batch(step)
            shapes.add((batch["q"]["ids"].shape, batch["p"]["ids"].shape))
            state, metrics = setup.step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[count] = shapes, losses, jax.device_get(state.params)
    assert len(runs[3][0]) >= 2 and len(runs[1][0]) == 1
    np.testing.assert_allclose(runs[3][1], runs[1][1], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), runs[3][2], runs[1][2])
