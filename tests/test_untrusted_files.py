"""Network files and fine-tuning checkpoints from strangers: forged with their digests
recomputed, they load correctly or raise an snnconv error, within the stated memory budget,
and no reader waits on a FIFO."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv
from snnconv.cli import main
from snnconv.errors import CheckpointError
from snnconv.io.checkpoint import read_checkpoint, write_checkpoint
from snnconv.io.digest import content_digest
from snnconv.io.files import MAX_FILE_BYTES
from snnconv.snn.network import SpikingNetwork
from snnconv.stages.finetune import CHECKPOINT_NAME, finetune


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(F.relu(self.conv(x))), 1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    x = torch.rand(16, 1, 6, 6)
    snn, _ = snnconv.convert(_Net().eval(), [(x, torch.zeros(16, dtype=torch.long))], T=2,
                             finetune_epochs=0, reconstruction_steps=0, progress=False,
                             on_collapse="warn")
    path = tmp_path_factory.mktemp("saved") / "snn.pt"
    snn.save(path)
    return path, x


def _forge(payload: dict, path) -> None:
    try:
        payload["digest"] = content_digest({k: v for k, v in payload.items() if k != "digest"})
    except RuntimeError:  # a sparse tensor has no digest of ours: the reader must refuse it anyway
        pass
    torch.save(payload, path)


def _neuron(payload: dict) -> str:
    return next(k for k, m in payload["graph"]["modules"].items() if m["type"] == "IFNeuron")


def _value_attack(payload: dict, how: str) -> None:
    state, neuron = payload["state_dict"], _neuron(payload)
    if how == "NaN threshold":
        state[f"{neuron}.theta"] = torch.full_like(state[f"{neuron}.theta"], float("nan"))
    elif how == "inf threshold":
        state[f"{neuron}.theta"] = torch.full_like(state[f"{neuron}.theta"], float("inf"))
    elif how == "zero threshold":
        state[f"{neuron}.theta"] = torch.zeros_like(state[f"{neuron}.theta"])
    elif how == "negative threshold":
        state[f"{neuron}.theta"] = -torch.ones_like(state[f"{neuron}.theta"])
    elif how == "NaN v_init":
        state[f"{neuron}.v_init"] = torch.full_like(state[f"{neuron}.v_init"], float("nan"))
    elif how == "v_init above theta":
        state[f"{neuron}.v_init"] = torch.full_like(state[f"{neuron}.v_init"], 7.0)
    elif how == "NaN weight":
        key = next(k for k in state if k.endswith("weight"))
        state[key] = torch.full_like(state[key], float("nan"))
    elif how == "huge adaptive pool":
        pool = next(m for m in payload["graph"]["modules"].values() if m["type"] == "AdaptiveAvgPool2d")
        pool["config"]["output_size"] = 2**20
    elif how == "sparse tensor":
        key = next(k for k in state if k.endswith("weight"))
        state[key] = state[key].to_sparse()
    elif how == "deep metadata":
        deep: dict = {}
        for _ in range(5000):
            deep = {"a": deep}
        payload["meta"] = deep
    elif how == "NaN T":
        payload["T"] = float("nan")
    else:
        raise AssertionError(how)


VALUE_ATTACKS = ["NaN threshold", "inf threshold", "zero threshold", "negative threshold", "NaN v_init",
                 "v_init above theta", "NaN weight", "huge adaptive pool", "sparse tensor",
                 "deep metadata", "NaN T"]


@pytest.mark.parametrize("how", VALUE_ATTACKS)
def test_values_the_nir_reader_refuses_are_refused_in_a_network_file(saved, tmp_path, how):
    path, x = saved
    payload = torch.load(path, weights_only=True)
    _value_attack(payload, how)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(60_000)  # what the attacker's own Python allows itself to write it
    try:
        _forge(payload, tmp_path / "evil.pt")
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(CheckpointError):
        SpikingNetwork.load(tmp_path / "evil.pt")(x)


def _deflated_bomb(src, dst, inflated: int) -> None:
    """``src``'s entries plus one entry of ``inflated`` zero bytes, deflated (about 1/1000)."""
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as b:
        for info in a.infolist():
            b.writestr(info, a.read(info.filename))
        root = a.infolist()[0].filename.split("/")[0]
        with b.open(f"{root}/data/9999", "w", force_zip64=True) as fh:
            block = bytes(2**24)
            for _ in range(inflated // len(block)):
                fh.write(block)


def test_a_small_file_that_inflates_past_the_budget_is_refused_before_inflating(saved, tmp_path):
    path, _ = saved
    _deflated_bomb(path, tmp_path / "bomb.pt", MAX_FILE_BYTES + 2**24)
    assert os.path.getsize(tmp_path / "bomb.pt") < 8 * 2**20
    with pytest.raises(CheckpointError, match="inflate"):
        SpikingNetwork.load(tmp_path / "bomb.pt")


def test_a_fifo_is_refused_without_waiting(saved, tmp_path):
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="FIFO"):
        SpikingNetwork.load(fifo)
    assert main(["export", str(fifo), str(tmp_path / "out.nir"), "--quiet"]) == 2


# --- fine-tuning checkpoints ------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(small_digits_snn_module, tmp_path_factory):
    snn, loader = small_digits_snn_module
    folder = tmp_path_factory.mktemp("ckpt")
    finetune(snn, loader, T=2, epochs=2, max_steps_per_epoch=1, checkpoint_dir=str(folder),
             progress=False)
    return snn, loader, folder


@pytest.fixture(scope="module")
def small_digits_snn_module(_small_digits_snn, digits_data):
    from torch.utils.data import DataLoader

    loader = DataLoader(digits_data[0], batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return _small_digits_snn, loader


def _payloads(state: dict) -> dict[str, dict]:
    """Crafted checkpoint records: each field with a wrong type or an out-of-range value."""
    bad: dict[str, dict] = {}
    for key in set(state) - {"start_digest", "data_size"}:  # files older than these fields: valid
        bad[f"no {key}"] = {k: v for k, v in state.items() if k != key}
    values = {
        "epoch": [-1, 99, 1.5, "1", True, None], "step": [-1, 10**9, 0.5, None],
        "history": ["notalist", [1, 2], [{"loss": "x"}], [{}] * 50, None],
        "best_val": [float("nan"), float("inf"), 1e9, "90", None],
        "model": [{}, {"x": torch.zeros(1)}, "weights", None],
        "best_state": [{"x": torch.zeros(1)}, 7],
        "optimizer": [[], "adam", {"state": 1, "param_groups": "x"}, {}],
        "scheduler": ["x", {"last_epoch": "x"}], "scaler": [3],
        "rng": [{}, {"cpu": torch.zeros(3)}, {"cpu": "x"}, "x"],
        "partial": [None], "config": ["x", [1]],
    }
    for key, options in values.items():
        for i, v in enumerate(options):
            bad[f"{key}={i}"] = {**state, key: v, **({"step": 1} if key == "partial" else {})}
    model = state["model"]
    k0 = next(iter(model))
    bad["NaN weights"] = {**state, "model": {**model, k0: torch.full_like(model[k0], float("nan"))}}
    return bad


def test_crafted_checkpoints_with_a_valid_sha256_are_refused_by_name(checkpoint, tmp_path):
    snn, loader, folder = checkpoint
    state = read_checkpoint(str(folder / CHECKPOINT_NAME))
    outcomes = {}
    for name, payload in _payloads(state).items():
        write_checkpoint(str(tmp_path / CHECKPOINT_NAME), payload)
        try:
            finetune(snn, loader, T=2, epochs=2, max_steps_per_epoch=1, checkpoint_dir=str(tmp_path),
                     resume=True, progress=False)
            outcomes[name] = "trained"
        except CheckpointError:
            outcomes[name] = "refused"
        except Exception as exc:  # noqa: BLE001 - the test reports every raw exception at once
            outcomes[name] = f"raw {type(exc).__name__}: {exc}"
    raw = {k: v for k, v in outcomes.items() if v != "refused"}
    assert not raw, raw
    assert len(outcomes) >= 40


def test_reading_forged_files_stays_within_the_budget(saved, tmp_path):
    """All forged network files in one child process: snnconv errors only, and its peak memory
    stays under the budget above what importing torch costs."""
    path, _ = saved
    _deflated_bomb(path, tmp_path / "bomb.pt", MAX_FILE_BYTES + 2**24)
    script = textwrap.dedent("""
        import json, resource, sys, torch
        from snnconv.snn.network import SpikingNetwork
        from snnconv.errors import SnnconvError
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = {}
        for name in ["bomb.pt", "snn.pt"]:
            try:
                SpikingNetwork.load(name)
                out[name] = "loaded"
            except SnnconvError as exc:
                out[name] = type(exc).__name__
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"out": out, "base": base, "peak": peak}))
    """)
    os.link(path, tmp_path / "snn.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["out"] == {"bomb.pt": "CheckpointError", "snn.pt": "loaded"}
    assert report["peak"] - report["base"] < MAX_FILE_BYTES
