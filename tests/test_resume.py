"""Fine-tuning checkpoints: written atomically each epoch and every N steps, verified on read,
and a run killed mid-epoch resumes to the same weights bit for bit (CPU)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import matplotlib.pyplot as plt
import pytest
import torch
import torch.nn as nn
from _interrupting import Interrupt, InterruptingDataset
from _probes import assert_bit_identical, state_copy
from torch.utils.data import DataLoader, Dataset

import snnconv
from snnconv import finetune
from snnconv.errors import CheckpointError
from snnconv.stages.finetune import CHECKPOINT_NAME, read_checkpoint

WORKER = os.path.join(os.path.dirname(__file__), "_finetune_worker.py")
# Not a speed bound: without it a worker that never checkpoints would hang the suite for ever.
HANG_GUARD_S = 900


def _assert_same_history(a: list[dict], b: list[dict]) -> None:
    def strip(h):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in h]
    assert strip(a) == strip(b)


class CheckpointWatcher(Dataset):
    """Reads the checkpoint file whenever a sample is fetched and records each new (epoch, step).

    Every read goes through ``read_checkpoint`` (sha256 verified), so a half-written file seen
    at any point of the run would raise.
    """

    def __init__(self, base: Dataset, path: str):
        self.base, self.path, self.seen, self._last = base, path, [], None

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        if os.path.exists(self.path):
            with open(self.path, "rb") as fh:
                raw = fh.read()
            if raw != self._last:
                self._last = raw
                state = read_checkpoint(self.path)
                self.seen.append((state["epoch"], state["step"]))
        return self.base[i]


# --- what is written, when ------------------------------------------------------------------

def test_a_checkpoint_is_written_every_epoch_and_every_n_steps(small_digits_snn, digits_data, tmp_path):
    train_set, _ = digits_data
    path = str(tmp_path / CHECKPOINT_NAME)
    watcher = CheckpointWatcher(train_set, path)
    finetune(small_digits_snn, DataLoader(watcher, batch_size=64), T=2, epochs=2,
             max_steps_per_epoch=4, checkpoint_every=2, checkpoint_dir=str(tmp_path), progress=False)
    final = read_checkpoint(path)
    assert watcher.seen + [(final["epoch"], final["step"])] == \
        [(0, 2), (0, 4), (1, 0), (1, 2), (1, 4), (2, 0)]
    assert sorted(os.listdir(tmp_path)) == [CHECKPOINT_NAME, "training_curve.png"], \
        "no temporary file is left behind"


def test_without_checkpoint_every_only_epoch_ends_are_written(small_digits_snn, digits_data, tmp_path):
    train_set, _ = digits_data
    path = str(tmp_path / CHECKPOINT_NAME)
    watcher = CheckpointWatcher(train_set, path)
    finetune(small_digits_snn, DataLoader(watcher, batch_size=64), T=2, epochs=3,
             max_steps_per_epoch=2, checkpoint_dir=str(tmp_path), progress=False)
    final = read_checkpoint(path)
    assert watcher.seen + [(final["epoch"], final["step"])] == [(1, 0), (2, 0), (3, 0)]


def test_a_training_curve_png_is_written_next_to_the_checkpoint(small_digits_snn, digits_loaders,
                                                                 tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    _, history = finetune(small_digits_snn, digits_loaders[0], T=2, epochs=2, max_steps_per_epoch=2,
                          checkpoint_dir=str(out), progress=False)
    png = out / "training_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = plt.imread(png)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
    state = read_checkpoint(str(out / CHECKPOINT_NAME))
    assert state["history"] == history
    finetune(small_digits_snn, digits_loaders[0], T=2, epochs=1, max_steps_per_epoch=1, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["run"], "without checkpoint_dir nothing is written"


# --- resuming -------------------------------------------------------------------------------

RUN = dict(T=2, epochs=2, max_steps_per_epoch=6, checkpoint_every=1, lr=3e-3, seed=3)


def test_a_killed_run_resumes_bit_identical_to_an_uninterrupted_one(small_digits_snn, digits_data,
                                                                    tmp_path):
    """SIGKILL a fine-tuning process mid-epoch 0, resume it here: same weights, same history."""
    train_set, _ = digits_data
    snn_path = str(tmp_path / "snn.pt")
    small_digits_snn.save(snn_path)
    killed_dir = tmp_path / "killed"
    ckpt = str(killed_dir / CHECKPOINT_NAME)
    config = dict(RUN, checkpoint_dir=str(killed_dir))
    # the worker's data blocks at its 5th batch, so the kill lands in epoch 0 whatever the timing
    log = open(tmp_path / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, WORKER, snn_path, str(tmp_path / "out"), json.dumps(config),
                             "--hang-after", str(4 * 64)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while True:
            if time.monotonic() > deadline:
                pytest.fail("no mid-epoch checkpoint appeared: " + (tmp_path / "worker.log").read_text())
            if proc.poll() is not None:
                pytest.fail(f"the worker exited with {proc.returncode} before the kill:\n"
                            + (tmp_path / "worker.log").read_text())
            if os.path.exists(ckpt):
                state = read_checkpoint(ckpt)
                if state["epoch"] == 0 and state["step"] >= 2:
                    break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    state = read_checkpoint(ckpt)
    assert state["epoch"] == 0 and 2 <= state["step"] <= 4, "killed in the middle of epoch 0"
    assert not os.path.exists(str(tmp_path / "out.rank0.pt")), "the worker never finished"

    loader = DataLoader(train_set, batch_size=64)
    snn = snnconv.SpikingNetwork.load(snn_path)
    resumed, h_resumed = finetune(snn, loader, resume=True, progress=False, **config)
    reference, h_reference = finetune(snn, loader, checkpoint_dir=str(tmp_path / "reference"),
                                      progress=False, **RUN)
    assert_bit_identical(state_copy(reference), state_copy(resumed))
    _assert_same_history(h_reference, h_resumed)
    assert read_checkpoint(ckpt)["epoch"] == 2


def _dropout_snn(digits_data):
    """An SNN with dropout between layers: training draws random numbers at every step."""
    torch.manual_seed(0)
    train_set, _ = digits_data
    ann = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                        nn.Flatten(), nn.Linear(512, 10)).eval()
    snn, _ = snnconv.convert(ann, DataLoader(train_set, batch_size=64), T=2, L=4, calib_batches=2,
                             progress=False)
    assert any(isinstance(m, nn.Dropout) for m in snn.modules())
    return snn


@pytest.mark.parametrize("stop_after_batches, checkpoint_every", [(3, 1), (5, 2), (8, 1)],
                         ids=["epoch0-step3", "epoch0-step4", "epoch1-step2"])
def test_an_interrupted_run_with_dropout_resumes_bit_identical(digits_data, tmp_path,
                                                               stop_after_batches, checkpoint_every):
    """The random state is restored where the interrupted run left it (dropout masks match)."""
    train_set, _ = digits_data
    snn = _dropout_snn(digits_data)
    run = dict(T=2, epochs=2, max_steps_per_epoch=6, lr=1e-2, seed=1, checkpoint_every=checkpoint_every,
               progress=False)
    crashing = DataLoader(InterruptingDataset(train_set, stop_after_batches * 64), batch_size=64)
    with pytest.raises(Interrupt):
        finetune(snn, crashing, checkpoint_dir=str(tmp_path / "a"), **run)
    state = read_checkpoint(str(tmp_path / "a" / CHECKPOINT_NAME))
    assert state["step"] > 0, "the interruption fell in the middle of an epoch"
    loader = DataLoader(train_set, batch_size=64)
    resumed, h_resumed = finetune(snn, loader, checkpoint_dir=str(tmp_path / "a"), resume=True, **run)
    reference, h_reference = finetune(snn, loader, checkpoint_dir=str(tmp_path / "b"), **run)
    assert_bit_identical(state_copy(reference), state_copy(resumed))
    _assert_same_history(h_reference, h_resumed)


def test_resume_without_a_checkpoint_starts_fresh(small_digits_snn, digits_loaders, tmp_path):
    train, _ = digits_loaders
    run = dict(T=2, epochs=1, max_steps_per_epoch=2, progress=False)
    a, _ = finetune(small_digits_snn, train, checkpoint_dir=str(tmp_path / "a"), resume=True, **run)
    b, _ = finetune(small_digits_snn, train, **run)
    assert_bit_identical(state_copy(a), state_copy(b))


def test_resuming_a_finished_run_returns_its_result_without_training(small_digits_snn, digits_data,
                                                                     tmp_path):
    train_set, _ = digits_data
    run = dict(T=2, epochs=2, max_steps_per_epoch=2, checkpoint_dir=str(tmp_path), progress=False)
    first, h_first = finetune(small_digits_snn, DataLoader(train_set, batch_size=64), **run)
    before = (tmp_path / CHECKPOINT_NAME).read_bytes()
    untouchable = InterruptingDataset(train_set, 0)  # reading any sample raises
    again, h_again = finetune(small_digits_snn, DataLoader(untouchable, batch_size=64), resume=True, **run)
    assert_bit_identical(state_copy(first), state_copy(again))
    assert h_again == h_first
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == before


# --- bad checkpoints ------------------------------------------------------------------------

def _write_one_checkpoint(snn, loader, folder) -> str:
    finetune(snn, loader, T=2, epochs=1, max_steps_per_epoch=1, checkpoint_dir=str(folder), progress=False)
    return str(folder / CHECKPOINT_NAME)


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1:]


def _valid_digest_of_garbage(raw: bytes) -> bytes:
    magic = raw.split(b"\n", 1)[0] + b"\n"
    payload = b"not a torch file at all"
    return magic + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


CORRUPTIONS = {
    "flip-in-payload": lambda raw: _flip(raw, len(raw) // 2),
    "flip-last-byte": lambda raw: _flip(raw, len(raw) - 1),
    "flip-in-digest": lambda raw: _flip(raw, 20),
    "flip-in-header": lambda raw: _flip(raw, 0),
    "truncated-half": lambda raw: raw[: len(raw) // 2],
    "truncated-one-byte": lambda raw: raw[:-1],
    "header-only": lambda raw: raw[:10],
    "empty": lambda raw: b"",
    "extra-bytes": lambda raw: raw + b"\0",
    "valid-digest-of-garbage": _valid_digest_of_garbage,
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_a_corrupted_checkpoint_is_detected_not_loaded(small_digits_snn, digits_loaders, tmp_path, corrupt):
    train, _ = digits_loaders
    path = _write_one_checkpoint(small_digits_snn, train, tmp_path)
    raw = open(path, "rb").read()
    read_checkpoint(path)  # intact: reads
    bad = CORRUPTIONS[corrupt](raw)
    assert bad != raw
    with open(path, "wb") as fh:
        fh.write(bad)
    with pytest.raises(CheckpointError, match=CHECKPOINT_NAME):
        read_checkpoint(path)
    with pytest.raises(CheckpointError):
        finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=1,
                 checkpoint_dir=str(tmp_path), resume=True, progress=False)
    assert open(path, "rb").read() == bad, "a bad checkpoint is left for the user to inspect"


def test_a_checkpoint_of_another_model_is_refused(small_digits_snn, digits_data, digits_loaders, tmp_path):
    from snnconv.models import small_cnn

    train, _ = digits_loaders
    _write_one_checkpoint(small_digits_snn, train, tmp_path)
    torch.manual_seed(0)
    other, _ = snnconv.convert(small_cnn(num_classes=10, in_channels=1, width=4).eval(), train, T=2,
                               L=4, calib_batches=1, progress=False)
    with pytest.raises(CheckpointError, match="another model"):
        finetune(other, train, T=2, epochs=1, max_steps_per_epoch=1, checkpoint_dir=str(tmp_path),
                 resume=True, progress=False)


@pytest.mark.parametrize("change", [dict(lr=5e-4), dict(T=3), dict(seed=1), dict(batch_size=32)],
                         ids=["lr", "T", "seed", "batch"])
def test_a_checkpoint_of_a_run_with_other_settings_is_refused(small_digits_snn, digits_loaders, tmp_path,
                                                              change):
    train, _ = digits_loaders
    _write_one_checkpoint(small_digits_snn, train, tmp_path)
    run = dict(T=2, epochs=1, max_steps_per_epoch=1, checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(CheckpointError, match="other settings"):
        finetune(small_digits_snn, train, resume=True, **{**run, **change})
    # settings that do not change the trajectory may differ
    finetune(copy.deepcopy(small_digits_snn), train, resume=True, checkpoint_every=5, **run)


def test_a_checkpoint_from_before_a_setting_existed_resumes_with_its_default(small_digits_snn,
                                                                            digits_loaders, tmp_path):
    """A checkpoint written before ``distill`` was a setting: that run had the default (0)."""
    from snnconv.io.checkpoint import write_checkpoint as _write_checkpoint

    train, _ = digits_loaders
    run = dict(T=2, epochs=2, max_steps_per_epoch=2, checkpoint_every=1, checkpoint_dir=str(tmp_path),
               progress=False)
    with pytest.raises(Interrupt):  # in the second batch, after the checkpoint of the first
        finetune(small_digits_snn, DataLoader(InterruptingDataset(train.dataset, 64), batch_size=64),
                 **run)
    path = str(tmp_path / CHECKPOINT_NAME)
    state = read_checkpoint(path)
    assert (state["epoch"], state["step"]) == (0, 1)
    del state["config"]["distill"]
    _write_checkpoint(path, state)
    resumed, _ = finetune(small_digits_snn, train, resume=True, **run)
    reference, _ = finetune(small_digits_snn, train, **{**run, "checkpoint_dir": str(tmp_path / "ref")})
    assert_bit_identical(state_copy(reference), state_copy(resumed))
    with pytest.raises(CheckpointError, match="label_smoothing: checkpoint 0.0, now 0.1"):
        finetune(small_digits_snn, train, resume=True, label_smoothing=0.1, **run)


def test_without_resume_an_existing_checkpoint_is_replaced(small_digits_snn, digits_loaders, tmp_path):
    train, _ = digits_loaders
    path = tmp_path / CHECKPOINT_NAME
    path.write_bytes(b"junk")
    tuned, _ = finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=1,
                        checkpoint_dir=str(tmp_path), progress=False)
    assert_bit_identical(read_checkpoint(str(path))["model"], state_copy(tuned))
