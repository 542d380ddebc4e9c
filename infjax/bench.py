"""Benchmarks that print figures: `python -m infjax.bench NAME [flags]`.

Each NAME is a module infjax/benchmarks/<name with - as _>.py with a
`main(argv: list[str]) -> None`. Speed targets live here, not in tests.
"""
from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import sys

if __name__ == "__main__":   # glibc reads its tunables once, at start: restart before the heavy imports
    from infjax.runtime.cpu import restart_with_huge_pages
    restart_with_huge_pages()

import infjax.benchmarks
from infjax import cli, errors
from infjax.runtime import platform, targets


PROG = "python -m infjax.bench"


CHILDREN = {"restore-run", "torch-loop"}     # modules of infjax/benchmarks that benchmarks run in a child process


def _module(name: str) -> ast.Module:
    """A benchmark module's syntax tree, read without importing it (some import torch)."""
    path = os.path.join(os.path.dirname(infjax.benchmarks.__file__), name.replace("-", "_") + ".py")
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def available() -> list[str]:
    """The modules of infjax/benchmarks with a `main` (the others are their shared parts)."""
    return sorted(name for m in pkgutil.iter_modules(infjax.benchmarks.__path__)
                  if (name := m.name.replace("_", "-")) not in CHILDREN
                  and any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in _module(name).body))


def summary(name: str) -> str:
    """The first line of a benchmark's docstring."""
    return (ast.get_docstring(_module(name)) or "").split("\n", 1)[0]


def usage() -> str:
    return "\n".join([f"usage: {PROG} NAME [flags]   ({PROG} NAME --help lists the flags of NAME, with defaults)",
                      "", "benchmarks:", *(f"  {n}: {summary(n)}" for n in available())])


def main(argv: list[str]) -> int:
    names = available()
    if len(argv) < 1 or argv[0] in cli.HELP:
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in names:
        print(f"{PROG}: error: unknown benchmark {argv[0]!r}; choose one of {names}", file=sys.stderr)
        return 2
    if argv[0] == "compile":        # before JAX starts (importing the benchmark starts it): see the function
        targets.compile_only_process()
    platform.choose()               # before JAX starts its backends too
    try:
        importlib.import_module(f"infjax.benchmarks.{argv[0].replace('-', '_')}").main(argv[1:])
    except (Exception, KeyboardInterrupt) as e:    # noqa: BLE001 - report() re-raises what is a bug
        code = errors.report(f"infjax.bench {argv[0]}", e)
        if code is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
