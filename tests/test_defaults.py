"""plan_conversion(): convert()'s defaults as a pure function of the settings, the traced model's
facts and the loader's facts; and the stage table convert() walks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from snnconv import defaults
from snnconv.config import ConvertConfig
from snnconv.defaults import ConversionPlan, GraphFacts, LoaderFacts, plan_conversion
from snnconv.pipeline import STAGES

pytestmark = pytest.mark.portable


def _data(**changes) -> LoaderFacts:
    facts = dict(labelled=True, one_batch=False, finetune_batch=32, finetune_epochs=3, qcfs_epochs=5)
    facts.update(changes)
    return LoaderFacts(**facts)


def _plan(graph: GraphFacts | None = None, data: LoaderFacts | None = None, **settings) -> ConversionPlan:
    return plan_conversion(ConvertConfig(**settings).resolved(), graph or GraphFacts(), data or _data())


def test_at_a_small_T_with_labels_it_fine_tunes_for_the_loaders_epochs_in_its_batches():
    plan = _plan(T=4)
    assert plan.finetunes and plan.config.finetune_epochs == 3
    ft = plan.finetune
    assert (ft.epochs, ft.T, ft.horizons, ft.batch_size) == (3, 8, (2, 4, 8), 32)
    assert ft.max_steps_per_epoch == defaults.FINETUNE_MAX_STEPS
    assert ft.distill == defaults.CONVERT_FINETUNE["distill"]
    assert plan.reasons["finetune_default"].startswith("3 epoch(s)")
    # fine-tuning starts from the training-free network: reconstructed first; no QCFS training
    # without max-pooling
    assert plan.config.reconstruction_steps == defaults.RECONSTRUCT_STEPS
    assert plan.reasons["reconstruction_default"].startswith(f"{defaults.RECONSTRUCT_STEPS} steps")
    assert plan.qcfs_train is None and not plan.qcfs_trains


@pytest.mark.parametrize("T, early_exit, horizons, anytime", [
    (2, False, (1, 2, 4), False), (4, False, (2, 4, 8), False), (8, False, (1, 2, 4, 8, 16), True),
    (4, True, (1, 2, 4, 8), True), (8, True, (1, 2, 4, 8, 16), True)])
def test_from_T_8_or_for_early_exit_fine_tuning_trains_every_readout_from_the_first_step(T, early_exit, horizons,
                                                                                           anytime):
    plan = _plan(T=T, early_exit=early_exit)
    assert plan.finetune.horizons == horizons and plan.finetune.horizon_weights is None
    assert plan.anytime is anytime  # judged on every readout, and not worse at T beyond the noise
    assert defaults.finetune_recipe(T, anytime=True if early_exit else None).horizons == horizons


def test_without_labels_the_fine_tuning_and_the_qcfs_training_learn_from_the_ann_alone():
    plan = _plan(graph=GraphFacts(max_pools=("pool",)), data=_data(labelled=False), T=4)
    assert plan.finetune.distill == defaults.LABEL_FREE_DISTILL
    assert plan.qcfs_train.distill == defaults.LABEL_FREE_DISTILL
    assert "no labels" in plan.reasons["finetune_default"]


@pytest.mark.parametrize("T, data, why", [(16, _data(), "T=16 > 8"),
                                          (4, _data(one_batch=True), "the loader has one batch")])
def test_a_large_T_or_a_loader_of_one_batch_gets_no_fine_tuning_but_the_reconstruction(T, data, why):
    plan = _plan(data=data, T=T)
    assert not plan.finetunes and plan.finetune is None and plan.config.finetune_epochs == 0
    assert plan.reasons["finetune_default"].startswith("none: " + why)
    expected = 0 if T > defaults.FINETUNE_UP_TO_T else defaults.RECONSTRUCT_STEPS
    assert plan.config.reconstruction_steps == expected


def test_max_pooling_past_the_prefix_becomes_average_pooling_and_is_trained_for():
    plan = _plan(graph=GraphFacts(max_pools=("features.2",)), T=4, finetune_epochs=0)
    assert plan.config.maxpool == "avg"
    assert plan.qcfs_trains
    assert (plan.qcfs_train.epochs, plan.qcfs_train.max_steps) == (5, defaults.QCFS_STEPS)
    # trained at L levels: calibrated against that function over L steps, not reconstructed
    assert plan.config.bias_calibration_T == plan.config.L == 4
    assert plan.config.reconstruction_steps == 0
    assert plan.reasons["reconstruction_default"] == "none: QCFS training ran"
    # without max-pooling, or with maxpool="error", no QCFS training is planned
    assert _plan(T=4, finetune_epochs=0).qcfs_train is None
    assert _plan(graph=GraphFacts(max_pools=("p",)), T=4, maxpool="error").qcfs_train is None


def test_what_the_caller_gave_is_kept_and_not_counted_as_a_default():
    plan = _plan(T=4, finetune_epochs=1, reconstruction_steps=7, qcfs_epochs=0)
    assert plan.defaults == {"finetune": False, "qcfs": False, "reconstruction": False}
    assert plan.reasons == {}
    assert plan.config.finetune_epochs == 1 and plan.finetune.epochs == 1
    assert plan.config.reconstruction_steps == 7 and plan.qcfs_train is None


def test_hard_reset_fine_tunes_with_the_reset_detached_and_is_never_reconstructed():
    plan = _plan(T=4, reset="zero")
    assert plan.finetune.detach_reset
    assert not _plan(T=4).finetune.detach_reset
    free = _plan(T=4, reset="zero", hard_rate=False, finetune_epochs=0)
    assert free.config.reconstruction_steps == 0
    assert free.reasons["reconstruction_default"] == "none: reset='zero'"


def test_the_hard_reset_rate_is_trained_into_the_ann_with_adamw():
    plan = _plan(T=4, reset="zero")
    assert plan.qcfs_trains and plan.qcfs_train.max_steps == defaults.QCFS_STEPS
    assert (plan.qcfs_train.optimizer, plan.qcfs_train.lr) == ("adamw", 1e-3)
    assert plan.config.hard_rate and plan.reasons["hard_rate_default"] == "on: reset='zero'"
    assert not _plan(T=4, reset="zero", hard_rate=False).qcfs_trains
    one_batch = _data(one_batch=True)
    for off in (_plan(T=4, reset="zero", qcfs_epochs=0), _plan(T=4), _plan(T=4, reset="zero", data=one_batch)):
        assert off.config.hard_rate is False and not off.qcfs_trains


def test_the_plan_is_a_function_of_its_arguments_alone():
    cfg = ConvertConfig(T=4).resolved()
    first = plan_conversion(cfg, GraphFacts(("p",)), _data())
    assert plan_conversion(cfg, GraphFacts(("p",)), _data()) == first
    assert cfg == ConvertConfig(T=4).resolved()  # the settings given are not changed


def test_the_loaders_facts_are_what_its_length_says():
    data = TensorDataset(torch.zeros(640, 1, 4, 4), torch.zeros(640, dtype=torch.long))
    facts = LoaderFacts.of(DataLoader(data, batch_size=64), labelled=True)
    assert not facts.one_batch and facts.labelled
    assert facts.finetune_batch == defaults._finetune_batch(DataLoader(data, batch_size=64), 64, 0.1)
    assert facts.finetune_epochs == defaults.default_finetune_epochs(DataLoader(data, batch_size=64))
    assert LoaderFacts.of([(torch.zeros(2, 1, 4, 4), None)], labelled=False).one_batch


def test_convert_walks_one_table_and_every_stage_after_tracing_is_guarded_and_checked():
    assert [s.name for s in STAGES] == ["prepare", "fold", "qcfs", "spiking", "finetune", "early_exit"]
    assert STAGES[0].checked is None  # the traced ANN still holds its BatchNorm
    assert all(s.checked is not None for s in STAGES[1:])
