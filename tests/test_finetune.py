"""Stage 4, BPTT fine-tuning: it trains, works on a copy, is seeded, and every option reaches
the place it is meant to act on.

Networks are tiny (a width-8 SmallCNN on 8x8 digits) and most runs are cut to a few steps with
``max_steps_per_epoch``: the properties are about what a step does, not about long training.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _probes import assert_bit_identical, state_copy
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import snnconv
from snnconv import FinetuneConfig, finetune
from snnconv.analysis.metrics import accuracy_by_T
from snnconv.data import split_dataset
from snnconv.errors import ConfigError, DataError, StageOrderError
from snnconv.snn.neuron import IFNeuron, neurons
from snnconv.stages.finetune import CHECKPOINT_NAME, blend, checkpointed

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

QUICK = dict(epochs=1, max_steps_per_epoch=3, progress=False)


def _weights_changed(before: dict, after: dict) -> list[str]:
    return [k for k in before if k.endswith("weight") and not torch.equal(before[k], after[k])]


def _thetas(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.theta.detach().clone() for n, m in neurons(model).items()}


def _first_batch(dataset: Dataset, batch: int, *, val_fraction: float = 0.1, seed: int = 0):
    """The first global batch fine-tuning trains on: the seeded split, then a one-replica
    DistributedSampler at epoch 0 (the order every process count shares)."""
    train_set, _ = split_dataset(dataset, val_fraction, seed=seed) if val_fraction else (dataset, None)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed,
                                 drop_last=True)
    sampler.set_epoch(0)
    idx = list(sampler)[:batch]
    xs, ys = zip(*(train_set[i] for i in idx))
    return torch.stack(xs), torch.stack(ys)


class RecordingDataset(Dataset):
    """Records every index read, in order."""

    def __init__(self, base: Dataset):
        self.base, self.reads = base, []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        self.reads.append(int(i))
        return self.base[i]


# --- it trains ------------------------------------------------------------------------------

def test_finetuning_at_T2_raises_test_accuracy_at_T2(small_digits_snn, digits_loaders):
    """An effect of training, so three seeds and margins well inside what was measured: the
    gain was +4.7..+13.4 points over 3 ANN seeds x 3 fine-tuning seeds on an AMD EPYC (1
    thread), about +17 on an Intel Xeon, where the fixture's ANN differs; a single seed with a
    5-point margin failed on the AMD machine (74.2 -> 78.8)."""
    train, test = digits_loaders
    before = accuracy_by_T(small_digits_snn, test, [2])[2]
    gains = []
    for seed in range(3):
        tuned, history = finetune(small_digits_snn, train, T=2, epochs=2, lr=3e-3, seed=seed,
                                  progress=False)
        gains.append(accuracy_by_T(tuned, test, [2])[2] - before)
        assert history[1]["loss"] < history[0]["loss"], (seed, history)
        assert tuned.T == small_digits_snn.T == 4, "the result keeps the T it was given at"
    assert min(gains) > 1 and sum(gains) / 3 > 3, (before, gains)


def test_history_has_one_record_per_epoch(small_digits_snn, digits_loaders):
    train, _ = digits_loaders
    _, history = finetune(small_digits_snn, train, T=2, epochs=2, max_steps_per_epoch=2, progress=False)
    assert [h["epoch"] for h in history] == [1, 2]
    for h in history:
        assert set(h) == {"epoch", "loss", "train_acc", "val_acc", "steps", "seconds"}
        assert h["steps"] == 2
        assert math.isfinite(h["loss"]) and h["loss"] > 0
        assert 0 <= h["train_acc"] <= 100 and 0 <= h["val_acc"] <= 100
        assert h["seconds"] > 0


def test_validation_comes_from_the_training_loader_and_never_overlaps(small_digits_snn, digits_data):
    train_set, _ = digits_data
    recorded = RecordingDataset(train_set)
    loader = DataLoader(recorded, batch_size=64)
    _, history = finetune(small_digits_snn, loader, T=2, epochs=1, val_fraction=0.2, seed=5,
                          progress=False)
    _, expected_val = split_dataset(train_set, 0.2, seed=5)
    n_val = len(expected_val)
    trained_on, validated_on = recorded.reads[:-n_val], recorded.reads[-n_val:]
    assert sorted(validated_on) == sorted(expected_val.indices)
    assert not set(trained_on) & set(validated_on)
    assert len(trained_on) == (len(train_set) - n_val) // 64 * 64, "full batches only"
    assert len(set(trained_on)) == len(trained_on), "each training sample once per epoch"
    assert "val_acc" in history[0]


def test_val_fraction_zero_trains_on_everything_and_records_no_val_acc(small_digits_snn, digits_data):
    train_set, _ = digits_data
    recorded = RecordingDataset(train_set)
    _, history = finetune(small_digits_snn, DataLoader(recorded, batch_size=64), T=2, epochs=1,
                          val_fraction=0.0, progress=False)
    assert len(recorded.reads) == len(train_set) // 64 * 64
    assert "val_acc" not in history[0]


def test_a_plain_list_of_batches_is_split_by_batches(small_digits_snn, digits_data):
    train_set, _ = digits_data
    x, y = train_set.tensors
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 640, 64)]
    tuned, history = finetune(small_digits_snn, batches, T=2, epochs=1, val_fraction=0.2,
                              progress=False)
    assert len(history) == 1 and "val_acc" in history[0]
    assert _weights_changed(state_copy(small_digits_snn), state_copy(tuned))


def test_first_step_loss_is_cross_entropy_on_the_first_seeded_batch(small_digits_snn, digits_data):
    """Pins the sample order (seeded split, one-replica DistributedSampler) and label smoothing."""
    train_set, _ = digits_data
    x, y = _first_batch(train_set, 64, seed=0)
    ref = copy.deepcopy(small_digits_snn)
    ref.T = 2
    with torch.no_grad():
        out = ref(x)
    for smoothing in (0.0, 0.2):
        _, history = finetune(small_digits_snn, DataLoader(train_set, batch_size=64), T=2, epochs=1,
                              max_steps_per_epoch=1, label_smoothing=smoothing, progress=False)
        expected = F.cross_entropy(out, y, label_smoothing=smoothing).item()
        assert history[0]["loss"] == pytest.approx(expected, rel=1e-5), smoothing
        assert history[0]["train_acc"] == pytest.approx(100 * (out.argmax(1) == y).float().mean().item())


# --- the caller's network, seeds ------------------------------------------------------------

def test_the_callers_snn_is_not_changed(small_digits_snn, digits_loaders):
    train, _ = digits_loaders
    before, thetas = state_copy(small_digits_snn), _thetas(small_digits_snn)
    tuned, _ = finetune(small_digits_snn, train, T=2, train_thresholds=True, alpha=4.0,
                        detach_reset=True, **QUICK)
    assert_bit_identical(before, state_copy(small_digits_snn))
    assert small_digits_snn.T == 4
    for m in neurons(small_digits_snn).values():
        assert m.T == 4 and m.alpha == 2.0 and m.detach_reset is False
        assert not m.theta.requires_grad
    assert _weights_changed(before, state_copy(tuned))
    assert any(not torch.equal(thetas[n], t) for n, t in _thetas(tuned).items())
    assert all(not p.requires_grad for n, p in tuned.named_parameters() if n.endswith("theta"))


def test_same_seed_gives_bit_identical_weights(small_digits_snn, digits_loaders):
    train, _ = digits_loaders
    a, ha = finetune(small_digits_snn, train, T=2, epochs=2, max_steps_per_epoch=3, seed=7,
                     progress=False)
    b, hb = finetune(small_digits_snn, train, T=2, epochs=2, max_steps_per_epoch=3, seed=7,
                     progress=False)
    assert_bit_identical(state_copy(a), state_copy(b))
    assert [h["loss"] for h in ha] == [h["loss"] for h in hb]
    c, _ = finetune(small_digits_snn, train, T=2, epochs=2, max_steps_per_epoch=3, seed=8,
                    progress=False)
    assert _weights_changed(state_copy(a), state_copy(c)), "another seed, another sample order"


def test_the_global_rng_does_not_decide_the_result(small_digits_snn, digits_loaders):
    train, _ = digits_loaders
    torch.manual_seed(123)
    a, _ = finetune(small_digits_snn, train, T=2, seed=1, **QUICK)
    torch.manual_seed(456)
    torch.rand(17)
    b, _ = finetune(small_digits_snn, train, T=2, seed=1, **QUICK)
    assert_bit_identical(state_copy(a), state_copy(b))


def test_the_callers_global_rng_is_left_as_it_was(small_digits_snn, digits_loaders):
    torch.manual_seed(11)
    state = torch.get_rng_state()
    finetune(small_digits_snn, digits_loaders[0], T=2, **QUICK)
    assert torch.equal(torch.get_rng_state(), state)


class Unsized:
    """A re-iterable loader without ``__len__`` (a streaming source)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_an_unsized_loader_trains_at_every_step(small_digits_snn, digits_data):
    """Without a known epoch length there is nothing to anneal over: the rate stays at lr."""
    x, y = digits_data[0].tensors
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 4 * 64, 64)]
    common = dict(T=2, epochs=1, optimizer="sgd", momentum=0.0, lr=1e-2, val_fraction=0.0,
                  progress=False)
    one, _ = finetune(small_digits_snn, Unsized(batches[:1]), **common)
    four, history = finetune(small_digits_snn, Unsized(batches), **common)
    assert _weights_changed(state_copy(one), state_copy(four)), "steps 2-4 moved the weights"
    assert history[0]["train_acc"] >= 0 and math.isfinite(history[0]["loss"])


# --- thresholds and weight decay ------------------------------------------------------------

def test_thresholds_are_frozen_by_default(small_digits_snn, digits_loaders):
    train, _ = digits_loaders
    before = state_copy(small_digits_snn)
    tuned, _ = finetune(small_digits_snn, train, T=2, lr=1e-2, **QUICK)
    assert_bit_identical(_thetas(small_digits_snn), _thetas(tuned))
    assert _weights_changed(before, state_copy(tuned))


@pytest.mark.parametrize("threshold_lr", [1e-2, 10.0])
def test_trained_thresholds_change_and_stay_positive(small_digits_snn, digits_loaders, threshold_lr):
    train, _ = digits_loaders
    before = _thetas(small_digits_snn)
    tuned, history = finetune(small_digits_snn, train, T=2, train_thresholds=True, optimizer="sgd",
                              lr=1e-3, threshold_lr=threshold_lr, **QUICK)
    after = _thetas(tuned)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all((t > 0).all() and torch.isfinite(t).all() for t in after.values()), after
    assert math.isfinite(history[0]["loss"])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("train_thresholds", [False, True])
def test_weight_decay_acts_on_weights_never_on_thresholds(small_digits_snn, digits_loaders, optimizer,
                                                          train_thresholds):
    """One step from the same start: the gradients are identical, so only decay can differ."""
    train, _ = digits_loaders
    runs = {}
    for wd in (0.0, 0.5):
        runs[wd], _ = finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=1,
                               optimizer=optimizer, lr=1e-2, weight_decay=wd, momentum=0.0,
                               train_thresholds=train_thresholds, threshold_lr=0.1,
                               val_fraction=0.0, progress=False)
    plain, decayed = state_copy(runs[0.0]), state_copy(runs[0.5])
    assert _weights_changed(plain, decayed), "weight decay must act on conv/linear weights"
    for name in plain:
        if not name.endswith("weight"):  # thresholds, scales and biases
            assert torch.equal(plain[name], decayed[name]), name
    if train_thresholds:
        assert any(not torch.equal(a, b) for a, b in
                   zip(_thetas(small_digits_snn).values(), _thetas(runs[0.5]).values()))


# --- options reach what they act on ---------------------------------------------------------

def test_alpha_and_detach_reset_reach_every_neuron(small_digits_snn, digits_loaders):
    train, _ = digits_loaders
    base, _ = finetune(small_digits_snn, train, T=2, lr=1e-2, **QUICK)
    tuned, _ = finetune(small_digits_snn, train, T=2, lr=1e-2, alpha=5.0, detach_reset=True, **QUICK)
    for m in neurons(tuned).values():
        assert m.alpha == 5.0 and m.node.surrogate_function.alpha == 5.0
        assert m.detach_reset is True and m.node.detach_reset is True
    for alpha, detach in ((5.0, False), (2.0, True)):
        other, _ = finetune(small_digits_snn, train, T=2, lr=1e-2, alpha=alpha, detach_reset=detach,
                            **QUICK)
        assert _weights_changed(state_copy(base), state_copy(other)), (alpha, detach)


@pytest.mark.parametrize("options", [
    dict(optimizer="sgd", momentum=0.9, label_smoothing=0.1),
    dict(optimizer="sgd", momentum=0.0, warmup_steps=2, grad_clip=0.0),
    dict(optimizer="adamw", weight_decay=1e-2, warmup_steps=2, label_smoothing=0.1),
    dict(optimizer="adamw", batch_size=32),
], ids=["sgd-nesterov-smoothing", "sgd-warmup-noclip", "adamw-decay-warmup-smoothing", "batch32"])
def test_optimizer_options_run_and_train(small_digits_snn, digits_loaders, options):
    train, _ = digits_loaders
    before = state_copy(small_digits_snn)
    tuned, history = finetune(small_digits_snn, train, T=2, lr=1e-2, **QUICK, **options)
    after = state_copy(tuned)
    assert _weights_changed(before, after)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert math.isfinite(history[0]["loss"])


def test_warmup_scales_the_first_step(small_digits_snn, digits_loaders):
    """Plain SGD moves weights by lr * f(0) * grad; with 4 warm-up steps f(0) = 1/4."""
    train, _ = digits_loaders
    start = state_copy(small_digits_snn)
    common = dict(T=2, epochs=1, max_steps_per_epoch=1, optimizer="sgd", momentum=0.0, lr=1e-2,
                  grad_clip=0.0, val_fraction=0.0, progress=False)
    full, _ = finetune(small_digits_snn, train, **common)
    warm, _ = finetune(small_digits_snn, train, warmup_steps=4, **common)
    moved = [k for k in _weights_changed(start, state_copy(full))]
    assert moved
    large = []
    for k in moved:
        d_full = state_copy(full)[k] - start[k]
        d_warm = state_copy(warm)[k] - start[k]
        # d = (w + lr*g) - w is exact up to one ulp of w, hence the absolute tolerance
        ulp = torch.finfo().eps * start[k].abs().max().item()
        torch.testing.assert_close(d_warm, d_full / 4, rtol=1e-3, atol=4 * ulp)
        if d_full.abs().max() > 100 * ulp:
            large.append(k)
    # the comparison means something only where the step is large against the tolerance (a
    # fixed 1e-4 on every tensor depended on the fixture network's gradients)
    assert len(large) >= len(moved) // 2, (large, moved)


def test_a_single_epoch_limit_caps_the_steps(small_digits_snn, digits_data):
    train_set, _ = digits_data
    recorded = RecordingDataset(train_set)
    finetune(small_digits_snn, DataLoader(recorded, batch_size=32), T=2, epochs=2,
             max_steps_per_epoch=2, val_fraction=0.0, progress=False)
    assert len(recorded.reads) == 2 * 2 * 32, "no batch is read beyond the limit"


# --- activation checkpointing ---------------------------------------------------------------

def _tiny_resnet_snn(digits_data):
    from snnconv.models import CifarResNet

    torch.manual_seed(0)
    train_set, _ = digits_data
    ann = CifarResNet([1, 1], [4, 8], num_classes=10, in_channels=1).eval()
    snn, _ = snnconv.convert(ann, DataLoader(train_set, batch_size=64), T=2, L=4, calib_batches=2,
                             progress=False)
    return snn


@pytest.mark.parametrize("mode", ["neuron", "block"])
def test_activation_checkpointing_gives_the_same_training(small_digits_snn, digits_loaders, mode):
    train, _ = digits_loaders
    common = dict(T=2, epochs=1, max_steps_per_epoch=3, optimizer="sgd", lr=5e-2, progress=False)
    plain, hp = finetune(small_digits_snn, train, **common)
    ckpt, hc = finetune(small_digits_snn, train, activation_checkpointing=mode, **common)
    a, b = state_copy(plain), state_copy(ckpt)
    assert _weights_changed(state_copy(small_digits_snn), b), "the checkpointed view trains the model"
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)
    assert hc[0]["loss"] == pytest.approx(hp[0]["loss"], rel=1e-5)


def test_block_checkpointing_on_a_resnet_matches_plain_training(digits_data):
    train_set, _ = digits_data
    snn = _tiny_resnet_snn(digits_data)
    loader = DataLoader(train_set, batch_size=32)
    view = checkpointed(snn, "block")
    assert sum(type(m).__name__ == "_Checkpointed" for m in view.modules()) >= 3, \
        "a ResNet splits into several blocks"
    common = dict(T=2, epochs=1, max_steps_per_epoch=2, optimizer="sgd", lr=5e-2, progress=False)
    a, _ = finetune(snn, loader, **common)
    b, _ = finetune(snn, loader, activation_checkpointing="block", **common)
    sa, sb = state_copy(a), state_copy(b)
    assert _weights_changed(state_copy(snn), sb)
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=1e-5, msg=k)


@pytest.mark.parametrize("mode", ["neuron", "block"])
def test_checkpointed_view_shares_parameters_computes_the_same_and_recomputes(small_digits_snn,
                                                                              digits_data, mode):
    train_set, _ = digits_data
    x = train_set.tensors[0][:16]
    snn = small_digits_snn
    snn.T = 2
    view = checkpointed(snn, mode)
    ptrs = {p.data_ptr() for p in snn.parameters()}
    assert {p.data_ptr() for p in view.parameters()} == ptrs
    with torch.no_grad():
        torch.testing.assert_close(view(x), snn(x), rtol=0, atol=0)
    first_if = next(iter(neurons(snn).values()))
    calls = []
    # a pre-hook: checkpoint's recomputation stops early, before forward hooks would fire
    handle = first_if.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        view.train()
        view(x).sum().backward()
    finally:
        handle.remove()
    assert len(calls) == 2, "the checkpointed IF layer runs again in backward"


# --- bad input ------------------------------------------------------------------------------

def test_a_loader_without_labels_is_a_data_error(small_digits_snn, digits_data):
    x = digits_data[0].tensors[0]
    with pytest.raises(DataError, match="labels"):
        finetune(small_digits_snn, DataLoader(TensorDataset(x), batch_size=64), T=2, progress=False)
    with pytest.raises(DataError, match="labels"):
        finetune(small_digits_snn, [x[:64], x[64:128]], T=2, val_fraction=0.0, progress=False)


def test_distillation_alone_needs_no_labels_and_validates_against_the_teacher(small_digits_snn,
                                                                               small_digits_ann, digits_data):
    """distill=1: an unlabelled loader trains exactly as the same images labelled by the
    teacher's top-1 (the loss reads only the teacher's outputs), and validation is agreement
    with the teacher."""
    x = digits_data[0].tensors[0][:512]
    with torch.no_grad():
        top1 = small_digits_ann.eval()(x).argmax(1)
    opts = dict(T=2, epochs=1, distill=1.0, teacher=small_digits_ann, batch_size=64, progress=False)
    free, h_free = finetune(small_digits_snn, DataLoader(TensorDataset(x), batch_size=64), **opts)
    told, h_told = finetune(small_digits_snn, DataLoader(TensorDataset(x, top1), batch_size=64), **opts)
    assert h_free[0]["val_acc"] == pytest.approx(h_told[0]["val_acc"])
    assert h_free[0]["steps"] == h_told[0]["steps"] > 0
    for (name, a), b in zip(free.state_dict().items(), told.state_dict().values()):
        assert torch.equal(a, b), name
    assert not all(torch.equal(a, b) for a, b in zip(free.state_dict().values(),
                                                     small_digits_snn.state_dict().values()))
    with pytest.raises(DataError, match="distill=1.0"):
        finetune(small_digits_snn, DataLoader(TensorDataset(x), batch_size=64),
                 **dict(opts, distill=0.5))


def test_an_empty_or_too_small_loader_is_a_data_error(small_digits_snn, digits_data):
    x, y = digits_data[0].tensors
    with pytest.raises(DataError):
        finetune(small_digits_snn, DataLoader(TensorDataset(x[:0], y[:0]), batch_size=8), progress=False)
    with pytest.raises(DataError):
        finetune(small_digits_snn, DataLoader(TensorDataset(x[:40], y[:40]), batch_size=64),
                 progress=False)
    with pytest.raises(DataError):
        finetune(small_digits_snn, [], val_fraction=0.0, progress=False)


def test_a_one_shot_iterator_that_runs_dry_is_a_data_error(small_digits_snn, digits_data):
    x, y = digits_data[0].tensors
    batches = iter([(x[:64], y[:64]), (x[64:128], y[64:128])])
    with pytest.raises(DataError, match="no batch"):
        finetune(small_digits_snn, batches, T=2, epochs=2, val_fraction=0.0, progress=False)


@pytest.mark.parametrize("T", [0, -1, 1.5, True])
def test_T_below_one_or_not_an_integer_is_a_value_error(small_digits_snn, digits_loaders, T):
    with pytest.raises(ValueError, match="T"):
        finetune(small_digits_snn, digits_loaders[0], T=T, progress=False)


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Flatten(), nn.Linear(64, 10)),
    nn.Sequential(IFNeuron(1.0)),
], ids=["sequential", "bare-neuron"])
def test_a_module_that_is_not_a_spiking_network_is_a_stage_order_error(model, digits_loaders):
    with pytest.raises(StageOrderError, match="SpikingNetwork"):
        finetune(model, digits_loaders[0], progress=False)


def test_an_unknown_option_is_a_type_error(small_digits_snn, digits_loaders):
    with pytest.raises(ConfigError, match="learning_rate"):
        finetune(small_digits_snn, digits_loaders[0], learning_rate=1e-3, progress=False)


@pytest.mark.parametrize("field, value", [
    ("epochs", -1), ("optimizer", "adam"), ("lr", 0.0), ("threshold_lr", -1.0),
    ("val_fraction", 1.0), ("alpha", 0.0), ("activation_checkpointing", "layer"),
    ("checkpoint_every", -1), ("warmup_steps", -2), ("batch_size", 0), ("max_steps_per_epoch", 0),
    ("label_smoothing", 1.0), ("label_smoothing", -0.1), ("weight_decay", -1e-4),
    ("momentum", 1.0), ("grad_clip", -1.0), ("wise", 1.0), ("wise", -0.1),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        FinetuneConfig(**{field: value})


def test_config_fields_and_keyword_options_combine(small_digits_snn, digits_loaders):
    """Keyword options override the config; the same run either way."""
    train, _ = digits_loaders
    cfg = FinetuneConfig(T=2, epochs=1, max_steps_per_epoch=2, lr=1e-2, seed=3)
    a, _ = finetune(small_digits_snn, train, config=cfg, progress=False)
    b, _ = finetune(small_digits_snn, train, config=FinetuneConfig(lr=1e-2, seed=3), T=2, epochs=1,
                    max_steps_per_epoch=2, progress=False)
    assert_bit_identical(state_copy(a), state_copy(b))


# --- progress bar and the pipeline ----------------------------------------------------------

def test_progress_false_prints_nothing_and_progress_true_shows_a_bar(small_digits_snn, digits_loaders,
                                                                     capsys):
    train, _ = digits_loaders
    finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=2, progress=False)
    quiet = capsys.readouterr()
    assert quiet.out == "" and quiet.err == ""
    finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=2, progress=True)
    loud = capsys.readouterr()
    assert "BPTT epoch" in loud.err


def test_convert_with_finetune_epochs_runs_stage_4(small_digits_ann, digits_loaders):
    train, test = digits_loaders
    snn, meta = snnconv.convert(small_digits_ann, train, T=2, L=4, finetune_epochs=1,
                                eval_loader=test, progress=False)
    names = [s.name for s in meta.stages]
    assert names[-1] == "finetune" and names.index("spiking") < names.index("finetune")
    history = meta.stages[-1].changes["history"]
    assert len(history) == 1 and "val_acc" in history[0]
    assert snn.T == 2
    assert snnconv.find_batchnorm(snn) == []
    # convert()'s own recipe (chosen on the robustness matrix), distilled from the user's ANN
    from snnconv.defaults import CONVERT_FINETUNE

    used = meta.settings["finetune"]
    assert {k: used[k] for k in CONVERT_FINETUNE if k != "batch_size"} == {
        k: v for k, v in CONVERT_FINETUNE.items() if k != "batch_size"}
    assert used["batch_size"] == 16  # about 1,300 training images: the smallest batch
    assert used["T"] == 4 and tuple(used["horizons"]) == (1, 2, 4)  # unrolled 2T, readouts at T/2, T, 2T
    assert used["max_steps_per_epoch"] == snnconv.defaults.FINETUNE_MAX_STEPS
    assert CONVERT_FINETUNE["distill"] > 0 and CONVERT_FINETUNE["train_thresholds"]


@pytest.mark.parametrize("images,loader_batch,want", [(40000, 128, 64), (12000, 128, 32), (1000, 128, 16),
                                                     (12000, 8, 8), (None, 128, 64)])
def test_convert_fine_tunes_small_data_sets_in_smaller_batches(images, loader_batch, want):
    """64 images a batch, halved down to 16 while an epoch of the training split (90%) would
    have fewer than 256 steps; never more than the loader's own; a loader without a sized
    data set keeps its own batches in finetune() and the recipe's number in the settings."""
    from snnconv.defaults import _finetune_batch

    if images is None:
        loader = [torch.zeros(loader_batch, 1)] * 3
    else:
        loader = DataLoader(torch.utils.data.TensorDataset(torch.zeros(images, 1)), batch_size=loader_batch)
    assert _finetune_batch(loader, 64, 0.1) == want


def test_convert_fine_tunes_a_small_data_set_in_the_loaders_batches(small_digits_ann, digits_data):
    """The recipe's batches of 64 never exceed the user's: 60 images in batches of 8 still train."""
    subset = torch.utils.data.Subset(digits_data[0], range(60))
    loader = DataLoader(subset, batch_size=8)
    snn, meta = snnconv.convert(small_digits_ann, loader, T=2, L=4, finetune_epochs=1, progress=False,
                                on_collapse="warn")
    assert meta.settings["finetune"]["batch_size"] == 8
    assert meta.stages[-1].name == "finetune" and len(meta.stages[-1].changes["history"]) == 1


def test_convert_with_finetune_epochs_0_has_no_stage_4(small_digits_ann, digits_loaders):
    _, meta = snnconv.convert(small_digits_ann, digits_loaders[0], T=2, L=4, finetune_epochs=0, progress=False)
    assert "finetune" not in [s.name for s in meta.stages]
    assert meta.settings["budget"]["finetune_steps"] == 0


# --- distillation from the ANN --------------------------------------------------------------

def test_first_step_loss_mixes_cross_entropy_and_distillation(small_digits_snn, small_digits_ann,
                                                              digits_data):
    train_set, _ = digits_data
    x, y = _first_batch(train_set, 64, seed=0)
    ref = copy.deepcopy(small_digits_snn)
    ref.T = 2
    teacher = copy.deepcopy(small_digits_ann).eval()
    with torch.no_grad():
        out, t_out = ref(x), teacher(x)
    w, tau = 0.3, 3.0
    ce = F.cross_entropy(out, y)
    kl = (F.softmax(t_out / tau, 1) * (F.log_softmax(t_out / tau, 1) - F.log_softmax(out / tau, 1))
          ).sum(1).mean()
    _, history = finetune(small_digits_snn, DataLoader(train_set, batch_size=64), T=2, epochs=1,
                          max_steps_per_epoch=1, distill=w, distill_temperature=tau,
                          teacher=small_digits_ann, progress=False)
    assert history[0]["loss"] == pytest.approx(((1 - w) * ce + w * tau ** 2 * kl).item(), rel=1e-5)


def test_distillation_trains_on_the_teacher_and_leaves_the_teacher_alone(
        small_digits_snn, small_digits_ann, digits_loaders):
    """The teacher (here in train mode, with BatchNorm) is read, never changed or switched to
    eval; distilling gives other weights than plain fine-tuning from the same seed.

    Whether distillation moves the SNN towards the teacher is a training outcome, not a test:
    the former assertion (top-1 agreement higher with distillation, 0.813 vs 0.797 here) failed
    on an AMD EPYC machine, and on digits the KL to the teacher after one epoch came out no lower
    with distillation (0.370 vs 0.363, seed 0); on Fashion-MNIST the GPU sweep measured equal
    accuracy with and without it (benchmarks/results/sweep_knobs_gpu.json, distill0 / distill1).
    The loss itself is pinned by test_first_step_loss_mixes_cross_entropy_and_distillation.
    """
    train, _ = digits_loaders
    teacher = small_digits_ann.train()
    before = copy.deepcopy(teacher.state_dict())
    options = dict(T=2, epochs=1, max_steps_per_epoch=3, lr=3e-3, progress=False)
    plain, _ = finetune(small_digits_snn, train, **options)
    taught, _ = finetune(small_digits_snn, train, distill=1.0, teacher=teacher, **options)
    assert _weights_changed(state_copy(plain), state_copy(taught))
    assert teacher.training
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())


def test_distill_needs_a_teacher_and_a_teacher_needs_distill(small_digits_snn, small_digits_ann,
                                                            digits_loaders):
    train, _ = digits_loaders
    with pytest.raises(ValueError, match="teacher"):
        finetune(small_digits_snn, train, distill=0.5, **QUICK)
    with pytest.raises(ValueError, match="distill"):
        finetune(small_digits_snn, train, teacher=small_digits_ann, **QUICK)


@pytest.mark.parametrize("field, value", [("distill", 1.5), ("distill", -0.1),
                                          ("distill_temperature", 0.0)])
def test_config_rejects_bad_distillation_values(field, value):
    with pytest.raises(ValueError, match=field):
        FinetuneConfig(**{field: value})


def test_convert_distills_from_the_callers_model(small_digits_ann, digits_loaders):
    train, _ = digits_loaders
    cfg = FinetuneConfig(T=2, epochs=1, max_steps_per_epoch=2, distill=0.5)
    snn, meta = snnconv.convert(small_digits_ann, train, T=2, L=4, finetune_config=cfg,
                                progress=False)
    assert meta.stages[-1].name == "finetune"
    assert meta.settings["finetune"]["distill"] == 0.5


# --- weight-space ensembling with the start (WiSE-FT) ---------------------------------------

def test_blend_mixes_every_weight_and_threshold_and_leaves_both_inputs_alone(small_digits_snn,
                                                                              digits_loaders):
    tuned, _ = finetune(small_digits_snn, digits_loaders[0], T=2, train_thresholds=True, lr=1e-2, **QUICK)
    start, end = state_copy(small_digits_snn), state_copy(tuned)
    mixed = state_copy(blend(small_digits_snn, tuned, 0.3))
    assert _weights_changed(start, end) and any(not torch.equal(start[k], end[k]) for k in start
                                                if k.endswith("theta"))
    for k in start:
        torch.testing.assert_close(mixed[k], 0.7 * end[k] + 0.3 * start[k], rtol=1e-6, atol=1e-7)
    assert_bit_identical(state_copy(blend(small_digits_snn, tuned, 0.0)), end)
    assert_bit_identical(state_copy(blend(small_digits_snn, tuned, 1.0)), start)
    assert_bit_identical(state_copy(small_digits_snn), start)
    assert_bit_identical(state_copy(tuned), end)


def test_blend_refuses_two_different_networks(small_digits_snn, digits_data):
    with pytest.raises(ValueError, match="same network"):
        blend(small_digits_snn, _tiny_resnet_snn(digits_data), 0.5)
    with pytest.raises(ValueError, match="wise"):
        blend(small_digits_snn, small_digits_snn, 1.5)
    with pytest.raises(StageOrderError, match="start is a Sequential"):
        blend(nn.Sequential(), small_digits_snn, 0.5)


def test_wise_returns_the_blend_and_a_finished_run_reblends_without_training(small_digits_snn,
                                                                             digits_loaders, tmp_path):
    run = dict(T=2, lr=1e-2, checkpoint_dir=str(tmp_path), **QUICK)
    tuned, history = finetune(small_digits_snn, digits_loaders[0], **run)
    stamp = os.stat(tmp_path / CHECKPOINT_NAME).st_mtime_ns
    mixed, h_mixed = finetune(small_digits_snn, digits_loaders[0], wise=0.4, resume=True, **run)
    assert os.stat(tmp_path / CHECKPOINT_NAME).st_mtime_ns == stamp, "nothing was trained again"
    assert h_mixed == history
    assert_bit_identical(state_copy(mixed), state_copy(blend(small_digits_snn, tuned, 0.4)))
    assert mixed.T == small_digits_snn.T and not mixed.training

