"""On a CUDA device: the SNN computes what it computes on CPU, fine-tuning trains there with
mixed precision (bfloat16 autocast, or float16 with a gradient scaler), and a run interrupted on
the GPU resumes there. Skipped where no GPU is visible (CI has none)."""

from __future__ import annotations

import copy

import pytest
import torch
from _interrupting import Interrupt, InterruptingDataset
from torch.utils.data import DataLoader

from snnconv import finetune
from snnconv.snn.neuron import neurons
from snnconv.stages.finetune import CHECKPOINT_NAME, read_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.usefixtures("no_tf32")]  # float32 on the GPU as on CPU


def test_the_snn_on_the_gpu_computes_what_it_computes_on_cpu(small_digits_snn, digits_data):
    _, test_set = digits_data
    x = test_set.tensors[0][:128]
    with torch.no_grad():
        cpu = small_digits_snn.run(x, T=8)
        gpu = copy.deepcopy(small_digits_snn).cuda().run(x.cuda(), T=8).cpu()
        rate_cpu, rate_gpu = small_digits_snn.rate(x, 8), small_digits_snn.cuda().rate(x.cuda(), 8).cpu()
    # a membrane a rounding error away from the threshold may fire one step apart
    assert (cpu.argmax(-1) == gpu.argmax(-1)).float().mean() > 0.98
    assert (cpu - gpu).abs().mean() < 1e-2 * cpu.abs().mean()
    assert (rate_cpu.argmax(-1) == rate_gpu.argmax(-1)).float().mean() > 0.98


@pytest.mark.parametrize("amp", [False, True])
def test_finetuning_on_the_gpu_trains_with_and_without_autocast(small_digits_snn, digits_loaders, amp):
    train, _ = digits_loaders
    before = {k: v.clone() for k, v in small_digits_snn.state_dict().items()}
    tuned, history = finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=6,
                              train_thresholds=True, horizons=(1, 2),
                              device="cuda", amp=amp, progress=False)
    state = tuned.state_dict()
    assert all(v.is_cuda for v in state.values())
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert all(v.dtype == before[k].dtype for k, v in state.items()), "weights stay float32"
    assert any(not torch.equal(before[k], v.cpu()) for k, v in state.items() if k.endswith("weight"))
    assert all((m.theta > 0).all() for m in neurons(tuned).values())
    assert history[0]["loss"] > 0 and 0 <= history[0]["val_acc"] <= 100
    for k, v in small_digits_snn.state_dict().items():  # the caller's network stays where it was
        assert torch.equal(v, before[k]) and not v.is_cuda


def test_float16_autocast_uses_the_gradient_scaler(small_digits_snn, digits_loaders, monkeypatch, tmp_path):
    """Where bfloat16 is missing, float16 autocast needs loss scaling; its state is checkpointed."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    train, _ = digits_loaders
    tuned, history = finetune(small_digits_snn, train, T=2, epochs=1, max_steps_per_epoch=4,
                              device="cuda", amp=True, checkpoint_dir=str(tmp_path), progress=False)
    scaler = read_checkpoint(str(tmp_path / CHECKPOINT_NAME))["scaler"]
    assert scaler and scaler["scale"] > 0, "the float16 run kept a loss scale"
    assert torch.isfinite(torch.tensor(history[0]["loss"]))


def test_a_gpu_run_resumes_from_its_mid_epoch_checkpoint(small_digits_snn, digits_data, tmp_path):
    """Stopped after 3 of 6 steps and resumed: the weights of one uninterrupted GPU run (float32,
    deterministic cuDNN), and the GPU's random state was saved with the CPU's."""
    torch.backends.cudnn.deterministic = True
    train_set, _ = digits_data
    run = dict(T=2, epochs=1, max_steps_per_epoch=6, checkpoint_every=1, device="cuda", amp=False,
               progress=False)
    with pytest.raises(Interrupt):
        finetune(small_digits_snn, DataLoader(InterruptingDataset(train_set, 3 * 64), batch_size=64),
                 checkpoint_dir=str(tmp_path / "a"), **run)
    state = read_checkpoint(str(tmp_path / "a" / CHECKPOINT_NAME))
    assert (state["epoch"], state["step"]) == (0, 3) and "cuda" in state["rng"]
    resumed, _ = finetune(small_digits_snn, DataLoader(train_set, batch_size=64),
                          checkpoint_dir=str(tmp_path / "a"), resume=True, **run)
    reference, _ = finetune(small_digits_snn, DataLoader(train_set, batch_size=64),
                            checkpoint_dir=str(tmp_path / "b"), **run)
    r = reference.state_dict()
    for k, v in resumed.state_dict().items():
        torch.testing.assert_close(v, r[k], rtol=0, atol=1e-6, msg=k)
