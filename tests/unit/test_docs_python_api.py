"""The script of docs/python-api.md runs as the page prints it: in an empty folder (so on the demo data, through
`with_demo_data`), with the Trainer it builds, the callback it defines and the summary it returns. Only the run's
length is shrunk, by wrapping `apply_overrides`, so that the test takes seconds."""

from __future__ import annotations

import pkgutil
import re

from training_helpers import ROOT

PAGE = ROOT / "docs" / "python-api.md"
SECTION = "## A training from a script"
# What the test adds to the overrides the script gives: 2 steps, a few validation rows, no BLEU-4 beyond 8 prompts.
SHORT_RUN = {"max_steps": 2, "eval_batches": 2, "eval_bleu_samples": 8, "logging_steps": 1}


def script_of_the_page() -> str:
    """The first python block of the page's script section."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert blocks, f"no python block under {SECTION!r} in {PAGE.name}"
    return blocks[0]


def test_the_script_compiles_and_names_only_what_lowmem_has():
    import importlib

    code = script_of_the_page()
    compile(code, str(PAGE), "exec")
    for module, names in re.findall(r"^from (lowmem[\w.]*) import (.+)$", code, re.MULTILINE):
        imported = importlib.import_module(module)
        for name in (part.strip() for part in names.split(",")):
            assert hasattr(imported, name), f"{PAGE.name}: {module} has no {name}"


def test_the_script_trains_from_an_empty_folder_on_the_demo_data(tmp_path, monkeypatch):
    import lowmem.config

    original = lowmem.config.apply_overrides

    def shortened(config, overrides):  # the script's overrides, then the short run's
        return original(original(config, overrides), SHORT_RUN)

    monkeypatch.setattr(lowmem.config, "apply_overrides", shortened)
    monkeypatch.chdir(tmp_path)
    assert not (tmp_path / "data").exists()
    namespace: dict = {"__name__": "docs_python_api_example"}
    exec(compile(script_of_the_page(), str(PAGE), "exec"), namespace)
    summary = namespace["summary"]
    assert summary["steps"] == SHORT_RUN["max_steps"]
    assert summary["stopped_by"] is None
    assert namespace["config"].train_file.endswith("train.parquet")
    assert "demo_data" in namespace["config"].train_file
    assert (tmp_path / "model_save" / "demo" / "final").is_dir()
    assert (tmp_path / "model_save" / "tokenizer" / "tokenizer.model").is_file()


def test_every_dotted_lowmem_name_of_the_page_exists():
    names = set(re.findall(r"`(lowmem(?:\.\w+)+)(?:\([^`]*\))?`", PAGE.read_text(encoding="utf-8")))
    assert "lowmem.config.with_demo_data" in names and "lowmem.config.DEMO_DATA_DIR" in names
    missing = []
    for name in sorted(names):
        try:
            pkgutil.resolve_name(name)  # the longest importable module, then attributes
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"{PAGE.name} names what lowmem does not have: {missing}"
