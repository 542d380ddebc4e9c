"""The Pallas GPU flash attention (infjax.models.kernels.gpu_flash), run on CPU in Pallas interpret mode against
an independent dense reference: outputs and q/k/v gradients for packed rows, causal grouped-query heads with
left padding, a two-sided local window, padding-only rows and a full row; the block-skipping bounds; the
reasons `supports` gives; and the lowering of all three kernels to Triton for a CUDA target (no GPU needed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax.models.kernels import gpu_flash

B, T, D = 2, 64, 16


def reference_mask(segment_ids, causal=False, window=None):
    """[B, T, T] bool, built directly from segment ids: same non-zero segment, (causal) key not after the
    query, (window) |i - j| <= window."""
    seg = np.asarray(segment_ids)
    i = np.arange(seg.shape[1])
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    if causal:
        mask &= (i[None, :] <= i[:, None])[None]
    if window is not None:
        mask &= (np.abs(i[:, None] - i[None, :]) <= window)[None]
    return mask


def ranges_of(mask):
    """lo/hi [B, T] int32 of a mask whose rows are contiguous (checked); [0, 0) on empty rows."""
    t = mask.shape[-1]
    any_ = mask.any(-1)
    lo = np.where(any_, mask.argmax(-1), 0)
    hi = np.where(any_, t - mask[..., ::-1].argmax(-1), 0)
    j = np.arange(t)
    assert ((j >= lo[..., None]) & (j < hi[..., None]) == mask).all(), "mask rows are not contiguous"
    return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


def project_key_ranges():
    for module in ("infjax.models.kernels.masks", "infjax.models.kernels.ranges", "infjax.models.cpu_attention"):
        try:
            return __import__(module, fromlist=["key_ranges"]).key_ranges
        except (ImportError, AttributeError):
            continue
    return None


def reference_attention(q, k, v, mask):
    """Dense masked softmax attention in float32; grouped heads by repetition; zero on rows without a key."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    mask = jnp.asarray(mask)[:, None]                                        # [B, 1, T, T]
    s = jnp.einsum("btnd,bsnd->bnts", q, k, precision="highest") * q.shape[-1] ** -0.5
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1) * mask           # all-masked rows: 0
    return jnp.einsum("bnts,bsnd->btnd", p, v, precision="highest")


def inputs(n, kv, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, T, n, D)), dtype)
    k = jnp.asarray(r.normal(size=(B, T, kv, D)), dtype)
    v = jnp.asarray(r.normal(size=(B, T, kv, D)), dtype)
    cot = jnp.asarray(r.normal(size=(B, T, n, D)), jnp.float32)
    return q, k, v, cot


def row(*runs):
    """A row of segment ids from (id, length) runs, padded with 0 to T."""
    ids = [i for i, n in runs for _ in range(n)]
    return ids + [0] * (T - len(ids))


CASES = {
    # several texts, the 2nd crossing the block edge at 16, the 3rd the one at 32; an empty (padding) tail
    "packed": dict(seg=[row((1, 10), (2, 13), (3, 25)), row((1, 30), (2, 21), (3, 5))], heads=(4, 4)),
    # decoder: causal, 4 query heads on 2 kv heads; row 0 left-padded, row 1 two texts
    "causal_gqa": dict(seg=[[0] * 20 + [1] * 44, row((1, 40), (2, 24))], heads=(4, 2), causal=True),
    # ModernBERT local layers: two-sided window of 5 inside each segment, windows crossing the 16-blocks
    "window": dict(seg=[row((1, 50)), row((1, 20), (2, 44))], heads=(4, 4), window=5),
    # a row of padding only (zero output, zero gradient, no NaN) beside a short text
    "padding_only": dict(seg=[[0] * T, row((1, 33))], heads=(4, 2)),
    # one text filling the whole row; key blocks of 32 against query blocks of 16
    "full_row": dict(seg=[[1] * T, [1] * T], heads=(4, 1), block_k=32),
}


def run_case(case, dtype=jnp.float32):
    seg = np.asarray(case["seg"], np.int32)
    mask = reference_mask(seg, case.get("causal", False), case.get("window"))
    lo, hi = ranges_of(mask)
    n, kv = case["heads"]
    q, k, v, cot = inputs(n, kv, dtype)
    blocks = dict(block_q=case.get("block_q", 16), block_k=case.get("block_k", 16), interpret=True)

    def kernel_loss(q, k, v):
        out = gpu_flash.flash_attention(q, k, v, lo, hi, **blocks)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    def reference_loss(q, k, v):
        out = reference_attention(q, k, v, mask)
        return jnp.sum(out * cot), out

    grads = jax.jit(jax.grad(kernel_loss, argnums=(0, 1, 2), has_aux=True))
    (dq, dk, dv), out = grads(q, k, v)
    (rdq, rdk, rdv), ref = jax.grad(reference_loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return seg, lo, hi, (out, dq, dk, dv), (ref, rdq, rdk, rdv)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    case = CASES[name]
    seg, lo, hi, got, want = run_case(case)
    key_ranges = project_key_ranges()
    if key_ranges is not None:    # the ranges the model passes are the ones this test derives from the mask
        plo, phi = key_ranges(jnp.asarray(seg), case.get("causal", False), case.get("window"))
        np.testing.assert_array_equal(plo, lo)
        np.testing.assert_array_equal(phi, hi)
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.float32 and g.shape == w.shape, label
        assert np.isfinite(np.asarray(g)).all(), label
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=f"{name}: {label}")
    empty = np.asarray(hi <= lo)                                              # [B, T] queries without a key
    out, dq = np.asarray(got[0]), np.asarray(got[1])
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    if name == "padding_only":
        assert all((np.asarray(x)[0] == 0).all() for x in got)                # row 0: nothing at all


def test_bfloat16_outputs():
    _, _, _, got, want = run_case(CASES["packed"], jnp.bfloat16)
    assert got[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got[0], np.float32), want[0], atol=3e-2, rtol=3e-2)


def test_block_bounds_skip_other_segments():
    seg = np.asarray([row((1, 32), (2, 32)), row((1, 24))], np.int32)        # row 1: 40 padding tokens
    lo, hi = ranges_of(reference_mask(seg))
    kb_lo, kb_hi, qb_lo, qb_hi = (np.asarray(x) for x in gpu_flash.block_bounds(lo, hi, 16, 16))
    # row 0: query blocks 0-1 (text 1) visit key blocks [0, 2), blocks 2-3 (text 2) key blocks [2, 4); and back
    np.testing.assert_array_equal(kb_lo[0], [0, 0, 2, 2])
    np.testing.assert_array_equal(kb_hi[0], [2, 2, 4, 4])
    np.testing.assert_array_equal(qb_lo[0], [0, 0, 2, 2])
    np.testing.assert_array_equal(qb_hi[0], [2, 2, 4, 4])
    # row 1: block 1 mixes 8 queries of text 1 with 8 padding ones, which must not widen it; blocks 2-3 are
    # padding only: no work either way
    np.testing.assert_array_equal(kb_lo[1], [0, 0, 0, 0])
    np.testing.assert_array_equal(kb_hi[1], [2, 2, 0, 0])
    np.testing.assert_array_equal(qb_lo[1], [0, 0, 0, 0])
    np.testing.assert_array_equal(qb_hi[1], [2, 2, 0, 0])
    # a window of 5 with 16-blocks: each query block reaches one block to either side, no further
    lo, hi = ranges_of(reference_mask(np.ones((1, T), np.int32), window=5))
    kb_lo, kb_hi, _, _ = (np.asarray(x) for x in gpu_flash.block_bounds(lo, hi, 16, 16))
    np.testing.assert_array_equal(kb_lo[0], [0, 0, 1, 2])
    np.testing.assert_array_equal(kb_hi[0], [2, 3, 4, 4])


def test_blocks_shrink_for_short_rows():
    assert [gpu_flash.blocks_for(t) for t in (16, 32, 48, 64, 96, 128, 4096)] == [16, 32, 16, 64, 32, 64, 64]
    assert gpu_flash.blocks_for(100) is None and gpu_flash.blocks_for(8) is None
    assert gpu_flash.blocks_for(128, 32) == 32


def test_supports_gives_reasons():
    def shapes(t=T, n=4, kv=2, d=D, dtype=jnp.float32):
        return jax.ShapeDtypeStruct((B, t, n, d), dtype), jax.ShapeDtypeStruct((B, t, kv, d), dtype)

    assert gpu_flash.supports(*shapes()) is None
    assert gpu_flash.supports(*shapes(dtype=jnp.bfloat16)) is None
    assert gpu_flash.supports(*shapes(t=48)) is None                          # blocks of 16
    assert "80" in gpu_flash.supports(*shapes(d=80)) and "power of two" in gpu_flash.supports(*shapes(d=80))
    assert "100" in gpu_flash.supports(*shapes(t=100))
    assert "int8" in gpu_flash.supports(*shapes(dtype=jnp.int8))
    assert "kv heads" in gpu_flash.supports(*shapes(n=4, kv=3))
    assert "8" in gpu_flash.supports(*shapes(d=8))
    assert "block_q" in gpu_flash.supports(*shapes(), block_q=48)
    q, k, v, _ = inputs(4, 2)
    q80 = jnp.zeros((B, 64, 4, 80))
    lo = hi = jnp.zeros((B, 64), jnp.int32)
    with pytest.raises(ValueError, match="head size 80"):
        gpu_flash.flash_attention(q80, q80, q80, lo, hi, interpret=True)
    with pytest.raises(ValueError, match="lo/hi"):
        gpu_flash.flash_attention(q, k, v, lo[:, :32], hi, interpret=True)


def test_lowers_to_triton_for_cuda():
    """The Pallas-to-Triton lowering (what runs on a GPU, up to Triton's own compilation) of the forward and both
    backward kernels, for a CUDA target from this CPU-only process: bf16, grouped heads, a window, D = 64."""
    pytest.importorskip("jax._src.lib.triton")
    q = jax.ShapeDtypeStruct((2, 128, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)
    ranges = jax.ShapeDtypeStruct((2, 128), jnp.int32)

    def loss(q, k, v, lo, hi):
        return gpu_flash.flash_attention(q, k, v, lo, hi).astype(jnp.float32).sum()

    # jax >= 0.11 lowers for the GPU of the context: an abstract H100 (0.10 lowers for compute capability 9.0
    # when no GPU is attached and ignores it)
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, ranges, ranges).lower(
            lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 3
