"""The CLI's shared flags: each defined once, and on exactly the commands the README names."""

from __future__ import annotations

import argparse

import pytest

from snnconv.cli import build_parser
from snnconv.cli.common import FLAGS, PARENTS

#: README.md, "Commands": which commands take which shared flag.
EVERY = ("demo", "convert", "finetune", "evaluate", "export", "inspect", "run", "check", "report", "backends")
CLAIMS = {
    "--out": EVERY, "--device": EVERY, "--seed": EVERY, "--quiet": EVERY,
    "--data": ("convert", "finetune", "evaluate", "run"),
    "--data-root": ("convert", "finetune", "evaluate", "run"),
    "--limit": ("convert", "finetune", "evaluate", "run"),
    "--model": ("convert", "finetune", "check"),
    "--T": ("convert", "finetune", "evaluate", "run"),
    "--L": ("convert",),
}


def _options(command: str) -> dict:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {opt: action for action in sub._actions for opt in action.option_strings}


@pytest.mark.parametrize("flag", sorted(CLAIMS))
def test_a_shared_flag_is_on_the_commands_the_readme_names(flag):
    have = tuple(c for c in EVERY if flag in _options(c))
    assert have == CLAIMS[flag]


def test_each_shared_flag_is_defined_once_and_means_the_same_everywhere():
    for parent, (_, flags) in PARENTS.items():
        assert set(flags) <= set(FLAGS), parent
    fields = ("default", "help", "type", "nargs", "choices", "const")
    for flag, spec in FLAGS.items():
        ref = argparse.ArgumentParser().add_argument(flag, **spec)
        for command in EVERY:
            action = _options(command).get(flag)
            if action is None or (command, flag) == ("run", "--T"):  # run: one T, default the file's
                continue
            assert all(getattr(action, f) == getattr(ref, f) for f in fields), (command, flag)


def test_run_takes_one_T_defaulting_to_the_file():
    action = _options("run")["--T"]
    assert action.nargs is None and action.default is None
    assert build_parser().parse_args(["convert", "--T", "2", "4"]).T == [2, 4]
