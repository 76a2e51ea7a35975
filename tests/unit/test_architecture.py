"""The architecture's rules, checked on the source: no test plumbing in the package, no test file importing another,
environment variables the documentation lists, functions of a readable length, and a layout section
(docs/architecture.md) that matches the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from training_helpers import ROOT

PACKAGE = ROOT / "lowmem"
# The environment variables may be documented on the front page or on any page of docs/; the layout lives in
# docs/architecture.md.
DOCUMENTATION = "\n".join(path.read_text(encoding="utf-8")
                          for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
ARCHITECTURE_PAGE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
# Long by nature: the model's forward pass reads best in one piece.
LONG_BY_NATURE = {("lowmem/model/gpt.py", "forward")}
MAX_FUNCTION_LINES = 80
MAX_LOOP_LINES = 40
MAX_FILE_LINES = 500
# Files over MAX_FILE_LINES, each with the most lines it may grow to and why it is one file.
LONG_FILES = {
    "lowmem/data/stream.py": (570, "ParquetStream's iteration and its exact-resume state change together; split, "
                                   "each half would need the other's private state"),
    "lowmem/data/mixture.py": (560, "MixedStream: the same reason as stream.py, for several sources"),
    "lowmem/tokenization/hf_tokenizer.py": (545, "a transformers tokenizer's pieces, special tokens and "
                                                 "pre-tokenizer restated for the tokenizers library; to split by part"),
    "lowmem/bench/train_bench.py": (545, "the benchmark's four phases share one set-up; to split by phase"),
    "lowmem/tokenization/sentencepiece_tokenizer.py": (540, "SentencePiece training (streamed, sampled) and "
                                                            "loading; to split in two"),
}


def package_sources() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py")}


def test_no_test_plumbing_in_the_package():
    for name, source in package_sources().items():
        assert "LOWMEM_" not in source, f"{name} names a test variable"
        assert "TestHooks" not in source and "TRACE_DIR" not in source, name


def _imported_modules(tree: ast.AST):
    """(module, line) for each import in `tree`, at any depth (inside functions too): `import a.b` and
    `from a.b import c` name a.b; `from . import c` names nothing here (tests/ is no package)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno


def test_no_test_file_imports_a_test_module():
    """What tests share lies in helper modules beside tests/conftest.py (training_helpers.py, trainer_fixtures.py,
    ...), never in a test file: renaming or splitting a test file must break no other test."""
    tests = ROOT / "tests"
    found = [f"{path.relative_to(ROOT).as_posix()}:{line} imports {module}"
             for path in sorted(tests.rglob("*.py"))
             for module, line in _imported_modules(ast.parse(path.read_text(encoding="utf-8")))
             if module.split(".")[0].startswith("test_")]
    assert not found, "import the shared helper module instead:\n" + "\n".join(found)


def test_every_environment_variable_the_package_reads_is_documented():
    environ_line = re.compile(r"os\.(environ|getenv)")
    variable = re.compile(r"[\"']([A-Z][A-Z0-9_]{2,})[\"']")
    read: set[str] = set()
    for name, source in package_sources().items():
        for line in source.splitlines():
            if environ_line.search(line):
                found = variable.findall(line)
                indirect = "ENDPOINT_VARIABLES" in line or "**os.environ" in line
                assert found or indirect, f"{name}: an environment read whose variable the test cannot see: {line}"
                read.update(found)
    from lowmem.data.storage import ENDPOINT_VARIABLES

    read.update(ENDPOINT_VARIABLES)
    assert read, "the package reads some variables (the launcher's, at least)"
    undocumented = sorted(name for name in read if f"`{name}`" not in DOCUMENTATION)
    assert not undocumented, f"read by lowmem but not listed in README.md or docs/: {undocumented}"


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_functions_stay_short():
    too_long = []
    for name, source in package_sources().items():
        for function in _functions(ast.parse(source)):
            lines = function.end_lineno - function.lineno + 1
            if lines > MAX_FUNCTION_LINES and (name, function.name) not in LONG_BY_NATURE:
                too_long.append(f"{name}:{function.lineno} {function.name} ({lines} lines)")
    assert not too_long, too_long


def test_files_stay_short():
    too_long, no_longer_long = [], []
    for name, source in package_sources().items():
        lines = len(source.splitlines())
        limit = LONG_FILES.get(name, (MAX_FILE_LINES, ""))[0]
        if lines > limit:
            too_long.append(f"{name} ({lines} lines, at most {limit})")
        if name in LONG_FILES and lines <= MAX_FILE_LINES:
            no_longer_long.append(name)
    assert not too_long, f"split these by job, or give the reason in LONG_FILES: {too_long}"
    assert not no_longer_long, f"back under {MAX_FILE_LINES} lines: take them out of LONG_FILES: {no_longer_long}"
    assert set(LONG_FILES) <= set(package_sources()), "LONG_FILES names a file that does not exist"


def test_the_training_loop_reads_in_one_screen():
    tree = ast.parse((PACKAGE / "train" / "trainer.py").read_text(encoding="utf-8"))
    [fit] = [f for f in _functions(tree) if f.name == "fit"]
    body_start = fit.body[1].lineno if ast.get_docstring(fit) else fit.body[0].lineno
    assert fit.end_lineno - body_start + 1 <= MAX_LOOP_LINES


def test_the_layout_names_every_module():
    layout = ARCHITECTURE_PAGE.split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name == "__init__.py":
            if relative.parent != Path(".") and f"{relative.parent.as_posix()}/" not in layout:
                missing.append(f"lowmem/{relative.parent.as_posix()}/")
        elif path.name not in layout:
            missing.append(f"lowmem/{relative.as_posix()}")
    assert not missing, f"the layout section of docs/architecture.md does not name: {missing}"


# The layers of the package, lowest first: a part may import its own layer's modules and those of the layers
# before it, never a later one (lazy imports inside functions and imports for annotations count too). The
# top-level modules are the foundation every part may use.
LAYERS = (
    ("errors", "units", "program", "progress", "atomic_files", "disk_errors", "run_files", "log_format"),
    ("memory",),
    ("model",),
    ("config",),
    ("adapters",),
    ("conversion",),  # below the rows: a file that is not parquet is answered with the convert command it needs
    ("data",),
    ("tokenization",),
    ("distributed",),
    ("checkpoint",),
    ("eval",),
    ("hf",),
    ("source",),
    ("preference",),
    ("train",),
    ("gpucheck",),
    ("bench",),
    ("cli", "__main__", "__init__"),
)
LAYER_OF = {part: index for index, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, with_lazy: bool = True):
    """(module imported, line) for each import of lowmem in `path`: every one, or only those at module level
    (those under `if TYPE_CHECKING:` included: they make a cycle for a reader and a type checker)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    if not with_lazy:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                skipped.update(id(inner) for inner in ast.walk(node) if inner is not node)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [f"{target}.{alias.name}" for alias in node.names]
            if node.module and target.startswith("lowmem"):  # `from lowmem.x import y`: y may be a module
                names += [f"{target}.{alias.name}" for alias in node.names
                          if (ROOT / Path(*f"{target}.{alias.name}".split("."))).with_suffix(".py").is_file()]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name == "lowmem" or name.startswith("lowmem."):
                yield name, node.lineno


def _part(module: str) -> str:
    """The part of the package a module belongs to: its subpackage, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(_module_name(path)) for path in PACKAGE.rglob("*.py")}
    assert parts == set(LAYER_OF), f"not in LAYERS: {sorted(parts - set(LAYER_OF))}"


def test_no_lower_layer_imports_a_higher_one():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _part(_module_name(path))
        for imported, line in _imports(path):
            if imported == "lowmem":
                continue  # the package's own __init__: its version and docstring
            if LAYER_OF[_part(imported)] > LAYER_OF[importer]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({importer}) imports {imported}")
    assert not upward, "a lower layer imports a higher one:\n" + "\n".join(upward)


# A module that is handed an object by the one module that calls it may name that object's class for annotations
# (`if TYPE_CHECKING:`), the way a callback's hooks name the trainer that calls them: the one back link allowed,
# and only directly (no other module between the two).
HANDED_BY_ITS_CALLER = {
    ("lowmem.train.callbacks", "lowmem.train.trainer"),  # the hooks get the Trainer
    ("lowmem.model.generation", "lowmem.model.gpt"),  # GPT.generate is generation.generate
}


def _import_graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports, at module level (annotations' imports included) and inside
    functions (a lazy import is a cycle at run time all the same). Packages' __init__ modules are left out: they
    import their own modules to re-export them."""
    packages = {_module_name(path) for path in PACKAGE.rglob("__init__.py")}
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py") if _module_name(path) not in packages}
    return {module: {name for name, _ in _imports(path) if name in modules and name != module}
            for module, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for imported in graph[todo.pop()] - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


def test_no_module_imports_itself_back():
    graph = _import_graph()
    for caller_side, called_side in HANDED_BY_ITS_CALLER:
        assert called_side in graph[caller_side] and caller_side in graph[called_side], (caller_side, called_side)
        graph[caller_side].discard(called_side)
    for handed, caller in HANDED_BY_ITS_CALLER:
        between = sorted(module for module in _reachable(graph, caller) - {handed}
                         if handed in _reachable(graph, module))
        assert not between, f"{caller} reaches {handed} through {between} too: {handed} names {caller} back"
    cycles = sorted(module for module in graph if module in _reachable(graph, module))
    assert not cycles, f"modules that import themselves back through others: {cycles}"
