"""The evaluation a training run makes of its own parameters: before, every eval.every steps, and after.

`Evaluator` scores the current parameters on dataset specs (evaluation/tasks.py) on the run's mesh. The
synthetic split of eval.synthetic is one more spec ("synthetic", its keys from config.data.synthetic), so
in-training evaluation has one path for every dataset. Before and after training it gives eval.json's entries
(the synthetic split and the canaries); in the loop it scores eval.sets and the canaries, and a canary that
drops by more than eval.canary_margin is a warning.
"""
from __future__ import annotations

import logging
import time

from infjax.evaluation.canary import CanaryWatch, describe_drop
from infjax.evaluation.tasks import cut_to, evaluate_specs, recording, template_pairs
from infjax.inference.embedders import CrossAttentionQueryEmbedder, TextEmbedder
from infjax.models.encoder import passage_params, query_params

log = logging.getLogger("infjax.train")      # the lines of the training run

SYNTHETIC_SET = "synthetic"     # eval.synthetic: the run's own FollowIR-style split (config.data.synthetic)


class Evaluator:
    """Evaluation of the current parameters on dataset specs (infjax.evaluation.tasks), on the run's mesh.

    `specs`: eval.sets, scored in the loop; `canaries`: eval.canary, scored in the loop, before and after,
    each watched for a drop (one `CanaryWatch` over the whole run).
    """

    def __init__(self, config, encoder, setup, mesh, specs: list[str], canaries: list[str]):
        self.config, self.fmt, self.mesh = config, setup.fmt, mesh
        self.specs, self.canaries = list(specs), list(canaries)
        self.evaluated = list(dict.fromkeys([*specs, *canaries]))      # in the loop
        self.watch = CanaryWatch(config.eval.canary_margin)
        self.synthetic_defaults = config.data.synthetic.to_dict()
        self.dims = [int(d) for d in config.eval.get("dims", "").split(",") if d.strip()]   # metric@d per cut
        self.embedder = TextEmbedder(encoder, mesh, setup.tokenizer, config.eval.batch_size)
        self.pair_embedder = (CrossAttentionQueryEmbedder(encoder, mesh, setup.tokenizer, setup.fmt,
                                                          config.eval.batch_size)
                              if config.model.interaction == "cross_attention" else None)

    def __call__(self, state, specs: list[str]) -> dict[str, dict[str, float]]:
        qlen, plen = self.config.data.query_max_len, self.config.data.passage_max_len
        params = state.model_params
        qp, pp = query_params(params), passage_params(params)
        if self.pair_embedder is not None:           # Interaction II: instruction and query encoded apart
            pairs = lambda i, q: self.pair_embedder(params, i, q, qlen)   # noqa: E731
        else:
            pairs = template_pairs(lambda t: self.embedder(qp, t, qlen), self.fmt)
        passages = lambda t: self.embedder(pp, t, plen)    # noqa: E731
        if not self.dims:
            return evaluate_specs(specs, pairs, passages, self.fmt, synthetic_defaults=self.synthetic_defaults,
                                  mesh=self.mesh)
        memo: dict = {}                 # eval.dims: each metric also at each cut, from the same encoder calls
        scores = evaluate_specs(specs, *recording(pairs, passages, memo), self.fmt,
                                synthetic_defaults=self.synthetic_defaults, mesh=self.mesh)
        for d in self.dims:
            cut = evaluate_specs(specs, *cut_to(d, pairs, passages, memo), self.fmt,
                                 synthetic_defaults=self.synthetic_defaults, mesh=self.mesh)
            for spec, metrics in cut.items():
                scores[spec].update({f"{k}@{d}": v for k, v in metrics.items()})
        return scores

    # ---- in the loop

    def due(self, done: int, steps: int) -> bool:
        """Whether the loop evaluates after step `done`: at eval.every and at the last step."""
        every = self.config.eval.every
        return bool(self.evaluated) and (done == steps or bool(every and done % every == 0))

    def at_step(self, state, done: int, writer) -> tuple[dict, dict]:
        """Score eval.sets and the canaries after step `done`: logged, written; (every score, the canaries')."""
        t0 = time.perf_counter()
        scores = self(state, self.evaluated)
        log.info("eval at step %d (%.1f s): %s", done, time.perf_counter() - t0, "  ".join(
            f"{spec} {v['main']:.4f}" for spec, v in scores.items()))
        writer.write({"step": done, "eval": scores})
        canary = {c: scores[c] for c in self.canaries}
        check_canaries(self.watch, done, canary, writer)
        return scores, canary

    # ---- before and after training: eval.json

    def milestones(self) -> bool:
        """Whether the run evaluates before and after training (eval.synthetic or canaries)."""
        return bool(self.config.eval.synthetic or self.canaries)

    def synthetic(self, state) -> dict:
        """eval.json's entry: p-MRR (x100) and nDCG@5 on the synthetic split, and the step."""
        m = self(state, [SYNTHETIC_SET])[SYNTHETIC_SET]
        return {"p_mrr": m["p_mrr"], "ndcg@5": m["ndcg@5"], "step": int(state.step)}

    def milestone(self, state, writer, known: dict | None = None) -> dict:
        """eval.json's "before" / "after" entry: the synthetic split (eval.synthetic) and the canaries.

        `known`: canary scores already computed at this step (the loop's last evaluation), not recomputed.
        """
        out = self.synthetic(state) if self.config.eval.synthetic else {"step": int(state.step)}
        if self.canaries:
            scores = dict(known or {})
            missing = [c for c in self.canaries if c not in scores]
            if missing:
                scores.update(self(state, missing))
                check_canaries(self.watch, int(state.step), {c: scores[c] for c in missing}, writer)
            out["canary"] = {c: scores[c] for c in self.canaries}
        return out

    def before(self, state, start: int, writer) -> dict:
        """eval.json's "before" entry at step `start`: viewed (TensorBoard, W&B) and logged."""
        t0 = time.perf_counter()
        entry = self.milestone(state, writer)
        writer.view({"step": start, "eval": milestone_sets(entry)})
        log.info("eval before training (step %d, %.1f s): %s", start, time.perf_counter() - t0,
                 describe_milestone(entry))
        return entry

    def after(self, state, writer, known: dict, trained: bool) -> dict:
        """eval.json's "after" entry: viewed (what the loop's last evaluation did not write) and logged.

        `known`: the canary scores of the loop's last evaluation; `trained`: whether the loop ran a step (its
        last evaluation then wrote eval.sets and the canaries).
        """
        t0 = time.perf_counter()
        entry = self.milestone(state, writer, known=known)
        in_loop = set(self.specs) | set(self.canaries) if trained else set()
        writer.view({"step": int(state.step), "eval": {k: v for k, v in milestone_sets(entry).items()
                                                       if k not in in_loop}})
        log.info("eval after training (step %d, %.1f s): %s", int(state.step), time.perf_counter() - t0,
                 describe_milestone(entry))
        return entry


def check_canaries(watch: CanaryWatch, step: int, scores: dict, writer) -> None:
    """Log and write (metrics.jsonl) a warning for each canary that dropped by more than its margin."""
    for w in watch.update(step, scores):
        log.warning("%s", describe_drop(w))
        writer.write(w)


def describe_milestone(entry: dict) -> str:
    """An eval.json entry in one line: p-MRR, nDCG@5 and each canary's main metric."""
    parts = []
    if "p_mrr" in entry:
        parts.append(f"p-MRR {entry['p_mrr']:+.2f}  nDCG@5 {entry['ndcg@5']:.4f}")
    for spec, m in entry.get("canary", {}).items():
        parts.append(f"canary {spec} {m['main']:.4f}")
    return "  ".join(parts)


def milestone_sets(entry: dict) -> dict:
    """An eval.json entry as {set: metrics}: the synthetic split (p-MRR, nDCG@5) and the canaries."""
    synthetic = {SYNTHETIC_SET: {k: entry[k] for k in ("p_mrr", "ndcg@5")}} if "p_mrr" in entry else {}
    return {**synthetic, **entry.get("canary", {})}
