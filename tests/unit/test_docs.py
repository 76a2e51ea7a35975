"""The documentation: the README stays a short front page, every relative link leads to a file (and heading) that
exists, and every `--flag` the pages name is one that lowmem, or the tool the page runs it with, takes."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from training_helpers import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250

# Flags of other programs that the pages run, by program. Everything else must be lowmem's own.
OTHER_TOOLS_FLAGS = {
    "accelerate launch": {"num_processes", "multi_gpu", "main_process_port", "config_file", "num_machines",
                          "machine_rank", "main_process_ip", "mixed_precision", "cpu"},
    "pip install": {"no-index", "no-deps"},
    "tensorboard": {"logdir"},
    "sbatch (SLURM)": {"mem"},
    "hadoop classpath": {"glob"},
    "DeepSpeed's zero_to_fp32.py": {"tag", "safe_serialization"},
    "scripts/plot_tensorboard.py, scripts/sorted_demo_copy.py": {"out"},
    "every lowmem command (fire)": {"help"},
    "python -m lowmem.bench.convert_bench": {"size_gb"},
}

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
FLAG = re.compile(r"(?<![\w\-/.])--([A-Za-z][\w-]*)")


def prose(text: str) -> str:
    """The page without code: links inside code blocks and spans are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug = github_slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)  # GitHub numbers repeated headings
        seen[slug] = seen.get(slug, 0) + 1
    return found


def lowmem_flags() -> set[str]:
    """The flags lowmem takes: config fields and aliases, the config-source flags, the commands' parameters."""
    from lowmem.cli.commands import COMMANDS
    from lowmem.config import TrainConfig
    from lowmem.config.overrides import config_aliases
    from lowmem.config.sources import SOURCE_FLAGS  # --preset, --config, --print_config: where the config comes from

    names = {field.name for field in dataclasses.fields(TrainConfig)} | set(config_aliases(TrainConfig))
    names |= set(SOURCE_FLAGS)
    for command in COMMANDS.values():
        for parameter in inspect.signature(inspect.unwrap(command)).parameters.values():
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                names.add(parameter.name)
    return names


def test_the_readme_is_a_short_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(ROOT).as_posix()}")
    assert not broken, f"{page.relative_to(ROOT).as_posix()}: {broken}"


def test_every_flag_the_pages_name_exists():
    known = lowmem_flags()
    others = set().union(*OTHER_TOOLS_FLAGS.values())
    unknown = {}
    for page in PAGES:
        for flag in FLAG.findall(page.read_text(encoding="utf-8")):
            if flag not in known and flag not in others:
                unknown.setdefault(flag, set()).add(page.relative_to(ROOT).as_posix())
    assert not unknown, f"flags that no command, config field or listed tool takes: {unknown}"


def test_github_slugs():
    assert github_slug("Architectures: llama (the default) and gpt2") == "architectures-llama-the-default-and-gpt2"
    assert github_slug("Where `train`'s extra memory went") == "where-trains-extra-memory-went"
    assert github_slug("The user's command on a 12 GB host") == "the-users-command-on-a-12-gb-host"
