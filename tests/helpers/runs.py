"""Training runs' files for the tests: records written as jsonl, the training data's fingerprint as a run computes
it, and a copy of a run with a poisoned checkpoint."""
import json
import shutil

import jax
import numpy as np

from infjax.runtime import checkpoint, mesh as mesh_lib
from infjax.runtime.restore import load_run
from infjax.training import state as state_lib


def write_records(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def data_fingerprint(records):
    """The training data's fingerprint (record count, content hash) as a run computes it, of in-memory records."""
    from infjax.data import token_store
    from tests.helpers.tiny import tiny_bert_path

    return token_store.in_memory(records, tiny_bert_path(), token_store.Encoding(48, 48)).fingerprint


def _poisoned_copy(workdir, tmp_path, leaf=3, value=np.nan):
    """A copy of `workdir` with one more checkpoint whose parameters hold `value` (a NaN: as a broken run would)
    at one place of parameter number `leaf`, or (`leaf` None) everywhere in its embedding layer norm's scale."""
    copy = str(tmp_path / "poisoned")
    shutil.copytree(workdir, copy)
    run = load_run(copy)
    optimizer, _ = state_lib.make_optimizer(run.config.train, total_steps=1)
    abstract = state_lib.abstract_state(run.params, optimizer)
    abstract = checkpoint.abstract_like(abstract, state_lib.state_shardings(abstract, run.encoder.module,
                                                                             mesh_lib.default_mesh()))
    ckpts = checkpoint.Checkpoints(copy)
    state, position = ckpts.restore(run.step, abstract)
    leaves, treedef = jax.tree.flatten(jax.device_get(state.params))
    if leaf is None:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
        leaf = paths.index("['shared']['embeddings']['LayerNorm']['scale']")
        leaves[leaf] = np.full_like(leaves[leaf], value)
    else:
        leaves[leaf] = np.array(leaves[leaf])
        leaves[leaf].reshape(-1)[5] = value
    ckpts.save(run.step + 1, state.replace(params=jax.tree.unflatten(treedef, leaves)), position,
               ckpts.saved_config(run.step))
    ckpts.close()
    return copy
