"""The architecture's rules, checked on the source: no test plumbing in the package, environment variables the
documentation lists, functions of a readable length, and a layout section (docs/architecture.md) that matches the
tree."""

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
# Long by nature: the model's forward pass and the decoding loop read best in one piece.
LONG_BY_NATURE = {("lowmem/model/gpt.py", "forward"), ("lowmem/model/gpt.py", "generate")}
MAX_FUNCTION_LINES = 80
MAX_LOOP_LINES = 40


def package_sources() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py")}


def test_no_test_plumbing_in_the_package():
    for name, source in package_sources().items():
        assert "LOWMEM_" not in source, f"{name} names a test variable"
        assert "TestHooks" not in source and "TRACE_DIR" not in source, name


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
