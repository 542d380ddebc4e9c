"""What a run is made of beside its data: objective, the batches told what the model decides, compiled step.

`infjax.train`, the benchmarks and the tests build a run through these
functions, so that a benchmark measures, and a test checks, exactly the step
that trains. The input pipeline itself is data/pipeline.py's; `make_batch_setup`
tells it what only the model and the mesh know.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import jax

from infjax import losses
from infjax.data import packing, pipeline
from infjax.data.pipeline import BatchSetup, TrainingData
from infjax.errors import ConfigError
from infjax.models import folder as folder_lib, remat as remat_lib
from infjax.models.encoder import Encoder
from infjax.runtime import distributed
from infjax.runtime import mesh as mesh_lib
from infjax.training import remat_choice, step as step_lib

log = logging.getLogger("infjax")


def make_objective(config, width: int | None = None) -> losses.Objective:
    """The paper's objective named by `config.objective` (or the reference code's reading of the name), with the
    recipes the loss keys turn on: false negatives left out, Matryoshka dims (docs/method.md §6). `width`: the
    model's embedding width, which no Matryoshka dim may exceed."""
    if config.loss.convention == "reference":
        base = losses.reference_objective(config.objective, config.loss.temperature)
    else:
        base = losses.Objective.from_name(config.objective, config.loss.temperature, config.loss.positive_once)
    dims, weights = losses.matryoshka(config.loss.matryoshka_dims, config.loss.matryoshka_weights)
    if dims and width is not None and dims[0] > width:
        raise ConfigError(f"config.loss.matryoshka_dims={config.loss.matryoshka_dims!r}: {dims[0]} is wider than "
                          f"the model's embeddings ({width}); give dims of at most {width}")
    margin = config.loss.false_negative_margin
    return dataclasses.replace(base, mask_duplicates=config.loss.mask_duplicates,
                               margin=None if margin is None else float(margin), dims=dims, dim_weights=weights)


def make_batch_setup(config, data: TrainingData, encoder: Encoder, model_path: str,
                     objective: losses.Objective, num_devices: int | None = None) -> BatchSetup:
    """The run's batches (data/pipeline.py), told what the model and the mesh decide about them.

    That is the encoder's padding side and, with data.packing, the batch shards of the mesh over
    `num_devices` (default: JAX's) and what the encoder's attention makes of packed rows (`attention_span`,
    `row_multiple`: every process is asked, so these are computed only where packing needs them).
    """
    folder_lib.check_lengths(model_path, {f"config.data.{key}": config.data[key]
                                          for key in ("query_max_len", "passage_max_len")}, ConfigError)
    packed, dropout = config.data.packing, config.model.dropout
    data_and_fsdp = mesh_lib.mesh_shape(config.mesh, num_devices or jax.device_count())[:2] if packed else (1, 1)
    layout = pipeline.BatchLayout(
        encoder.padding_side, jax.process_index(), jax.process_count(), shards=math.prod(data_and_fsdp),
        attention_span=attention_span(encoder, dropout) if packed else packing.ATTENTION_SPAN,
        row_multiple=row_multiple(encoder, dropout) if packed else packing.LENGTH_STEP)
    return pipeline.make_batch_setup(config, data, model_path, layout, objective.needs_instruction_negatives)


def attention_span(encoder: Encoder, dropout: bool) -> float:
    """`packing.row_cost`'s span for this encoder: infinite where its attention costs per text, else ATTENTION_SPAN.

    Attention costs per text with the CPU kernel. Every process must agree, since the shapes must: one whose
    attention would cover whole rows (e.g. no compiler for the kernel) makes all of them cost whole rows."""
    whole_row = distributed.max_over_processes(int(not encoder.attention_costs_per_text(dropout)))
    return packing.ATTENTION_SPAN if whole_row else math.inf


def row_multiple(encoder: Encoder, dropout: bool) -> int:
    """What packed row lengths are a multiple of, the largest over the processes.

    packing.LENGTH_STEP, or what the encoder's attention kernel needs (TPU splash: 128)."""
    return distributed.max_over_processes(encoder.attention_row_multiple(dropout) or packing.LENGTH_STEP)


def compiled_train_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding, example=None,
                        memory_device=None):
    """The jitted train step (explicit shardings, donated state), with gradient caching per config.

    The encoder's activations keep their rows split over the batch axes layer by layer (see
    `layers.run_layers`), so fsdp gathers kernels rather than every device encoding every row.

    With `model.remat=auto`, `example` (the state and the widest batch, arrays or ShapeDtypeStructs with their
    shardings) is compiled under each policy until one fits the memory of `memory_device` (default: the mesh's
    first device), training/remat_choice.py; the choice is logged in one line and its compiled program kept."""
    if remat_lib.normalize(config.model.remat) != "auto":       # offload where it cannot: full, one warning
        policy = remat_lib.effective(encoder.remat)
        encoder = encoder if policy == encoder.remat else encoder.with_remat(policy)
        return jitted_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding)
    if example is None:
        raise ValueError("model.remat=auto needs the step's example inputs to choose a policy")

    def compile_policy(policy: str) -> remat_choice.Tried:
        step = jitted_step(config, encoder.with_remat(policy), objective, optimizer, schedule, mesh, state_sharding)
        t0 = time.perf_counter()
        try:
            compiled = step.lower(*example).compile()
        except Exception as err:     # noqa: BLE001 - a compiler refusing the memory (TPU) is an answer
            line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if "exceed" not in line.lower() and "memory" not in line.lower():
                raise
            log.info("remat auto: %s refused by the compiler: %s", policy, line[:200])
            return remat_choice.Tried(policy, None, line, step)
        peak = peak_bytes(compiled)
        log.info("remat auto: %s compiled in %.0f s, peak %.2f GB per device", policy, time.perf_counter() - t0,
                 peak / 1e9)
        return remat_choice.Tried(policy, peak, None, step, compiled)

    device = memory_device if memory_device is not None else mesh.devices.flat[0]
    choice = remat_choice.choose(compile_policy, remat_choice.capacity(config.model.remat_memory_gb, device))
    log.info(choice.line)
    chosen = choice.chosen
    return remat_choice.Precompiled(chosen.step, chosen.compiled, example[1], choice.policy, choice.line)


def peak_bytes(compiled) -> int:
    """A compiled program's peak memory per device.

    Arguments, temporaries and outputs, less what outputs reuse of the (donated) arguments."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def abstract_global_batch(local: dict, mesh) -> dict:
    """This process's slice of a batch as the global batch's ShapeDtypeStructs.

    The rows of every process, split over the mesh's batch axes: what `mesh_lib.global_batch` would make of
    it."""
    sharding = mesh_lib.batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] * jax.process_count(),) + tuple(x.shape[1:]),
                                                       x.dtype, sharding=sharding), local)


def jitted_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding):
    """The jitted train step of `encoder` as it is (its remat policy included)."""
    encoder = encoder.with_activation_sharding(mesh_lib.batch_sharding(mesh))
    # A dropout key goes to the encoder when the backbone's dropout or LoRA's applies; the backbone's own
    # dropout layers follow model.dropout either way.
    encoder = dataclasses.replace(encoder, backbone_dropout=bool(config.model.dropout))
    dropout = bool(config.model.dropout) or bool(encoder.lora and encoder.lora.dropout > 0)
    return step_lib.jit_train_step(
        step_lib.make_train_step(encoder, objective, optimizer, schedule, dropout,
                                 config.train.chunk_size, mesh), mesh, state_sharding)
