"""Benchmarks that print figures: `python -m infjax.bench NAME [flags]`.

Each NAME is a module infjax/benchmarks/<name with - as _>.py with a
`main(argv: list[str]) -> None`. Speed targets live here, not in tests.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

if __name__ == "__main__":   # glibc reads its tunables once, at start: restart before the heavy imports
    from infjax.runtime.cpu import restart_with_huge_pages
    restart_with_huge_pages()

import infjax.benchmarks
from infjax import errors


def available() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(infjax.benchmarks.__path__))


def main(argv: list[str]) -> int:
    names = available()
    if len(argv) < 1 or argv[0] in ("-h", "--help"):
        print(f"usage: python -m infjax.bench NAME [flags]; NAME in {names}")
        return 0 if argv else 2
    if argv[0] not in names:
        print(f"unknown benchmark {argv[0]!r}; available: {names}", file=sys.stderr)
        return 2
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
