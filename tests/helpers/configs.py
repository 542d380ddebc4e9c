"""Small run configs shared by the tests, and dotted-key overrides of a config."""
from infjax import config as config_lib


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
    test_export exports and test_mteb scores."""
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


def run_parts(config):
    """(encoder, params, batch builder, objective) of `config`'s run, unsharded: texts padded to the config's
    lengths, no packing; `build(step)` is the global batch of a step."""
    from infjax import losses
    from infjax.data import batches
    from infjax.data.tokenize import TextFormat, Tokenizer
    from infjax.models.encoder import load_encoder
    from infjax.training import setup as setup_lib

    encoder, params, path = load_encoder(config.model)
    records = setup_lib.load_training_records(config.data)
    plan = batches.BatchPlan(len(records), config.train.batch_size, config.train.seed)
    sampler = batches.InstructionNegativeSampler(records, config.loss.instruction_negatives, config.train.seed)
    build = batches.BatchBuilder(records, plan, Tokenizer(path), TextFormat(), config.data.query_max_len,
                                 config.data.passage_max_len, config.data.hard_negatives, sampler)
    return encoder, params, build, losses.Objective.from_name(config.objective, config.loss.temperature)
