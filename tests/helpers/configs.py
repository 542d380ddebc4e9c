"""Small run configs shared by the tests, and dotted-key overrides of a config."""
from infjax import config as config_lib


def small_config(objective="multi_pi", **overrides):
    """The trainer tests' run (from test_train): the embedded MiniLM on 48 synthetic records, 6 steps."""
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


EXPORT_MAX_LEN = 48


def small_export_config(**overrides):
    """The embedded default (MiniLM, synthetic data), cut to a few seconds of training.

    The run that test_export exports and test_mteb scores (from test_export, where it was `small_config`)."""
    c = config_lib.base_config("multi_pi")
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
    """(encoder, params, batch builder, objective) of `config`'s run, unsharded: texts padded to 48
    tokens, no packing; `build(step)` is the global batch of a step."""
    from infjax import losses
    from infjax.data import batches
    from infjax.data.tokenize import TextFormat, Tokenizer
    from infjax.models.encoder import load_encoder
    from infjax.training import setup as setup_lib

    encoder, params, path = load_encoder(config.model)
    records = setup_lib.load_training_records(config.data)
    plan = batches.BatchPlan(len(records), config.train.batch_size, config.train.seed)
    sampler = batches.InstructionNegativeSampler(records, config.loss.instruction_negatives, config.train.seed)
    build = batches.BatchBuilder(records, plan, Tokenizer(path), TextFormat(), 48, 48, True, sampler)
    return encoder, params, build, losses.Objective.from_name(config.objective)
