"""The backend registry: built-ins, third parties through entry points, clear errors, and the
import contracts (snnconv_backends never imports the conversion stages) checked by import-linter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import snnconv
from snnconv.errors import BackendError, SnnconvError
from snnconv_backends import BUILTINS, ENTRY_POINT_GROUP, Backend, available, get, names

REPO = Path(__file__).resolve().parents[1]


def _install_plugin(root: Path, body: str, name: str = "echo") -> str:
    """A minimal installed distribution: a module and a *.dist-info declaring the entry point.

    Each test gets its own module name (a module once imported stays in sys.modules)."""
    module = f"snnconv_plugin_{root.name.replace('-', '_')}"
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {module}:EchoBackend\n")
    return f"{module}:EchoBackend"


ECHO = """
    import torch
    from snnconv_backends import Backend, Program, RunResult

    class _Echo(Program):
        def run(self, x, T):
            out = x.unsqueeze(0).expand(T, *x.shape)
            return RunResult(outputs=out, spikes={}, synops={}, macs={})

    class EchoBackend(Backend):
        name = "echo"

        def compile(self, graph, **options):
            return _Echo()
"""


def test_builtins_are_listed_and_cpu_is_usable():
    listing = available()
    assert list(listing)[:len(BUILTINS)] == list(BUILTINS)
    for name, (ok, reason) in listing.items():
        assert isinstance(ok, bool) and isinstance(reason, str)
        assert ok or reason, f"{name} is unavailable without a reason"
    assert listing["cpu"] == (True, "")
    assert get("cpu").name == "cpu"
    assert snnconv.backends.get is get and snnconv.backends.available is available


def test_unknown_backend_is_refused_with_the_known_names():
    with pytest.raises(BackendError, match="unknown backend 'nope'.*cpu.*gpu") as info:
        get("nope")
    assert isinstance(info.value, SnnconvError)
    with pytest.raises(BackendError, match="string"):
        get(3)


def test_third_party_backend_through_the_entry_point_group(tmp_path, monkeypatch):
    import torch

    _install_plugin(tmp_path, ECHO)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "echo" in names()
    assert available()["echo"] == (True, "")
    backend = get("echo")
    assert isinstance(backend, Backend) and backend.name == "echo"
    result = backend.compile(None).run(torch.ones(2, 3), T=4)
    assert result.outputs.shape == (4, 2, 3)
    assert result.prediction.shape == (2, 3)


def test_a_broken_third_party_backend_is_reported_not_raised(tmp_path, monkeypatch):
    target = _install_plugin(tmp_path, "raise ImportError('needs libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ok, reason = available()["echo"]
    assert not ok and "needs libfoo" in reason and target in reason
    with pytest.raises(BackendError, match="needs libfoo"):
        get("echo")


def test_an_entry_point_that_is_not_a_backend_is_refused(tmp_path, monkeypatch):
    _install_plugin(tmp_path, "class EchoBackend:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BackendError, match="not a snnconv_backends.Backend"):
        get("echo")


def test_a_builtin_name_cannot_be_taken_by_a_third_party(tmp_path, monkeypatch):
    _install_plugin(tmp_path, ECHO, name="cpu")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(get("cpu")).__module__ == "snnconv_backends.cpu"
    assert names().count("cpu") == 1


def test_import_contracts_hold():
    """import-linter (pyproject's [tool.importlinter]): snnconv_backends imports only
    snnconv.errors and the IF neuron from snnconv, the neuron no other snnconv module, and the
    stages only earlier stages."""
    pytest.importorskip("importlinter")
    exe = Path(sys.executable).parent / "lint-imports"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c",
                                          "import sys; from importlinter.cli import lint_imports_command;"
                                          " sys.exit(lint_imports_command())"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd + ["--no-cache"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" in proc.stdout and " 0 broken" in proc.stdout


#: The layout's size rule (DESIGN.md): one job per module, none over this many lines.
MAX_MODULE_LINES = 700


def test_no_python_file_of_the_project_is_over_the_module_size_limit():
    """Every tracked Python file (the packages, backends, benchmarks, tutorials' builder, tests)
    stays within MAX_MODULE_LINES lines."""
    proc = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    sizes = {p: len((REPO / p).read_text(encoding="utf-8").splitlines())
             for p in proc.stdout.split() if (REPO / p).is_file()}
    assert len(sizes) > 50  # the listing found the project
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}


REPORTING = """
    import torch
    from snnconv_backends import Backend, Program, Report, RunResult, RunWarning, get

    class _Reporting(Program):
        default_batch = 7

        def __init__(self, graph):
            self.inner = get("cpu").compile(graph)
            self.sizes = []

        def run(self, x, T, *, exit_rule=None):
            import warnings

            self.sizes.append(len(x))
            warnings.warn("one batch looks odd", RunWarning)  # judged over all batches in report()
            return self.inner.run(x, T, exit_rule=exit_rule)

        def report(self, runs, *, analog_macs_per_image=0.0):
            images = sum(r.outputs.shape[1] for r in runs)
            return Report(text=f"odd chip: {len(runs)} runs, batches {self.sizes}",
                          verdict=f"WARNING: odd chip: {images} images judged", warnings=("too odd",),
                          record={"odd_check": {"images": images}})

    class EchoBackend(Backend):
        name = "odd"

        def compile(self, graph, **options):
            return _Reporting(graph)
"""


def test_run_prints_and_records_any_backends_report_without_knowing_its_name(tmp_path, monkeypatch, capsys,
                                                                             small_digits_snn):
    """``snnconv run`` takes what a backend reports (text, verdict, warnings, record, batch size)
    from its Program: a third-party backend's report reaches the page and the record, and
    ``--strict`` fails on its warnings."""
    import json

    from snnconv.cli import main
    from snnconv.nir.file import save_nir
    from snnconv.snn.nir_io import export_nir

    _install_plugin(tmp_path, REPORTING, name="odd")
    monkeypatch.syspath_prepend(str(tmp_path))
    save_nir(export_nir(small_digits_snn), tmp_path / "snn.nir")
    args = ["run", str(tmp_path / "snn.nir"), "--backend", "odd", "--data", "digits", "--T", "2", "--limit", "20"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the per-batch warnings are the report's to judge
        assert main(args) == 0
    out = capsys.readouterr().out
    assert "odd chip: 3 runs, batches [7, 7, 6]" in out and "WARNING: odd chip: 20 images judged" in out
    rec = json.loads(next((tmp_path / "backends").glob("odd_*.json")).read_text())
    assert rec["odd_check"] == {"images": 20}
    assert main(args + ["--strict"]) == 1
    assert "--strict: the odd backend's check failed (1 departure(s))" in capsys.readouterr().out
