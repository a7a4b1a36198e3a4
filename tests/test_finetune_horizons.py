"""Fine-tuning's anytime readouts (``horizons``): the cross-entropy of the running average after
each horizon, their mean (or their ``horizon_weights``' weighted mean), and the best epoch picked
on the same mean of validation accuracies."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import snnconv
from snnconv.analysis.metrics import accuracy_by_T
from snnconv.data import split_dataset

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too


def test_horizons_of_T_alone_equal_the_plain_loss(small_digits_snn, digits_loaders):
    train, _ = digits_loaders
    plain, _ = snnconv.finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=3,
                                progress=False)
    same, _ = snnconv.finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=3,
                               horizons=(2,), progress=False)
    other, _ = snnconv.finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=3,
                                horizons=(1, 2), progress=False)
    a, b, c = plain.state_dict(), same.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_with_horizons_the_validation_accuracy_is_their_mean(small_digits_snn, digits_loaders):
    """The best epoch is picked on what is trained: the mean accuracy over the horizons."""
    train, _ = digits_loaders
    tuned, history = snnconv.finetune(small_digits_snn, train, T=4, epochs=1, max_steps_per_epoch=2,
                                      horizons=(2, 4), progress=False)
    _, val_set = split_dataset(train.dataset, 0.1, seed=0)
    by_T = accuracy_by_T(tuned, DataLoader(val_set, batch_size=256), (2, 4))
    assert history[0]["val_acc"] == pytest.approx((by_T[2] + by_T[4]) / 2)


def test_horizon_weights_weigh_the_validation_accuracy_and_equal_weights_change_nothing(small_digits_snn,
                                                                                      digits_loaders):
    train, _ = digits_loaders
    kw = dict(T=4, epochs=1, max_steps_per_epoch=2, horizons=(4, 2), progress=False)
    plain, _ = snnconv.finetune(small_digits_snn, train, **kw)
    equal, _ = snnconv.finetune(small_digits_snn, train, horizon_weights=(3.0, 3.0), **kw)
    tuned, history = snnconv.finetune(small_digits_snn, train, horizon_weights=(3.0, 1.0), **kw)
    a, b, c = plain.state_dict(), equal.state_dict(), tuned.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    _, val_set = split_dataset(train.dataset, 0.1, seed=0)
    by_T = accuracy_by_T(tuned, DataLoader(val_set, batch_size=256), (2, 4))
    # the weights follow the horizons in the order given: 3 for T=4, 1 for T=2
    assert history[0]["val_acc"] == pytest.approx((3 * by_T[4] + by_T[2]) / 4)


@pytest.mark.parametrize("weights", [(1.0,), (1.0, 0.0), (1.0, -1.0), (1.0, float("nan")), (True, 1.0)])
def test_horizon_weights_that_do_not_fit_the_horizons_are_refused(weights):
    with pytest.raises(ValueError, match="horizon_weights"):
        snnconv.FinetuneConfig(T=4, horizons=(2, 4), horizon_weights=weights)
    with pytest.raises(ValueError, match="horizon_weights"):
        snnconv.FinetuneConfig(T=4, horizon_weights=(1.0,))


@pytest.mark.parametrize("horizons", [(), (0,), (5,), (2, 9)])
def test_horizons_outside_1_to_T_are_refused(horizons):
    with pytest.raises(ValueError, match="horizons"):
        snnconv.FinetuneConfig(T=4, horizons=horizons)
