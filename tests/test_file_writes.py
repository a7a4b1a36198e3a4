"""Writers that leave nothing behind: a save killed with SIGKILL keeps the old file, and the next
save to the same target removes the temporary file it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from _nirfiles import same_graph, tiny_graph

from snnconv.io.atomic import atomic_write_bytes, stale_temporaries
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.nir_io import load_nir, save_nir

_WORKER = os.path.join(os.path.dirname(__file__), "_interrupted_save.py")


def _tiny_snn() -> SpikingNetwork:
    import torch.nn as nn

    import snnconv

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.rand(16, 3, 2, 2)
    qann = snnconv.calibrate_qcfs(model, [x], L=4, progress=False)
    return snnconv.to_spiking(qann, T=4)


def _kill_mid_save(kind: str, path) -> None:
    proc = subprocess.Popen([sys.executable, _WORKER, kind, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.wait()
            pytest.fail(f"the worker exited with {proc.returncode} before the kill:\n{proc.stderr.read()}")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("kind", ["nir", "snn"])
def test_a_killed_save_keeps_the_target_and_the_next_save_sweeps_its_temporary(tmp_path, kind):
    path = tmp_path / ("net.nir" if kind == "nir" else "snn.pt")
    if kind == "nir":
        save_nir(tiny_graph(), path)
        expected, load = load_nir(path), load_nir
    else:
        _tiny_snn().save(path)
        expected, load = SpikingNetwork.load(path).net.state_dict(), SpikingNetwork.load
    before = path.read_bytes()
    _kill_mid_save(kind, path)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != path.name)
    assert len(left) == 1 and left[0].startswith(".tmp-"), left  # what SIGKILL leaves
    assert path.read_bytes() == before  # the target is untouched
    assert [os.path.basename(p) for p in stale_temporaries(path)] == left
    if kind == "nir":
        save_nir(load(path), path)
        assert same_graph(load_nir(path), expected)
    else:
        load(path).save(path)
        state = SpikingNetwork.load(path).net.state_dict()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    path = tmp_path / "out.bin"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = tmp_path / f".tmp-{sleeper.pid}-0123abcd-out.bin"
        live.write_bytes(b"being written")
        other = tmp_path / ".tmp-1-0123abcd-other.bin"  # another target's
        other.write_bytes(b"x")
        atomic_write_bytes(path, b"data")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, live.name, other.name])
    finally:
        sleeper.kill()
        sleeper.wait()
    atomic_write_bytes(path, b"data 2")  # its writer is gone now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, other.name])
    assert path.read_bytes() == b"data 2"
