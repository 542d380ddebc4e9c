"""Loss + gradient time and memory over the global batch: `python -m infjax.bench loss`.

For each (R rows, d dims) the objective's value and gradient with respect to
the embeddings (iq [R, d], p [R, d], instruction negatives [R, K, d]) is
jitted, warmed up, and timed; each size runs in its own process so that the
reported peak resident memory belongs to that size alone. XLA's own figure
(arguments + outputs + temporaries of the compiled computation) is printed too.
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from absl import flags

from infjax import cli


def measure(rows: int, dim: int, k: int, objective: str, reps: int) -> dict:
    # The benchmark's parent process only spawns one child per size; JAX is imported in the child
    # alone, so that each size's peak resident memory is its own.
    import jax  # noqa: I001 (lazy on purpose, see above)
    import jax.numpy as jnp
    import numpy as np

    from infjax import losses  # lazy on purpose: the parent process never imports JAX
    from infjax.runtime import platform  # lazy on purpose, likewise

    obj = losses.Objective.from_name(objective)
    rng = np.random.default_rng(0)

    def unit(*shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True))

    iq, p, neg = unit(rows, dim), unit(rows, dim), unit(rows, k, dim)
    fn = jax.jit(jax.value_and_grad(lambda a, b, c: losses.contrastive_loss(obj, a, b, c)[0], argnums=(0, 1, 2)))
    compiled = fn.lower(iq, p, neg).compile()
    mem = compiled.memory_analysis()
    xla_bytes = None
    if mem is not None:
        xla_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    jax.block_until_ready(compiled(iq, p, neg))                 # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(iq, p, neg))
        times.append(time.perf_counter() - t0)
    return {"rows": rows, "dim": dim, "k": k, "objective": objective, "seconds": statistics.median(times),
            "xla_bytes": xla_bytes, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "device": platform.name()}


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("rows", "96,768,3072,12288", "comma-separated R (rows of the global batch)", flag_values=fv)
    flags.DEFINE_string("dims", "384,1536", "comma-separated embedding sizes d", flag_values=fv)
    flags.DEFINE_integer("k", 5, "instruction negatives per row", flag_values=fv)
    flags.DEFINE_string("objective", "multi_piiq", "objective name (the default uses all three sets)", flag_values=fv)
    flags.DEFINE_integer("reps", 3, "timed repetitions (median reported)", flag_values=fv)
    flags.DEFINE_bool("one", False, "measure the first size in this process (how the table's children run)",
                      flag_values=fv)


def main(argv: list[str]) -> None:
    args = cli.parse("python -m infjax.bench loss", define_flags, argv, doc=__doc__.splitlines()[0])
    rows = [int(x) for x in args.rows.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    if args.one:
        print(json.dumps(measure(rows[0], dims[0], args.k, args.objective, args.reps)))
        return
    print(f"objective {args.objective}, K={args.k}, loss + gradient w.r.t. iq, p and instruction negatives")
    print(f"{'R':>7} {'d':>6} {'ms/step':>10} {'XLA MiB':>9} {'peak RSS MiB':>13}")
    for d in dims:
        for r in rows:
            cmd = [sys.executable, "-m", "infjax.benchmarks.loss", "--one", f"--rows={r}", f"--dims={d}",
                   f"--k={args.k}", f"--objective={args.objective}", f"--reps={args.reps}"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{r:>7} {d:>6}  failed: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
                continue
            m = json.loads(out.stdout.strip().splitlines()[-1])
            xla = f"{m['xla_bytes'] / 2**20:9.0f}" if m["xla_bytes"] is not None else f"{'n/a':>9}"
            print(f"{r:>7} {d:>6} {m['seconds'] * 1e3:10.1f} {xla} {m['peak_rss_bytes'] / 2**20:13.0f}", flush=True)
    print(f"device: {m['device'] if rows and dims else '?'}")


if __name__ == "__main__":
    main(sys.argv[1:])
