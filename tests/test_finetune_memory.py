"""BPTT fine-tuning where a batch does not fit the memory: micro-batches add up to the whole
batch's training, and the step plan cuts a batch to what fits (block checkpointing where one
image does not fit otherwise)."""

from __future__ import annotations

import pytest
import torch
from _probes import state_copy

from snnconv import finetune

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too


def _weights_changed(before: dict, after: dict) -> list[str]:
    return [k for k in before if k.endswith("weight") and not torch.equal(before[k], after[k])]


@pytest.mark.parametrize("horizons", [None, (1, 2)])
def test_micro_batches_give_the_training_of_the_whole_batch(small_digits_snn, digits_loaders, horizons):
    """A batch run in pieces (as where it does not fit the memory) adds up the pieces' weighted
    gradients: the same training up to float rounding."""
    train, _ = digits_loaders
    common = dict(T=2, epochs=1, max_steps_per_epoch=3, optimizer="sgd", lr=5e-2, horizons=horizons,
                  progress=False)
    whole, hw = finetune(small_digits_snn, train, **common)
    pieces, hp = finetune(small_digits_snn, train, micro_batch=5, **common)
    assert whole.meta["finetune_step"]["micro_batch"] == train.batch_size
    assert pieces.meta["finetune_step"] == {"activation_checkpointing": None, "micro_batch": 5,
                                            "bytes_per_image": whole.meta["finetune_step"]["bytes_per_image"]}
    a, b = state_copy(whole), state_copy(pieces)
    assert _weights_changed(state_copy(small_digits_snn), b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)
    assert hp[0]["loss"] == pytest.approx(hw[0]["loss"], rel=1e-5)
    assert hp[0]["train_acc"] == hw[0]["train_acc"]


def test_a_batch_that_does_not_fit_is_cut_to_what_does(small_digits_snn, digits_data, monkeypatch):
    """From the bytes autograd keeps on one image: as many images per piece as fit the step's
    budget, block checkpointing one at a time where one image does not fit otherwise, and a
    ResourceError only where even that does not fit what is free."""
    from snnconv import memory, recompute
    from snnconv.errors import ResourceError

    x = digits_data[0].tensors[0][:32]
    snn = small_digits_snn
    per = recompute.step_bytes(snn, x[:1], None)
    monkeypatch.setattr(recompute, "step_budget", lambda device: 3 * per)
    assert recompute.plan_step(snn, x, 32) == recompute.StepBudget(None, 3, per)
    monkeypatch.setattr(recompute, "step_budget", lambda device: per - 1)
    plan = recompute.plan_step(snn, x, 32)
    assert plan.mode == "block" and plan.micro_batch == 1
    monkeypatch.setattr(memory, "available_bytes", lambda device: 16)
    with pytest.raises(ResourceError, match="single image"):
        recompute.plan_step(snn, x, 32)
