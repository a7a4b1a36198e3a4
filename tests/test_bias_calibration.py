"""calibrate_bias: each IF layer's mean output over T moves towards its QCFS-ANN reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import snnconv
from snnconv.activation import QCFS
from snnconv.calibration import calibrate_bias
from snnconv.errors import DataError, StageOrderError
from snnconv.snn.neuron import IFNeuron, neurons


def _layer_means(model, x, kind, T=None):
    """Per-channel mean output of every ``kind`` module (IF outputs as theta * rate over T)."""
    means, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, kind):
            def hook(mod, inp, out, name=name):
                if isinstance(mod, IFNeuron):
                    out = out.reshape(mod.T, -1, *out.shape[1:]).mean(0)
                    th = mod.theta
                    if th.dim():
                        th = th.reshape(1, -1, *[1] * (out.dim() - 2))
                    out = out * th
                means[name] = out.double().mean(dim=[d for d in range(out.dim()) if d != 1])
            hooks.append(m.register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return means


@pytest.fixture
def qcfs_and_snn(trained_digits_cnn, digits_loaders):
    train, _ = digits_loaders
    folded = snnconv.fold_batchnorm(trained_digits_cnn)
    qcfs = snnconv.calibrate_qcfs(folded, train, L=8, per_channel=True, progress=False)
    return qcfs, snnconv.to_spiking(qcfs, T=4), train


def test_bias_calibration_brings_every_layer_mean_towards_the_qcfs_reference(qcfs_and_snn):
    qcfs, snn, train = qcfs_and_snn
    x = torch.cat([b[0] for _, b in zip(range(4), train)])
    calibrated = calibrate_bias(snn, qcfs, [(x,)], T=4, num_batches=1)
    ref = _layer_means(qcfs, x, QCFS)
    before = _layer_means(snn.net, x, IFNeuron)
    after = _layer_means(calibrated.net, x, IFNeuron)
    sources = {n: r["source"] for n, r in snn.meta["neurons"].items()}
    err_before = sum((before[n] - ref[s]).abs().sum().item() for n, s in sources.items())
    err_after = sum((after[n] - ref[s]).abs().sum().item() for n, s in sources.items())
    assert err_after < 0.5 * err_before
    assert set(calibrated.meta["bias_calibration"]["mean_abs_shift"]) == set(sources)


def test_bias_calibration_works_on_a_copy_and_keeps_T(qcfs_and_snn):
    qcfs, snn, train = qcfs_and_snn
    state = copy.deepcopy(snn.state_dict())
    calibrated = calibrate_bias(snn, qcfs, train, T=16)
    assert all(torch.equal(state[k], v) for k, v in snn.state_dict().items())
    assert calibrated.T == snn.T == 4
    assert calibrated.meta["bias_calibration"]["T"] == 16
    assert not all(torch.equal(state[k], v) for k, v in calibrated.state_dict().items())


def test_bias_calibration_does_not_lower_accuracy_at_its_T(qcfs_and_snn, digits_loaders):
    qcfs, snn, train = qcfs_and_snn
    _, test = digits_loaders
    calibrated = calibrate_bias(snn, qcfs, train, T=4)
    from snnconv.analysis.metrics import accuracy_by_T

    assert accuracy_by_T(calibrated, test, [4])[4] >= accuracy_by_T(snn, test, [4])[4] - 1.0


def test_bias_calibration_refusals(qcfs_and_snn):
    qcfs, snn, train = qcfs_and_snn
    with pytest.raises(DataError, match="empty"):
        calibrate_bias(snn, qcfs, [])
    with pytest.raises(StageOrderError, match="to_spiking"):
        calibrate_bias(qcfs, qcfs, train)
    with pytest.raises(ValueError, match="T"):
        calibrate_bias(snn, qcfs, train, T=0)


def test_convert_with_bias_calibration_records_it(trained_digits_cnn, digits_loaders):
    train, test = digits_loaders
    snn, meta = snnconv.convert(trained_digits_cnn, train, T=4, L=8, bias_calibration=True,
                                bias_calibration_T=8, eval_loader=test, progress=False)
    record = meta.stage("spiking").changes["bias_calibration"]
    assert record["T"] == 8 and record["batches"] == 4
    assert meta.accuracy["snn"]["4"] > 50.0


def test_convert_calibrates_on_fewer_batches_where_calib_batches_asks_for_fewer(trained_digits_cnn,
                                                                                digits_loaders):
    """calib_batches is the user's handle on the calibration's memory (all its batches at once)."""
    _, meta = snnconv.convert(trained_digits_cnn, digits_loaders[0], T=4, calib_batches=2, progress=False)
    assert meta.stage("spiking").changes["bias_calibration"]["batches"] == 2


def _reference_means(qcfs, x, levels):
    """Per-channel mean QCFS output of every site with all QCFS at ``levels`` levels."""
    q = copy.deepcopy(qcfs)
    for m in q.modules():
        if isinstance(m, QCFS):
            m.L = levels
    return _layer_means(q, x, QCFS)


def test_membrane_calibration_fits_both_horizons(qcfs_and_snn):
    """horizons=(T1, T2): bias and per-channel v_init move every layer's mean at T1 and at T2
    (each against the QCFS-ANN at that many levels) towards the reference."""
    qcfs, snn, train = qcfs_and_snn
    x = torch.cat([b[0] for _, b in zip(range(4), train)])
    calibrated = calibrate_bias(snn, qcfs, [(x,)], num_batches=1, horizons=(2, 8))
    sources = {n: r["source"] for n, r in snn.meta["neurons"].items()}
    for t in (2, 8):
        ref = _reference_means(qcfs, x, t)
        snn.T = calibrated.T = t
        before, after = _layer_means(snn.net, x, IFNeuron), _layer_means(calibrated.net, x, IFNeuron)
        err_before = sum((before[n] - ref[s]).abs().sum().item() for n, s in sources.items())
        err_after = sum((after[n] - ref[s]).abs().sum().item() for n, s in sources.items())
        assert err_after < 0.5 * err_before, (t, err_after, err_before)
    moved = []
    for name, m in neurons(calibrated.net).items():
        assert m.v_init.dim() == 1 and ((m.v_init >= 0) & (m.v_init <= 1)).all(), name
        moved.append(float((m.v_init - 0.5).abs().max()))
    # the first layer sees the static input, on which t IF steps compute QCFS at t levels
    # (up to float rounding at level boundaries): nothing to correct there; the layers fed by
    # spikes move
    assert moved[0] < 1e-3 and all(d > 1e-2 for d in moved[1:]), moved
    for m in neurons(snn.net).values():  # the input network is untouched
        assert m.v_init.dim() == 0 and float(m.v_init) == 0.5
    assert calibrated.meta["bias_calibration"]["horizons"] == [2, 8]


def test_membrane_calibration_refusals(qcfs_and_snn, trained_digits_cnn, digits_loaders):
    qcfs, snn, train = qcfs_and_snn
    for bad in ((4, 4), (0, 4), (8, 2), (4,), 8):
        with pytest.raises(ValueError, match="horizons"):
            calibrate_bias(snn, qcfs, train, horizons=bad)
    hard = snnconv.to_spiking(qcfs, T=4, reset="zero")
    with pytest.raises(ValueError, match="subtractive"):
        calibrate_bias(hard, qcfs, train, horizons=(2, 8))
    with pytest.raises(ValueError, match="subtractive"):
        calibrate_bias(hard, qcfs, train, T=8, membrane=True)
    with pytest.raises(ValueError, match="one T"):
        calibrate_bias(snn, qcfs, train, horizons=(2, 8), membrane=True)
    with pytest.raises(ValueError, match="initial membrane"):
        snnconv.convert(trained_digits_cnn, digits_loaders[0], reset="zero", bias_calibration_T=(2, 8),
                        progress=False)


def test_convert_calibrates_the_membrane_by_default(trained_digits_cnn, digits_loaders):
    train, _ = digits_loaders
    snn, meta = snnconv.convert(trained_digits_cnn, train, T=4, progress=False)
    record = meta.stage("spiking").changes["bias_calibration"]
    assert record["membrane"] is True and record["T"] == 8 and "horizons" not in record
    assert meta.settings["membrane_calibration"] is True and meta.settings["bias_calibration_T"] == 8
    # kept where it does at least as well on held-out images as the network without it
    assert record["kept"] == meta.stage("spiking").changes["kept"]["bias_calibration"]["kept"]
    assert all(m.v_init.dim() == (1 if record["kept"] else 0) for m in neurons(snn.net).values())
    _, meta = snnconv.convert(trained_digits_cnn, train, T=4, bias_calibration_T=(4, 8), progress=False)
    assert meta.stage("spiking").changes["bias_calibration"]["horizons"] == [4, 8]
    assert meta.settings["membrane_calibration"] is False


def test_membrane_calibration_moves_the_membrane_and_the_bias_only_where_it_must(qcfs_and_snn):
    """membrane=True: every layer's mean at T moves towards the QCFS-ANN at T levels (what
    v_init's range cannot take goes to the bias), and a layer's bias moves only where a
    channel's v_init sits at a bound of [0, 1]."""
    qcfs, snn, train = qcfs_and_snn
    x = torch.cat([b[0] for _, b in zip(range(4), train)])
    T = 8
    calibrated = calibrate_bias(snn, qcfs, [(x,)], T=T, num_batches=1, membrane=True)
    sources = {n: r["source"] for n, r in snn.meta["neurons"].items()}
    ref = _reference_means(qcfs, x, T)
    snn.T = calibrated.T = T
    before, after = _layer_means(snn.net, x, IFNeuron), _layer_means(calibrated.net, x, IFNeuron)
    err_before = sum((before[n] - ref[s]).abs().sum().item() for n, s in sources.items())
    err_after = sum((after[n] - ref[s]).abs().sum().item() for n, s in sources.items())
    assert err_after < 0.5 * err_before, (err_after, err_before)
    interior = 0
    for name, m in neurons(calibrated.net).items():
        assert m.v_init.dim() == 1 and ((m.v_init >= 0) & (m.v_init <= 1)).all(), name
        shift = calibrated.meta["bias_calibration"]["mean_abs_shift"][name]
        if ((m.v_init > 0) & (m.v_init < 1)).all():
            interior += 1
            assert shift < 1e-6, (name, shift)  # the membrane took it all: no bias
    assert interior >= 1
    assert calibrated.meta["bias_calibration"]["membrane"] is True


def test_convert_with_threshold_calibration_and_membrane_calibration(trained_digits_cnn, digits_loaders):
    """threshold_calibration=True on a subtractive network runs at the network's T, then the
    membrane calibration at its two horizons."""
    snn, meta = snnconv.convert(trained_digits_cnn, digits_loaders[0], T=4, threshold_calibration=True,
                                progress=False)
    assert meta.stage("spiking").changes["threshold_calibration"]["T"] == 4
    assert meta.stage("spiking").changes["bias_calibration"]["membrane"] is True


def test_bias_calibration_refuses_only_where_one_image_does_not_fit(qcfs_and_snn, monkeypatch):
    """Where every calibration image at once does not fit, the images go through in groups;
    only a single image that does not fit is refused, before anything runs, with how much it
    needs and what to lower (an out-of-memory kill says nothing)."""
    from snnconv import memory
    from snnconv.calibration import bias
    from snnconv.errors import ResourceError

    qcfs, snn, train = qcfs_and_snn
    loader = torch.utils.data.DataLoader(train.dataset, batch_size=64)
    monkeypatch.setattr(bias, "budget_bytes", lambda device: 1024)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1024)
    with pytest.raises(ResourceError, match=r"for a single image, with 0.0 GiB free on cpu; lower"):
        calibrate_bias(snn, qcfs, loader, T=4)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**50)
    out = calibrate_bias(snn, qcfs, loader, T=4)
    assert out.meta["bias_calibration"]["method"] == "grouped"
    assert out.meta["bias_calibration"]["groups"]["images"] == 1


def test_firing_gives_the_spike_rates_from_charge_and_membrane():
    """The rates a fitted layer reads come from each position's charge and last membrane, not
    a pass over the spikes: exactly the spikes' mean over the steps, with a shift folded into
    the threshold, an initial membrane per channel and inputs of both signs."""
    from snnconv.calibration.membrane import charge_counts, fire

    torch.manual_seed(0)
    mod = IFNeuron(theta=torch.ones(5), T=16)
    mod.v_init = torch.rand(5)
    u = torch.randn(16, 3, 5, 4, 4) * 0.8 + 0.3
    charges = []
    counts = charge_counts(mod, u.clone(), (8, 16), charges)
    assert charges[0].shape == u.shape[1:]
    shift = (torch.rand(5) - 0.5).reshape(1, 5, 1, 1) * 0.2
    spikes, rates = fire(mod, u.clone(), shift, charges[0])
    assert set(spikes.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(rates, spikes.mean(0))
    assert torch.equal(spikes, fire(mod, u.clone(), shift))  # the same spikes without the rates
    # the counts before the shift, from the same charge: the unshifted neuron's spikes
    plain = fire(mod, u.clone())
    torch.testing.assert_close(counts[16], plain.double().sum(dim=(0, 1, 3, 4)))
    torch.testing.assert_close(counts[8], plain[:8].double().sum(dim=(0, 1, 3, 4)))


@pytest.mark.parametrize("layer", [torch.nn.Conv2d(6, 4, 3, stride=2, padding=1),
                                   torch.nn.Conv2d(6, 6, 3, padding=1, groups=3),
                                   torch.nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False),
                                   torch.nn.Linear(6, 5)])
def test_weight_fit_recovers_the_reference_map(layer):
    """The normal equations of one layer (gathered columns, groups, bias difference) on a
    sample of its output positions: on rates ``U`` whose reference input is ``U * theta`` per
    input channel, the fit from any start lands on the reference weights times theta (what IF
    replacement absorbs), up to the ridge."""
    from snnconv.calibration.weights import WeightFit, layer_output

    torch.manual_seed(0)
    ref = copy.deepcopy(layer)
    theta = torch.rand(6) + 0.5
    snn_layer = copy.deepcopy(layer)
    with torch.no_grad():
        snn_layer.weight.normal_()  # a wrong start
        if snn_layer.bias is not None:
            snn_layer.bias.copy_(ref.bias + 0.3)  # and a bias that differs from the reference's
    u = torch.rand(64, 6, 7, 7) if isinstance(layer, torch.nn.Conv2d) else torch.rand(64, 3, 6)
    shape = [1, 6, 1, 1] if u.dim() == 4 else [1, 1, 6]
    fit = WeightFit(snn_layer, ref)
    for part in (u[:40], u[40:]):
        with torch.no_grad():
            y = layer_output(ref, part * theta.reshape(shape))
        pos = torch.randperm(len(y))[:len(y) // 2].sort().values  # half of the positions
        fit.add(part, y[pos], pos)
    change = fit.solve(1e-9)
    assert change > 0.5
    expected = ref.weight * (theta.reshape(1, 6, 1, 1)[:, :ref.weight.shape[1]] if u.dim() == 4 else theta)
    if isinstance(layer, torch.nn.Conv2d) and layer.groups > 1:  # group g reads channels g*per..
        per = 6 // layer.groups
        idx = (torch.arange(layer.out_channels) // (layer.out_channels // layer.groups)).unsqueeze(1) * per
        expected = ref.weight * theta[idx + torch.arange(per)].reshape(layer.out_channels, per, 1, 1)
    # the bias stays; the weights take up the bias difference where the inputs can (a Linear's
    # columns span no constant; this one's do not either), so compare the outputs
    with torch.no_grad():
        got, want = snn_layer(u), ref(u * theta.reshape(shape))
    resid_fit = (got - want).pow(2).mean()
    with torch.no_grad():
        snn_layer.weight.copy_(expected)
        resid_exact = (snn_layer(u) - want).pow(2).mean()
    assert resid_fit <= resid_exact + 1e-6


@pytest.mark.parametrize("layer", [torch.nn.Conv2d(4, 3, (3, 2), stride=(2, 1), padding=(1, 2),
                                                   dilation=(1, 2)),
                                   torch.nn.Conv2d(4, 4, 3, padding=1, groups=2),
                                   torch.nn.Conv2d(130, 2, 3, padding=1)])
def test_weight_fit_columns_are_the_unfolded_input_and_its_gram_matrix_is_exact(layer):
    """The columns gathered at sampled positions are F.unfold's rows there (same feature
    order, groups split), and the half-computed U^T U completes to the full product."""
    from snnconv.calibration.weights import columns, layer_output, upper_gram

    torch.manual_seed(0)
    x = torch.rand(3, layer.in_channels, 6, 5)
    n_pos = len(layer_output(layer, x))
    pos = torch.randperm(n_pos)[:n_pos // 3].sort().values
    unfolded = F.unfold(x, layer.kernel_size, layer.dilation, layer.padding, layer.stride)
    rows = unfolded.transpose(1, 2).reshape(n_pos, -1)[pos]
    got = columns(layer, x, pos)
    assert torch.equal(got, rows.reshape(len(pos), layer.groups, -1).transpose(0, 1))
    g = upper_gram(got.double())
    assert torch.allclose(g.triu() + g.triu(1).transpose(1, 2), got.double().transpose(1, 2) @ got.double())
    assert n_pos == x.shape[0] * math.prod(layer(x).shape[2:])
    with torch.no_grad():
        assert torch.allclose(layer_output(layer, x, pos), layer_output(layer, x)[pos], atol=1e-5)


@pytest.mark.parametrize("steps", [1, 16, 127])
def test_weight_fit_gram_of_spike_counts_is_exact(steps, monkeypatch):
    """Rates that are counts over ``steps`` steps: their U^T U from int8 counts equals the
    float64 product, also where the int32 sums are split so that none can overflow; more than
    127 steps and grouped columns are left to the float path."""
    from snnconv.calibration import weights

    torch.manual_seed(0)
    counts = torch.randint(0, steps + 1, (1, 301, 70)) * (torch.rand(1, 301, 70) < 0.4)
    u = counts.float() / steps  # what _fire's rates hold
    exact = counts.double().transpose(1, 2) @ counts.double() / steps**2
    g = weights.count_gram(u, steps)
    assert g is not None and g.dtype == torch.float64 and torch.equal(g, exact)
    real, rows = torch._int_mm, []
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: rows.append(len(b)) or real(a, b))
    monkeypatch.setattr(weights, "INT32_MAX", 7 * steps**2)  # products of 7 rows at most
    assert torch.equal(weights.count_gram(u, steps), exact)
    assert sum(rows) == 301 and max(rows) == 7
    assert weights.count_gram(u, 128) is None
    assert weights.count_gram(u.expand(2, -1, -1), steps) is None


def _pre_activation_error(snn, qcfs, x, T):
    """Mean squared difference, over every Conv/Linear that reads spikes, between the SNN's
    output averaged over T steps and the QCFS-ANN's at T levels (same images)."""
    from snnconv.graph import capture, prepare

    ref = prepare(copy.deepcopy(qcfs), leaf_types=(QCFS,))
    for m in ref.modules():
        if isinstance(m, QCFS):
            m.L = T
    snn.T = T
    layers = {str(n.target): n.name for n in snn.net.graph.nodes
              if n.op == "call_module" and isinstance(snn.net.get_submodule(n.target), (torch.nn.Conv2d,
                                                                                       torch.nn.Linear))}
    ref_names = {str(n.target): n.name for n in ref.graph.nodes if str(n.target) in layers}
    got = capture(snn.net, (x,), layers.values())
    want = capture(ref, (x,), ref_names.values())
    total = 0.0
    for target in list(layers)[1:]:  # the first layer reads the image in both
        g = got[layers[target]]
        g = g.reshape(T, -1, *g.shape[1:]).mean(0)
        total += (g - want[ref_names[target]]).pow(2).mean().item()
    return total


def test_weight_fit_reference_pass_gives_the_membrane_its_reference_means(qcfs_and_snn):
    """One QCFS-ANN pass serves both: the per-channel means the membrane calibration reads are
    those of its own reference pass, bit for bit."""
    from snnconv.calibration.reference import reference_means
    from snnconv.calibration.weights import WeightCalibration
    from snnconv.graph import module_of, prepare

    qcfs, snn, train = qcfs_and_snn
    batches = [b[0] for _, b in zip(range(2), train)]
    ref = prepare(qcfs, leaf_types=(QCFS,))
    sites = {str(n.target): n.name for n in ref.graph.nodes
             if n.op == "call_module" and isinstance(module_of(ref, n), QCFS)}
    want = reference_means(ref, sites, batches, 8)
    got = WeightCalibration(copy.deepcopy(snn).net, ref, batches, 8, sites).means
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_weight_calibration_brings_every_layer_towards_the_reference(qcfs_and_snn):
    """weights=True: each Conv/Linear that reads spikes is refitted (least squares over the
    images) so its output over the calibration's T steps matches the QCFS-ANN's at T levels;
    the summed error of the layers' outputs there falls below the membrane calibration's
    alone, and the fits are recorded."""
    qcfs, snn, train = qcfs_and_snn
    x = torch.cat([b[0] for _, b in zip(range(4), train)])
    plain = calibrate_bias(snn, qcfs, [(x,)], T=8, num_batches=1, membrane=True)
    rng = torch.get_rng_state()
    fitted = calibrate_bias(snn, qcfs, [(x,)], T=8, num_batches=1, membrane=True, weights=True)
    assert torch.equal(torch.get_rng_state(), rng)  # the positions' sample has its own generator
    again = calibrate_bias(snn, qcfs, [(x,)], T=8, num_batches=1, membrane=True, weights=True)
    assert all(torch.equal(a, b) for a, b in zip(fitted.state_dict().values(), again.state_dict().values()))
    record = fitted.meta["bias_calibration"]["weights"]
    assert record["T"] == 8 and sorted(record["relative_change"]) == ["conv2", "conv3", "fc1", "fc2"]
    assert record["relative_change"]["conv2"] < 1e-4  # its input, the first layer's spikes on a
    # constant input, is the QCFS at L=T exactly: nothing to fit
    assert fitted.T == snn.T == 4
    err_plain = _pre_activation_error(plain, qcfs, x, 8)
    err_fitted = _pre_activation_error(fitted, qcfs, x, 8)
    assert err_fitted < 0.9 * err_plain, (err_fitted, err_plain)  # 0.57 here


def test_convert_calibrates_the_weights_with_the_membrane(trained_digits_cnn, digits_loaders):
    train, _ = digits_loaders
    _, meta = snnconv.convert(trained_digits_cnn, train, T=4, progress=False)
    assert meta.settings["weight_calibration"] is True
    assert meta.stage("spiking").changes["bias_calibration"]["weights"]["T"] == 8
    for off in (dict(weight_calibration=False), dict(bias_calibration_T=4), dict(reset="zero")):
        _, meta = snnconv.convert(trained_digits_cnn, train, T=4, progress=False, **off)
        assert meta.settings["weight_calibration"] is False
        assert "weights" not in meta.stage("spiking").changes["bias_calibration"]



class _Unfittable(torch.nn.Module):
    """A Conv2d called twice and one with circular padding: the weight fit leaves both alone."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.c1, self.shared = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.circ = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.c4, self.fc = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 10)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.relu(self.shared(torch.relu(self.shared(x))))
        x = torch.relu(self.c4(torch.relu(self.circ(x))))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


def test_weight_fit_skips_shared_and_non_zero_padded_layers_and_refusals(trained_digits_cnn, digits_loaders):
    torch.manual_seed(0)
    x = [torch.randn(32, 1, 8, 8)]
    qcfs = snnconv.calibrate_qcfs(_Unfittable().eval(), x, L=4, progress=False)
    snn = snnconv.to_spiking(qcfs, T=4)
    before = {k: v.clone() for k, v in snn.state_dict().items()}
    out = calibrate_bias(snn, qcfs, x, T=8, membrane=True, weights=True)
    assert sorted(out.meta["bias_calibration"]["weights"]["relative_change"]) == ["c4", "fc"]
    after = out.state_dict()
    for name in ("shared", "circ"):
        assert torch.equal(after[f"net.{name}.weight"], before[f"net.{name}.weight"]), name
    assert all(torch.equal(v, before[k]) for k, v in snn.state_dict().items())  # on a copy
    with pytest.raises(ValueError, match="bias_calibration=True or weight_calibration=False"):
        snnconv.convert(trained_digits_cnn, digits_loaders[0], T=4, bias_calibration=False,
                        weight_calibration=True, progress=False)


@pytest.mark.parametrize("layer", [torch.nn.Linear(300, 7), torch.nn.Conv2d(8, 6, 3, groups=2, bias=False)],
                         ids=["linear", "grouped_conv"])
def test_the_weight_fit_from_fewer_positions_than_features_is_the_same_ridge_solution(layer):
    """Fewer positions than features (VGG's 25,088-input classifier, one position per image):
    the positions' Gram matrix gives the features' ridge solution (float64, to float32
    rounding), in positions^2 memory; the features' own normal equations agree within their
    float32 Gram matrix's rounding."""
    from snnconv.calibration.weights import RIDGE, WeightFit, columns, layer_output

    torch.manual_seed(0)
    ref = copy.deepcopy(layer)
    with torch.no_grad():
        ref.weight.mul_(1.5)
        if ref.bias is not None:
            ref.bias.add_(0.2)
    u = torch.rand(40, 300) if isinstance(layer, torch.nn.Linear) else torch.rand(3, 8, 3, 3)
    with torch.no_grad():
        y = layer_output(ref, u)
    pos = torch.arange(len(y))
    # the closed form in float64, per group: (U^T U + lam I) W^T = U^T (Y + db) + lam W0^T
    cols = columns(layer, u, pos).double()  # [g, P, f]
    g = cols.shape[0]
    target = y.double().reshape(len(y), g, -1).transpose(0, 1)
    if layer.bias is not None:
        target = target + (ref.bias - layer.bias).detach().double().reshape(g, 1, -1)
    w0 = layer.weight.detach().double().reshape(g, layer.weight.shape[0] // g, -1)
    exact = []
    for k in range(g):
        lam = RIDGE * cols[k].pow(2).sum() / cols.shape[2]
        a = cols[k].T @ cols[k] + lam * torch.eye(cols.shape[2], dtype=torch.float64)
        exact.append(torch.linalg.solve(a, cols[k].T @ target[k] + lam * w0[k].T).T)
    exact = torch.stack(exact).reshape(layer.weight.shape)
    for dual, tol in ((True, 1e-6), (False, 1e-3)):
        snn_layer = copy.deepcopy(layer)
        fit = WeightFit(snn_layer, ref, positions=len(y) if dual else None)
        assert fit.dual == dual and len(y) < cols.shape[2]
        fit.add(u, y, pos)
        assert fit.solve(RIDGE) > 0.01
        assert float((snn_layer.weight.detach().double() - exact).abs().max()) < tol


def test_reference_passes_in_pieces_give_the_values_of_whole_batches(qcfs_and_snn, trained_digits_cnn,
                                                                     monkeypatch):
    """Where a batch's reference values do not fit the memory, the QCFS-ANN's passes (the
    thresholds' percentiles, the reference means, the weight fit's sampled positions and
    targets) run in pieces of images: the same values up to float rounding (the same positions
    exactly)."""
    from snnconv import graph, memory
    from snnconv.calibration.reference import reference_means, reference_sites
    from snnconv.calibration.weights import WeightCalibration

    qcfs, snn, train = qcfs_and_snn
    loader = torch.utils.data.DataLoader(train.dataset, batch_size=64)
    batches = [x for x, _ in loader][:4]
    folded = snnconv.fold_batchnorm(trained_digits_cnn)
    ref = graph.prepare(qcfs, leaf_types=(QCFS,))
    sites = reference_sites(ref)

    def passes():
        lam = snnconv.calibrate_qcfs(folded, loader, L=8, per_channel=True, num_batches=4, progress=False)
        fit = WeightCalibration(copy.deepcopy(snn.net), ref, batches, 8, sites)
        return lam.meta["qcfs"]["sites"], reference_means(ref, sites, batches, 8), fit

    lam, means, fit = passes()
    pieces, real = [], graph.capture
    monkeypatch.setattr(graph, "capture", lambda gm, inputs, *a, **k: pieces.append(len(inputs[0])) or real(
        gm, inputs, *a, **k))
    monkeypatch.setattr(memory, "budget_bytes", lambda device: 1)  # one image at a time
    lam_p, means_p, fit_p = passes()
    assert pieces and max(pieces) == 1
    for name in lam:
        assert lam_p[name]["lambda_init"] == pytest.approx(lam[name]["lambda_init"], rel=1e-5), name
    for target in means:
        torch.testing.assert_close(means_p[target], means[target], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(fit_p.means[target], fit.means[target], rtol=1e-5, atol=1e-7)
    assert fit.targets.keys() == fit_p.targets.keys() and fit.targets
    for name in fit.targets:
        for (pos, y), (pos_p, y_p) in zip(fit.targets[name], fit_p.targets[name]):
            assert torch.equal(pos, pos_p)
            torch.testing.assert_close(y_p, y, rtol=1e-5, atol=1e-5)
