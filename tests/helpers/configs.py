"""Small run configs shared by the tests, and dotted-key overrides of a config."""
from infjax import config as config_lib
from infjax.data import pipeline
from infjax.runtime import mesh as mesh_lib


def minilm_config(objective="multi_pi", **overrides):
    """The trainer tests' run on the embedded MiniLM (real weights) and 48 synthetic records, 6 steps: for tests
    that claim learning or parity with real weights."""
    c = config_lib.base_config(objective)
    c.data.synthetic.num_train = 48
    c.data.synthetic.num_eval_queries = 6
    c.data.query_max_len = 48
    c.data.passage_max_len = 48
    c.loss.instruction_negatives = 2
    c.train.batch_size = 8          # 24 rows: 3 per fake device
    c.train.steps = 6
    c.train.learning_rate = 1e-4
    c.log_every = 2
    c.checkpoint.every = 3
    c.eval.batch_size = 32
    c.eval.canary = ""              # the canaries have their own tests (evaluation/test_canary.py)
    return config_lib.override(c, overrides)


def tiny_config(objective="multi_pi", **overrides):
    """`minilm_config`'s run on the tiny random BERT (tests/helpers/tiny.py): for the tests that prove
    mechanics (resume, restores, several processes, packing, sharding, writers, refusals), where two runs of
    the same model are compared or a path must work, and learning is not the claim."""
    from tests.helpers.tiny import tiny_bert_path

    return minilm_config(objective, **{"model.checkpoint": tiny_bert_path(), **overrides})


small_config = tiny_config


EXPORT_MAX_LEN = 48


def small_export_config(**overrides):
    """The embedded default's run (synthetic data) on the tiny random BERT, cut to 3 steps: the run that
    test_export exports and test_mteb_adapter scores."""
    from tests.helpers.tiny import tiny_bert_path

    c = config_lib.base_config("multi_pi")
    c.model.checkpoint = tiny_bert_path()
    c.data.synthetic.num_train = 24
    c.data.synthetic.num_eval_queries = 6
    c.data.query_max_len = EXPORT_MAX_LEN
    c.data.passage_max_len = EXPORT_MAX_LEN
    c.loss.instruction_negatives = 2
    c.train.batch_size = 8
    c.train.steps = 3
    c.train.learning_rate = 1e-3       # large enough that the exported weights differ visibly from the base
    c.log_every = 3
    c.checkpoint.every = 3
    c.eval.synthetic = False
    c.eval.canary = ""
    return config_lib.override(c, overrides)


def changed(config, **overrides):
    """A copy of `config` with dotted-key overrides ("train.steps": 5)."""
    return config_lib.override(config.copy_and_resolve_references(), overrides)


def padded_builder(config, path: str, query_max_len: int | None = None, passage_max_len: int | None = None,
                   negatives: int | None = None, interaction: str | None = None):
    """The unsharded batch builder of `config`'s data, made by the run's pipeline (data/pipeline.py).

    Texts padded to the lengths given, else the config's; no packing; `build(step)` is the global batch of a
    step, with K=`negatives` instruction negatives (default the config's; none under Interaction II)."""
    from infjax.data import pipeline

    k = config.loss.instruction_negatives if negatives is None else negatives
    c = changed(config, **{"data.query_max_len": query_max_len or config.data.query_max_len,
                           "data.passage_max_len": passage_max_len or config.data.passage_max_len,
                           "model.interaction": interaction or config.model.interaction,
                           "loss.instruction_negatives": k, "data.packing": False})
    data = pipeline.open_training_data(c, path)
    return pipeline.make_batch_setup(c, data, path, pipeline.BatchLayout(), instruction_negatives=True).build


def run_parts(config):
    """(encoder, params, batch builder, objective) of `config`'s run, unsharded: texts padded to the config's
    lengths, no packing; `build(step)` is the global batch of a step."""
    from infjax import losses
    from infjax.models.encoder import load_encoder

    encoder, params, path = load_encoder(config.model)
    build = padded_builder(config, path)
    return encoder, params, build, losses.Objective.from_name(config.objective, config.loss.temperature)


def load_training_records(data_config, model_path: str | None = None) -> list[dict]:
    """The training records of `data_config` (config.data, or some of its keys: the others take their defaults)
    as text, clean, checked and with duplicates dropped as training reads them with the tokenizer of
    `model_path` (default: the embedded MiniLM's)."""
    from infjax.models.hf.files import embedded_minilm_path

    config = config_lib.base_config("multi_pi")
    config.data.update(data_config.to_dict() if hasattr(data_config, "to_dict") else dict(data_config))
    return list(pipeline.open_training_data(config, model_path or embedded_minilm_path()).records)


def read_split(source, split: str, *, field_map=None, limit: int | None = None, on_bad_row: str = "error",
               dedupe: bool = True, model_path: str | None = None) -> list[dict]:
    """The clean records of one split of `source` as training reads them, without the token cache.

    Opened by `inf_ir.open_split` (its field map, limit and checks), then cleaned, checked and tokenized by the
    token store's pass (the bad-row rules, the negatives with their positive's token ids for the tokenizer of
    `model_path`, default the embedded MiniLM's; duplicates dropped unless not `dedupe`), read back as
    training reads the texts."""
    import numpy as np

    from infjax.data import inf_ir, token_store
    from infjax.models.hf.files import embedded_minilm_path

    sources = [(split, *inf_ir.open_split(str(source), split, field_map=field_map, limit=limit))]
    store = token_store.of_splits(sources, model_path or embedded_minilm_path(), token_store.Encoding(64, 64),
                                  token_store.Reading(on_bad_row, dedupe))
    return list(inf_ir.SourceRecords(lambda: sources, np.asarray(store.source)[np.asarray(store.kept)]))


def _mesh(data, fsdp, tensor=1):
    return mesh_lib.make_mesh(config_lib.override(small_config(), {
        "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}).mesh)
