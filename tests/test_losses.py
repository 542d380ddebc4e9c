"""The contrastive objectives against a float64 per-row loop written from docs/method.md §3,
and their invariance to the number of devices holding the batch."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from infjax import losses


def per_row_loss(objective, iq, p, iq_neg=None, i_cos=None, i_valid=None):
    """The objective's loss for every row of the global batch, [R]: what `losses.contrastive_loss` (the train
    step's loss) averages."""
    return losses.combine(objective, losses.objective_logits(objective, iq, p, iq_neg, i_cos, i_valid))


def naive_loss(name, iq, p, neg, tau, positive_once=False, left_out=lambda t, r, m: False):
    """docs/method.md §3 as written, one row at a time, in float64. `left_out(t, r, m)`: whether entry m of row r's
    set t (a column of S for "p", a row of S for "iq", an instruction negative m >= 1 for "i") is removed."""
    kind, sets = losses.OBJECTIVES[name]
    iq, p, neg = (np.asarray(a, np.float64) for a in (iq, p, neg))
    R = len(iq)
    total = 0.0
    for r in range(R):
        pos = float(iq[r] @ p[r]) / tau
        # each set as (list of logits, index of the positive inside it)
        A = {
            "p": ([float(iq[r] @ p[m]) / tau for m in range(R)], r),
            "iq": ([float(iq[k] @ p[r]) / tau for k in range(R)], r),
            "i": ([pos] + [float(neg[r, j] @ p[r]) / tau for j in range(neg.shape[1])], 0),
        }
        A = {t: ([x for m, x in enumerate(logits) if m == at or not left_out(t, r, m)],
                 sum(1 for m in range(at) if not left_out(t, r, m)))
             for t, (logits, at) in A.items()}
        if kind == "uni":
            for t in sets:
                logits, _ = A[t]
                total += math.log(sum(math.exp(x) for x in logits)) - pos
        else:
            denom = math.exp(pos) if positive_once else 0.0
            for t in sets:
                logits, at = A[t]
                denom += sum(math.exp(x) for i, x in enumerate(logits) if not (positive_once and i == at))
            total += math.log(denom) - pos
    return total / R


def unit(rng, *shape):
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def embeddings():
    rng = np.random.default_rng(0)
    R, K, d = 12, 4, 16
    iq, p, neg = unit(rng, R, d), unit(rng, R, d), unit(rng, R, K, d)
    p[5] = p[4]                    # duplicate passages
    iq[7] = p[7]                   # similarity exactly +1
    p[8] = -iq[8]                  # similarity exactly -1
    neg[3, 0] = iq[3]              # an instruction negative identical to the positive query
    return iq.astype(np.float32), p.astype(np.float32), neg.astype(np.float32)


@pytest.mark.parametrize("name", sorted(losses.OBJECTIVES))
@pytest.mark.parametrize("positive_once", [False, True])
def test_objective_equals_naive_loop(name, positive_once, embeddings):
    iq, p, neg = embeddings
    obj = losses.Objective.from_name(name, temperature=0.05, positive_once=positive_once)
    got = float(jnp.mean(per_row_loss(obj, iq, p, neg)))
    want = naive_loss(name, iq, p, neg, 0.05, positive_once)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("sets", ["p", "i", "iq"])
def test_uni_equals_multi_for_one_set(sets, embeddings):
    iq, p, neg = embeddings
    uni = per_row_loss(losses.Objective.from_name(f"uni_{sets}"), iq, p, neg)
    multi = per_row_loss(losses.Objective("multi", (sets,)), iq, p, neg)
    np.testing.assert_allclose(uni, multi, rtol=1e-6)


def test_multivariate_counts_positive_per_set(embeddings):
    """Eq. 21 as written: with |T| = 2 the positive adds exp(s_rr) once more to the
    denominator, so l_twice = log(exp(l_once) + 1) = logaddexp(l_once, 0)."""
    iq, p, neg = embeddings
    twice = per_row_loss(losses.Objective.from_name("multi_pi"), iq, p, neg)
    once = per_row_loss(losses.Objective.from_name("multi_pi", positive_once=True), iq, p, neg)
    np.testing.assert_allclose(twice, np.logaddexp(np.asarray(once, np.float64), 0.0), rtol=1e-5, atol=1e-5)


def test_no_nan_for_extreme_logits(embeddings):
    iq, p, neg = embeddings
    obj = losses.Objective.from_name("multi_piiq", temperature=1e-4)   # logits up to 1e4
    value, grads = jax.jit(jax.value_and_grad(lambda a, b, c: jnp.mean(per_row_loss(obj, a, b, c)),
                                              argnums=(0, 1, 2)))(iq, p, neg)
    assert np.isfinite(float(value))
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="unknown objective 'multi_px'"):
        losses.Objective.from_name("multi_px")


def test_missing_instruction_negatives_is_refused(embeddings):
    iq, p, _ = embeddings
    with pytest.raises(ValueError, match="instruction negatives"):
        per_row_loss(losses.Objective.from_name("multi_pi"), iq, p, None)


def _value_and_grad_on(n_devices, name, iq, p, neg):
    mesh = jax.make_mesh((n_devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n_devices])
    sh = NamedSharding(mesh, P("data"))
    obj = losses.Objective.from_name(name)
    fn = jax.jit(jax.value_and_grad(lambda a, b, c: losses.contrastive_loss(obj, a, b, c)[0], argnums=(0, 1, 2)),
                 in_shardings=(sh, sh, sh))
    value, grads = fn(*(jax.device_put(x, sh) for x in (iq, p, neg)))
    assert len(value.sharding.device_set) <= n_devices
    return float(value), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("name", sorted(losses.OBJECTIVES))
def test_value_and_gradient_do_not_depend_on_device_count(name):
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    rng = np.random.default_rng(1)
    R, K, d = 24, 3, 32
    iq, p, neg = (unit(rng, *s).astype(np.float32) for s in ((R, d), (R, d), (R, K, d)))
    v1, g1 = _value_and_grad_on(1, name, iq, p, neg)
    for n in (2, 8):
        vn, gn = _value_and_grad_on(n, name, iq, p, neg)
        assert vn == pytest.approx(v1, rel=1e-6)
        for a, b in zip(g1, gn):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_set_metrics_against_numpy(embeddings):
    iq, p, neg = embeddings
    obj = losses.Objective.from_name("multi_piiq")
    _, m = losses.contrastive_loss(obj, iq, p, neg)
    s = np.asarray(iq, np.float64) @ np.asarray(p, np.float64).T
    R = len(s)
    for t, mat in (("p", s), ("iq", s.T)):
        off = np.where(np.eye(R, dtype=bool), -np.inf, mat)
        assert float(m[f"{t}/pos_sim"]) == pytest.approx(np.mean(np.diag(s)), abs=1e-5)
        assert float(m[f"{t}/hard_neg_sim"]) == pytest.approx(np.mean(off.max(1)), abs=1e-5)
        assert float(m[f"{t}/top1"]) == pytest.approx(np.mean(np.diag(mat) > off.max(1)))
    inst = np.einsum("rkd,rd->rk", neg, p)
    assert float(m["i/hard_neg_sim"]) == pytest.approx(np.mean(inst.max(1)), abs=1e-5)
    assert float(m["i/top1"]) == pytest.approx(np.mean(np.diag(s) > inst.max(1)))
    assert float(m["p/loss"]) == pytest.approx(naive_loss("uni_p", iq, p, neg, 0.05), rel=1e-5)


def _reference_loss_torch(name, iq, p, neg, tau):
    """The reference code's definitions (docs/method.md §3.5), written with torch:
    "uni" = one softmax over the concatenated blocks, the positive's duplicates masked;
    "multi" = a sum of separate cross-entropies, one per block."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    iq, p, neg = (torch.tensor(np.asarray(a), dtype=torch.float64) for a in (iq, p, neg))
    kind, sets = losses.OBJECTIVES[name]
    R = iq.shape[0]
    s = iq @ p.T / tau
    blocks = {"p": s, "iq": s.T, "i": torch.cat([s.diag()[:, None], torch.einsum("rkd,rd->rk", neg, p) / tau], 1)}
    target = {"p": torch.arange(R), "iq": torch.arange(R), "i": torch.zeros(R, dtype=torch.long)}
    if kind == "multi":      # reference "multivariate": separate cross-entropies
        return float(sum(F.cross_entropy(blocks[t], target[t]) for t in sets))
    # reference "univariate": [positive | block_1 without positive | block_2 without positive ...]
    parts = [s.diag()[:, None]]
    for t in sets:
        keep = torch.ones_like(blocks[t], dtype=torch.bool)
        keep[torch.arange(R), target[t]] = False
        parts.append(blocks[t][keep].reshape(R, -1))
    return float(F.cross_entropy(torch.cat(parts, 1), torch.zeros(R, dtype=torch.long)))


@pytest.mark.parametrize("name", ["uni_pi", "uni_piiq", "uni_iiq", "multi_pi", "multi_piq", "uni_p"])
def test_reference_convention_reproduces_the_reference_definitions(name, embeddings):
    iq, p, neg = embeddings
    want = _reference_loss_torch(name, iq, p, neg, 0.05 + 1e-4)     # the reference divides by tau + 1e-4
    got = float(jnp.mean(per_row_loss(losses.reference_objective(name, 0.05), iq, p, neg)))
    assert got == pytest.approx(want, rel=1e-5)
    # and the swap is what docs/method.md §3.5 says: the reference's multi_* is our uni_* and vice versa
    ours = name if len(losses.OBJECTIVES[name][1]) == 1 else \
        {"uni": "multi", "multi": "uni"}[name.split("_")[0]] + "_" + name.split("_")[1]
    assert want == pytest.approx(naive_loss(ours, iq, p, neg, 0.05 + 1e-4, positive_once=name.startswith("uni")),
                                 rel=1e-5)


def test_reference_convention_by_hand():
    """convention=reference on a fixed batch at the default tau, against numbers worked out by hand.

    Two rows in 2-d: iq = (e1, e2), p = ((0.8, 0.6), (0.6, 0.8)), so each row's positive has cosine 0.8
    and the other passage 0.6; one instruction negative per row at cosine 0.7 with the row's passage.
    The reference scales cosines by 1/(0.05 + 1e-4) = 1/0.0501.
    """
    from infjax import config as config_lib
    from infjax.training.setup import make_objective
    with jax.enable_x64(True):
        iq = jnp.array([[1.0, 0.0], [0.0, 1.0]])
        p = jnp.array([[0.8, 0.6], [0.6, 0.8]])
        perp = jnp.array([[0.6, -0.8], [0.8, -0.6]])
        neg = (0.7 * p + math.sqrt(1 - 0.49) * perp)[:, None, :]
        assert np.allclose(np.einsum("rkd,rd->rk", neg, p), 0.7)
        k = 1 / 0.0501
        ce = lambda pos, *others: -k * pos + math.log(sum(math.exp(k * x) for x in (pos, *others)))  # noqa: E731
        want = {
            "uni_p": ce(0.8, 0.6),                      # each row: [positive, the other passage]
            "multi_pi": ce(0.8, 0.6) + ce(0.8, 0.7),    # a sum of separate cross-entropies (P, then I)
            "uni_pi": ce(0.8, 0.6, 0.7),                # one softmax over [positive | other passage | negative]
        }
        for name, value in want.items():
            config = config_lib.base_config(name)
            config.loss.convention = "reference"
            objective = make_objective(config)
            assert objective.temperature == pytest.approx(0.0501, abs=1e-12)
            got = float(jnp.mean(per_row_loss(objective, iq, p, neg)))
            assert got == pytest.approx(value, rel=1e-9), name
            # the paper's exact 1/tau gives visibly other numbers
            paper = float(jnp.mean(per_row_loss(dataclasses.replace(objective, temperature=0.05), iq, p, neg)))
            assert abs(paper - value) > 1e-3 * value, name


@pytest.mark.parametrize("name, positive_once", [("multi_pi", False), ("uni_piiq", False),
                                                 ("multi_piiq", True), ("multi_iiq", False)])
def test_gradients_match_finite_differences(name, positive_once, embeddings):
    """Central differences in float64 along random directions, for iq, p and the instruction negatives."""
    with jax.enable_x64(True):
        iq, p, neg = (jnp.asarray(a, jnp.float64) for a in embeddings)
        obj = losses.Objective.from_name(name, positive_once=positive_once)
        f = lambda a, b, c: jnp.mean(per_row_loss(obj, a, b, c))
        grads = jax.grad(f, argnums=(0, 1, 2))(iq, p, neg)
        rng = np.random.default_rng(2)
        for _ in range(3):
            dirs = [jnp.asarray(rng.normal(size=x.shape)) for x in (iq, p, neg)]
            eps = 1e-6
            plus = f(*(x + eps * v for x, v in zip((iq, p, neg), dirs)))
            minus = f(*(x - eps * v for x, v in zip((iq, p, neg), dirs)))
            numeric = float(plus - minus) / (2 * eps)
            analytic = float(sum(jnp.vdot(g, v) for g, v in zip(grads, dirs)))
            assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-8)


def test_bf16_embeddings_give_float32_scores(embeddings):
    iq, p, neg = (jnp.asarray(a, jnp.bfloat16) for a in embeddings)
    logits = losses.marginal_logits(iq, p, neg, 0.05)
    assert all(v.dtype == jnp.float32 for v in logits.values())
    assert per_row_loss(losses.Objective.from_name("multi_pi"), iq, p, neg).dtype == jnp.float32


# --- false negatives left out (docs/method.md §6.2)

def _duplicates(R):
    """Rows 4 and 5 share a passage (the fixture's p[5] = p[4]); rows 9 and 10 an instruction-aware query."""
    p_text, iq_text = np.arange(R), np.arange(R)
    p_text[5], iq_text[10] = 4, 9
    same = (p_text[:, None] == p_text[None, :]) | (iq_text[:, None] == iq_text[None, :])
    return same


@pytest.mark.parametrize("name", ["uni_piiq", "multi_piiq", "multi_pi", "uni_iq"])
@pytest.mark.parametrize("positive_once", [False, True])
def test_a_duplicate_is_left_out_of_every_set_as_if_its_column_were_removed(name, positive_once, embeddings):
    iq, p, neg = embeddings
    iq = iq.copy()
    iq[10] = iq[9]                                    # the same query text: the same embedding
    same = _duplicates(len(iq))
    n_same = np.zeros(neg.shape[:2], bool)
    n_same[3, 0] = True                               # the fixture's neg[3, 0] = iq[3]: row 3's own instruction
    obj = losses.Objective.from_name(name, positive_once=positive_once, mask_duplicates=True)
    got, metrics = losses.contrastive_loss(obj, iq, p, neg, same=jnp.asarray(same), n_same=jnp.asarray(n_same))

    def left_out(t, r, m):
        return bool(n_same[r, m - 1]) if t == "i" else bool(same[r, m])
    want = naive_loss(name, iq, p, neg, 0.05, positive_once, left_out)
    assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert abs(float(got) - naive_loss(name, iq, p, neg, 0.05, positive_once)) > 1e-3     # it did leave some out
    assert float(metrics["masked_duplicates"]) == 2 + 2 + 1     # (4, 5), (5, 4), (9, 10), (10, 9); one negative
    # and off: today's loss, whatever the batch says
    off = losses.Objective.from_name(name, positive_once=positive_once)
    plain = losses.contrastive_loss(off, iq, p, neg, same=jnp.asarray(same), n_same=jnp.asarray(n_same))[0]
    assert float(plain) == float(losses.contrastive_loss(off, iq, p, neg)[0])


def test_a_left_out_logit_has_no_gradient(embeddings):
    """The gradient of the loss with respect to S (and the instruction negatives' scores) is 0 where masked."""
    iq, p, neg = embeddings
    same = jnp.asarray(_duplicates(len(iq)))
    obj = losses.Objective.from_name("multi_piiq", mask_duplicates=True)

    def of_logits(s, i_neg):
        logits = {"pos": jnp.diagonal(s), "p": s, "iq": s.T, "i": jnp.concatenate([jnp.diagonal(s)[:, None], i_neg], 1)}
        masked, _ = losses.mask_false_negatives(obj, logits, same)
        return jnp.mean(losses.combine(obj, masked))
    s = losses.scores(jnp.asarray(iq), jnp.asarray(p), 0.05)
    i_neg = losses.instruction_scores(jnp.asarray(neg), jnp.asarray(p), 0.05)
    g = np.asarray(jax.grad(of_logits)(s, i_neg))
    off = np.asarray(same) & ~np.eye(len(iq), dtype=bool)
    assert (g[off] == 0).all() and (g[~off] != 0).all()


def test_the_margin_leaves_out_negatives_scored_above_the_positive_plus_the_margin(embeddings):
    iq, p, neg = embeddings
    margin, tau = -0.1, 0.05
    obj = losses.Objective.from_name("uni_piiq", margin=margin)
    got, metrics = losses.contrastive_loss(obj, iq, p, neg)
    iq64, p64, neg64 = (np.asarray(a, np.float64) for a in (iq, p, neg))
    S = iq64 @ p64.T
    over = {"p": lambda r, m: S[r, m] > S[r, r] + margin, "iq": lambda r, m: S[m, r] > S[r, r] + margin,
            "i": lambda r, m: neg64[r, m - 1] @ p64[r] > S[r, r] + margin}
    want = naive_loss("uni_piiq", iq, p, neg, tau, left_out=lambda t, r, m: bool(over[t](r, m)))
    count = sum(bool(over[t](r, m)) for t in ("p", "iq") for r in range(len(iq)) for m in range(len(iq)) if m != r) \
        + sum(bool(over["i"](r, m)) for r in range(len(iq)) for m in range(1, neg.shape[1] + 1))
    assert count > 0
    assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert float(metrics["masked_margin"]) == count


# --- Matryoshka dims (docs/method.md §6.3)

@pytest.mark.parametrize("name", ["multi_pi", "uni_piiq"])
def test_matryoshka_with_the_whole_width_only_is_todays_loss_bit_for_bit(name, embeddings):
    iq, p, neg = embeddings
    today, m0 = jax.jit(lambda a, b, c: losses.contrastive_loss(losses.Objective.from_name(name), a, b, c))(iq, p, neg)
    obj = losses.Objective.from_name(name, dims=(16,), dim_weights=(1.0,))
    whole, m1 = jax.jit(lambda a, b, c: losses.contrastive_loss(obj, a, b, c))(iq, p, neg)
    assert np.asarray(whole).tobytes() == np.asarray(today).tobytes()
    assert float(m1["dim16/loss"]) == float(today)


def test_matryoshka_sums_the_weighted_losses_of_renormalized_prefixes(embeddings):
    iq, p, neg = embeddings
    obj = losses.Objective.from_name("multi_pi", dims=(16, 8, 4), dim_weights=(1.0, 0.5, 0.25))
    got, metrics = losses.contrastive_loss(obj, iq, p, neg)

    def cut(x, d):
        x = np.asarray(x, np.float64)[..., :d]
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    parts = {d: naive_loss("multi_pi", cut(iq, d), cut(p, d), cut(neg, d), 0.05) for d in (16, 8, 4)}
    assert float(got) == pytest.approx(parts[16] + 0.5 * parts[8] + 0.25 * parts[4], rel=1e-5)
    for d in (16, 8, 4):
        assert float(metrics[f"dim{d}/loss"]) == pytest.approx(parts[d], rel=1e-5)


@pytest.mark.parametrize("dims, weights, why", [
    ("64,x", "", "positive whole numbers"), ("64,0", "", "positive whole numbers"), ("64,64", "", "twice"),
    ("64,32", "1", "one number >= 0 per dim"), ("64,32", "1,-1", "one number >= 0 per dim"),
    ("64,32", "0,0", "not all 0"), ("", "1", "weights given without dims"), ("64", "a", "must be numbers")])
def test_matryoshka_keys_are_refused_naming_what_is_wrong(dims, weights, why):
    with pytest.raises(ValueError, match=why):
        losses.matryoshka(dims, weights)


def test_matryoshka_keys_are_read_largest_first():
    assert losses.matryoshka("64,384, 128", "0.2,1,0.5") == ((384, 128, 64), (1.0, 0.5, 0.2))
    assert losses.matryoshka("", "") == ((), ())
