"""The anchor of `bench gradients --vs_torch`: the same loss's gradient through the Hugging Face model in torch.

The gradient is computed in float32 and under `torch.autocast(bfloat16)`, the paper's setup (Hugging Face Trainer
with `bf16=True`).

    grads = torch_gradients.gradients(folder, padding_side, batch, pooling, loss_fn, autocast=True)

`batch` is infjax's unpacked batch (`q_ids`/`q_mask`, `p_ids`/`p_mask`, `n_ids`/`n_mask`): the same token ids,
masks and (left-padded decoders) positions from 0 at each text's first token. The model computes the hidden
states (under autocast or not), pooled as infjax pools (mean, cls or last real token) and L2-normalized in
float32; the loss is infjax's own (`loss_fn(iq, p, iq_neg)`, JAX, float32), and its gradient with respect to the
embeddings is pushed back through the torch model. So the two sides differ only in how the backbone computes:
the loss is the same function, in float32, on both (under autocast the paper's own loss would run its
similarity product in bf16 as well: this anchor is the stricter one).

torch, transformers: imported when called (`pip install torch transformers`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def gradients(folder: str, padding_side: str, batch: dict, pooling: str, loss_fn: Callable,
              autocast: bool) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, {Hugging Face parameter name: float64 gradient}) of the model in `folder` on `batch`."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.train(False)

    def embed(ids, mask):
        ids, mask = torch.tensor(np.asarray(ids), dtype=torch.long), torch.tensor(np.asarray(mask), dtype=torch.long)
        kw = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)} if padding_side == "left" else {}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state
        hidden = hidden.float()
        if pooling == "last":
            index = mask.shape[1] - 1 - torch.argmax(mask.flip(1), dim=1)
            pooled = hidden[torch.arange(hidden.shape[0]), index]
        elif pooling == "cls":
            pooled = hidden[torch.arange(hidden.shape[0]), torch.argmax(mask, dim=1)]
        else:
            m = mask[..., None].float()
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)

    outs = [embed(batch["q_ids"], batch["q_mask"]), embed(batch["p_ids"], batch["p_mask"])]
    args = [jnp.asarray(x.detach().numpy()) for x in outs]
    if "n_ids" in batch:
        r, k, length = batch["n_ids"].shape
        outs.append(embed(np.reshape(batch["n_ids"], (r * k, length)), np.reshape(batch["n_mask"], (r * k, length))))
        args.append(jnp.asarray(outs[-1].detach().numpy()).reshape(r, k, -1))
    loss, vjp = jax.vjp(loss_fn, *args)
    cotangents = vjp(jnp.ones_like(loss))
    torch.autograd.backward(outs, [torch.tensor(np.asarray(c)).reshape(o.shape) for c, o in zip(cotangents, outs)])
    return float(loss), {name: p.grad.double().numpy() for name, p in model.named_parameters() if p.grad is not None}
