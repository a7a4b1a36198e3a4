"""convert() keeps a calibration's network only where it does at least as well as the network it
started from on held-out images of the loader, and fine-tuning's only where it beats it beyond
their noise: the default conversion is never worse there than the simpler paths without its
steps."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

import snnconv
from snnconv.analysis.metrics import evaluate
from snnconv.data import split_loader
from snnconv.stages.finetune import FinetuneConfig


def _held_out(loader, seed=0):
    return split_loader(loader, FinetuneConfig.val_fraction, seed=seed)[1]


def test_every_step_is_recorded_and_the_better_network_is_kept(small_digits_ann, digits_loaders):
    train, _ = digits_loaders
    snn, meta = snnconv.convert(small_digits_ann, train, T=2, finetune_epochs=0, reconstruction_steps=20,
                                progress=False)
    kept = meta.stage("spiking").changes["kept"]
    assert set(kept) == {"bias_calibration", "reconstruction"}
    for step, record in kept.items():
        wins, losses = record["wins"], record["losses"]
        assert record["kept"] == (wins >= losses), step  # a calibration: at least as many won as lost
        n = record["images"]
        assert record["after"] - record["before"] == pytest.approx(100.0 * (wins - losses) / n)
        assert record["measure"] == "accuracy" and n > 0
    assert snn.meta["calibrated_T"] == 2


def test_the_default_is_never_worse_than_the_paths_without_its_steps(small_digits_ann, digits_loaders):
    """On the held-out images that choose (the fine-tuning's validation split): the training-free
    conversion against no calibration at all and against no reconstruction, and the conversion
    with fine-tuning against the training-free one (its starting point)."""
    train, _ = digits_loaders
    val = _held_out(train)
    common = dict(T=2, progress=False)
    score = {}
    for name, settings in {"plain": dict(bias_calibration=False, reconstruction_steps=0, finetune_epochs=0),
                           "no_reconstruction": dict(reconstruction_steps=0, finetune_epochs=0),
                           "free": dict(reconstruction_steps=30, finetune_epochs=0),
                           "tuned": dict(reconstruction_steps=30, finetune_epochs=1)}.items():
        snn, _ = snnconv.convert(small_digits_ann, train, **common, **settings)
        score[name] = evaluate(snn, val)
    assert score["free"] >= score["plain"]
    assert score["free"] >= score["no_reconstruction"]
    assert score["tuned"] >= score["free"]


def test_fine_tuning_that_hurts_is_dropped(small_digits_ann, digits_loaders):
    """A fine-tuning that wrecks the network (a huge learning rate) leaves the converted network."""
    train, _ = digits_loaders
    free, _ = snnconv.convert(small_digits_ann, train, T=2, finetune_epochs=0, progress=False)
    bad = FinetuneConfig(epochs=1, T=2, lr=50.0, grad_clip=0.0, keep_start=False, seed=0)
    tuned, meta = snnconv.convert(small_digits_ann, train, T=2, finetune_config=bad, progress=False)
    record = meta.stage("finetune").changes["kept"]
    assert record["kept"] is False and record["after"] < record["before"]
    # fine-tuning chose its best epoch on the judging images: it must win beyond their noise
    wins, losses = record["wins"], record["losses"]
    assert record["kept"] == (wins - losses >= max(1.0, math.sqrt(wins + losses)))
    x = next(iter(DataLoader(train.dataset, batch_size=64)))[0]
    with torch.no_grad():
        assert torch.equal(tuned(x), free(x))


def test_the_held_out_images_are_the_split_that_fine_tuning_holds_out(small_digits_ann, digits_loaders):
    """A fine-tuning with its own validation split: the judge reads that split, not the default."""
    train, _ = digits_loaders
    ft = FinetuneConfig(epochs=1, T=2, val_fraction=0.2, max_steps_per_epoch=2, seed=3)
    _, meta = snnconv.convert(small_digits_ann, train, T=2, finetune_config=ft, progress=False)
    held = split_loader(train, 0.2, seed=3)[1]
    images = sum(len(x) for x, _ in held)
    assert meta.stage("spiking").changes["kept"]["bias_calibration"]["images"] == images
    assert meta.stage("finetune").changes["kept"]["images"] == images


class _Stream:
    """A re-iterable loader with no length and no dataset (a stream)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_a_streams_held_out_images_are_the_batches_after_the_calibrations(small_digits_ann, digits_data):
    train_set, _ = digits_data
    batches = list(DataLoader(train_set, batch_size=32))[:8]
    _, meta = snnconv.convert(small_digits_ann, _Stream(batches), T=2, calib_batches=3, finetune_epochs=0,
                              progress=False)
    # as many held-out images as the 3 calibration batches hold, from the batches after them
    assert meta.stage("spiking").changes["kept"]["bias_calibration"]["images"] == 96


class _Scripted(torch.nn.Module):
    """A network whose readout after each step is given: ``steps`` ``[T, B, classes]``."""

    def __init__(self, steps):
        super().__init__()
        self.steps, self.T = steps, steps.shape[0]

    def run(self, x, T):
        return self.steps[:T]

    def forward(self, x):
        return self.steps.mean(0)


def test_judged_on_every_readout_a_network_worse_at_its_T_is_dropped():
    """Judged over the readouts after 1, 2 and 4 steps, a network far better after one step but
    worse after four beyond the noise there loses where ``at=4`` asks; within it, it wins."""
    from snnconv.pipeline import _Judge

    n, y = 40, torch.zeros(40, dtype=torch.long)
    right, wrong = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    before = torch.stack([wrong.expand(n, 2)] * 4)  # wrong after one and two steps ...
    before[2:] = right  # ... and right from step 3 on
    after = before.clone()
    after[:2] = right  # right from the first step ...
    after[:, :3] = wrong  # ... but three images wrong at every step
    judge = _Judge([(torch.zeros(n, 1), y)], torch.nn.Identity(), torch.device("cpu"))
    judge.ann = [torch.stack([torch.ones(n), torch.zeros(n)], 1)]
    a, b = _Scripted(before), _Scripted(after)
    assert judge.keep("finetune", a, b, selected_here=True, horizons=(1, 2, 4)) is b
    assert judge.keep("finetune", a, b, selected_here=True, horizons=(1, 2, 4), at=4) is a
    rec = judge.record["finetune"]
    assert rec["at"] == pytest.approx({"steps": 4, "before": 100.0, "after": 100.0 * 37 / 40, "wins": 0, "losses": 3})
    assert rec["wins"] == 2 * 37 and rec["losses"] == 3 and rec["images"] == n and not rec["kept"]
    after[:, 1:3] = right  # one image wrong at every step: within the noise at step 4
    c = _Scripted(after)
    assert judge.keep("finetune", a, c, selected_here=True, horizons=(1, 2, 4), at=4) is c
    assert judge.record["finetune"]["at"]["losses"] == 1 and judge.record["finetune"]["kept"]
