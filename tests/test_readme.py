"""The README's examples run as written: the first Python block, and the command-line block.

Each runs in a fresh process in a temporary folder, against this checkout (``PYTHONPATH``), so
what a user copies from the README is what is tested.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _blocks(language: str) -> list[str]:
    """The fenced code blocks of README.md in ``language``, in order."""
    with open(README, encoding="utf-8") as fh:
        text = fh.read()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}


def _cli_block() -> list[list[str]]:
    """The first ``sh`` block whose every command is ``snnconv ...``, one argv per line."""
    for block in _blocks("sh"):
        lines = block.replace("\\\n", " ").splitlines()  # a trailing backslash continues a line
        commands = [shlex.split(line, comments=True) for line in lines]
        commands = [c for c in commands if c]
        if commands and all(c[0] == "snnconv" for c in commands):
            return commands
    raise AssertionError("README.md has no ```sh block of snnconv commands")


def _run(argv: list[str], cwd, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_the_readme_has_a_python_block_of_at_most_ten_lines():
    blocks = _blocks("python")
    assert blocks, "README.md has no ```python block"
    lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(lines) <= 10, f"the first Python block has {len(lines)} lines"


@pytest.mark.slow
def test_the_first_python_block_runs_as_written(tmp_path):
    code = _blocks("python")[0]
    proc = _run([sys.executable, "-c", code], tmp_path, timeout=1800)  # a hang guard only
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert re.search(r"SNN T=4: \d+\.\d\d%", proc.stdout), proc.stdout


@pytest.mark.slow
def test_the_command_line_block_runs_line_by_line(tmp_path):
    commands = _cli_block()
    assert len(commands) >= 3
    for argv in commands:
        proc = _run([sys.executable, "-m", "snnconv.cli", *argv[1:]], tmp_path, timeout=1800)  # a hang guard only
        assert proc.returncode == 0, (shlex.join(argv), proc.stdout[-2000:], proc.stderr[-4000:])


def test_the_nir_block_writes_and_reads_a_network_with_its_prefix_in_one_call(small_digits_snn, tmp_path,
                                                                              monkeypatch):
    """The README's NIR block, run as written on a converted network, with no private import."""
    import torch

    block = next(b for b in _blocks("python") if "save_nir" in b)
    assert "import" not in block and "prefixfile" not in block
    monkeypatch.chdir(tmp_path)
    images = torch.randn(4, 1, 8, 8)
    scope = {"snnconv": __import__("snnconv"), "snn": small_digits_snn, "images": images}
    exec(block, scope)
    with torch.no_grad():
        assert scope["result"].outputs.shape == small_digits_snn.run(images, 4).shape
    assert (tmp_path / "snn.nir").is_file()
