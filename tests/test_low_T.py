"""The few-step pipeline: the QCFS path at T = L, the default fine-tuning and its budget."""

from __future__ import annotations

import statistics
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv import defaults


def _digits_cnn(train_set, seed: int, epochs: int = 6):
    from snnconv.demo import train_ann
    from snnconv.models import small_cnn

    torch.manual_seed(seed)
    loader = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed))
    return train_ann(small_cnn(num_classes=10, in_channels=1, width=8), loader, epochs=epochs, progress=False)


def test_qcfs_path_at_T_equal_L_comes_within_three_points_of_its_qcfs_ann(digits_data):
    """QCFS-trained at L = 4 and run at T = 4 without BPTT, the SNN of a small CNN trained on
    real digits is within 3 points of its own QCFS-ANN, on the mean over three seeds (each ANN
    trained afresh): the calibration targets the function the network was trained for."""
    train_set, test_set = digits_data
    test = DataLoader(test_set, batch_size=256)
    gaps = []
    for seed in range(3):
        ann = _digits_cnn(train_set, seed)
        loader = DataLoader(train_set, batch_size=64, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            snn, meta = snnconv.convert(ann, loader, T=4, L=4, qcfs_epochs=2, finetune_epochs=0, seed=seed,
                                        eval_loader=test, progress=False, on_collapse="warn")
        assert meta.settings["bias_calibration_T"] == 4  # calibrated at the trained L, not 2T
        assert "finetune" not in [s.name for s in meta.stages]
        gaps.append(meta.accuracy["qcfs"] - meta.accuracy["snn"]["4"])
    assert statistics.fmean(gaps) <= 3.0, gaps


def test_default_fine_tunes_a_labelled_loader_at_low_T_only(small_digits_ann, digits_data):
    """convert(model, loader) fine-tunes (readouts at T/2, T, 2T) at T <= 8, from the labels
    and the ANN's outputs, or from the ANN's outputs alone where the loader has no labels;
    T = 16 gets the training-free conversion; L follows T."""
    train_set, _ = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    _, meta = snnconv.convert(small_digits_ann, loader, T=4, progress=False, on_collapse="warn")
    assert [s.name for s in meta.stages][-1] == "finetune"
    assert meta.settings["finetune"]["horizons"] == (2, 4, 8) and meta.settings["finetune"]["T"] == 8
    assert meta.settings["L"] == 4
    budget = meta.settings["budget"]
    assert budget["finetune_steps_run"] == budget["finetune_steps"] >= defaults.FINETUNE_MIN_STEPS
    assert budget["finetune_seconds"] > 0 and budget["ann_epoch_steps"] == len(loader)
    assert budget["qcfs_steps"] == 0  # no max-pooling: no QCFS training

    images = DataLoader(train_set.tensors[0], batch_size=64)
    _, meta = snnconv.convert(small_digits_ann, images, T=4, progress=False, on_collapse="warn")
    assert [s.name for s in meta.stages][-1] == "finetune"
    assert "no labels" in meta.settings["finetune_default"] and meta.settings["finetune"]["distill"] == 1.0
    assert meta.settings["budget"]["finetune_steps_run"] == budget["finetune_steps"]
    _, meta = snnconv.convert(small_digits_ann, images, T=4, finetune_epochs=0, progress=False,
                              on_collapse="warn")
    assert "finetune" not in [s.name for s in meta.stages] and meta.settings["qcfs_epochs"] == 0
    _, meta = snnconv.convert(small_digits_ann, loader, T=16, progress=False, on_collapse="warn")
    assert "finetune" not in [s.name for s in meta.stages] and meta.settings["budget"]["finetune_steps"] == 0
    assert meta.settings["budget"]["qcfs_steps"] == 0


class _Counting(TensorDataset):
    """A TensorDataset that counts the samples read."""

    reads = 0

    def __getitem__(self, i):
        type(self).reads += 1
        return super().__getitem__(i)


def test_the_budget_bounds_the_fine_tuning_steps(small_digits_ann, monkeypatch):
    """With the step caps at 3, a loader of 125 batches is QCFS-trained and fine-tuned for 3
    optimiser steps each, counted in meta and in the samples the loader gave (the planned steps
    are the ones run)."""
    monkeypatch.setattr(defaults, "FINETUNE_MAX_STEPS", 3)
    monkeypatch.setattr(defaults, "FINETUNE_MIN_STEPS", 3)
    qcfs = defaults.QCFSTrainConfig(epochs=1, max_steps=3, seed=0)
    g = torch.Generator().manual_seed(0)
    data = _Counting(torch.rand(2000, 1, 8, 8, generator=g), torch.randint(0, 10, (2000,), generator=g))
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    _Counting.reads = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, meta = snnconv.convert(small_digits_ann, loader, T=2, calib_batches=2, qcfs_train=qcfs,
                                  progress=False, on_collapse="warn")
    budget = meta.settings["budget"]
    assert budget["finetune_steps"] == budget["finetune_steps_run"] == 3
    assert meta.stage("finetune").changes["steps"] == 3
    assert budget["qcfs_steps"] == budget["qcfs_steps_run"] == 3
    # 3 + 3 steps, a few calibration batches, the 10% validation split and the held-out images
    # that keep the better network: far from the 2,000 samples that one uncapped epoch would read
    assert _Counting.reads < 1100, _Counting.reads


@pytest.mark.parametrize("images,batch,epochs", [(5000, 128, 2), (60000, 128, 1), (10**6, 128, 1),
                                                 (1000, 128, 8), (None, 128, 1)])
def test_the_default_budget_is_whole_epochs_that_reach_the_least_steps(images, batch, epochs):
    """convert()'s default fine-tuning runs whole epochs until FINETUNE_MIN_STEPS steps: two of
    the robustness matrix's 5,000 images (281 steps of 16 each), one of Fashion-MNIST's 60,000,
    at most FINETUNE_MAX_EPOCHS for a small data set, one for a loader without a length."""
    if images is None:
        loader = iter(())
    else:
        loader = DataLoader(TensorDataset(torch.zeros(images, 1), torch.zeros(images)), batch_size=batch)
    assert defaults.default_finetune_epochs(loader) == epochs


def test_max_steps_bounds_the_qcfs_training_steps(small_digits_ann):
    """QCFS training of 5 epochs over 20 training batches with ``max_steps=7`` runs 7 optimiser
    steps (counted in meta: planned and run), ending inside its first epoch."""
    from snnconv.stages.qcfs import QCFSTrainConfig

    g = torch.Generator().manual_seed(0)
    data = _Counting(torch.rand(352, 1, 8, 8, generator=g), torch.randint(0, 10, (352,), generator=g))
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, meta = snnconv.convert(small_digits_ann, loader, T=2, qcfs_train=QCFSTrainConfig(epochs=5, max_steps=7),
                                  finetune_epochs=0, calib_batches=2, progress=False, on_collapse="warn")
    budget = meta.settings["budget"]
    assert budget["qcfs_steps"] == budget["qcfs_steps_run"] == 7
    assert [h["steps"] for h in meta.stage("qcfs").changes["history"]] == [7]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_qcfs_max_steps_must_be_a_positive_count(bad):
    from snnconv.errors import ConfigError
    from snnconv.stages.qcfs import QCFSTrainConfig

    with pytest.raises(ConfigError, match="max_steps"):
        QCFSTrainConfig(epochs=1, max_steps=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_finetune_epochs_must_be_a_count(small_digits_ann, bad):
    loader = [(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,)))]
    with pytest.raises(ValueError, match="finetune_epochs"):
        snnconv.convert(small_digits_ann, loader, finetune_epochs=bad, progress=False)


def test_keep_start_returns_the_given_network_when_fine_tuning_only_makes_it_worse(small_digits_snn,
                                                                                   digits_loaders):
    """A learning rate that wrecks the network: with ``keep_start`` (convert()'s recipe) the
    network comes back as it was given, and the history says so; without it, the wreck."""
    train, _ = digits_loaders
    wreck = dict(T=2, epochs=1, max_steps_per_epoch=3, lr=10.0, progress=False)
    kept, history = snnconv.finetune(small_digits_snn, train, keep_start=True, **wreck)
    assert history[-1]["kept_start"] and history[-1]["val_acc"] < history[-1]["start_val_acc"]
    start = small_digits_snn.state_dict()
    assert all(torch.equal(v, start[k]) for k, v in kept.state_dict().items())
    wrecked, _ = snnconv.finetune(small_digits_snn, train, keep_start=False, **wreck)
    assert not all(torch.equal(v, start[k]) for k, v in wrecked.state_dict().items())


def test_keep_start_lets_a_trained_epoch_win_a_tie_within_the_validation_noise(small_digits_snn,
                                                                             digits_loaders):
    """An epoch that scores what the start scores (a learning rate too small to move it) is
    returned, not the start: the start's score is handicapped by one binomial standard error of
    the validation split, whose size the history records through the margin."""
    from snnconv.stages.finetune import start_margin

    train, _ = digits_loaders
    _, history = snnconv.finetune(small_digits_snn, train, keep_start=True, T=2, epochs=1,
                                  max_steps_per_epoch=2, lr=1e-12, progress=False)
    last = history[-1]
    assert last["val_acc"] == pytest.approx(last["start_val_acc"])
    assert not last["kept_start"]
    n_val = round(len(train.dataset) * 0.1)
    assert last["start_margin"] == pytest.approx(start_margin(last["start_val_acc"], n_val))
    assert start_margin(90.0, 400) == pytest.approx(1.5)
    assert start_margin(100.0, 400) == 0.0


def test_the_recipe_detaches_the_reset_of_hard_reset_networks_only(small_digits_ann, digits_data):
    """convert(reset="zero") fine-tunes with the reset detached; subtractive reset keeps the
    gradient through it; both keep the converted network as epoch 0."""
    assert defaults.finetune_recipe(8, reset="zero").detach_reset
    assert not defaults.finetune_recipe(8).detach_reset
    loader = DataLoader(digits_data[0], batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, meta = snnconv.convert(small_digits_ann, loader, T=2, reset="zero", progress=False,
                                  on_collapse="warn")
    used = meta.settings["finetune"]
    assert used["detach_reset"] and used["keep_start"]
