"""Restore a run's model onto the default mesh, as `infjax.evaluate --model=WORKDIR` does.

`python -m infjax.benchmarks.restore_run WORKDIR`: a child of `infjax.bench export`, which measures its memory.
"""
import sys

from infjax.runtime.restore import load_run


def main(argv: list[str]) -> None:
    run = load_run(argv[0])
    print(f"restored step {run.step} of {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
