"""The command line of every entry point: absl flags, one `--help` format, one error line.

Each entry point defines its flags into a `flags.FlagValues` of its own (nothing global, so a test or a
benchmark can parse several command lines in one process) and calls `parse`:

- `-h` / `--help` prints the usage line, the entry point's description and every flag with its default,
  and exits 0;
- a bad flag (unknown, wrong type, not one of the choices, missing when required, or a stray argument)
  prints one line `PROG: error: ...` naming it on stderr and exits 2;
- `--name=value` and `--name value` both work; a boolean is `--name` / `--noname` / `--name=false`.

This module imports nothing of infjax but `errors`.
"""
from __future__ import annotations

import contextvars
import os
import re
import sys
import textwrap
from typing import Callable, Iterable

from absl import flags
from ml_collections import config_flags

from infjax import errors

HELP = ("-h", "--help", "-help", "--helpfull", "--helpshort")
_ABSL_OWN = {"flagfile", "undefok"}       # absl defines these in every FlagValues; not infjax's flags


def own_flags(fv: flags.FlagValues) -> list[flags.Flag]:
    """The flags an entry point defined in `fv`, in the order it defined them."""
    seen, out = set(), []
    for name in fv:
        f = fv[name]
        if f.name in _ABSL_OWN or f.name in seen:
            continue
        seen.add(f.name)
        out.append(f)
    return out


def _default(f: flags.Flag, required: Iterable[str]) -> str:
    if f.name in required:
        return "required"
    if f.default is None:
        return "none"
    if isinstance(f.default, bool):
        return "true" if f.default else "false"
    if isinstance(f.default, list):
        return "[]" if not f.default else ",".join(map(str, f.default))
    return repr(f.default) if isinstance(f.default, str) else str(f.default)


def help_text(prog: str, fv: flags.FlagValues, doc: str = "", required: Iterable[str] = ()) -> str:
    """Usage, description and every flag (`--name=<choices>: help` and its default), as `--help` prints it."""
    required = tuple(required)
    lines = ["usage: " + " ".join([prog, *(f"--{r}=..." for r in required), "[flags]"])]
    if doc.strip():
        lines += ["", doc.strip()]
    lines += ["", "flags:"]
    for f in own_flags(fv):
        name = f"--[no]{f.name}" if f.boolean else f"--{f.name}"
        values = getattr(f.parser, "enum_values", None)
        if values:
            name += "=<" + "|".join(values) + ">"
        elif isinstance(f, flags.MultiFlag):
            name += " (repeatable)"
        text = " ".join((f.help or "").split())
        if values and text.startswith("<"):                     # absl's enum help starts with the choices
            text = text.split(": ", 1)[-1]
        text = text.removesuffix(";\n").split(";\nrepeat this option", 1)[0].split("; repeat this option", 1)[0]
        if not (f.default is None and "default" in text and f.name not in required):
            text += f" (default: {_default(f, required)})"
        lines += textwrap.wrap(f"{name}: {text}", 110, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def setup_logging(quiet: Iterable[str] = ("absl", "jax", "httpx"), replace: bool = True) -> None:
    """One log format for every entry point: infjax's INFO lines, and warnings and errors of the `quiet` libraries.

    `quiet` names the libraries whose warnings and errors only are logged. `replace` drops any handler a library
    installed on the root logger at import (absl's, through Orbax); an entry point called as a function inside another
    program (a test) leaves that program's."""
    import logging
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, force=replace)
    logging.getLogger("infjax").setLevel(logging.INFO)
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)


def fail(prog: str, message: str) -> None:
    """One line on stderr, exit status 2 (bad input)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _flag_error(error: flags.Error) -> str:
    first = str(error).strip().split("\n", 1)[0].rstrip(":")
    inner = error.__cause__ or error.__context__
    if inner is not None and str(inner) and str(inner) not in first:
        first += f": {inner}"
    return first


def given_empty(fv: flags.FlagValues, may_be_empty: Iterable[str] = ()) -> list[str]:
    """The string flags given on the command line as empty (`--workdir=`, `--out="$UNSET"`) whose default is not.

    For flags whose default is not empty, empty is not "not given" but a value that names nothing (a run would go to
    the default folder, an output nowhere). `may_be_empty`: flags where empty means something (a prefix). A config key
    (`--config.eval.canary=`) is the config's to validate: there empty may mean "off"."""
    return [f.name for f in own_flags(fv) if f.present and f.value == "" and f.flag_type() == "string"
            and f.default != "" and f.name not in may_be_empty and "." not in f.name]   # --config.KEY: validated


def parse(prog: str, define: Callable[[flags.FlagValues], None], argv: Iterable[str], *, doc: str = "",
          required: Iterable[str] = (), after: Callable[[flags.FlagValues], None] | None = None,
          catch: tuple[type[BaseException], ...] = (),
          message: Callable[[BaseException, list[str]], str] | None = None,
          may_be_empty: Iterable[str] = ()) -> flags.FlagValues:
    """Parse `argv` (without the program name) into a new FlagValues defined by `define(fv)`.

    `after(fv)` runs once the flags are parsed (e.g. loading a config file); the errors it raises that are in
    `catch` (and every flags.Error and errors.UserError) become the one error line, worded by
    `message(error, argv)` when given. A string flag given empty is refused (`given_empty`).
    """
    argv = [str(a) for a in argv]
    required = tuple(required)
    fv = flags.FlagValues()
    token = _PARSING.set([prog, *argv])
    try:
        define(fv)
    finally:
        _PARSING.reset(token)
    options = argv[: argv.index("--")] if "--" in argv else argv
    if any(a in HELP for a in options):
        print(help_text(prog, fv, doc, required))
        raise SystemExit(0)
    if errors.current_folder_gone():
        fail(prog, errors.current_folder_gone())
    if "config" in fv and repeated_config(options):
        fail(prog, repeated_config(options))
    try:
        rest = fv([prog, *argv])
        if len(rest) > 1:
            raise errors.UserError(f"unexpected argument(s) {rest[1:]}: every option is a --flag (see --help)")
        empty = given_empty(fv, may_be_empty)
        if empty:                    # the flag's own error, whatever `message` makes of the others
            fail(prog, ", ".join(f"--{e}" for e in empty) + (" is" if len(empty) == 1 else " are")
                 + " given empty (an unset shell variable?): give a value, or leave the flag out for its default")
        missing = [r for r in required if fv[r].value is None]
        if missing:
            raise errors.UserError(", ".join(f"--{r}" for r in missing)
                                   + (" is" if len(missing) == 1 else " are") + " required (see --help)")
        if after is not None:
            after(fv)
    except (flags.Error, errors.UserError, *catch) as e:
        if message is not None:
            fail(prog, message(e, argv))
        fail(prog, _flag_error(e) if isinstance(e, flags.Error) else str(e))
    return fv


# ---------------------------------------------------------------------------------------- --config files

# What loading a config file and its --config.a.b overrides can raise (besides flags.Error and UserError).
CONFIG_ERRORS = (AttributeError, KeyError, ValueError, TypeError, OSError, SyntaxError)


_PARSING: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("infjax_cli_argv", default=None)


def repeated_config(argv: list[str]) -> str | None:
    """The error line for a command line with more than one `--config` file (ml_collections would silently
    take the later file, or fail on its overrides with "defined twice", naming neither), else None."""
    given = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            given.append(arg.split("=", 1)[1])
        elif arg == "--config" and i + 1 < len(argv):
            given.append(argv[i + 1])
    if len(given) < 2:
        return None
    return (f"--config is given {len(given)} times ({', '.join(given)}): give one config file and change its keys "
            f"with --config.KEY=VALUE")


def define_config(fv: flags.FlagValues, help: str, lock_config: bool = True) -> None:
    """`--config=FILE[:arg]` and its `--config.a.b=value` overrides. ml_collections finds the override flags in
    the command line at definition time: inside `parse`, that is the command line being parsed (not sys.argv)."""
    config_flags.DEFINE_config_file("config", None, help, flag_values=fv, lock_config=lock_config,
                                    sys_argv=_PARSING.get())


def load_config(fv: flags.FlagValues) -> None:
    """Load the `--config` file now (absl loads it at first use), so that its errors are flag errors."""
    fv.config.objective      # noqa: B018


def config_flag_error(error: BaseException, argv: list[str]) -> str:
    """The message of an error parsing flags that include an ml_collections `--config` file (argv without the
    program name), naming the flag, the config file or the config key."""
    given = [a for a in argv if a.startswith("--config=")]
    config_arg = given[-1].split("=", 1)[1] if given else ""
    config_file = config_arg.split(":", 1)[0]
    if config_file and not os.path.isfile(config_file):
        return f"--config={config_arg}: no such config file ({os.path.abspath(config_file)})"
    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for e in reversed(chain):                # infjax's own innermost error (e.g. an unknown preset) says it best
        if isinstance(e, errors.UserError):
            return f"--config={config_arg}: {e}" if config_arg else str(e)
    text = str(error).strip("'\"").replace("\\'", "'").replace("\\n", "\n")
    missing = re.match(r"'?([^'\n]+)'?\n?(Did you mean \"([^\"]+)\")?", text)
    if isinstance(error, (AttributeError, KeyError)) and missing:
        key, hint = missing.group(1), missing.group(3)
        flag = next((a.split("=", 1)[0] for a in argv if a.startswith("--config.")
                     and key in a.split("=", 1)[0].split(".")), f"--config.{key}")
        return f"{flag}: no such config key" + (f" (did you mean {hint!r}?)" if hint else "")
    if isinstance(error, SyntaxError):
        return f"--config={config_arg}: {error.msg} ({error.filename}, line {error.lineno})"
    if isinstance(error, flags.Error):
        first = str(error).split("\n", 1)[0].rstrip(":")
        inner = chain[-1] if len(chain) > 1 else None
        return first + (f": {type(inner).__name__}: {inner}" if inner is not None and str(inner) not in first
                        else "")
    return f"{type(error).__name__}: {error}"
