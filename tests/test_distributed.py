"""Fine-tuning under ``torchrun --nproc_per_node=2`` (gloo, CPU) computes what one process
computes on the same global batches, keeps the ranks in step, and only rank 0 writes files.

One launch runs several fine-tunings in a row (process start-up dominates the cost):

- ``sgd``: SGD, checkpoints to a per-rank folder (only rank 0's may appear);
- ``adamw``: AdamW with warm-up and label smoothing;
- ``block``: activation checkpointing by blocks inside DistributedDataParallel;
- ``resume``: resumes, on two processes, a checkpoint a single process wrote mid-epoch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from _interrupting import Interrupt, InterruptingDataset
from torch.utils.data import DataLoader

import snnconv
from snnconv import finetune
from snnconv.stages.finetune import CHECKPOINT_NAME, read_checkpoint

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

WORKER = os.path.join(os.path.dirname(__file__), "_finetune_worker.py")
# Not a speed bound: a deadlocked process group would otherwise hang the suite for ever.
HANG_GUARD_S = 900
COMMON = dict(T=2, epochs=2, max_steps_per_epoch=3)
RUNS = {
    "sgd": dict(COMMON, optimizer="sgd", lr=1e-2),
    "adamw": dict(COMMON, optimizer="adamw", lr=1e-3, warmup_steps=2, label_smoothing=0.1),
    "block": dict(COMMON, optimizer="sgd", lr=1e-2, activation_checkpointing="block"),
    "resume": dict(COMMON, optimizer="sgd", lr=1e-2, checkpoint_every=1),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], log_path, script: str = WORKER) -> subprocess.CompletedProcess:
    """``script args`` on two processes (gloo, CPU); its output in ``log_path``."""
    for _attempt in range(2):  # a port taken between _free_port() and torchrun: try another
        with open(log_path, "wb") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                 "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), script, *args],
                stdout=log, stderr=subprocess.STDOUT, timeout=HANG_GUARD_S)
        text = open(log_path, errors="replace").read()
        if proc.returncode == 0 or "address already in use" not in text.lower():
            return proc
    return proc


@pytest.fixture(scope="module")
def ddp_results(_small_digits_snn, digits_data, tmp_path_factory):
    """Runs every RUNS entry on two processes; returns the folder and the per-rank results.

    Under pytest-xdist the launch happens once per session, not once per worker: the first
    worker runs it under a file lock, the others read its results.
    """
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this session's folder, common to its workers
    base = shared / "snnconv-ddp"
    with FileLock(str(shared / "snnconv-ddp.lock")):
        if not (base / "done").exists():
            base.mkdir(exist_ok=True)
            _launch(_small_digits_snn, digits_data, base)
            (base / "done").write_text("ok\n")
    snn_path = str(base / "snn.pt")
    results = {name: [torch.load(base / f"out.{i}.rank{r}.pt", weights_only=True) for r in (0, 1)]
               for i, name in enumerate(RUNS)}
    return base, snn_path, results


def _launch(snn, digits_data, base) -> None:
    snn_path = str(base / "snn.pt")
    snn.save(snn_path)
    train_set, _ = digits_data
    # a single process stops mid-epoch 0 (after 2 of 3 steps); the two processes resume it
    crashing = DataLoader(InterruptingDataset(train_set, 2 * 64), batch_size=64)
    with pytest.raises(Interrupt):
        finetune(snnconv.SpikingNetwork.load(snn_path), crashing, checkpoint_dir=str(base / "resume"),
                 progress=False, **RUNS["resume"])
    assert read_checkpoint(str(base / "resume" / CHECKPOINT_NAME))["step"] == 2
    runs = [dict(RUNS["sgd"], checkpoint_dir=str(base / "rank{rank}")), RUNS["adamw"], RUNS["block"],
            dict(RUNS["resume"], checkpoint_dir=str(base / "resume"), resume=True)]
    proc = _torchrun([snn_path, str(base / "out"), json.dumps(runs)], base / "torchrun.log")
    assert proc.returncode == 0, (base / "torchrun.log").read_text()


@pytest.fixture(scope="module")
def single_process(ddp_results, digits_data):
    """The same runs on one process (in this one), from the same saved network."""
    _, snn_path, _ = ddp_results
    train_set, _ = digits_data
    loader = DataLoader(train_set, batch_size=64)
    out = {}
    for name, run in RUNS.items():
        tuned, history = finetune(snnconv.SpikingNetwork.load(snn_path), loader, progress=False, **run)
        out[name] = {"state": tuned.state_dict(), "history": history}
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_match_one_process_on_the_same_global_batch(ddp_results, single_process, name):
    _, _, results = ddp_results
    one = single_process[name]
    for rank_result in results[name]:
        assert rank_result["world"] == 2
        assert rank_result["state"].keys() == one["state"].keys()
        for k, v in one["state"].items():
            torch.testing.assert_close(rank_result["state"][k], v, rtol=0, atol=1e-5, msg=k)
        assert len(rank_result["history"]) == len(one["history"])
        for got, want in zip(rank_result["history"], one["history"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["train_acc"] == pytest.approx(want["train_acc"], abs=1e-9)
            assert got["val_acc"] == pytest.approx(want["val_acc"], abs=1e-9)


@pytest.mark.parametrize("name", list(RUNS))
def test_the_ranks_end_with_the_same_weights_and_the_same_validation(ddp_results, name):
    _, _, results = ddp_results
    r0, r1 = results[name]
    for k in r0["state"]:
        assert torch.equal(r0["state"][k], r1["state"][k]), k
    strip = [[{k: v for k, v in h.items() if k != "seconds"} for h in r["history"]] for r in (r0, r1)]
    assert strip[0] == strip[1], "every rank evaluates the same model on the same validation split"


def test_only_rank_0_writes_the_checkpoint_and_the_curve(ddp_results):
    base, _, results = ddp_results
    assert sorted(os.listdir(base / "rank0")) == [CHECKPOINT_NAME, "training_curve.png"]
    assert not (base / "rank1").exists(), "rank 1 wrote into its checkpoint_dir"
    state = read_checkpoint(str(base / "rank0" / CHECKPOINT_NAME))
    assert (state["epoch"], state["step"]) == (2, 0)
    assert state["global_batch"] == 64
    assert state["history"] == results["sgd"][0]["history"]


def test_a_single_process_checkpoint_resumes_on_two_processes(ddp_results):
    base, _, _ = ddp_results
    state = read_checkpoint(str(base / "resume" / CHECKPOINT_NAME))
    assert (state["epoch"], state["step"]) == (2, 0), "the two processes finished the run"
    assert sorted(os.listdir(base / "resume")) == [CHECKPOINT_NAME, "training_curve.png"]
