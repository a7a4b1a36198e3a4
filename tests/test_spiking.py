"""Stage 3, IF replacement: IF semantics, QCFS <-> IF theory, scale absorption, SpikingNetwork."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from spikingjelly.activation_based import neuron
from torch.nn.modules.batchnorm import _BatchNorm

import snnconv
from snnconv import models
from snnconv.activation import QCFS, qcfs_sites
from snnconv.errors import BatchNormRemainsError, StageOrderError, UnsupportedLayerError
from snnconv.snn.neuron import IFNeuron, Scale, neurons
from snnconv.stages.fold import fold_batchnorm

# --------------------------------------------------------------------------------------------
# helpers


def _randomise_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics, so folding and calibration see varied scales."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                n = m.num_features
                m.running_mean.copy_(0.2 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=g))
                m.weight.copy_(0.5 + torch.rand(n, generator=g))
                m.bias.copy_(0.2 * torch.randn(n, generator=g))
    return model.eval()


def _batches(shape: tuple[int, ...], n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=g) for _ in range(n)]


def _calibrated(model: nn.Module, batches: list[torch.Tensor], **kw) -> torch.fx.GraphModule:
    """fold -> calibrate_qcfs on ``batches`` (per-layer unless ``per_channel=True``)."""
    return snnconv.calibrate_qcfs(fold_batchnorm(model, batches[0]), batches, progress=False, **kw)


class GroupNet(nn.Module):
    """Depthwise and grouped consumers, an identity shortcut, and a flatten into a Linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn2 = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 16, 1, groups=4)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.dw(x)))
        x = F.relu(self.grouped(x))
        x = F.relu(self.conv3(x) + x)  # identity shortcut: the IF output reaches the add as is
        return self.fc(torch.flatten(self.pool(x), 1))


def _reference_if(x: torch.Tensor, theta: float, v0: float) -> torch.Tensor:
    """The IF recurrence of DESIGN.md, written out: h = v + x; s = h >= theta; v = h - theta s."""
    v = torch.full_like(x[0], v0)
    out = []
    for xt in x:
        h = v + xt
        s = (h >= theta).to(x.dtype)
        v = h - theta * s
        out.append(s)
    return torch.stack(out)


def _if_steps(neuron_: nn.Module, z: torch.Tensor, T: int) -> torch.Tensor:
    """Run a multi-step IFNeuron on ``z`` held constant for T steps; returns ``[T, *z.shape]``."""
    seq = z.unsqueeze(0).expand(T, *z.shape).reshape(T * z.shape[0], *z.shape[1:])
    return neuron_(seq).reshape(T, *z.shape)


# --------------------------------------------------------------------------------------------
# the IF neuron itself: golden trajectories


def test_if_golden_trajectory_with_equality_boundary():
    # theta = 2, v0 = 1.  h: 1.5 | 2.0 (= theta: fires) | 1.0 | 4.0 (fires; v stays 2.0 ...)
    # | 1.0 (... but one spike per step) | 1.0 | 3.0 (fires) | 1.0 | -1.0 | 1.0
    x = torch.tensor([0.5, 0.5, 1.0, 3.0, -1.0, 0.0, 2.0, 0.0, -2.0, 2.0])
    expected = torch.tensor([0., 1., 0., 1., 0., 0., 1., 0., 0., 0.])
    n = IFNeuron(torch.tensor(2.0), T=len(x))
    out = n(x.reshape(-1, 1)).reshape(-1)
    assert torch.equal(out, expected), out
    assert torch.equal(expected, _reference_if(x.reshape(-1, 1), 2.0, 1.0).reshape(-1))


def test_if_golden_trajectory_per_channel():
    # channel 0: theta 0.5, v0 0.25.  h: 0.5 (= theta: fires) | 0 | 0.75 (fires) | 0.25 | -0.25
    # channel 1: theta 4, v0 2.       h: 4 (= theta: fires) | 0 | 1 | 2 | 7 (fires)
    x = torch.tensor([[0.25, 2.0], [0.0, 0.0], [0.75, 1.0], [0.0, 1.0], [-0.5, 5.0]])
    expected = torch.tensor([[1., 1.], [0., 0.], [1., 0.], [0., 0.], [0., 1.]])
    out = IFNeuron(torch.tensor([0.5, 4.0]), T=x.shape[0])(x)
    assert torch.equal(out, expected), out
    ref = torch.cat([_reference_if(x[:, :1], 0.5, 0.25), _reference_if(x[:, 1:], 4.0, 2.0)], 1)
    assert torch.equal(ref, expected)


def test_if_matches_reference_recurrence_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    T, B, C = 16, 5, 7
    x = torch.randint(-8, 12, (T, B, C), generator=g).float() / 8  # dyadic: exact arithmetic
    for theta in (0.5, 1.0, 2.0):
        out = IFNeuron(torch.tensor(theta), T=T)(x.reshape(T * B, C)).reshape(T, B, C)
        assert torch.equal(out, _reference_if(x, theta, theta / 2))


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_if_inference_path_is_bit_identical_to_the_training_path(reset):
    """Without autograd IFNeuron runs an in-place loop; with it, spikingjelly's surrogate node
    (subtract) or the surrogate loop (zero): the same spikes, bit for bit, including ties at
    the threshold, per-channel thresholds, calibrated initial membranes and 2-D inputs."""
    g = torch.Generator().manual_seed(0)
    v0s = [None, 0.3, torch.rand(6, generator=g)] if reset == "subtract" else [None]
    for theta in (torch.tensor(0.5), torch.rand(6, generator=g) + 0.1):
        for v0 in v0s:
            for shape in ((6, 5, 5), (6,)):
                m = IFNeuron(theta, T=7, reset=reset, v_init=v0)
                x = torch.randn(7 * 4, *shape, generator=g)
                x[:8] = 0.5  # exact ties with the threshold 0.5
                with torch.enable_grad():
                    ref = m(x)
                with torch.no_grad():
                    fast = m(x)
                assert ref.sum() > 0 and torch.equal(ref.detach(), fast), (theta, v0, shape)


def test_if_rejects_bad_thresholds_and_batches():
    for bad in (0.0, -1.0, float("nan"), float("inf"), torch.ones(2, 2)):
        with pytest.raises(ValueError):
            IFNeuron(bad)
    with pytest.raises(ValueError, match="multiple of T"):
        IFNeuron(1.0, T=3)(torch.zeros(4, 2))


# --------------------------------------------------------------------------------------------
# theory: one layer, constant input, T = L


def _grid(L: int, theta: float) -> torch.Tensor:
    """Inputs ``m * theta / (8L)`` from -theta to 1.5 theta: every quantisation boundary
    ``(k - 1/2) theta / L`` is on the grid, and with dyadic theta all arithmetic is exact."""
    return (torch.arange(-8 * L, 12 * L + 1).float() * (theta / (8 * L))).reshape(-1, 1)


@pytest.mark.parametrize("L", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("theta", [0.25, 1.0, 2.0])
def test_if_average_equals_qcfs_at_T_equals_L_on_a_grid(L, theta):
    """phi = 1/2, v0 = theta/2: exact, including every quantisation boundary."""
    z = _grid(L, theta)
    spikes = _if_steps(IFNeuron(torch.tensor(theta), T=L), z, L)
    assert torch.equal(spikes.sum(0), torch.clamp(torch.floor(z * L / theta + 0.5), 0, L))
    assert torch.equal(theta * spikes.mean(0), QCFS(L, theta)(z))


@pytest.mark.parametrize("L", [1, 3, 4, 8, 16])
def test_if_average_equals_qcfs_at_T_equals_L_random(L):
    """Random thresholds per channel, random inputs away from the boundaries (a float tie
    between two ways of rounding could go either way there)."""
    g = torch.Generator().manual_seed(L)
    C = 6
    theta = 0.1 + 3 * torch.rand(C, generator=g)
    z = (torch.rand(300, C, generator=g) * 1.4 - 0.2) * theta
    u = z * L / theta + 0.5
    keep = ((u - u.round()).abs() > 1e-3).all(1)
    z, u = z[keep], u[keep]
    assert len(z) > 50
    spikes = _if_steps(IFNeuron(theta, T=L), z, L)
    assert torch.equal(spikes.sum(0), torch.clamp(torch.floor(u), 0, L))
    assert torch.allclose(theta * spikes.mean(0), QCFS(L, theta)(z), rtol=0, atol=1e-6)


@pytest.mark.parametrize("L", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("theta", [0.25, 1.0, 2.0])
def test_if_without_offset_equals_qcfs_phi0(L, theta):
    """phi = 0 with v0 = 0: spikingjelly's IFNode(v_reset=None) and QCFS(phi=0) agree at T = L."""
    z = _grid(L, theta)
    node = neuron.IFNode(v_threshold=theta, v_reset=None, step_mode="m")
    spikes = node(z.unsqueeze(0).expand(L, *z.shape).contiguous())
    node.reset()
    assert torch.equal(spikes.sum(0), torch.clamp(torch.floor(z * L / theta), 0, L))
    assert torch.equal(theta * spikes.mean(0), QCFS(L, theta, phi=0.0)(z))
    assert torch.equal(spikes, _reference_if(z.unsqueeze(0).expand(L, *z.shape), theta, 0.0))


def test_single_hidden_layer_network_at_T_equals_L():
    """Linear -> QCFS -> Linear: the SNN at T = L equals the QCFS-ANN up to float rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    batches = _batches((64, 6), 2)
    for L in (2, 4, 8):
        qann = snnconv.calibrate_qcfs(model, batches, L=L, progress=False)
        snn = snnconv.to_spiking(qann, T=L)
        with torch.no_grad():
            assert torch.allclose(snn(batches[0]), qann(batches[0]), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# the zoo


_ZOO_BATCH = {"resnet18": 2, "vgg16": 2}


@pytest.mark.parametrize("name", models.names())
def test_every_if_output_is_binary_in_every_zoo_network(name):
    torch.manual_seed(0)
    B = _ZOO_BATCH.get(name, 4)
    batches = _batches((B, 3, 32, 32), 2)
    qann = _calibrated(_randomise_bn(models.get(name, num_classes=10, in_channels=3)), batches, L=4)
    snn = snnconv.to_spiking(qann, T=3)
    seen = {}

    def hook(mod, inp, out, key=None):
        seen.setdefault(key, []).append(out.detach().clone())

    ifs = neurons(snn)
    assert len(ifs) == len(qcfs_sites(qann)) > 0
    handles = [m.register_forward_hook(lambda mod, i, o, k=k: hook(mod, i, o, k)) for k, m in ifs.items()]
    try:
        with torch.no_grad():
            out = snn(batches[1])
    finally:
        for h in handles:
            h.remove()
    assert out.shape == (B, 10)
    assert set(seen) == set(ifs)
    for key, outs in seen.items():
        s = outs[0]
        assert s.shape[0] == 3 * B, key
        assert ((s == 0) | (s == 1)).all(), f"{key} emitted values {s.unique().tolist()}"


@pytest.mark.parametrize("name", models.names())
@pytest.mark.parametrize("per_channel", [False, True])
def test_T1_L1_snn_equals_qcfs_ann_exactly_on_the_zoo(name, per_channel):
    """At T = L = 1 each IF fires iff z >= theta/2, which is QCFS(L=1): equal layer by layer."""
    torch.manual_seed(1)
    batches = _batches((2, 3, 32, 32), 2, seed=1)
    qann = _calibrated(_randomise_bn(models.get(name, num_classes=10, in_channels=3)), batches,
                       L=1, per_channel=per_channel)
    snn = snnconv.to_spiking(qann, T=1)
    with torch.no_grad():
        ref = qann(batches[1])
        out, counts = snn.run(batches[1], spike_counts=True)
    out = out.mean(0)
    assert all(c.sum() > 0 for c in counts.values()), "a silent layer would make this vacuous"
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item())), \
        (out - ref).abs().max()


_LARGE_T_NETS = {
    "small_cnn": lambda: models.small_cnn(num_classes=10, in_channels=3),
    "resnet8": lambda: models.resnet8(num_classes=10, in_channels=3),
    "groupnet": GroupNet,
}


@pytest.mark.parametrize("name", sorted(_LARGE_T_NETS))
@pytest.mark.parametrize("per_channel", [False, True])
def test_scale_absorption_keeps_the_function_at_large_T(name, per_channel):
    """SNN at T = 1024 vs its QCFS-ANN (L = 1024): within 1% of the output range.

    A wrong absorption (theta missing, applied twice, or to the wrong channel/group) is an O(1)
    error; what remains at large T is the O(1/T) rate error (measured: at most 0.25%).
    """
    torch.manual_seed(0)
    model = _randomise_bn(_LARGE_T_NETS[name]())
    batches = _batches((2, 3, 8, 8), 2)
    qann = _calibrated(model, batches, L=1024, per_channel=per_channel)
    snn = snnconv.to_spiking(qann, T=1024)
    with torch.no_grad():
        ref, out = qann(batches[0]), snn(batches[0])
    scale = ref.abs().max().item()
    assert scale > 1e-3
    assert (out - ref).abs().max().item() <= 0.01 * scale, ((out - ref).abs().max().item(), scale)
    # the structure the test is meant to cover really is there
    record = snn.meta["neurons"]
    explicit = [u for r in record.values() for u in r["explicit_scale_for"]]
    absorbed = [a for r in record.values() for a in r["absorbed_into"]]
    n_scales = sum(isinstance(m, Scale) for m in snn.modules())
    assert n_scales == sum(1 for r in record.values() if r["explicit_scale_for"])
    if name == "groupnet":
        assert {"dw", "grouped", "conv3", "fc"} <= set(absorbed)
        assert explicit == ["add"]
    if name == "resnet8":
        assert "add" in explicit  # the identity shortcut of the first block


def test_to_spiking_does_not_change_the_qcfs_ann():
    torch.manual_seed(0)
    batches = _batches((4, 3, 8, 8), 2)
    qann = _calibrated(_randomise_bn(models.resnet8(num_classes=10, in_channels=3)), batches)
    before = {k: v.clone() for k, v in qann.state_dict().items()}
    with torch.no_grad():
        ref = qann(batches[0])
    snnconv.to_spiking(qann, T=4)
    after = qann.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(qann(batches[0]), ref)


def test_the_spiking_network_comes_back_in_eval_mode():
    torch.manual_seed(0)
    qann = snnconv.calibrate_qcfs(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5),
                                                nn.Linear(8, 2)), _batches((16, 4), 2), progress=False)
    snn = snnconv.to_spiking(qann, T=4)
    assert not any(m.training for m in snn.modules())
    x = _batches((16, 4), 1, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(snn(x), snn(x))  # no live dropout


def test_thresholds_are_the_qcfs_lambdas():
    torch.manual_seed(0)
    batches = _batches((4, 3, 8, 8), 2)
    qann = _calibrated(_randomise_bn(models.resnet8(num_classes=10, in_channels=3)), batches,
                       per_channel=True)
    snn = snnconv.to_spiking(qann, T=4)
    lams = {n.replace("qcfs_", "if_", 1): q.lam.detach() for n, q in qcfs_sites(qann).items()}
    thetas = snn.thresholds()
    assert lams.keys() == thetas.keys()
    assert all(torch.equal(lams[k], thetas[k]) for k in lams)


# --------------------------------------------------------------------------------------------
# refusals and graph hygiene


def test_to_spiking_refuses_batchnorm():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), QCFS(4, 1.0), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3)).eval()
    with pytest.raises(BatchNormRemainsError, match="module '1': BatchNorm2d"):
        snnconv.to_spiking(model)


def test_to_spiking_refuses_bare_relu():
    model = nn.Sequential(nn.Linear(4, 8), QCFS(4, 1.0), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(StageOrderError, match="calibrate_qcfs") as info:
        snnconv.to_spiking(model)
    assert "'3'" in str(info.value)  # names the offending module


def test_to_spiking_refuses_max_pooling_and_other_activations():
    pooled = nn.Sequential(nn.Conv2d(1, 4, 3), QCFS(4, 1.0), nn.MaxPool2d(2), nn.Flatten(),
                           nn.Linear(4 * 3 * 3, 3))
    with pytest.raises(UnsupportedLayerError, match="max-pooling"):
        snnconv.to_spiking(pooled)
    gelu = nn.Sequential(nn.Linear(4, 8), QCFS(4, 1.0), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    with pytest.raises(UnsupportedLayerError, match="GELU"):
        snnconv.to_spiking(gelu)


def test_to_spiking_never_overwrites_a_user_module_with_a_colliding_name():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 8)
            self.qcfs_a = QCFS(1, 1.0)
            self.if_a = nn.Linear(8, 3)        # the name an IF neuron for qcfs_a would get
            self.if_a_scale = nn.Linear(3, 3)  # and its explicit scale

        def forward(self, x):
            h = self.qcfs_a(self.fc1(x))
            return self.if_a_scale(self.if_a(h) + h[:, :3])

    net = Net().eval()
    x = torch.randn(32, 4)
    snn = snnconv.to_spiking(net, T=1)
    assert isinstance(snn.net.get_submodule("if_a"), nn.Linear)
    assert isinstance(snn.net.get_submodule("if_a_scale"), nn.Linear)
    with torch.no_grad():
        assert torch.allclose(snn(x), net(x), atol=1e-6)


def test_to_spiking_rejects_bad_T():
    model = nn.Sequential(nn.Linear(4, 8), QCFS(4, 1.0), nn.Linear(8, 2))
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="T"):
            snnconv.to_spiking(model, T=bad)


# --------------------------------------------------------------------------------------------
# SpikingNetwork behaviour


@pytest.fixture(scope="module")
def resnet8_snn():
    torch.manual_seed(0)
    batches = _batches((4, 3, 8, 8), 2)
    qann = _calibrated(_randomise_bn(models.resnet8(num_classes=10, in_channels=3)), batches)
    return snnconv.to_spiking(qann, T=6), batches


def test_forward_is_the_mean_of_run(resnet8_snn):
    snn, (x, _) = resnet8_snn
    with torch.no_grad():
        steps, out = snn.run(x), snn(x)
    assert steps.shape == (6, 4, 10)
    assert out.shape == (4, 10)
    assert torch.allclose(out, steps.mean(0), rtol=0, atol=1e-6)


def test_T_is_settable(resnet8_snn):
    snn, (x, _) = resnet8_snn
    try:
        snn.T = 3
        assert snn.T == 3
        assert all(m.T == 3 for m in neurons(snn).values())
        with torch.no_grad():
            assert snn.run(x).shape == (3, 4, 10)
            assert torch.allclose(snn(x), snn.run(x, T=6)[:3].mean(0), atol=1e-6)
        with pytest.raises(ValueError):
            snn.T = 0
        assert snn.T == 3
    finally:
        snn.T = 6


def test_run_with_another_T_leaves_T_unchanged(resnet8_snn):
    snn, (x, _) = resnet8_snn
    with torch.no_grad():
        assert snn.run(x, T=2).shape == (2, 4, 10)
    assert snn.T == 6 and all(m.T == 6 for m in neurons(snn).values())


def test_state_is_reset_at_every_call(resnet8_snn):
    snn, (x, other) = resnet8_snn
    with torch.no_grad():
        first = snn(x)
        again = snn(x)
        snn(other[:3])  # another batch size in between
        snn.run(other, T=2)
        last = snn(x)
    assert torch.equal(first, again)
    assert torch.equal(first, last)


def test_a_shorter_run_is_the_prefix_of_a_longer_one(resnet8_snn):
    """What metrics.accuracy_by_T relies on: the first t steps of a T-step run are a t-step run."""
    snn, (x, _) = resnet8_snn
    with torch.no_grad():
        long, short = snn.run(x, T=6), snn.run(x, T=3)
    assert torch.allclose(long[:3], short, atol=1e-6)


def test_run_reports_spike_counts_per_layer(resnet8_snn):
    snn, (x, _) = resnet8_snn
    expected = {}

    def count(name):
        def hook(mod, inp, out):
            expected[name] = out.reshape(6, -1).sum(1)
        return hook

    handles = [m.register_forward_hook(count(n)) for n, m in neurons(snn.net).items()]
    try:
        with torch.no_grad():
            steps, counts = snn.run(x, spike_counts=True)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        assert torch.equal(steps, snn.run(x))
    assert set(counts) == set(neurons(snn.net)) and len(counts) == 7
    for name, c in counts.items():
        assert c.shape == (6,)
        assert torch.equal(c, expected[name])
    assert sum(c.sum().item() for c in counts.values()) > 0
    # no hooks left behind
    assert all(not m._forward_hooks for m in neurons(snn.net).values())


def test_numpy_integers_are_accepted_as_T(resnet8_snn):
    np = pytest.importorskip("numpy")
    snn, (x, _) = resnet8_snn
    with torch.no_grad():
        assert snn.run(x, T=np.int64(2)).shape == (2, 4, 10)


@pytest.mark.parametrize("chunk_size", [6, 12, 18, 1])
def test_chunked_inference_equals_the_whole_batch(resnet8_snn, chunk_size):
    """Without gradients the batch is cut into chunks of chunk_size // T inputs (at least 1):
    readouts and spike counts are those of one pass over the whole batch."""
    snn, (x, _) = resnet8_snn
    snn = copy.deepcopy(snn)
    with torch.no_grad():
        snn.chunk_size = 0
        whole, whole_counts = snn.run(x, spike_counts=True)
        snn.chunk_size = chunk_size
        calls = []
        handle = snn.net.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape[0]))
        try:
            chunked, counts = snn.run(x, spike_counts=True)
        finally:
            handle.remove()
    assert calls == [len(part) for part in torch.arange(4).split(max(1, chunk_size // 6))]
    assert torch.allclose(chunked, whole, rtol=0, atol=1e-5)
    assert set(counts) == set(whole_counts)
    assert all(torch.equal(counts[k], whole_counts[k]) for k in counts)


def test_with_gradients_the_batch_is_never_chunked(resnet8_snn):
    snn, (x, _) = resnet8_snn
    snn = copy.deepcopy(snn)
    snn.chunk_size = 6
    calls = []
    handle = snn.net.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape[0]))
    try:
        snn(x.requires_grad_(True)).sum().backward()
    finally:
        handle.remove()
    assert calls == [4]


# --------------------------------------------------------------------------------------------
# the rate function


@pytest.mark.parametrize("name", sorted(_LARGE_T_NETS))
@pytest.mark.parametrize("per_channel", [False, True])
def test_rate_with_L_levels_is_the_qcfs_ann(name, per_channel):
    """snn.rate(x, L) computes the QCFS-ANN the network was made from (theta absorbed or not)."""
    torch.manual_seed(2)
    batches = _batches((8, 3, 8, 8), 2, seed=2)
    qann = _calibrated(_randomise_bn(_LARGE_T_NETS[name]()), batches, L=4, per_channel=per_channel)
    snn = snnconv.to_spiking(qann, T=3)
    with torch.no_grad():
        ref, out = qann(batches[1]), snn.rate(batches[1], 4)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()))
    assert snn.T == 3 and all(m.T == 3 and m.rate_levels == 0 for m in neurons(snn).values())


def test_rate_is_the_snn_when_every_neuron_sees_a_constant_input():
    """One hidden layer: its input is the same at every step, so T steps count exactly
    clamp(floor(T z / theta + 1/2), 0, T) spikes and rate(x, T) is the SNN at T."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    batches = _batches((64, 6), 2)
    snn = snnconv.to_spiking(snnconv.calibrate_qcfs(model, batches, L=4, progress=False), T=8)
    with torch.no_grad():
        for T in (1, 3, 8, 16):
            torch.testing.assert_close(snn.rate(batches[1], T), snn.run(batches[1], T).mean(0),
                                       rtol=0, atol=1e-5)


def test_rate_passes_gradients_to_weights_and_thresholds(resnet8_snn):
    snn, (x, _) = resnet8_snn
    snn = copy.deepcopy(snn).train()
    for m in neurons(snn).values():
        m.theta.requires_grad_(True)
    snn.rate(x, 8).square().sum().backward()
    grads = {n: p.grad for n, p in snn.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if n.endswith("theta"))
    assert any(g.abs().sum() > 0 for n, g in grads.items() if n.endswith("weight"))


@pytest.mark.parametrize("levels", [0, -2, 1.5, True, None])
def test_rate_rejects_bad_levels(resnet8_snn, levels):
    snn, (x, _) = resnet8_snn
    with pytest.raises(ValueError, match="levels"):
        snn.rate(x, levels)
