"""InF-Embed contrastive objectives over marginal negatives (paper §5.2, Eqs. 6-21).

Notation (docs/method.md §3), over the R rows of the GLOBAL batch:

    s(r, m) = sim(iq_r, p_m) = <iq_r, p_m> / tau            (S, an R x R matrix)

For row r the positive logit is s(r, r) and the three marginal sets are

    P  : { s(r, m)  : m = 1..R }                 row r of S
    IQ : { s(k, r)  : k = 1..R }                 column r of S
    I  : { sim(iq(j->r), p_r) : j in {r} u N_I(r) }   an R x (K+1) matrix, column 0 = positive

    univariate   l_uni   = mean_r  sum_t [ logsumexp(A_t(r)) - s(r, r) ]
    multivariate l_multi = mean_r  [ logsumexp( union_t A_t(r) ) - s(r, r) ]

The union is a multiset: the positive sits in each set, so it appears |T|
times in the multivariate denominator (Eq. 21 as written), unless
`positive_once`, which counts it once. Multivariate terms combine the
per-set logsumexps with `logaddexp`.

Everything here is written on global arrays: under jit with sharded inputs,
the sharding inserts the collectives, and neither value nor gradient depends
on how many devices hold the batch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SETS = ("p", "i", "iq")

# The eleven distinct objectives (|T| = 1 is the same loss for uni and multi).
OBJECTIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "uni_p": ("uni", ("p",)),
    "uni_i": ("uni", ("i",)),
    "uni_iq": ("uni", ("iq",)),
    "uni_pi": ("uni", ("p", "i")),
    "uni_piq": ("uni", ("p", "iq")),
    "uni_iiq": ("uni", ("i", "iq")),
    "uni_piiq": ("uni", ("p", "i", "iq")),
    "multi_pi": ("multi", ("p", "i")),
    "multi_piq": ("multi", ("p", "iq")),
    "multi_iiq": ("multi", ("i", "iq")),
    "multi_piiq": ("multi", ("p", "i", "iq")),
}


@dataclasses.dataclass(frozen=True)
class Objective:
    """Which marginal sets T, how they are combined, and what the sets leave out (docs/method.md §3, §6)."""

    kind: str                 # "uni" or "multi"
    sets: tuple[str, ...]     # a subset of SETS
    temperature: float = 0.05
    positive_once: bool = False
    mask_duplicates: bool = False        # leave out negatives that are the row's positive by text (§6.2)
    margin: float | None = None          # leave out negatives whose cosine exceeds the positive's + margin
    dims: tuple[int, ...] = ()           # Matryoshka: the loss on each prefix of the embedding (() = whole)
    dim_weights: tuple[float, ...] = ()  # and its weight, one per dim

    @classmethod
    def from_name(cls, name: str, temperature: float = 0.05, positive_once: bool = False, **recipes) -> "Objective":
        if name not in OBJECTIVES:
            raise ValueError(f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}")
        kind, sets = OBJECTIVES[name]
        return cls(kind, sets, temperature, positive_once, **recipes)

    @property
    def needs_instruction_negatives(self) -> bool:
        return "i" in self.sets


def matryoshka(dims: str, weights: str = "") -> tuple[tuple[int, ...], tuple[float, ...]]:
    """loss.matryoshka_dims and loss.matryoshka_weights ("768,256,64", "" = each 1) as tuples, largest first.

    Raises ValueError naming what is wrong: a dim that is not a positive whole number, one given twice, or
    weights that are not one non-negative number per dim."""
    items = [x.strip() for x in dims.split(",") if x.strip()]
    if not items:
        if weights.strip():
            raise ValueError("weights given without dims")
        return (), ()
    if not all(x.isdigit() and int(x) > 0 for x in items):
        raise ValueError(f"dims must be positive whole numbers, comma-separated, got {dims!r}")
    parsed = [int(x) for x in items]
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"a dim is given twice in {dims!r}")
    if weights.strip():
        try:
            w = [float(x) for x in weights.split(",")]
        except ValueError:
            raise ValueError(f"weights must be numbers, comma-separated, got {weights!r}") from None
        if len(w) != len(parsed) or any(not x >= 0 for x in w) or not sum(w) > 0:
            raise ValueError(f"weights must be one number >= 0 per dim ({len(parsed)}), not all 0, got {weights!r}")
    else:
        w = [1.0] * len(parsed)
    order = sorted(range(len(parsed)), key=lambda k: -parsed[k])
    return tuple(parsed[k] for k in order), tuple(w[k] for k in order)


def score_dtype(*xs: jax.Array):
    """At least float32, whatever the compute dtype (bf16 embeddings give float32 scores)."""
    return jnp.result_type(jnp.float32, *xs)


def scores(x: jax.Array, y: jax.Array, temperature: float) -> jax.Array:
    """sim(x_r, y_m) = <x_r, y_m> / tau for L2-normalized rows, in (at least) float32: [R, M]."""
    dot = jnp.einsum("rd,md->rm", x, y, preferred_element_type=score_dtype(x, y))
    return dot / temperature


def instruction_scores(iq_neg: jax.Array, p: jax.Array, temperature: float) -> jax.Array:
    """sim(iq(j->r), p_r) for each row's K instruction negatives: [R, K, d] x [R, d] -> [R, K]."""
    dot = jnp.einsum("rkd,rd->rk", iq_neg, p, preferred_element_type=score_dtype(iq_neg, p))
    return dot / temperature


def marginal_logits(iq: jax.Array, p: jax.Array, iq_neg: jax.Array | None, temperature: float,
                    i_cos: jax.Array | None = None, i_valid: jax.Array | None = None) -> dict[str, jax.Array]:
    """The positive logits and the three marginal sets as matrices.

    Instruction negatives come either as embeddings `iq_neg` [R, K, d]
    (Interaction I: g(template(I_j, Q_r)) for K drawn instructions) or as
    cosines `i_cos` [R, M] with a validity mask `i_valid` (Interaction II:
    all in-batch instructions, duplicates of the row's own masked out).

    Returns {"pos": [R], "p": [R, R] (row r = set of row r), "iq": [R, R]
    (row r = column r of S), "i": [R, 1+K] or [R, 1+M] (column 0 = the positive)}.
    """
    s = scores(iq, p, temperature)
    pos = jnp.diagonal(s)
    logits = {"pos": pos, "p": s, "iq": s.T}
    if iq_neg is not None:
        negatives = instruction_scores(iq_neg, p, temperature)
    elif i_cos is not None:
        negatives = jnp.asarray(i_cos, pos.dtype) / temperature
        if i_valid is not None:
            negatives = jnp.where(i_valid, negatives, -jnp.inf)
    else:
        return logits
    logits["i"] = jnp.concatenate([pos[:, None], negatives], axis=1)
    return logits


def _positive_mask(t: str, logits: jax.Array) -> jax.Array:
    """True where a set's logit is the row's own positive (diagonal of P/IQ, column 0 of I)."""
    if t == "i":
        return jnp.arange(logits.shape[1])[None, :] == 0
    return jnp.eye(logits.shape[0], logits.shape[1], dtype=bool)


def set_logsumexp(logits: dict[str, jax.Array], t: str, exclude_positive: bool = False) -> jax.Array:
    """logsumexp over row r's set A_t(r), optionally without the positive: [R]."""
    a = logits[t]
    if exclude_positive:
        a = jnp.where(_positive_mask(t, a), -jnp.inf, a)
    return jax.nn.logsumexp(a, axis=1)


def univariate(logits: dict[str, jax.Array], sets: tuple[str, ...]) -> jax.Array:
    """Eqs. 6, 8-14: per-row sum over t of [logsumexp(A_t(r)) - s(r, r)]: [R]."""
    return sum(set_logsumexp(logits, t) - logits["pos"] for t in sets)


def multivariate(logits: dict[str, jax.Array], sets: tuple[str, ...], positive_once: bool = False) -> jax.Array:
    """Eqs. 7, 15-21: per-row logsumexp over the union of the sets minus s(r, r): [R]."""
    if positive_once:
        lse = logits["pos"]
        for t in sets:
            lse = jnp.logaddexp(lse, set_logsumexp(logits, t, exclude_positive=True))
    else:
        lse = set_logsumexp(logits, sets[0])
        for t in sets[1:]:
            lse = jnp.logaddexp(lse, set_logsumexp(logits, t))
    return lse - logits["pos"]


def objective_logits(objective: Objective, iq: jax.Array, p: jax.Array, iq_neg: jax.Array | None,
                     i_cos: jax.Array | None = None, i_valid: jax.Array | None = None) -> dict[str, jax.Array]:
    if objective.needs_instruction_negatives and iq_neg is None and i_cos is None:
        raise ValueError(f"objective with sets {objective.sets} needs instruction negatives (iq_neg or i_cos)")
    return marginal_logits(iq, p, iq_neg, objective.temperature, i_cos, i_valid)


def combine(objective: Objective, logits: dict[str, jax.Array]) -> jax.Array:
    """Per-row loss [R] from the marginal sets: univariate or multivariate."""
    if objective.kind == "uni":
        return univariate(logits, objective.sets)
    if objective.kind == "multi":
        return multivariate(logits, objective.sets, objective.positive_once)
    raise ValueError(f"objective kind must be 'uni' or 'multi', got {objective.kind!r}")


REFERENCE_TEMPERATURE_OFFSET = 1e-4   # the reference code computes sim / (tau + 1e-4)


def reference_objective(name: str, temperature: float = 0.05) -> Objective:
    """The reference PyTorch code's definition of objective `name`, in our terms (docs/method.md §3.5).

    Its "univariate" is one softmax over the concatenated blocks with the
    positive's duplicates masked: our multivariate with `positive_once`. Its
    "multivariate" is a sum of separate cross-entropies: our univariate. It
    divides similarities by tau + 1e-4, so the returned objective's
    temperature is `temperature` + REFERENCE_TEMPERATURE_OFFSET: with it the
    loss numbers equal the reference's. (The reference also multiplies its
    loss by the data-parallel world size before backward; under the gradient
    averaging of DDP that gives the gradient of the global-batch mean, which
    is what infjax computes, so only the logged loss differs by that factor.)
    """
    temperature = temperature + REFERENCE_TEMPERATURE_OFFSET
    ours = Objective.from_name(name, temperature)
    if len(ours.sets) == 1:
        return ours
    if ours.kind == "uni":
        return Objective("multi", ours.sets, temperature, positive_once=True)
    return Objective("uni", ours.sets, temperature)


def set_metrics(logits: dict[str, jax.Array], t: str, temperature: float) -> dict[str, jax.Array]:
    """Diagnostics of one marginal set: its own contrastive term, in-batch top-1 accuracy,
    mean positive similarity and mean hardest-negative similarity (cosines)."""
    a = logits[t]
    positive = _positive_mask(t, a)
    hardest = jnp.max(jnp.where(positive, -jnp.inf, a), axis=1)
    return {
        f"{t}/loss": jnp.mean(set_logsumexp(logits, t) - logits["pos"]),
        f"{t}/top1": jnp.mean(jnp.all(jnp.where(positive, True, a < logits["pos"][:, None]), axis=1)),
        f"{t}/pos_sim": jnp.mean(logits["pos"]) * temperature,
        f"{t}/hard_neg_sim": jnp.mean(hardest) * temperature,
    }


def mask_false_negatives(objective: Objective, logits: dict[str, jax.Array], same: jax.Array | None = None,
                         n_same: jax.Array | None = None) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """The sets without their false negatives, and how many logits each rule left out (docs/method.md §6.2).

    `same` [R, R]: pair m shares its passage or its instruction-aware query with pair r (the diagonal is not
    read), so s(r, m) in P and s(m, r) in IQ score row r's positive again; `n_same` [R, K]: an instruction
    negative of row r whose text is row r's own instruction. With `objective.margin`, a negative whose
    cosine exceeds the positive's by more than the margin is left out too (decided without a gradient)."""
    counts = {}
    out = dict(logits)
    if objective.mask_duplicates and same is not None:
        off = same & ~jnp.eye(same.shape[0], dtype=bool)
        out["p"] = jnp.where(off, -jnp.inf, out["p"])
        out["iq"] = jnp.where(off.T, -jnp.inf, out["iq"])
        masked = jnp.sum(off)
        if n_same is not None and "i" in out:
            out["i"] = out["i"].at[:, 1:].set(jnp.where(n_same, -jnp.inf, out["i"][:, 1:]))
            masked = masked + jnp.sum(n_same)
        counts["masked_duplicates"] = masked.astype(jnp.float32)
    if objective.margin is not None:
        masked = jnp.zeros((), jnp.float32)
        bound = jax.lax.stop_gradient(out["pos"])[:, None] + objective.margin / objective.temperature
        for t in objective.sets:
            a = out[t]
            over = (jax.lax.stop_gradient(a) > bound) & ~_positive_mask(t, a) & jnp.isfinite(a)
            out[t] = jnp.where(over, -jnp.inf, a)
            masked = masked + jnp.sum(over)
        counts["masked_margin"] = masked
    return out, counts


def prefix(x: jax.Array | None, dim: int) -> jax.Array | None:
    """The first `dim` coordinates of each embedding, L2-normalized again (the whole embedding unchanged)."""
    if x is None or dim >= x.shape[-1]:
        return x
    x = x[..., :dim]
    norm = jnp.linalg.norm(x.astype(score_dtype(x)), axis=-1, keepdims=True)
    return (x / jnp.maximum(norm, 1e-12).astype(x.dtype)).astype(x.dtype)


def contrastive_loss(objective: Objective, iq: jax.Array, p: jax.Array, iq_neg: jax.Array | None = None,
                     i_cos: jax.Array | None = None, i_valid: jax.Array | None = None, same: jax.Array | None = None,
                     n_same: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean loss over the global batch, plus per-set step metrics.

    With Matryoshka dims (`objective.dims`), the weighted sum of the loss on each prefix of the embeddings
    (`i_cos` then holds one [R, M] matrix per dim, as `embed.assemble` makes it), the per-dim losses as
    metrics `dim<d>/loss`, and the set metrics of the first dim."""
    if not objective.dims:
        return _loss(objective, iq, p, iq_neg, i_cos, i_valid, same, n_same)
    total, metrics = None, {}
    for k, (dim, weight) in enumerate(zip(objective.dims, objective.dim_weights)):
        loss, m = _loss(objective, prefix(iq, dim), prefix(p, dim), prefix(iq_neg, dim),
                        None if i_cos is None else i_cos[k], i_valid, same, n_same)
        total = weight * loss if total is None else total + weight * loss
        metrics = metrics or m
        metrics[f"dim{dim}/loss"] = loss
    return total, metrics


def _loss(objective, iq, p, iq_neg, i_cos, i_valid, same, n_same):
    logits = objective_logits(objective, iq, p, iq_neg, i_cos, i_valid)
    logits, counts = mask_false_negatives(objective, logits, same, n_same)
    metrics = dict(counts)
    for t in objective.sets:
        metrics.update(set_metrics(logits, t, objective.temperature))
    return jnp.mean(combine(objective, logits)), metrics
