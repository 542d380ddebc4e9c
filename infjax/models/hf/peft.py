"""LoRA adapters as a PEFT folder: `adapter_config.json` + `adapter_model.safetensors`.

`peft.PeftModel.from_pretrained(AutoModel.from_pretrained(base), folder)` loads it onto the bare Hugging
Face model (BertModel, ModernBertModel, LlamaModel, Qwen2Model: what sentence-transformers and infjax
encode with). PEFT names an adapter by the Linear module it adapts, under the `base_model.model.` prefix
of its wrapper: `base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r] (torch's
Linear layout: the transposes of infjax's A [in, r] and B [r, out]); its update is
`lora_alpha / r * B A x`, the same as infjax's. The HF module names come from the family's name map
(the Linear weights it maps), so no family is spelled out here.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from infjax.models import layers as L
from infjax.models.lora import LoraSpec

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def linear_modules(family, config) -> dict[tuple[str, ...], str]:
    """{Flax module path (unrolled): HF module name} of every Linear layer of the family's bare model."""
    return {path[:-1]: hf[:-len(".weight")] for hf, path, transpose in family.names.entries(config)
            if transpose and path[-1] == "kernel" and hf.endswith(".weight")}


def _adapted(tree: Mapping, path: tuple[str, ...] = ()):
    """(module path, A, B) of every adapter in an unrolled tree."""
    if "lora_a" in tree:
        yield path, np.asarray(tree["lora_a"], np.float32), np.asarray(tree["lora_b"], np.float32)
        return
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _adapted(value, path + (key,))


def tensors(adapters: Mapping, family, config) -> dict[str, np.ndarray]:
    """PEFT's tensors of one tower's adapters (unrolled or scanned tree, as trained)."""
    names = linear_modules(family, config)
    out = {}
    for path, a, b in _adapted(L.unstack_layers(adapters, family.names.scanned_from)):
        if path not in names:
            raise ValueError(f"adapter at {'/'.join(path)} adapts no Linear layer of the {family.name} name map")
        out[f"{PREFIX}{names[path]}.lora_A.weight"] = np.ascontiguousarray(a.T)
        out[f"{PREFIX}{names[path]}.lora_B.weight"] = np.ascontiguousarray(b.T)
    return out


def target_pattern(modules: list[str]) -> str:
    """A regex that PEFT full-matches against module names: exactly the adapted modules.

    Layer numbers are digits (so it names the bare model's modules and no others: on a *ForCausalLM model, whose modules
    carry a `model.` prefix, PEFT finds no target and says so, rather than loading nothing silently)."""
    shapes = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(m)) for m in modules})
    return "|".join(shapes) if len(shapes) == 1 else "(?:" + "|".join(shapes) + ")"


def adapter_config(spec: LoraSpec, modules: list[str], base: str) -> dict[str, Any]:
    """adapter_config.json for `spec` on `modules` (HF names) of the bare model `base`."""
    return {
        "peft_type": "LORA",
        "task_type": "FEATURE_EXTRACTION",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": target_pattern(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def modules_of(peft_tensors: Mapping[str, Any]) -> list[str]:
    """The HF module names a PEFT tensor dict adapts."""
    return sorted({k[len(PREFIX):].rsplit(".lora_", 1)[0] for k in peft_tensors})
