"""convert(): the whole pipeline on trained digits networks, its meta, its refusals, its hygiene."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv import models
from snnconv.activation import qcfs_sites
from snnconv.analysis.metrics import predictions
from snnconv.calibration import calibrate_bias
from snnconv.defaults import QCFS_STEPS, _qcfs_epochs
from snnconv.errors import DataError, UnsupportedLayerError, UnsupportedModelError
from snnconv.meta import ConversionMeta
from snnconv.snn.network import SpikingNetwork
from snnconv.stages.fold import fold_batchnorm
from snnconv.stages.qcfs import QCFSTrainConfig

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

# --------------------------------------------------------------------------------------------
# helpers


def _snapshot(model: nn.Module) -> tuple[dict[str, bytes], dict[str, bool]]:
    """Every tensor of the state_dict as bytes (with dtype and shape), every training flag."""
    tensors = {k: (str(v.dtype), tuple(v.shape), v.detach().cpu().numpy().tobytes())
               for k, v in model.state_dict().items()}
    flags = {name: m.training for name, m in model.named_modules()}
    return tensors, flags


def _tiny(in_channels: int = 1) -> nn.Module:
    """An untrained width-4 SmallCNN with non-trivial BatchNorm statistics."""
    torch.manual_seed(0)
    model = models.small_cnn(num_classes=10, in_channels=in_channels, width=4)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _data(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _pairs(n: int = 96, batch: int = 32, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _data(n, seed)
    return list(zip(x.split(batch), y.split(batch)))


# --------------------------------------------------------------------------------------------
# trained networks: the SNN agrees with its QCFS-ANN


@pytest.mark.parametrize("qcfs_epochs", [0, 3])
def test_snn_agrees_with_its_qcfs_ann_on_digits_at_T64(trained_digits_cnn, digits_loaders, qcfs_epochs):
    """>= 99% of the 449 test predictions equal.

    Measured with L = 16 and lambda from the whole training set: 0 disagreements untrained (five
    loader orders), 0-1 after 3 epochs of QCFS training at lr 0.002 (three seeds). Calibrating on
    10 batches only, or training at lr 0.01, gave up to 4 (99.1%), too close to the bound.
    """
    train, test = digits_loaders
    folded = fold_batchnorm(trained_digits_cnn)
    train_cfg = QCFSTrainConfig(epochs=qcfs_epochs, lr=0.002) if qcfs_epochs else None
    qann = snnconv.calibrate_qcfs(folded, train, L=16, num_batches=len(train), train=train_cfg,
                                  progress=False)
    snn = snnconv.to_spiking(qann, T=64)
    p_qcfs, labels = predictions(qann, test)
    p_snn, _ = predictions(snn, test)
    agreement = (p_qcfs == p_snn).float().mean().item()
    accuracy = (p_qcfs == labels).float().mean().item()
    assert accuracy >= 0.95, f"QCFS-ANN accuracy {accuracy:.4f}"
    assert agreement >= 0.99, f"SNN/QCFS-ANN agreement {agreement:.4f} on {len(labels)} images"


def test_convert_without_bias_calibration_is_fold_calibrate_replace(trained_digits_cnn, digits_data):
    train_set, test_set = digits_data
    loader = DataLoader(train_set, batch_size=64)
    x = test_set.tensors[0][:64]
    snn, _ = snnconv.convert(trained_digits_cnn, loader, T=8, L=8, calib_batches=4,
                             bias_calibration=False, finetune_epochs=0, progress=False)
    qann = snnconv.calibrate_qcfs(fold_batchnorm(trained_digits_cnn), loader, L=8, num_batches=4,
                                  per_channel=True, progress=False)  # convert()'s default
    with torch.no_grad():
        assert torch.equal(snn(x), snnconv.to_spiking(qann, T=8)(x))


def test_convert_is_fold_calibrate_replace(trained_digits_cnn, digits_data):
    """convert() without fine-tuning gives the network the three public stages give, on the
    same data."""
    train_set, test_set = digits_data
    loader = DataLoader(train_set, batch_size=64)  # not shuffled: both runs see the same batches
    x = test_set.tensors[0][:64]
    snn, _ = snnconv.convert(trained_digits_cnn, loader, T=8, L=8, calib_batches=4, finetune_epochs=0,
                             progress=False)
    x0 = next(iter(loader))[0]
    qann = snnconv.calibrate_qcfs(fold_batchnorm(trained_digits_cnn, x0), loader, L=8,
                                  num_batches=4, per_channel=True, progress=False)  # convert()'s default
    manual = calibrate_bias(snnconv.to_spiking(qann, T=8), qann, loader, T=16, membrane=True, weights=True)
    assert isinstance(snn, SpikingNetwork) and snn.T == 8
    assert snn.thresholds().keys() == manual.thresholds().keys()
    assert all(torch.equal(a, b) for a, b in zip(snn.thresholds().values(), manual.thresholds().values()))
    with torch.no_grad():
        assert torch.equal(snn(x), manual(x))


# --------------------------------------------------------------------------------------------
# meta


def test_meta_records_every_stage_and_round_trips_through_json(trained_digits_cnn, digits_loaders, tmp_path):
    train, test = digits_loaders
    snn, meta = snnconv.convert(trained_digits_cnn, train, T=16, L=8, eval_loader=test,
                                eval_T=(4, 8), progress=False)
    assert [s.name for s in meta.stages] == ["prepare", "fold", "qcfs", "spiking"]
    assert all(s.seconds > 0 for s in meta.stages)
    folded = meta.stage("fold").changes["folded"]
    assert len(folded) == 4
    assert {f["batchnorm"] for f in folded} == {"bn1", "bn2", "bn3", "bn4"}
    assert all(f["max_abs_diff"] is not None and f["max_abs_diff"] < 1e-4 for f in folded)
    assert meta.stage("fold").changes["max_abs_diff"] == max(f["max_abs_diff"] for f in folded)
    sites = meta.stage("qcfs").changes["sites"]
    assert len(sites) == 4
    thetas = snn.thresholds()
    for name, site in sites.items():  # per channel by default: one lambda per channel
        lam = torch.tensor(site["lambda"])
        assert lam.dim() == 1 and (lam > 0).all()
        assert torch.equal(thetas[name.replace("qcfs_", "if_", 1)], lam)
    assert set(meta.stage("spiking").changes["neurons"]) == set(thetas)
    acc = meta.accuracy
    assert set(acc) == {"ann", "folded", "qcfs", "snn"}
    assert set(acc["snn"]) == {"4", "8", "16"}
    assert acc["ann"] > 90 and abs(acc["folded"] - acc["ann"]) < 0.5
    assert all(0 <= a <= 100 for a in acc["snn"].values())
    assert meta.settings["T"] == 16 and meta.settings["L"] == 8 and meta.seed == 0
    assert "torch" in meta.environment

    text = meta.to_json(tmp_path / "meta.json")
    for again in (ConversionMeta.from_json(text), ConversionMeta.from_json(tmp_path / "meta.json")):
        assert json.loads(again.to_json()) == json.loads(text)
        assert again.stage("qcfs").changes["sites"] == json.loads(text)["stages"][2]["changes"]["sites"]
        assert again.accuracy == acc


def test_without_qcfs_training_the_default_snn_does_not_depend_on_L():
    """L is the QCFS-ANN's (trained and reported at L); thresholds come from the percentile
    and the default calibration targets the QCFS-ANN at 2T levels, so the SNN is the same for
    any L. The bias-only calibration targets the QCFS-ANN at L, and there L tells."""
    def same(**kw):
        a, b = (snnconv.convert(_tiny(), _pairs(), T=4, L=L, progress=False, **kw)[0].state_dict()
                for L in (2, 8))
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert same(qcfs_epochs=0)
    assert not same(qcfs_epochs=0, bias_calibration_T=4)


def test_meta_records_qcfs_training_history():
    _, meta = snnconv.convert(_tiny(), _pairs(192), T=2, L=4, qcfs_epochs=2, progress=False)
    assert meta.settings["qcfs_train"]["epochs"] == 2
    assert [h["epoch"] for h in meta.stage("qcfs").changes["history"]] == [1, 2]
    json.loads(meta.to_json())


# --------------------------------------------------------------------------------------------
# the caller's model is never touched


def _half_training(model: nn.Module) -> nn.Module:
    """Training mode with one module left in eval mode: flags that must all come back."""
    model.train()
    model.bn2.eval()
    return model


def test_caller_model_is_unchanged_after_convert():
    model = _half_training(_tiny())
    before = _snapshot(model)
    snnconv.convert(model, _pairs(192), T=2, L=4, qcfs_epochs=1, eval_loader=_pairs(64, seed=1),
                    progress=False)
    assert _snapshot(model) == before


def _nan_in_third_batch():
    batches = _pairs(96)
    x, y = batches[2]
    x = x.clone()
    x[0, 0, 0, 0] = float("nan")
    return batches[:2] + [(x, y)]


@pytest.mark.parametrize("failure", ["nan in a later batch", "training on a batch without labels"])
def test_caller_model_is_unchanged_when_convert_fails_midway(failure):
    model = _half_training(_tiny())
    before = _snapshot(model)
    if failure == "nan in a later batch":
        with pytest.raises(DataError, match="NaN"):
            snnconv.convert(model, _nan_in_third_batch(), T=2, progress=False)
    else:
        x, y = _data(192)
        batches = list(zip(x.split(32), y.split(32)))[:2] + list(x[64:].split(32))
        with pytest.raises(DataError, match="labels"):
            snnconv.convert(model, batches, T=2, qcfs_epochs=1, progress=False)
    assert _snapshot(model) == before


# --------------------------------------------------------------------------------------------
# loaders and refusals


def test_loaders_of_pairs_lists_or_bare_inputs_all_convert():
    x, y = _data(96)
    forms = {
        "tuples": list(zip(x.split(32), y.split(32))),
        "lists": [[a, b] for a, b in zip(x.split(32), y.split(32))],
        "bare": list(x.split(32)),
        "DataLoader": DataLoader(TensorDataset(x, y), batch_size=32),
        "DataLoader(x)": DataLoader(TensorDataset(x), batch_size=32),
    }
    outputs = {}
    for name, loader in forms.items():
        snn, _ = snnconv.convert(_tiny(), loader, T=4, finetune_epochs=0, progress=False)
        with torch.no_grad():
            outputs[name] = snn(x[:16])
    ref = outputs.pop("tuples")
    assert all(torch.equal(ref, out) for out in outputs.values())


def test_empty_loader_is_refused():
    with pytest.raises(DataError, match="empty"):
        snnconv.convert(_tiny(), [], progress=False)
    with pytest.raises(DataError, match="empty"):
        snnconv.convert(_tiny(), DataLoader(TensorDataset(torch.zeros(0, 1, 8, 8)), batch_size=4),
                        progress=False)


def test_a_batch_the_model_rejects_is_refused_with_its_shape():
    x = torch.rand(4, 3, 8, 8)  # the model takes one channel
    with pytest.raises(DataError, match=r"\(4, 3, 8, 8\)"):
        snnconv.convert(_tiny(), [x], progress=False)


def test_nan_weights_are_refused_by_name():
    model = _tiny()
    with torch.no_grad():
        model.conv2.weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(UnsupportedModelError, match="conv2.weight"):
        snnconv.convert(model, _pairs(), progress=False)
    model = _tiny()
    model.bn3.running_var[1] = float("inf")
    with pytest.raises(UnsupportedModelError, match="bn3.running_var"):
        snnconv.convert(model, _pairs(), progress=False)


def test_nan_data_is_refused():
    x, y = _data(32)
    x[3, 0, 2, 2] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        snnconv.convert(_tiny(), [(x, y)], progress=False)


def test_qcfs_training_without_labels_learns_from_the_model():
    x, _ = _data(192)
    _, meta = snnconv.convert(_tiny(), DataLoader(TensorDataset(x), batch_size=32), qcfs_epochs=1,
                              finetune_epochs=0, progress=False)
    assert meta.settings["qcfs_train"]["distill"] == 1.0
    assert len(meta.stage("qcfs").changes["history"]) == 1


def test_a_one_shot_iterator_is_refused():
    with pytest.raises(DataError, match="one-shot"):
        snnconv.convert(_tiny(), iter(_pairs()), progress=False)


def test_other_activations_and_max_pooling_through_convert():
    model = _tiny()
    model.relu = nn.GELU()
    with pytest.raises(UnsupportedLayerError, match="GELU"):
        snnconv.convert(model, _pairs(), progress=False)
    model = _tiny()
    model.pool = nn.MaxPool2d(2)
    with pytest.raises(UnsupportedLayerError, match="max-pooling"):
        snnconv.convert(model, _pairs(), maxpool="error", progress=False)
    snn, meta = snnconv.convert(model, _pairs(), T=2, maxpool="avg", progress=False)
    assert meta.stage("qcfs").changes["maxpool_replaced"] == ["pool"]
    assert not any(isinstance(m, nn.MaxPool2d) for m in snn.modules())
    # average pooling is another function: by default some epochs of QCFS training adapt to it
    epochs = meta.settings["qcfs_epochs"]
    assert epochs == _qcfs_epochs(_pairs()) >= 1 and len(meta.stage("qcfs").changes["history"]) == epochs
    _, meta = snnconv.convert(model, _pairs(), T=2, maxpool="avg", qcfs_epochs=0, progress=False)
    assert meta.settings["qcfs_epochs"] == 0 and "history" not in meta.stage("qcfs").changes
    # without labels the same steps learn from the model's outputs alone
    _, meta = snnconv.convert(model, [x for x, _ in _pairs()], T=2, maxpool="avg", progress=False)
    assert meta.settings["qcfs_epochs"] == epochs and meta.settings["qcfs_train"]["distill"] == 1.0
    _, meta = snnconv.convert(_tiny(), _pairs(), T=2, progress=False)  # no max-pooling: no training
    assert meta.settings["qcfs_epochs"] == 0 and "history" not in meta.stage("qcfs").changes


def test_convert_result_has_no_batchnorm_and_one_if_per_relu_site():
    snn, _ = snnconv.convert(_tiny(), _pairs(), T=2, progress=False)
    assert snnconv.find_batchnorm(snn) == []
    assert len(snn.thresholds()) == 4
    assert not qcfs_sites(snn)


@pytest.mark.parametrize("kwargs", [dict(T=0), dict(T=2.5), dict(eval_T=(4, 0))])
def test_bad_time_steps_are_refused_before_any_work(kwargs):
    with pytest.raises(ValueError, match="T"):
        snnconv.convert(_tiny(), [], progress=False, **kwargs)  # the empty loader is never read


def test_default_qcfs_training_is_a_number_of_steps_in_whole_epochs():
    """Where convert() trains QCFS by default it runs QCFS_STEPS optimiser steps in whole
    epochs, the last one cut: 16 epochs of the robustness matrix's 5,000 images in batches of
    128, 2 of Fashion-MNIST's 60,000, capped for a tiny loader, and 16 for a loader without a
    length; the planned steps are QCFS_STEPS wherever the epochs hold them."""
    from torch.utils.data import DataLoader, TensorDataset

    from snnconv.plan import planned_work
    from snnconv.stages.qcfs import QCFSTrainConfig

    def loader(n):
        return DataLoader(TensorDataset(torch.zeros(n, 1), torch.zeros(n)), batch_size=128)

    assert _qcfs_epochs(loader(5000)) == 16
    assert _qcfs_epochs(loader(60000)) == 2
    assert _qcfs_epochs(loader(10**7)) == 1
    assert _qcfs_epochs(loader(128)) == 64
    assert _qcfs_epochs(iter([])) == 16
    for n in (5000, 6000, 60000, 10**6):
        cfg = QCFSTrainConfig(epochs=_qcfs_epochs(loader(n)), max_steps=QCFS_STEPS)
        assert planned_work(loader(n), cfg, None)["qcfs_steps"] == QCFS_STEPS
    assert planned_work(loader(128), QCFSTrainConfig(epochs=64, max_steps=QCFS_STEPS), None)["qcfs_steps"] == 64
