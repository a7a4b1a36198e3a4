"""Hard reset (reset="zero"): spikingjelly IFNode(v_reset=0.) semantics, conversion, save/load."""

from __future__ import annotations

import pytest
import torch
from spikingjelly.activation_based import functional, neuron, surrogate
from torch.utils.data import DataLoader

import snnconv
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.neuron import IFNeuron, neurons


def _sj_hard(x_seq: torch.Tensor, theta: float) -> torch.Tensor:
    node = neuron.IFNode(v_threshold=theta, v_reset=0.0, surrogate_function=surrogate.ATan(),
                         step_mode="m")
    out = node(x_seq)
    functional.reset_net(node)
    return out


@pytest.mark.parametrize("theta", [0.25, 1.0, 1.7])
def test_hard_reset_forward_is_spikingjellys_ifnode(theta):
    g = torch.Generator().manual_seed(0)
    T, B = 8, 6
    # random inputs, and multiples of 1/8 so that h == theta happens exactly (fires: >=)
    for x in (torch.randn(T, B, 5, 3, generator=g),
              torch.randint(-2, 9, (T, B, 5, 3), generator=g).float() / 8):
        ours = IFNeuron(theta, T, reset="zero")(x.reshape(T * B, 5, 3)).reshape(x.shape)
        assert torch.equal(ours, _sj_hard(x, theta))
        assert ours.sum() > 0


def test_hard_reset_golden_trajectory():
    """h = v + x; fire on h >= theta; v = 0 after a spike; v[0] = 0 (no half-threshold start)."""
    x = torch.tensor([0.6, 0.6, 0.6, 0.3, 1.0, 0.0, 2.5, 0.1]).reshape(8, 1)
    s = IFNeuron(1.0, 8, reset="zero")(x).reshape(-1).tolist()
    # v: 0.6, fire at 1.2 -> 0, 0.6, 0.9, fire at 1.9 -> 0, 0, fire at 2.5 -> 0, 0.1
    assert s == [0, 1, 0, 0, 1, 0, 1, 0]
    # the subtractive neuron on the same input keeps the excess and starts at theta/2
    assert IFNeuron(1.0, 8)(x).reshape(-1).tolist() == [1, 0, 1, 0, 1, 0, 1, 1]


def test_hard_reset_per_channel_thresholds():
    g = torch.Generator().manual_seed(1)
    theta = torch.tensor([0.3, 1.0, 2.0])
    x = torch.rand(8, 4, 3, 2, generator=g) * 1.5
    ours = IFNeuron(theta, 8, reset="zero")(x.reshape(32, 3, 2)).reshape(x.shape)
    for c in range(3):
        assert torch.equal(ours[:, :, c], _sj_hard(x[:, :, c], float(theta[c])))


def test_hard_reset_has_surrogate_gradients():
    m = IFNeuron(torch.tensor([0.5, 1.0]), 4, reset="zero")
    m.theta.requires_grad_(True)
    x = (torch.rand(4 * 3, 2) * 2).requires_grad_(True)
    m(x).sum().backward()
    assert x.grad.abs().sum() > 0 and m.theta.grad.abs().sum() > 0


def test_bad_reset_is_refused():
    with pytest.raises(ValueError, match="reset"):
        IFNeuron(1.0, 4, reset="hard")
    with pytest.raises(ValueError, match="reset"):
        snnconv.convert(torch.nn.Linear(2, 2), [torch.zeros(1, 2)], reset="soft", progress=False)


@pytest.fixture(scope="module")
def hard_and_soft(_small_digits_ann, digits_data):
    import copy

    train_set, _ = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    out = {}
    for reset in ("subtract", "zero"):
        out[reset] = snnconv.convert(copy.deepcopy(_small_digits_ann), loader, T=4, L=4,
                                     reset=reset, progress=False)
    return out


def test_convert_records_the_reset_and_calibrates_both(hard_and_soft):
    for reset, (snn, meta) in hard_and_soft.items():
        assert meta.settings["reset"] == reset and snn.meta["reset"] == reset
        assert {m.reset for m in neurons(snn.net).values()} == {reset}
        shifts = snn.meta["bias_calibration"]["mean_abs_shift"]
        assert shifts and all(isinstance(v, float) for v in shifts.values())  # none skipped


def test_hard_reset_survives_save_and_load(hard_and_soft, digits_data, tmp_path):
    snn, _ = hard_and_soft["zero"]
    snn.save(tmp_path / "hard.pt")
    back = SpikingNetwork.load(tmp_path / "hard.pt")
    assert {m.reset for m in neurons(back.net).values()} == {"zero"}
    x = torch.stack([digits_data[1][i][0] for i in range(8)])
    with torch.no_grad():
        assert torch.equal(snn.run(x), back.run(x))
        # and it really is a different network from the subtractive one
        assert not torch.equal(snn.run(x), hard_and_soft["subtract"][0].run(x))


def test_rate_function_is_for_subtractive_reset_only(hard_and_soft):
    snn, _ = hard_and_soft["zero"]
    with pytest.raises(ValueError, match="subtractive"):
        snn.rate(torch.zeros(1, 1, 8, 8), 4)


def test_hard_reset_network_fine_tunes(hard_and_soft, digits_data):
    snn, _ = hard_and_soft["zero"]
    loader = DataLoader(digits_data[0], batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    cfg = snnconv.FinetuneConfig(epochs=1, T=4, max_steps_per_epoch=2, train_thresholds=True,
                                 val_fraction=0.0, amp=False)
    tuned, _ = snnconv.finetune(snn, loader, config=cfg, progress=False)
    assert {m.reset for m in neurons(tuned.net).values()} == {"zero"}
    before, after = snn.state_dict(), tuned.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if k.endswith("theta"))
