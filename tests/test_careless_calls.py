"""Careless calls refused by name before work starts: out-of-range settings, empty batches, labels
that are not the model's classes, models that are not float32 or have no weights, endless
loaders, memory that will not fit, and resuming with another network or other data."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset

import snnconv
from snnconv import finetune
from snnconv.analysis.metrics import evaluate
from snnconv.data import MAX_UNSIZED_BATCHES
from snnconv.errors import CheckpointError, ConfigError, DataError, ResourceError, UnsupportedModelError
from snnconv.memory import refuse_one_image


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()


def _data(n=64, batch=16):
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.rand(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    return [(xs[i:i + batch], ys[i:i + batch]) for i in range(0, n, batch)]


class Endless:
    """A re-iterable without len() that never ends."""

    def __init__(self, batch):
        self.batch = batch

    def __iter__(self):
        return itertools.repeat(self.batch)


@pytest.mark.parametrize("settings", [{"T": 10**6}, {"T": 0}, {"T": 1.5}, {"T": "4"}, {"L": 0},
                                      {"percentile": 150}, {"calib_batches": 0}])
def test_out_of_range_settings_are_refused_before_any_work(settings):
    with pytest.raises(ConfigError) as info:
        snnconv.convert(_model(), Endless(_data()[0]), progress=False, **settings)  # never read
    assert isinstance(info.value, ValueError)


def test_an_empty_batch_is_named():
    data = _data()
    with pytest.raises(DataError, match="empty batch"):
        snnconv.convert(_model(), [(data[0][0][:0], data[0][1][:0])] + data, progress=False)


def test_labels_outside_the_models_classes_are_refused_for_training_and_evaluation():
    bad = [(x, y + 10) for x, y in _data()]
    with pytest.raises(DataError, match="labels from 10 to 13.*4 outputs"):
        snnconv.convert(_model(), bad, T=2, progress=False)
    with pytest.raises(DataError, match="4 outputs"):
        evaluate(_model(), bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_is_refused_with_the_fix(dtype):
    with pytest.raises(UnsupportedModelError, match="float32.*model.float"):
        snnconv.convert(_model().to(dtype), _data(), progress=False)


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 4))
    with pytest.raises(UnsupportedModelError, match="meta device"):
        snnconv.convert(model, _data(), progress=False)


def test_endless_loaders_are_refused_after_a_bound_not_read_forever():
    batch = _data()[0]
    with pytest.raises(DataError, match=f"more than {MAX_UNSIZED_BATCHES} batches"):
        snnconv.convert(_model(), Endless(batch), T=2, progress=False, on_collapse="warn")
    with pytest.raises(DataError, match=f"more than {MAX_UNSIZED_BATCHES} batches"):
        snnconv.convert(_model(), Endless(batch), T=2, finetune_epochs=0, qcfs_epochs=1,
                        progress=False, on_collapse="warn")
    with pytest.raises(DataError, match="evaluation loader has no len"):
        evaluate(nn.Sequential(nn.Flatten(), nn.Linear(192, 4)), Endless(batch))


def test_a_stage_whose_single_image_cannot_fit_is_refused_with_the_estimate(monkeypatch):
    monkeypatch.setenv("SNNCONV_MEMORY", "1G")
    with pytest.raises(ResourceError, match=r"2.0 GiB for a single image.*SNNCONV_MEMORY=1.0 GiB.*lower T"):
        refuse_one_image(2 * 2**30, "cpu", "calibration", "lower T")
    refuse_one_image(2**20, "cpu", "calibration", "lower T")  # fits: nothing raised
    monkeypatch.setenv("SNNCONV_MEMORY", "lots")
    with pytest.raises(ConfigError, match="SNNCONV_MEMORY='lots' is not a size"):
        refuse_one_image(1, "cpu", "calibration", "lower T")


def test_an_allocation_failure_in_a_stage_is_a_resource_error_naming_it(monkeypatch):
    import snnconv.pipeline as pipeline

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(pipeline, "to_spiking", out_of_memory)
    with pytest.raises(ResourceError, match="stage 'spiking' ran out of memory.*SNNCONV_MEMORY"):
        snnconv.convert(_model(), _data(), T=2, finetune_epochs=0, progress=False, on_collapse="warn")


def test_resume_refuses_another_network_or_other_data(small_digits_snn, digits_data, tmp_path):
    train_set, _ = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    run = dict(T=2, epochs=1, max_steps_per_epoch=2, checkpoint_dir=str(tmp_path), progress=False)
    finetune(copy.deepcopy(small_digits_snn), loader, **run)
    other = copy.deepcopy(small_digits_snn)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    with pytest.raises(CheckpointError, match="other weights"):
        finetune(other, loader, resume=True, **run)
    fewer = DataLoader(Subset(train_set, range(len(train_set) // 2)), batch_size=64, shuffle=True)
    with pytest.raises(CheckpointError, match="other data"):
        finetune(copy.deepcopy(small_digits_snn), fewer, resume=True, **run)
    # the same network and data, shuffled in another order, resume
    again = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(7))
    finetune(copy.deepcopy(small_digits_snn), again, resume=True, **run)
