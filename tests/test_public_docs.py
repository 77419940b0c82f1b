"""What a user reads first is checked: every public name of ``kvpack`` has a docstring with an example
(its runnable examples run here), and every command's ``--help`` starts with a one-line description and
ends with an example."""

from __future__ import annotations

import doctest
import inspect

import pytest

import kvpack
from kvpack.cli import build_parser


@pytest.mark.parametrize("name", kvpack.__all__)
def test_every_public_name_has_a_docstring_with_an_example_that_runs(name):
    obj = getattr(kvpack, name)
    doc = inspect.getdoc(obj) or ""
    assert len(doc.splitlines()) >= 3, f"kvpack.{name} needs a docstring that says what it is and how to use it"
    assert "Example:" in doc, f"kvpack.{name}'s docstring has no example"
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(obj, name, globs={"kvpack": kvpack}):
        runner.run(test)
    assert runner.failures == 0, f"kvpack.{name}'s example does not run as written"


def _subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_command_help_has_a_description_and_an_example(command):
    sub = _subcommands()[command]
    text = sub.format_help()
    description = text.split("\n\n")[1]
    assert description.strip() and "\n" not in description.strip(), f"kvpack {command}: no one-line description"
    tail = text.rstrip().split("\n\n")[-1].splitlines()
    assert tail[0] in ("example:", "examples:"), f"kvpack {command} --help ends without an example"
    assert all("kvpack " in line for line in tail[1:]), tail
