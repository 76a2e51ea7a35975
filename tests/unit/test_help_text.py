"""Every command's help, as `--help` prints it, holds each option's whole text: fire would cut a wrapped line
that holds a colon, or read it as another option."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import fire.docstrings
import pytest

from lowmem.cli import COMMANDS, main
from lowmem.cli.help_text import args_on_one_line

WRAPPED = '''Do a thing.

    Args:
        plot: draw it into this PNG
            (needs matplotlib: pip install matplotlib).
        overwrite: start again, deleting the run first;
            without it: such a run is refused.
        quiet: say nothing.
    '''


def printed_help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:  # fire ends a help with exit status 0
        main(list(argv))
    assert exited.value.code in (0, None)
    captured = capsys.readouterr()
    return captured.out + captured.err  # fire writes the help to stderr when it is not a terminal


def declared_options(function) -> dict[str, str]:
    """Each option's text as its source declares it (the docstring in the file, before any rewriting)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    docstring = ast.get_docstring(tree.body[0], clean=True) or ""
    options: dict[str, str] = {}
    section = re.search(r"^Args:\n((?:[ \t]+\S.*\n?)+)", docstring, flags=re.M)
    assert section, f"{function.__name__} documents no Args"
    name = None
    for line in section.group(1).splitlines():
        match = re.match(r"^    (\*{0,2}\w+): (.*)$", line)
        if match:
            name = match.group(1)
            options[name] = match.group(2)
        elif name is not None:
            options[name] += " " + line.strip()
    return options


def flat(text: str) -> str:
    return " ".join(text.split())


def test_fire_cuts_a_wrapped_line_with_a_colon_and_reads_the_joined_one_whole():
    cut = {arg.name: arg.description for arg in fire.docstrings.parse(WRAPPED).args}
    assert cut["plot"] == "draw it into this PNG (needs matplotlib"  # what fire makes of the wrapped lines
    assert "without" in cut  # a continuation read as an option of its own
    whole = {arg.name: arg.description for arg in fire.docstrings.parse(args_on_one_line(WRAPPED)).args}
    assert whole == {"plot": "draw it into this PNG (needs matplotlib: pip install matplotlib).",
                     "overwrite": "start again, deleting the run first; without it: such a run is refused.",
                     "quiet": "say nothing."}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_options_help_is_printed_whole(capsys, name):
    printed = flat(printed_help(capsys, name, "--help"))
    options = declared_options(COMMANDS[name])
    assert options
    for option, text in options.items():
        assert flat(text) in printed, f"`{name} --help` cuts the help of {option}: {text!r}"


def test_the_list_of_commands_is_printed_without_a_note_from_fire(capsys):
    printed = printed_help(capsys, "--help")
    assert "INFO" not in printed and "Showing help" not in printed
    assert all(name in printed for name in COMMANDS)


def test_memlog_help_shows_the_path_and_where_runs_keep_their_logs(capsys):
    printed = printed_help(capsys, "memlog", "--help")
    assert "lowmem memlog PATH" in printed and "<output_dir>/logs" in printed
