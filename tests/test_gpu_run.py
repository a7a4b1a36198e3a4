"""scripts/gpu_run.py, the GPU machine's one command: its conversion step runs end to end on
CPU in --small mode and writes its JSON; --device cuda without a GPU is a usage error (exit 2)
that writes nothing. (The whole command, tests and gpu_check included: docs/gpu.md.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu_run.py")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_small_cpu_run_converts_and_writes_json(tmp_path):
    argv = [SCRIPT, "--device", "cpu", "--small", "--skip", "tests", "gpu_check", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] and list(summary["steps"]) == ["convert"]
    env = json.loads((tmp_path / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["gpus"] == []
    record = json.loads((tmp_path / "convert.json").read_text())
    assert record["device"] == "cpu" and record["model"] == "resnet8"
    assert {"fold", "spiking", "finetune"} <= set(record["stages"])
    assert record["meta"]["settings"]["T"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_a_usage_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert _module().main(["--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is visible here" in err and "--device cpu" in err
    assert not out.exists()
