"""examples/finetune_ddp.py runs under ``torchrun --nproc_per_node=2`` (gloo, CPU) on a tiny
network, only rank 0 writes, and two processes end where one process ends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_distributed import HANG_GUARD_S, _torchrun

from snnconv import SpikingNetwork

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "finetune_ddp.py")
TINY = ["--width", "8", "--train-epochs", "2", "--T", "2", "--epochs", "1", "--max-steps", "3"]


@pytest.mark.slow
def test_two_processes_fine_tune_as_one_does(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    proc = _torchrun(["--out", str(two), *TINY], tmp_path / "torchrun.log", script=EXAMPLE)
    assert proc.returncode == 0, (tmp_path / "torchrun.log").read_text()
    assert sorted(os.listdir(two)) == ["checkpoints", "finetune.json", "snn.pt", "snn_finetuned.pt"]
    record = json.loads((two / "finetune.json").read_text())
    assert record["processes"] == 2 and record["global_batch"] == 64
    assert record["history"][0]["steps"] == 3

    one.mkdir()
    shutil.copy(two / "snn.pt", one / "snn.pt")  # the same start: the run skips its conversion
    single = subprocess.run([sys.executable, EXAMPLE, "--out", str(one), *TINY], capture_output=True,
                            text=True, timeout=HANG_GUARD_S)
    assert single.returncode == 0, single.stderr[-3000:]
    assert json.loads((one / "finetune.json").read_text())["processes"] == 1
    a = SpikingNetwork.load(two / "snn_finetuned.pt").state_dict()
    b = SpikingNetwork.load(one / "snn_finetuned.pt").state_dict()
    assert a.keys() == b.keys()
    for k, v in b.items():
        torch.testing.assert_close(a[k], v, rtol=0, atol=1e-5, msg=k)
