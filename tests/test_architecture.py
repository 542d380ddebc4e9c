"""The package's layers import one way, with no cycles, and without hidden function-local imports.

Layers, lowest first (a module may import its own package and any lower layer, nothing else), and two
rules more: only the platform modules (`PLATFORM_MODULES`) ask which platform the program runs on, and every
top-level function and class is reached from an entry point (`unreached_definitions`), not kept alive by tests.

Layers:

    errors                    the error types and the entry points' one-line report (imports nothing)
    cli                       the entry points' flags: absl, one --help format, one error line
    data, models, losses      what a batch is, what the networks are, what the loss is (independent)
    runtime                   where the program runs: mesh, partitioning, multi-host start-up, storage,
                              checkpoints, restoring a run's parameters, process settings on CPU
    training                  state, embed, step, gradcache, setup, workdir, writers
    inference                 embedders, embedding cache, exact search, model sources
    evaluation                datasets, metrics, scoring tasks, TREC files, MTEB adapter
    config, curation          defaults, presets, validation (checks values of any lower layer); data curation
                              (LLM stages over (query, passage) pairs; reads BEIR folders with evaluation's
                              reader, retrieves with inference, generates with models) (independent)
    entry points              train, evaluate, export, curate, bench, benchmarks/ (nothing imports them)
"""
import ast
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "infjax")

LAYERS = {"errors": -1, "cli": -0.5, "data": 0, "models": 0, "losses": 0, "runtime": 0.5, "training": 1, "inference": 2,
          "evaluation": 3, "config": 4, "curation": 4, "train": 5, "evaluate": 5, "export": 5, "curate": 5, "bench": 5,
          "benchmarks": 5}
ENTRY_POINTS = {"train", "evaluate", "export", "curate", "bench", "benchmarks"}


def modules_of(package_dir: str) -> dict[str, str]:
    """{dotted module name: file path} of every module under `package_dir` (named infjax)."""
    out = {}
    for folder, _, files in os.walk(package_dir):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(package_dir))
                out[rel[:-3].replace(os.sep, ".").removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def imports_of(path: str, modules: dict[str, str]) -> list[tuple[str, int, bool, str]]:
    """(imported infjax module, line, inside a function?, the line) for each infjax import in `path`.

    `from infjax.x import y` counts as importing infjax.x.y when that is a module, else infjax.x.
    """
    source = open(path, encoding="utf-8").read()
    lines = source.splitlines()
    found = []

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [f"{child.module}.{a.name}" for a in child.names]
            for n in names:
                target = resolve(n) if n.split(".")[0] == "infjax" else None
                if target and target != "infjax":
                    found.append((target, child.lineno, in_function, lines[child.lineno - 1]))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def layer_of(module: str) -> str:
    name = module.split(".")[1]
    return "benchmarks" if name == "bench" else name        # `python -m infjax.bench` is benchmarks/' command line


def upward_imports(modules: dict[str, str]) -> list[str]:
    bad = []
    for module, path in modules.items():
        if module == "infjax":
            continue
        src = layer_of(module)
        for target, line, _, _ in imports_of(path, modules):
            dst = layer_of(target)
            if dst == src:
                continue
            if dst in ENTRY_POINTS:
                bad.append(f"{path}:{line}: {module} imports the entry point {target}")
            elif LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{path}:{line}: {module} ({src}) imports {target} ({dst}), not a lower layer")
    return bad


def import_cycles(modules: dict[str, str]) -> list[list[str]]:
    graph = {m: sorted({t for t, *_ in imports_of(p, modules) if t != m}) for m, p in modules.items()}
    state, cycles = {}, []

    def dfs(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                dfs(nxt, stack)
        stack.pop()
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            dfs(m, [])
    return cycles


# The modules that may ask which platform they run on (jax.default_backend(), a device's .platform, the
# JAX_PLATFORMS setting): one per platform for attention, the CPU process settings, and the devices in words.
PLATFORM_MODULES = re.compile(r"^infjax\.(models\.kernels(\..+)?|runtime\.(cpu|platform|targets))$")
PLATFORM_QUESTION = re.compile(r"default_backend\s*\(|\.platform\b(?!\s*\()|JAX_PLATFORMS")


def platform_questions(modules: dict[str, str]) -> list[str]:
    """`path:line: text` of each place outside PLATFORM_MODULES that asks which platform it runs on."""
    bad = []
    for module, path in modules.items():
        if PLATFORM_MODULES.match(module):
            continue
        for number, line in enumerate(open(path, encoding="utf-8").read().splitlines(), 1):
            code = line.split("#")[0]
            if PLATFORM_QUESTION.search(code):
                bad.append(f"{path}:{number}: {module} asks which platform it runs on: {line.strip()}")
    return bad


MODULES = modules_of(PACKAGE)


def test_every_module_belongs_to_a_layer():
    unknown = sorted(m for m in MODULES if m != "infjax" and layer_of(m) not in LAYERS)
    assert not unknown, f"modules outside the layers listed in {__file__}: {unknown}"


def test_imports_flow_down_the_layers():
    bad = upward_imports(MODULES)
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles(MODULES)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_only_the_platform_modules_ask_which_platform_they_run_on():
    bad = platform_questions(MODULES)
    assert not bad, "platform-specific code outside the platform modules:\n" + "\n".join(bad)


def test_the_platform_rule_catches_a_planted_question(tmp_path):
    pkg = tmp_path / "infjax"
    (pkg / "training").mkdir(parents=True)
    (pkg / "models" / "kernels").mkdir(parents=True)
    (pkg / "training" / "step.py").write_text("import jax\nfast = jax.default_backend() == 'gpu'\n")
    (pkg / "models" / "kernels" / "gpu.py").write_text("import jax\non_gpu = jax.default_backend() == 'gpu'\n")
    (pkg / "training" / "mesh.py").write_text("def f(mesh):\n    return mesh.devices.flat[0].platform\n")
    bad = sorted(platform_questions(modules_of(str(pkg))))
    assert [b.split(": ")[0].rsplit(os.sep, 2)[-2:] for b in bad] == [["training", "mesh.py:2"],
                                                                      ["training", "step.py:2"]]


def test_function_local_imports_of_infjax_say_why():
    """An infjax import inside a function hides a dependency; allowed only with a comment saying why."""
    bad = [f"{path}:{line}: {text.strip()}" for path in MODULES.values()
           for _, line, local, text in imports_of(path, MODULES) if local and "#" not in text]
    assert not bad, "function-local imports of infjax modules without a reason:\n" + "\n".join(bad)


@pytest.mark.parametrize("planted", ["upward", "entry point", "cycle"])
def test_the_checks_catch_a_planted_violation(tmp_path, planted):
    """The checks can fail: an upward import, an import of an entry point and a cycle are each reported."""
    pkg = tmp_path / "infjax"
    for sub in ("models", "training"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("")
    (pkg / "training" / "step.py").write_text("from infjax.models import net\n")
    (pkg / "models" / "other.py").write_text("from infjax.models import net\n")
    (pkg / "models" / "net.py").write_text({"upward": "from infjax.training import step\n",
                                           "entry point": "import infjax.train\n",
                                           "cycle": "from infjax.models.other import x\n"}[planted])
    modules = modules_of(str(pkg))
    assert upward_imports(modules) if planted != "cycle" else import_cycles(modules)


# --------------------------------------------------------------------------
# No code that only tests keep alive
# --------------------------------------------------------------------------

ENTRY_MODULES = re.compile(r"^infjax\.(train|evaluate|export|curate|bench|benchmarks\.\w+)$")
DOCUMENTED_IMPORT = re.compile(r"from (infjax[\w.]*) import ([\w, ]+)")


def _names_imported(module: str, tree: ast.Module, modules: dict[str, str]) -> tuple[dict, dict]:
    """({local name: (module, name)} of names imported from infjax modules, {local name: module} of infjax
    modules imported whole)."""
    names, aliases = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in modules})
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("infjax"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    aliases[a.asname or a.name] = full
                else:
                    names[a.asname or a.name] = (node.module, a.name)
    return names, aliases


def unreached_definitions(package_dir: str, scripts: str = "", docs: str = "") -> list[str]:
    """`path:line name` of each top-level function or class of the package that no entry point reaches.

    A name graph with imports resolved: a definition reaches what its body names (a name of its own module,
    a name imported from an infjax module, `alias.attr` of an imported infjax module, a string naming a
    definition of its module). The roots: the entry points' `main`, the module-level code of every module
    (tables, registries; not `__all__`), the names `scripts` mentions (configs/ and launch/ files) and the
    Python API `docs` show (`from infjax.x import a, b`)."""
    modules = modules_of(package_dir)
    trees = {m: ast.parse(open(p, encoding="utf-8").read()) for m, p in modules.items()}
    imported = {m: _names_imported(m, t, modules) for m, t in trees.items()}
    defs, edges, roots = {}, {}, set()

    def follow(key, depth=0):                     # a name re-exported by another module: its definition
        mod, name = key
        if key in defs or depth > 5 or name not in imported.get(mod, ({}, {}))[0]:
            return key
        return follow(imported[mod][0][name], depth + 1)

    for mod, tree in trees.items():
        names, aliases = imported[mod]
        own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}

        def refs(node):
            out = set()
            for n in ast.walk(node):
                if isinstance(n, ast.Name) and n.id in own:
                    out.add((mod, n.id))
                elif isinstance(n, ast.Name) and n.id in names:
                    out.add(names[n.id])
                elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in own:
                    out.add((mod, n.value))
                elif isinstance(n, ast.Attribute):
                    chain, v = [n.attr], n.value
                    while isinstance(v, ast.Attribute):
                        chain.append(v.attr)
                        v = v.value
                    if isinstance(v, ast.Name) and v.id in aliases:
                        target = aliases[v.id]
                        for attr in reversed(chain):
                            if f"{target}.{attr}" not in modules:
                                out.add((target, attr))
                                break
                            target = f"{target}.{attr}"
            return out

        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs[(mod, node.name)] = f"{modules[mod]}:{node.lineno} {node.name}"
                edges[(mod, node.name)] = refs(node)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                continue
            elif not isinstance(node, (ast.Import, ast.ImportFrom)):
                roots |= refs(node)
        if ENTRY_MODULES.match(mod):
            roots.add((mod, "main"))
    for mod, names in DOCUMENTED_IMPORT.findall(docs):
        roots |= {(mod, n.strip()) for n in names.split(",")}
    words = set(re.findall(r"\w+", scripts))
    roots |= {key for key in defs if key[1] in words}
    seen, todo = set(), [follow(r) for r in roots]
    while todo:
        key = todo.pop()
        if key in defs and key not in seen:
            seen.add(key)
            todo += [follow(k) for k in edges[key]]
    return sorted(where for key, where in defs.items() if key not in seen)


def _text_of(root: str, *paths: str) -> str:
    """The text of the files at `paths` under `root` (folders walked)."""
    files = []
    for path in paths:
        full = os.path.join(root, path)
        files += [full] if os.path.isfile(full) else [os.path.join(b, n) for b, _, ns in os.walk(full) for n in ns]
    return "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files)


def test_every_definition_is_reached_from_an_entry_point_not_only_from_tests():
    """A top-level function or class that no entry point, config, launcher or documented API reaches is kept
    alive by its tests alone: delete it, or let what trains, evaluates or exports use it."""
    root = os.path.dirname(PACKAGE)
    unreached = unreached_definitions(PACKAGE, _text_of(root, "configs", "launch"), _text_of(root, "README.md", "docs"))
    assert not unreached, "reached by no entry point:\n" + "\n".join(unreached)


def test_the_reach_check_catches_a_definition_only_a_test_calls(tmp_path):
    pkg = tmp_path / "infjax"
    (pkg / "data").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "data" / "__init__.py"):
        init.write_text("")
    (pkg / "data" / "rows.py").write_text("def used():\n    return helper()\n\n\ndef helper():\n    return 1\n\n\n"
                                          "def orphan():\n    return helper()\n\n\nclass Shown:\n    pass\n")
    (pkg / "train.py").write_text("from infjax.data import rows\n\n\ndef main():\n    return rows.used()\n")
    unreached = unreached_definitions(str(pkg), docs="from infjax.data.rows import Shown")
    assert [u.rsplit(" ", 1)[1] for u in unreached] == ["orphan"]
