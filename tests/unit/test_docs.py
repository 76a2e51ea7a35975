"""The documentation: the README stays a short front page, every relative link leads to a file (and heading) that
exists, every `--flag` the pages name is one that lowmem, or the tool the page runs it with, takes, and every
measured figure names the command that measured it and the machine it ran on.

How figures are given (docs/architecture.md says the same to the pages' writers):

- A *measured figure* is a number followed by a unit of size (kB, MB, GB, MiB, GiB, ...), time (ms, s, min, h),
  rate (tokens/s, rows/s, MB/s, GiB/s, ...) or ratio (%, 3.4x, 2.8×, 1.92 times), in a page's prose or tables.
  Code blocks (commands and what they print), headings and link texts are not searched: a heading or a link
  names a place, and the figures are stated where it leads.
- Not measurements, and left out by their context: hardware and settings, a figure followed by RAM, memory, GPU,
  card, host, machine, budget, threshold, limit, cgroup, tolerance, file or "by default" ("12 GB of RAM", "a
  20 GB GPU", "a 12 GiB budget"); bounds a test or the code sets, a figure after "within", "allows", "up to",
  "at least", "at most" or "leaks"; and a figure computed before the reader's eyes, after "=", "≈" or "×"
  ("4 B × 109.5 M = 418 MB").
- Every section (a heading to the next heading) that states a measured figure names a machine (MACHINES) and a
  command: a code span or block that starts with one of COMMAND_STARTS, or a test file that pytest runs.
"""

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
    "pip install": {"no-index", "no-deps", "index-url", "no-compile", "upgrade"},
    "tensorboard": {"logdir"},
    "sbatch (SLURM)": {"mem"},
    "hadoop classpath": {"glob"},
    "DeepSpeed's zero_to_fp32.py": {"tag", "safe_serialization"},
    "scripts/plot_tensorboard.py, scripts/sorted_demo_copy.py": {"out"},
    "scripts/dpo_side_by_side.py": {"model", "train", "valid", "steps", "lr", "seeds"},
    "every lowmem command (fire)": {"help"},
    "python -m lowmem.bench.convert_bench": {"size_gb"},
    "spm_train (SentencePiece)": {"pad_id", "bos_id", "eos_id", "unk_id", "user_defined_symbols", "byte_fallback"},
}

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1\s*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
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


# ---- Figures: each names its command and its machine (the rule is in this module's docstring). ----

# The machines the pages' figures were measured on, as the pages name them.
MACHINES = ("Intel Xeon", "AMD EPYC", "H100", "H200")
# How a command starts, in a code span or the first line of a code block.
COMMAND_STARTS = ("lowmem ", "python ", "python3 ", "accelerate ", "pytest", "bash ", "pip ", "ACCELERATE_USE_CPU=",
                  "LOWMEM_", "head ", "/usr/bin/time ", "mkdir ", "$ lowmem ")
TEST_FILE = re.compile(r"`tests/[\w/]+\.py")
INDENTED_BLOCK = re.compile(r"(?:^(?: {4}|\t)(?![-*] |\d+\. ).*\n?)+", re.MULTILINE)
UNIT = (r"(?:[kKMGT]i?B(?:/s)?|(?:tokens|rows|steps|samples|TFLOP)/s|ms|s|min|h|%|x|×|times)")
MEASURED = re.compile(r"(?<![\w.,/=+-])(?:[+−-])?\d[\d,]*(?:\.\d+)?(?P<space>\s?)(?P<unit>" + UNIT + r")(?![\w/])")
SETTING_AFTER = re.compile(r"\s+(?:of\s+)?(?:RAM|memory|GPUs?|card|host|machine|budget|threshold|limit|cgroup|"
                           r"tolerance|file|by default)\b")
BOUND_BEFORE = re.compile(r"(?:within|allows|up to|at least|at most|leaks|[=≈×])\s*$")
HEADING_LINE = re.compile(r"^#{1,6}\s.*$", re.MULTILINE)
LINK_TEXT = re.compile(r"\[([^\]]*)\]\([^)]*\)")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, text up to the next heading) for each section of a page; the part before the first heading too."""
    starts = [match.start() for match in HEADING_LINE.finditer(FENCE.sub(lambda m: "x" * len(m.group(0)), text))]
    bounds = [0, *starts, len(text)]
    return [(text[a:b].splitlines()[0] if text[a:b] else "", text[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def measured_figures(section: str) -> list[str]:
    """The measured figures a section states, by the rule of this module's docstring."""
    text = FENCE.sub(" ", section)
    text = INDENTED_BLOCK.sub(" ", text)
    text = HEADING_LINE.sub(" ", text)
    text = LINK_TEXT.sub(" ", text)
    found = []
    for match in MEASURED.finditer(text):
        unit, spaced = match.group("unit"), bool(match.group("space"))
        if unit in ("x", "×") and spaced:  # "32 x 2", "3 × 2": a shape or a product, not a ratio
            continue
        if unit == "times" and not spaced:
            continue
        if unit in ("s", "min", "h", "ms") and not spaced:
            continue
        before = text[max(0, match.start() - 12):match.start()]
        if SETTING_AFTER.match(text, match.end()) or BOUND_BEFORE.search(before):
            continue
        found.append(match.group(0))
    return found


def names_a_machine(section: str) -> bool:
    flat = " ".join(section.split())
    return any(machine in flat for machine in MACHINES)


def names_a_command(section: str) -> bool:
    spans = re.findall(r"`([^`]+)`", FENCE.sub(" ", section))
    blocks = [block.split("\n", 1)[1] if "\n" in block else "" for block in
              (match.group(0) for match in FENCE.finditer(section))]
    starts = [" ".join(span.split()) for span in spans] + [block.lstrip() for block in blocks]
    return any(start.startswith(COMMAND_STARTS) for start in starts) or bool(TEST_FILE.search(section))


def unbacked_figures(text: str) -> list[str]:
    """Sections that state measured figures without naming a machine and a command: 'heading: figures, what is
    missing'."""
    problems = []
    for heading, section in sections(text):
        figures = measured_figures(section)
        missing = [what for what, present in (("machine", names_a_machine(section)),
                                              ("command", names_a_command(section))) if not present]
        if figures and missing:
            problems.append(f"{heading or '(top)'}: {', '.join(figures[:6])}; no {' and no '.join(missing)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_measured_figure_names_its_command_and_machine(page):
    problems = unbacked_figures(page.read_text(encoding="utf-8"))
    assert not problems, f"{page.relative_to(ROOT).as_posix()}: {problems}"


def test_the_figure_rule_finds_a_figure_without_machine_or_command():
    page = ("# A page\n\n## Speed\n\nThe loader reads 618,191 rows/s and peaks at 355 MB.\n\n"
            "## Speed, measured\n\n`lowmem bench_data` on a 2-core Intel Xeon: 618,191 rows/s, peak 355 MB.\n\n"
            "## Only a machine\n\nOn the AMD EPYC it took 4 s.\n\n"
            "## Only a command\n\n`lowmem train --max_steps=60` took 45 s.\n")
    problems = unbacked_figures(page)
    assert len(problems) == 3, problems
    assert problems[0].startswith("## Speed: 618,191 rows/s, 355 MB; no machine and no command")
    assert problems[1].endswith("no command") and problems[2].endswith("no machine")


def test_the_figure_rule_leaves_settings_bounds_formulas_and_code_alone():
    page = ("## Hardware\n\nThree 20 GB GPUs fed by 12 GB of RAM; a 12 GiB budget; below the 15 GiB threshold;\n"
            "a test allows 20 s and agrees within 2%; it leaks 100 MB a step; 4 B × 109.5 M = 418 MB; a 2 GiB cgroup;\n"
            "the [12 GB claim](#x); micro-batches of 32 x 2; the lease, 90 s by default.\n\n"
            "```\nstep 10/60 | tokens/s 5,176 | rss 506 MB\n```\n\n    indented output: 947 MB\n")
    assert measured_figures(page) == []
    assert unbacked_figures(page) == []
    assert measured_figures("It ran at 3.4x the speed, 1.92 times faster, 12% fewer, in 8 min 06 s.") == [
        "3.4x", "1.92 times", "12%", "8 min", "06 s"]


# ---- Defects a pattern can catch ----

def page_text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def section_of(text: str, heading: str) -> str:
    found = [section for title, section in sections(text) if title.lstrip("#").strip() == heading]
    assert found, f"no section {heading!r}"
    return found[0]


def test_no_page_installs_lowmem_from_a_registry_by_name():
    """The project installs from its folder (`pip install ".[hf]"`); no `lowmem[...]` spec a registry would serve."""
    texts = {page.relative_to(ROOT).as_posix(): page.read_text(encoding="utf-8") for page in PAGES}
    offenders = [name for name, text in texts.items()
                 if re.search(r"pip install\s+[\"']?lowmem\b", text) or "lowmem[" in text]
    assert not offenders, offenders
    # Nor do the install hints of lowmem's own messages and help.
    hints = [path.relative_to(ROOT).as_posix() for path in sorted((ROOT / "lowmem").rglob("*.py"))
             if "lowmem[" in path.read_text(encoding="utf-8")]
    assert not hints, hints


def test_every_extra_the_pages_install_exists():
    import tomllib

    extras = set(tomllib.loads(page_text("pyproject.toml"))["project"]["optional-dependencies"])
    named = {extra for page in PAGES for extra in re.findall(r'pip install[^\n`]*?"\.\[(\w+)\]"',
                                                              page.read_text(encoding="utf-8"))}
    assert named, "no page installs an extra"
    assert named <= extras, f"extras the pages install that pyproject.toml lacks: {named - extras}"


def machine_named(section: str) -> str:
    flat = " ".join(section.split())
    positions = {machine: flat.find(machine) for machine in MACHINES if machine in flat}
    assert positions, "no machine named"
    return min(positions, key=positions.__getitem__)


def test_the_demo_runs_figures_name_one_machine_on_every_page():
    """The demo run's figures come from one machine, named first wherever they are quoted; another machine is
    named only for a figure of an earlier run, with that said in the same sentence."""
    quoted = {"README.md": "The demo run", "docs/evaluation.md": "The demo's test scores",
              "docs/training.md": "The training log"}
    machines = {name: machine_named(section_of(page_text(name), heading)) for name, heading in quoted.items()}
    assert set(machines.values()) == {"Intel Xeon"}, machines
    for name, heading in quoted.items():
        section = " ".join(FENCE.sub(" ", section_of(page_text(name), heading)).split())
        for sentence in re.split(r"(?<=[.:;])\s", section):
            others = [machine for machine in MACHINES if machine in sentence and machine != "Intel Xeon"]
            if others:
                assert re.search(r"earlier|previous", sentence), f"{name}: {others} without 'earlier': {sentence}"


def test_performance_page_does_not_deny_the_gpu_figures_it_quotes():
    text = page_text("docs/performance.md")
    quotes_a_gpu = any(names_a_machine(section) and re.search(r"H100|H200", section) and measured_figures(section)
                       for _, section in sections(text))
    denials = [phrase for phrase in ("not measurable here", "no GPU figure", "not been measured on a GPU",
                                     "measured on CPUs only", "no GPU has run") if phrase in " ".join(text.split())]
    assert quotes_a_gpu, "performance.md quotes no GPU figure (then this test should change)"
    assert not denials, denials


def test_the_logits_widths_on_the_pages_are_the_padded_vocabularies():
    from lowmem.config import PRESETS, TrainConfig
    from lowmem.model.config import GPTConfig

    padded = {GPTConfig.from_preset("demo", vocab).padded_vocab_size
              for vocab in (TrainConfig().vocab_size, *(preset["vocab_size"] for preset in PRESETS.values()))}
    widths = {}
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for width in re.findall(r"\((?:tokens|positions) [×x] ([\d,]+)\)|tokens x ([\d,]+) x 4 B", text):
            widths.setdefault(int("".join(width).replace(",", "")), set()).add(page.relative_to(ROOT).as_posix())
    assert widths, "no logits width found on the pages"
    assert set(widths) <= padded, f"logits widths that are not a padded vocabulary ({sorted(padded)}): {widths}"


def test_the_memory_page_gives_the_verdict_rule_the_code_applies():
    from lowmem.memory.report import FLAT_FLOOR_MB_PER_1K, MIN_FIT_RECORDS, SIGNIFICANCE

    numbers = {2: "two", 3: "three", 4: "four", 5: "five"}
    text = page_text("docs/memory.md")
    assert f"a slope above both {FLAT_FLOOR_MB_PER_1K:g} MB per 1,000 steps" in text
    assert f"{numbers[int(SIGNIFICANCE)]} standard errors of the fitted slope" in text
    assert f"more than {numbers[int(SIGNIFICANCE)]} times what the record-to-record changes" in text
    assert f"fewer than {MIN_FIT_RECORDS} (`MIN_FIT_RECORDS`" in text
    assert "less the end record" in text
