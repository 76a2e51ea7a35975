"""Pages that must say what the code does today: the reference host's plan on docs/memory.md is the one `lowmem plan`
prints for it, the memlog example has today's columns and run id, the README's memory and install statements hold."""

from __future__ import annotations

import re

from training_helpers import ROOT

from lowmem.cli import main
from lowmem.config import TrainConfig
from lowmem.memory.report import TABLE_COLUMNS
from lowmem.train import memory_fit

FENCE_BODY = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
REFERENCE_HOST_PLAN = ("plan --use_large_config=True --num_processes=3 --device=cuda --gpu_memory_gb=20 "
                       "--memory_budget_gb=12")


def section(page: str, heading: str) -> str:
    text = (ROOT / page).read_text(encoding="utf-8")
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def gpu_part(plan: str) -> list[str]:
    """The plan's lines for each GPU, its GPU peak and its savers' line: none depends on the machine that plans."""
    lines = plan.splitlines()
    start = next(index for index, line in enumerate(lines) if line.strip().startswith("each GPU"))
    end = next(index for index, line in enumerate(lines) if line.strip().startswith("GPU peak"))
    # The savers' sentence after it counts the host, whose interpreter is measured where the plan runs.
    decided = [re.sub(r"\(predicted [\d,]+ MB for this machine", "(predicted N MB for this machine", line)
               for line in lines if line.startswith("GPU micro-batches:")]
    return [line.rstrip() for line in lines[start:end + 1]] + decided


def test_the_reference_hosts_plan_on_the_memory_page_is_what_lowmem_plan_prints(tmp_path, monkeypatch, capsys):
    page = section("docs/memory.md", "## The reference host")
    [block] = [body for body in FENCE_BODY.findall(page) if REFERENCE_HOST_PLAN in body][:1]
    monkeypatch.chdir(tmp_path)  # no tokenizer yet, as on a first launch, and the demo data
    # The page's interpreter, measured in a fresh process: this one has run other tests, and the savers the plan
    # chooses depend on it.
    interpreter_mb = int(re.search(r"interpreter and libraries +([\d,]+)", block).group(1).replace(",", ""))
    monkeypatch.setattr(memory_fit, "measure_base_bytes", lambda: interpreter_mb * 2**20)
    capsys.readouterr()
    main(REFERENCE_HOST_PLAN.split())
    printed = capsys.readouterr()
    assert gpu_part(block) == gpu_part(printed.out + printed.err)
    assert "No run on three GPUs has been made." in page


def test_the_memlog_example_has_todays_columns_and_run_id():
    page = section("docs/memory.md", "## Reading the memory log")
    [table] = [body for body in FENCE_BODY.findall(page) if body.startswith("Memory log of run")][:1]
    assert re.match(r"Memory log of run \d{8}-\d{6}-[0-9a-f]{6}: \d+ rank\(s\)\n", table)
    header = next(line for line in table.splitlines() if line.lstrip().startswith("rank "))
    assert re.split(r"\s{2,}", header.strip()) == list(TABLE_COLUMNS)
    assert "UNKNOWN" in page and "MIN_FIT_RECORDS" in page


def test_the_readme_says_what_host_memory_holds_and_what_the_plan_leaves_out():
    memory = section("README.md", "### Where the memory goes")  # after the quick start: what to type comes first
    assert "one parquet row group" not in memory
    assert f"{TrainConfig().dataloader_mix_row_groups} at a time" in memory and "--dataloader_mix_row_groups" in memory
    assert "rank 0 trains the tokenizer" in memory and "--tokenizer_max_sentences" in memory
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.index("## Quick start") < readme.index("### Where the memory goes")


def test_the_quick_start_says_which_torch_a_linux_machine_gets():
    quick_start = section("README.md", "## Quick start")
    assert "installs torch's CUDA build" in quick_start
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in quick_start


def test_the_checkpoints_page_says_the_schedule_is_saved_state():
    text = (ROOT / "docs" / "checkpoints.md").read_text(encoding="utf-8")
    assert "function of the step" not in text and "needs no state" not in text
    assert "learning-rate schedule (its warmup" in text
