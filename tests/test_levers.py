"""The few-step levers, each as its option says: noise-modelled QCFS training (the noise's
distribution, the residual error it is measured from), the per-step loss of fine-tuning, and
the calibration against the ANN itself. Properties on small networks, never one seed's accuracy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv.activation import QCFS, qcfs_sites
from snnconv.calibration import calibrate_bias, residual_noise
from snnconv.calibration.reference import ReLUSite, unquantised
from snnconv.errors import ConfigError
from snnconv.graph import capture, module_of
from snnconv.snn.neuron import IFNeuron, channel_view
from snnconv.stages.finetune import FinetuneConfig, _backward
from snnconv.stages.qcfs import QCFSTrainConfig, set_noise
from snnconv.stages.spiking import to_spiking

pytestmark = pytest.mark.portable


def _labelled(n: int = 256, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(),
                         nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3)).eval()


# --------------------------------------------------------------------------------------------
# noise-modelled QCFS training


def test_the_qcfs_noise_is_gaussian_with_the_stated_deviation_in_training_only():
    q = QCFS(4, torch.tensor(2.0))
    q.noise = 0.3
    x = torch.rand(200_000) * 3
    q.eval()
    clean = q(x).detach()
    assert torch.equal(clean, q(x))  # eval: no noise, deterministic
    q.train()
    torch.manual_seed(0)
    e = (clean - q(x)).detach()  # what training subtracts
    assert abs(float(e.mean())) < 0.005
    assert float(e.std()) == pytest.approx(0.3, rel=0.01)
    # Gaussian: the fraction within one deviation
    assert float((e.abs() < 0.3).float().mean()) == pytest.approx(0.6827, abs=0.005)
    q.noise = 0.0
    assert torch.equal(q(x), clean)


def _snn_error_local(qgm, x: torch.Tensor, T: int) -> dict[str, float]:
    """The local residual error's deviation, computed here from its definition: per site,
    QCFS applied to the time-mean of the IF neuron's input current, minus theta * rate."""
    snn = to_spiking(qgm, T=T)
    out = {}
    sites = [n for n in qgm.graph.nodes if n.op == "call_module" and isinstance(module_of(qgm, n), QCFS)]
    ifs = [n for n in snn.net.graph.nodes if n.op == "call_module" and isinstance(module_of(snn.net, n), IFNeuron)]
    seen = capture(snn.net, (x,), [n.name for n in ifs] + [n.args[0].name for n in ifs])
    for site, node in zip(sites, ifs):
        rate = seen[node.name].reshape(T, len(x), -1).mean(0)
        mean_in = seen[node.args[0].name].reshape(T, len(x), -1).mean(0)
        q = module_of(qgm, site)
        theta = channel_view(module_of(snn.net, node).theta, 2)
        with torch.no_grad():
            out[site.name] = float((q(mean_in) - rate * theta).var()) ** 0.5
    return out


def test_the_residual_noise_is_each_sites_own_spiking_error():
    qgm = snnconv.calibrate_qcfs(_mlp(), _labelled(), L=4, progress=False)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    sigmas = residual_noise(qgm, [x], T=4)
    want = _snn_error_local(qgm, x, 4)
    assert sigmas == pytest.approx(want, rel=1e-5, abs=1e-7)
    first, *later = sigmas.values()
    # the first layer's input is the same at every step: its IF neuron computes QCFS exactly
    assert first == 0.0
    assert any(s > 0 for s in later)
    # the reference's model (each network run from the input) counts earlier errors again
    accumulated = residual_noise(qgm, [x], T=4, local=False)
    assert list(accumulated.values())[0] == first and sum(accumulated.values()) > sum(later)
    assert not qgm.training  # measured in eval mode, the mode restored


@pytest.mark.filterwarnings("ignore:QCFS training did not beat")
def test_the_residual_noise_is_the_same_measured_in_pieces_of_images(monkeypatch):
    """Where a batch's values do not fit the memory the images go through in pieces; the
    deviation is the same up to float rounding."""
    qgm = snnconv.calibrate_qcfs(_mlp(), _labelled(), L=4, progress=False)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(2))
    for local in (True, False):
        whole = residual_noise(qgm, [x, x[:16]], T=4, local=local)
        monkeypatch.setenv("SNNCONV_MEMORY", "20K")  # a few images at a time
        pieces = residual_noise(qgm, [x, x[:16]], T=4, local=local)
        monkeypatch.delenv("SNNCONV_MEMORY")
        assert pieces == pytest.approx(whole, rel=1e-6, abs=1e-9)


@pytest.mark.filterwarnings("ignore:QCFS training did not beat")
def test_noise_modelled_training_measures_before_each_epoch_and_leaves_no_noise():
    loader = _labelled(1024)
    calls = []

    def model(gm, batches):
        calls.append((gm.training, len(batches)))
        return residual_noise(gm, batches, T=4)

    train = QCFSTrainConfig(epochs=2, lr=0.01, noise=0.5, noise_batches=2)
    qgm = snnconv.calibrate_qcfs(_mlp(), loader, L=4, progress=False, train=train, noise_model=model)
    history = qgm.meta["qcfs"]["history"]
    assert [c[1] for c in calls] == [2, 2]  # once per epoch, on noise_batches batches
    for h in history:
        assert set(h["noise"]) == set(qcfs_sites(qgm))
        assert any(v > 0 for v in h["noise"].values())
    assert all(q.noise == 0.0 for q in qcfs_sites(qgm).values())
    with pytest.raises(ConfigError, match="noise_model"):
        snnconv.calibrate_qcfs(_mlp(), loader, L=4, progress=False, train=train)
    with pytest.raises(ConfigError, match="noise"):
        QCFSTrainConfig(epochs=1, noise=-1.0)


def test_set_noise_scales_each_module_and_clears_the_rest():
    qgm = snnconv.calibrate_qcfs(_mlp(), _labelled(), L=4, progress=False)
    names = [n.name for n in qgm.graph.nodes if n.op == "call_module" and isinstance(module_of(qgm, n), QCFS)]
    set_noise(qgm, {names[1]: 0.25})
    assert [q.noise for q in qcfs_sites(qgm).values()] == [0.0, 0.25, 0.0]
    set_noise(qgm, {})
    assert all(q.noise == 0.0 for q in qcfs_sites(qgm).values())


@pytest.mark.filterwarnings("ignore:QCFS training did not beat")
def test_convert_runs_noise_modelled_qcfs_training_at_its_T():
    _, meta = snnconv.convert(_mlp(), _labelled(), T=4, L=4, finetune_epochs=0, progress=False,
                              qcfs_train=QCFSTrainConfig(epochs=1, noise=1.0))
    record = next(s for s in meta.stages if s.name == "qcfs").changes
    assert record["history"][0]["noise"]


# --------------------------------------------------------------------------------------------
# a loss at every step


class _Steps(nn.Module):
    """A stand-in for a spiking network: fixed per-step readouts ``[T, B, C]``."""

    def __init__(self, steps: torch.Tensor):
        super().__init__()
        self.steps = nn.Parameter(steps)

    def forward(self, x, per_step=False):
        return self.steps if per_step else self.steps.mean(0)


@pytest.mark.parametrize("weight", [0.0, 0.4, 1.0])
def test_the_per_step_loss_mixes_each_steps_own_cross_entropy(weight):
    g = torch.Generator().manual_seed(0)
    steps = torch.randn(4, 8, 3, generator=g)
    y = torch.randint(0, 3, (8,), generator=g)
    cfg = FinetuneConfig(T=4, per_step=weight, amp=False)
    runner = _Steps(steps.clone())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss, out = _backward(runner, torch.zeros(8, 1), y, None, cfg, 8, scaler, False, torch.float32)
    mean_ce = F.cross_entropy(steps.mean(0), y)
    each = sum(F.cross_entropy(s, y) for s in steps) / 4
    assert loss == pytest.approx(float((1 - weight) * mean_ce + weight * each), rel=1e-6)
    assert torch.allclose(out, steps.mean(0))
    with pytest.raises(ConfigError, match="per_step"):
        FinetuneConfig(per_step=1.5)


# --------------------------------------------------------------------------------------------
# calibration against the ANN itself


def test_the_ann_reference_is_the_relu_network_at_the_same_sites():
    ann = _mlp()
    qgm = snnconv.calibrate_qcfs(ann, _labelled(), L=2, progress=False)
    ref = unquantised(qgm)
    x = torch.randn(32, 6)
    with torch.no_grad():
        assert torch.allclose(ref(x), ann(x), atol=1e-6)
    assert all(isinstance(m, ReLUSite) for m in qcfs_sites(ref).values())
    assert sorted(qcfs_sites(ref)) == sorted(qcfs_sites(qgm))
    assert all(type(m) is QCFS for m in qcfs_sites(qgm).values())  # the QCFS-ANN is untouched


def _mean_errors(snn, ann_ref, x: torch.Tensor, T: int) -> list[float]:
    """Per IF layer: the mean over channels of |ANN mean - SNN mean| of its output on ``x``."""
    names = {r["source"]: n for n, r in snn.meta["neurons"].items()}
    sites = {str(n.target): n.name for n in ann_ref.graph.nodes if n.op == "call_module"
             and isinstance(module_of(ann_ref, n), QCFS)}
    ifs = {str(n.target): n.name for n in snn.net.graph.nodes if n.op == "call_module"}
    a = capture(ann_ref, (x,), sites.values())
    s = capture(snn.net, (x,), [ifs[names[t]] for t in sites])
    out = []
    for t, node in sites.items():
        spikes = s[ifs[names[t]]]
        theta = snn.net.get_submodule(names[t]).theta
        value = spikes.reshape(T, len(x), -1).mean(0) * channel_view(theta, 2)
        out.append(float((a[node].mean(0) - value.mean(0)).abs().mean()))
    return out


def test_bias_correction_against_the_ann_moves_each_layers_mean_error_towards_zero():
    """Calibrated against the ANN (bias only, at the network's T), every layer's mean output
    over the calibration images is nearer the ANN's than before, and nearer than calibrated
    against the QCFS-ANN, which keeps the error of clipping at the threshold."""
    torch.manual_seed(0)
    ann = _mlp(3)
    loader = _labelled(512)
    x = torch.cat([b[0] for b in loader])
    qgm = snnconv.calibrate_qcfs(ann, loader, L=4, percentile=90.0, progress=False)
    ref = unquantised(qgm)
    snn = to_spiking(qgm, T=4)
    before = _mean_errors(snn, ref, x, 4)
    to_ann = calibrate_bias(snn, ref, [x], T=4, num_batches=1)
    to_qcfs = calibrate_bias(snn, qgm, [x], T=4, num_batches=1)
    after, other = _mean_errors(to_ann, ref, x, 4), _mean_errors(to_qcfs, ref, x, 4)
    assert all(b > 0 for b in before)
    for layer, (b, a, o) in enumerate(zip(before, after, other)):
        assert a < 0.7 * b, (layer, before, after)  # a saturated neuron cannot fire more
        assert a < o, (layer, after, other)
    assert math.isfinite(sum(after))


def test_convert_takes_the_ann_as_calibration_reference():
    _, meta = snnconv.convert(_mlp(), _labelled(), T=4, finetune_epochs=0, reconstruction_steps=0,
                              calibration_reference="ann", progress=False)
    assert meta.settings["calibration_reference"] == "ann"
    with pytest.raises(ConfigError, match="calibration_reference"):
        snnconv.convert(_mlp(), _labelled(), T=4, calibration_reference="relu", progress=False)
