"""Model FLOPs of a train step (infjax/benchmarks/flops.py) against hand counts of the paper's backbones, scanned
and not, and against XLA's own count of a compiled unscanned step (where XLA's count is right: no loop, no
custom call); XLA's count of the scanned step sees one layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax import config as config_lib
from infjax.benchmarks import flops, shapes as bench_shapes
from infjax.models import attention
from infjax.models.encoder import load_encoder


def _encoder(hf_config, tmp_path, scan=False, **model):
    """(encoder, params, path) of a weightless checkpoint folder of `hf_config` (model.lora.rank: lora_rank)."""
    folder = bench_shapes.checkpoint_folder(hf_config, str(tmp_path))
    c = config_lib.base_config("multi_pi").model
    c.checkpoint, c.scan_layers = folder, scan
    c.lora.rank = model.get("lora_rank", 0)
    return load_encoder(c, weights=False)


@pytest.mark.parametrize("scan", [False, True])
def test_dense_multiply_adds_are_the_hand_count_of_bert_base_and_qwen25_15b(tmp_path, scan):
    bert = _encoder(bench_shapes.BERT_BASE, tmp_path, scan)
    h, i = 768, 3072
    assert flops.dense_macs(bert.params["shared"]) == (12 * (4 * h * h + 2 * h * i), 0)      # q, k, v, o, up, down
    qwen = _encoder(bench_shapes.QWEN25_15B, tmp_path, scan)
    h, i, kv = 1536, 8960, 2 * 128                  # 2 kv heads of 128
    assert flops.dense_macs(qwen.params["shared"]) == (28 * (2 * h * h + 2 * h * kv + 3 * h * i), 0)


def test_step_flops_by_hand_bidirectional_causal_window_and_lora(tmp_path):
    lengths = [10, 20, 3]
    bert = _encoder(bench_shapes.BERT_BASE, tmp_path)
    f = flops.step_flops(bert.params["shared"], bert.encoder.module.config, lengths)
    dense = 12 * (4 * 768 ** 2 + 2 * 768 * 3072)
    assert f.dense == 3 * 2 * 33 * dense and f.tokens == 33 and f.texts == 3
    assert f.attention == 3 * 12 * 4 * 768 * (100 + 400 + 9)        # fwd + 2 bwd, layers, 4 N d per pair
    qwen = _encoder(bench_shapes.QWEN25_15B, tmp_path, scan=True)
    f = flops.step_flops(qwen.params["shared"], qwen.encoder.module.config, lengths)
    assert f.attention == 3 * 28 * 4 * 1536 * (55 + 210 + 6)         # causal: L (L + 1) / 2 pairs
    lora = _encoder(bench_shapes.QWEN25_15B, tmp_path, scan=True, lora_rank=8)
    f_lora = flops.step_flops(lora.params["shared"], lora.encoder.module.config, lengths, frozen_base=True)
    _, adapters = flops.dense_macs(lora.params["shared"])
    assert adapters == 28 * 8 * (2 * (1536 + 1536) + 2 * (1536 + 256) + 3 * (1536 + 8960))   # r (in + out) each
    assert f_lora.dense == 2 * 33 * (2 * flops.dense_macs(qwen.params["shared"])[0] + 3 * adapters)
    assert [flops.pairs(6, window=1), flops.pairs(6, causal=True, window=2), flops.pairs(4, window=9)] == \
        [16, 15, 16]


def test_text_lengths_of_packed_and_padded_batches():
    packed = {"p": {"segments": np.array([[[5, 3, 0], [7, 0, 0]]])}}
    padded = {"q_mask": np.array([[1, 1, 0], [1, 1, 1]]), "n_mask": np.array([[[1, 0, 0], [0, 0, 0]]])}
    assert sorted(flops.text_lengths(packed)) == [3, 5, 7]
    assert sorted(flops.text_lengths(padded)) == [1, 2, 3]


def _compiled_flops(encoder, params, b, length):
    ids = jax.ShapeDtypeStruct((b, length), jnp.int32)
    w = jax.ShapeDtypeStruct((b, encoder.module.config.hidden_size), jnp.float32)

    def loss(p, ids, w):
        return jnp.sum(encoder(p, ids, jnp.ones_like(ids)) * w)
    compiled = jax.jit(jax.grad(loss)).lower(params, ids, w).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def test_xla_counts_the_unscanned_step_as_the_analytic_count_and_one_layer_when_scanned(tmp_path, monkeypatch):
    """Full rows (no padding), the explicit attention (plain XLA ops), forward and backward: XLA's count of the
    unscanned program equals the analytic one up to the element-wise work it adds (softmax, norms, GELU);
    with scanned layers it counts one of them."""
    monkeypatch.setenv(attention.ENV, "explicit")
    tiny = dict(bench_shapes.BERT_BASE, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=512)
    b, length = 8, 64
    counts = {}
    for scan in (False, True):
        loaded = _encoder(tiny, tmp_path, scan)
        analytic = flops.step_flops(loaded.params["shared"], loaded.encoder.module.config, [length] * b).total
        counts[scan] = _compiled_flops(loaded.encoder, loaded.params["shared"], b, length), analytic
    (xla, analytic), (xla_scanned, analytic_scanned) = counts[False], counts[True]
    print(f"tiny BERT, 4 layers, 8 x 64 tokens: analytic {analytic:.3e}, XLA {xla:.3e} (unscanned), "
          f"{xla_scanned:.3e} (scanned)")
    assert analytic == analytic_scanned
    assert 1.0 <= xla / analytic < 1.15
    assert xla_scanned < 0.5 * analytic
