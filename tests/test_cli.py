"""Every entry point speaks absl flags through infjax.cli: `--help` lists every flag with its default, a bad flag
is one line and exit 2, and every command line written in the README and docs/ still parses; the refusals that
every entry point makes alike (config files, flags given empty, the attention switch, an --out that cannot be
written), each in one line."""
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest
from absl import flags

from infjax import cli, evaluate, export, train
from tests.helpers.paths import ROOT

# entry point -> (module, prog, required flags); bench NAME is benchmarks/<name>.py
ENTRY_POINTS = {
    "train": ("infjax.train", ("config",)),
    "evaluate": ("infjax.evaluate", ("model", "dataset")),
    "export": ("infjax.export", ("workdir", "out")),
    "curate": ("infjax.curate", ("input", "out")),
    **{f"bench {n}": (f"infjax.benchmarks.{n.replace('-', '_')}",
                      {"train": ("config",), "compile": ("config", "target"), "gradients": ("config",)}.get(n, ()))
       for n in ("accelerator", "checkpoint", "compile", "encode", "encode-corpus", "export", "generate", "gradients",
                 "loss", "pipeline", "train")},
}


def _define(name):
    return importlib.import_module(ENTRY_POINTS[name][0]).define_flags


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_help_lists_every_flag_with_its_default(name, capsys):
    define, required = _define(name), ENTRY_POINTS[name][1]
    with pytest.raises(SystemExit) as e:
        cli.parse(f"python -m infjax.{name}", define, ["--help"], required=required)
    assert e.value.code == 0
    out = capsys.readouterr().out
    fv = flags.FlagValues()
    define(fv)
    names = [f.name for f in cli.own_flags(fv)]
    assert names, name
    entries = re.split(r"\n  --", out.split("\nflags:\n", 1)[1])
    assert len(entries) == len(names)
    for flag, entry in zip(names, entries):
        entry = " ".join(entry.split())
        assert re.match(rf"(\[no\])?{flag}\b", entry.lstrip("- ")), (flag, entry)
        assert "default" in entry, (name, flag, entry)                  # stated, or "(default: ...)"
        if flag in required:
            assert entry.endswith("(default: required)"), entry


def _define_demo(fv):
    flags.DEFINE_integer("step", None, "a step", flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace", flag_values=fv)
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dtype", flag_values=fv)
    flags.DEFINE_multi_string("tree", [], "trees", flag_values=fv)
    flags.DEFINE_string("out", None, "where", flag_values=fv)


def test_both_spellings_of_a_value_and_of_a_boolean():
    fv = cli.parse("p", _define_demo, ["--step", "300", "--overwrite", "--tree", "a", "--tree=b", "--out=x y"],
                   required=("out",))
    assert (fv.step, fv.overwrite, fv.tree, fv.out, fv.dtype) == (300, True, ["a", "b"], "x y", "float32")
    fv = cli.parse("p", _define_demo, ["--step=7", "--nooverwrite", "--dtype", "bfloat16", "--out", "o"])
    assert (fv.step, fv.overwrite, fv.dtype) == (7, False, "bfloat16")
    assert cli.parse("p", _define_demo, ["--overwrite=false"]).overwrite is False


@pytest.mark.parametrize("argv, message", [
    (["--out=o", "--bogus=1"], "Unknown command line flag 'bogus'"),
    (["--out=o", "--step=a"], "flag --step=a: invalid literal for int()"),
    (["--out=o", "--dtype=f16"], "flag --dtype=f16: value should be one of <float32|bfloat16>"),
    ([], "--out is required"),
    (["--out=o", "extra"], "unexpected argument(s) ['extra']"),
])
def test_a_bad_flag_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse("prog", _define_demo, argv, required=("out",))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("prog: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_deleted_current_folder_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """A current folder deleted under a command is one line naming it, exit 2: as every entry point parses
    its flags (a relative --config too), and when met later (the folder deleted mid-run)."""
    from infjax import errors

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    monkeypatch.setenv("PWD", str(gone))
    gone.rmdir()
    with pytest.raises(SystemExit) as e:
        cli.parse("prog", _define_demo, ["--out=o"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip() == (f"prog: error: the current folder {gone} no longer exists (deleted "
                                                 f"or moved while the command ran in it): cd to a folder that exists "
                                                 f"and run the command again"), err
    assert errors.describe(FileNotFoundError(2, "No such file or directory")).startswith(
        f"the current folder {gone} no longer exists")
    assert errors.describe(FileNotFoundError(2, "No such file or directory", "runs/x")).startswith(
        f"runs/x: the current folder {gone} no longer exists")
    absolute = FileNotFoundError(2, "No such file or directory", "/data/x.parquet")
    assert errors.describe(absolute) == "/data/x.parquet: No such file or directory"    # not about the folder


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(file:line, entry point, flags) of every `python -m infjax.X ...` line in the README and docs/,
    continuation lines joined and `[...]` optional parts taken as given."""
    files = [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    found = []
    for path in files:
        lines = open(path, encoding="utf-8").read().splitlines()
        for i, line in enumerate(lines):
            m = re.search(r"python -m infjax\.(train|evaluate|export|curate|bench)\b(.*)", line)
            if not m:
                continue
            text, j = m.group(2), i
            while text.rstrip().endswith("\\") and j + 1 < len(lines):
                j += 1
                text = text.rstrip()[:-1] + " " + lines[j].strip()
            text = re.split(r"`|\s#\s|\s{2,}#|\|", text)[0].replace("[", "").replace("]", "")
            try:
                words = shlex.split(text)
            except ValueError:
                continue
            name = m.group(1)
            if name == "bench":
                if not words or words[0].startswith("-") or words[0] == "NAME":
                    continue
                name, words = f"bench {words[0]}", words[1:]
            found.append((f"{os.path.relpath(path, ROOT)}:{i + 1}", name, words))
    return found


PLACEHOLDER = re.compile(r"^(N|S|K|NAME|FILE\.json|\.\.\.|<.*>|.*=S|.*=N|.*=\.\.\.|.*<.*>.*)$")


def test_every_documented_command_line_parses():
    commands = documented_commands()
    assert len(commands) >= 20 and {n for _, n, _ in commands} >= {"train", "evaluate", "export", "curate"}
    for where, name, words in commands:
        if any(PLACEHOLDER.match(w) for w in words):
            words = [w for k, w in enumerate(words) if not PLACEHOLDER.match(w)
                     and not (k + 1 < len(words) and PLACEHOLDER.match(words[k + 1]) and "=" not in w)]
        try:
            cli.parse(f"infjax.{name}", _define(name), words)         # flags only: nothing is loaded or run
        except SystemExit as e:
            pytest.fail(f"{where}: `{name} {' '.join(words)}` no longer parses (exit {e.code})")


def test_transformers_notice_about_a_missing_pytorch_is_not_printed():
    """transformers' notice that PyTorch is missing (Python 3.12, `.[gpu]`) is not printed by any entry point:
    infjax uses transformers' tokenizers and configs only; transformers' other warnings pass."""
    import logging

    import infjax  # noqa: F401 - the filter is installed on import

    notice = logging.LogRecord("transformers", logging.WARNING, __file__, 1, "PyTorch was not found. Models won't be "
                               "available and only tokenizers, configuration and file/data utilities can be used.",
                               None, None)
    other = logging.LogRecord("transformers", logging.WARNING, __file__, 1, "something else", None, None)
    logger = logging.getLogger("transformers")
    assert not logger.filter(notice) and logger.filter(other)


@pytest.mark.parametrize("flag, message", [
    ("--config.train.stepz=3", "--config.train.stepz: no such config key (did you mean 'steps'?)"),
    ("--config=configs/nowhere.py", "--config=configs/nowhere.py: no such config file"),
    ("--config=configs/multi_pi.py:nope", "unknown preset 'nope'"),
])
@pytest.mark.parametrize("command", [["infjax.train"], ["infjax.bench", "train"]], ids=["train", "bench"])
def test_flag_errors_are_one_line(flag, message, command, capfd, monkeypatch):
    """In process (what reaches file descriptors 1 and 2, as a terminal would show it): the flags are refused
    before anything starts."""
    from infjax import bench

    monkeypatch.chdir(ROOT)
    args = ["--config=configs/multi_pi.py", flag] if flag.startswith("--config.") else [flag]
    try:
        code = train.main(args) if command == ["infjax.train"] else bench.main([command[1], *args])
    except SystemExit as e:
        code = e.code
    out = "".join(capfd.readouterr())
    assert code == 2 and message in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("argv", [
    ["--config=configs/multi_pi.py", "--config=configs/multi_pi.py:minilm"],
    ["--config=configs/multi_pi.py", "--config.train.steps=3", "--config=configs/multi_pi.py:minilm"],
    ["--config", "configs/multi_pi.py", "--config", "configs/multi_pi.py:minilm"],
], ids=["two files", "with an override", "two-word form"])
def test_a_second_config_file_is_refused_naming_both(argv, capsys):
    """A second --config file is refused in one line naming both, with or without overrides between them
    (never "defined twice", never the later file winning silently)."""
    with pytest.raises(SystemExit) as e:
        train.parse_flags(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m infjax.train: error: --config is given 2 times (configs/multi_pi.py, configs/multi_pi.py:minilm): "
        "give one config file and change its keys with --config.KEY=VALUE"]


@pytest.mark.parametrize("command", [["infjax.train"], ["infjax.bench", "train"]], ids=["train", "bench"])
def test_a_config_file_that_does_not_parse_is_one_line(tmp_path, command, capfd):
    from infjax import bench

    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(arg=None):\n    return {\n")
    try:               # in process: refused while the flags are read, before anything starts
        code = train.main([f"--config={broken}"]) if command == ["infjax.train"] else \
            bench.main([command[1], f"--config={broken}"])
    except SystemExit as e:
        code = e.code
    out = "".join(capfd.readouterr())
    assert code == 2 and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1 and f"--config={broken}:" in out and "line 2" in out, out


@pytest.mark.parametrize("argv, flag", [
    (["--config=configs/multi_pi.py", "--workdir="], "--workdir"),
    (["--model=", "--dataset=synthetic"], "--model"),
    (["--model=runs/x", "--dataset=synthetic", "--out="], "--out"),
    (["--workdir=runs/x", "--out="], "--out"),
], ids=["train", "evaluate model", "evaluate out", "export"])
def test_a_flag_given_empty_is_refused_not_taken_as_not_given(argv, flag, capsys, monkeypatch):
    """A flag given empty (`--workdir=$UNSET`) is refused in one line naming it, exit 2, not taken as
    the flag's default."""
    monkeypatch.chdir(ROOT)
    parse = {"train": train.parse_flags, "evaluate": evaluate.parse_flags,
             "export": lambda a: export.main(a)}["export" if argv[0].startswith("--workdir") else
                                                 "train" if argv[0].startswith("--config") else "evaluate"]
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f": error: {flag} is given empty (an unset shell variable?): give a "
                                             f"value, or leave the flag out for its default"), err


def test_flags_where_empty_means_something_still_take_it():
    fv = evaluate.parse_flags(["--model=runs/x", "--dataset=synthetic", "--query_prefix=", "--instruction="])
    assert fv.query_prefix == "" and fv.instruction == ""
    fv = train.parse_flags(["--config=configs/multi_pi.py", "--config.eval.canary="])
    assert fv.config.eval.canary == ""


@pytest.mark.parametrize("entry", ["infjax.train", "infjax.evaluate"])
def test_a_bad_attention_switch_is_one_line(entry, tmp_path):
    args = ["--config=configs/multi_pi.py", f"--workdir={tmp_path / 'w'}"] if entry == "infjax.train" else \
        ["--model=embedded:all-MiniLM-L6-v2", "--dataset=synthetic"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="", INFJAX_ATTENTION="bogus")
    p = subprocess.run([sys.executable, "-m", entry, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out
    assert sum("INFJAX_ATTENTION='bogus': choose one of" in line for line in out.splitlines()) == 1, out
    assert not [line for line in out.splitlines() if "ERROR" in line or "error" in line][1:], out
    assert not (tmp_path / "w").exists()


READ_ONLY = "/proc/sys"          # not writable, even for root (a read-only mount in containers, root-owned else)


@pytest.mark.skipif(os.access(READ_ONLY, os.W_OK), reason=f"{READ_ONLY} is writable here")
@pytest.mark.parametrize("entry", ["evaluate", "curate"])
def test_an_out_folder_that_cannot_be_written_is_refused_before_the_work(entry, tmp_path, capsys, caplog):
    out = f"{READ_ONLY}/infjax-out"
    if entry == "evaluate":
        from infjax import evaluate
        code = evaluate.main(["--model=embedded:all-MiniLM-L6-v2", "--dataset=synthetic", f"--out={out}"])
    else:
        from infjax import curate
        with pytest.raises(SystemExit) as e:
            curate.main([f"--input={tmp_path}", f"--out={out}", "--backend=local"])
        code = e.value.code
    shown = capsys.readouterr().err + caplog.text           # curate reports through its logger
    assert code == 2
    assert out in shown and "--out=" in shown and f"cannot write there: {READ_ONLY} is not writable" in shown
