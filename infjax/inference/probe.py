"""A model's embeddings of a few fixed texts, checked before the model leaves infjax (an export).

Finite parameters do not make a working model: one update with a huge learning rate can leave every weight
finite and every embedding NaN (an overflow inside a layer norm or the attention). `check_outputs` embeds a few
fixed instruction-queries and passages, as the model's users will, and refuses a model that gives NaN or inf
for any of them, naming how many.
"""
from __future__ import annotations

import jax
import numpy as np

from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.errors import UserError
from infjax.models import interaction
from infjax.models.encoder import Encoder, passage_params, query_params

PAIRS = (("Find documents that give the numbers in degrees Celsius.", "boiling point of water at high altitude"),
         ("Only recipes without any dairy products are relevant.", "pancakes for breakfast"),
         ("", "hi"))
PASSAGES = ("Water boils at about 70 degrees Celsius on the summit of Mount Everest.",
            "Mix oat flour, oat milk and baking powder, then fry the batter in a little oil.",
            "hi")
PROBE_MAX_LEN = 64


class NonFiniteOutputs(UserError):
    """A model whose parameters are finite but whose embeddings are not: nothing should be exported from it."""


def _host_device():
    """The CPU device when there is one, else the default device.

    The parameters are on the host, and a large model may not fit one accelerator."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


def probe_embeddings(encoder: Encoder, params: dict, tokenizer: Tokenizer, fmt: TextFormat
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(query embeddings [len(PAIRS), d], passage embeddings [len(PASSAGES), d]) of the fixed texts.

    As the model is used: one text per query under Interaction I, the head over the instruction and the query
    under II."""
    with jax.default_device(_host_device()):
        qp, pp = query_params(params), passage_params(params)
        embed = jax.jit(encoder)
        passages = embed(pp, *tokenizer([fmt.passage(p) for p in PASSAGES], PROBE_MAX_LEN))
        if "interaction" in params:
            i_vec = embed(qp, *tokenizer([fmt.alone(i) for i, _ in PAIRS], PROBE_MAX_LEN))
            q_ids, q_mask = tokenizer([fmt.alone(q) for _, q in PAIRS], PROBE_MAX_LEN)
            iq = jax.jit(lambda p, head, i, ids, mask: interaction.iq_embeddings(
                head, i, encoder.hidden(p, ids, mask, max_segments=1), mask))
            queries = iq(qp, params["interaction"], i_vec, q_ids, q_mask)
        else:
            queries = embed(qp, *tokenizer([fmt.query(i, q) for i, q in PAIRS], PROBE_MAX_LEN))
        return np.asarray(queries), np.asarray(passages)


def check_outputs(encoder: Encoder, params: dict, tokenizer: Tokenizer, fmt: TextFormat, where: str) -> None:
    """Refuse a model whose embeddings of the fixed texts hold NaN or inf (NonFiniteOutputs naming the counts)."""
    queries, passages = probe_embeddings(encoder, params, tokenizer, fmt)
    bad_q = int((~np.isfinite(queries).all(axis=1)).sum())
    bad_p = int((~np.isfinite(passages).all(axis=1)).sum())
    if bad_q or bad_p:
        raise NonFiniteOutputs(
            f"{where}: the model embeds fixed test texts as NaN or inf ({bad_q} of {len(queries)} queries, {bad_p} "
            f"of {len(passages)} passages) although its parameters are finite: it is broken (an update too large "
            f"for float32?); export an earlier step with --step, or train again with a lower train.learning_rate")
