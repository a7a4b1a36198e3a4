"""Importing a backend (or snnconv.errors, or the bare package) loads no conversion stage: checked
in a fresh interpreter, where sys.modules shows what an import really pulled in."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: The conversion stages and their calibration passes.
STAGES = ("snnconv.pipeline", "snnconv.stages", "snnconv.calibration", "snnconv.snn.network",
          "snnconv.snn.nir_io", "snnconv.analysis.health", "snnconv.guards", "snnconv.graph")
#: What of snnconv a backend may load: the package itself, its errors, the shared names, the NIR
#: package, the neurons' step (stage-free), the energy figures and the early-exit rule, with the
#: packages around them.
ALLOWED = {"snnconv", "snnconv.errors", "snnconv.vocabulary", "snnconv.exit_rule",
           "snnconv.nir", "snnconv.nir.format", "snnconv.nir.reader", "snnconv.nir.node_readers", "snnconv.nir.leaky",
           "snnconv.nir.values", "snnconv.nir.ops", "snnconv.snn", "snnconv.snn.neuron", "snnconv.analysis",
           "snnconv.analysis.energy"}

MODULES = ["snnconv_backends", "snnconv_backends.registry", "snnconv.nir.reader",
           "snnconv_backends.engine", "snnconv_backends.cpu", "snnconv_backends.gpu",
           "snnconv_backends.loihi2", "snnconv_backends.lava", "snnconv.errors", "snnconv.analysis.energy",
           "snnconv.exit_rule", "snnconv"]


def _loaded_after_import(module: str) -> list[str]:
    """The snnconv modules in sys.modules of a fresh interpreter after ``import module``."""
    code = (f"import json, sys, {module}\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'snnconv')))")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_importing_loads_no_conversion_stage(module):
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{module} is not installed")
    loaded = _loaded_after_import(module)
    stages = sorted(m for m in loaded if m.startswith(STAGES))
    assert not stages, f"import {module} loaded stages {stages}"
    assert set(loaded) <= ALLOWED, f"import {module} loaded {sorted(set(loaded) - ALLOWED)}"


def test_the_lazy_package_still_offers_every_public_name():
    code = ("import json, snnconv\n"
            "listed = [n for n in snnconv.__all__ if n in dir(snnconv)]\n"
            "missing = [n for n in snnconv.__all__ if getattr(snnconv, n, None) is None]\n"
            "import snnconv.stages.finetune\n"  # binding the submodule leaves the name the function
            "print(json.dumps([len(snnconv.__all__), len(listed), missing, callable(snnconv.finetune),"
            " snnconv.finetune is sys.modules['snnconv.stages.finetune'].finetune]))")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", "import sys\n" + code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    n_all, n_listed, missing, callable_, same = json.loads(proc.stdout.strip().splitlines()[-1])
    assert n_all == n_listed and not missing
    assert callable_ and same


def test_the_wheel_holds_both_packages_and_no_top_level_backends(tmp_path):
    """The backends live under backends/ in the tree; the wheel installs them as snnconv_backends
    beside snnconv, and an import from outside the repository finds the installed copies."""
    pytest.importorskip("setuptools")
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    had_build = (REPO / "build").exists()
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(wheel_dir), str(REPO)],
                           capture_output=True, text=True, timeout=600)
    if not had_build:  # setuptools builds in the tree: leave it as found
        import shutil

        shutil.rmtree(REPO / "build", ignore_errors=True)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheel_dir.glob("snnconv-*.whl")
    import zipfile
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {"snnconv", "snnconv_backends"} <= tops and "backends" not in tops, tops
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                              "--disable-pip-version-check", "--target", str(target), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    code = ("import importlib.util, json, snnconv, snnconv_backends, snnconv_backends.cpu\n"
            "print(json.dumps([snnconv.__file__, snnconv_backends.cpu.__file__,"
            " importlib.util.find_spec('backends') is None, sorted(snnconv_backends.available())]))")
    env = dict(os.environ, PYTHONPATH=str(target))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    snnconv_file, cpu_file, no_backends, available = json.loads(proc.stdout.strip().splitlines()[-1])
    assert snnconv_file.startswith(str(target)) and cpu_file.startswith(str(target))
    assert no_backends and "cpu" in available
