"""Robust conversion: reproducibility, collapse detection, the allow-list of ops
between neurons, and the linear-time bias calibration."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

import snnconv


def _state(snn):
    return {k: v.clone() for k, v in snn.state_dict().items()}


# --- item 3: the result is a function of model, data, settings and seed ---------------------

def test_eval_loader_leaves_the_converted_network_bit_identical(small_digits_ann, digits_data):
    """A loader shuffled by the global RNG: evaluating between stages must not reshuffle it."""
    train_set, test_set = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True)  # global-RNG shuffling
    test = DataLoader(test_set, batch_size=256)
    options = dict(T=4, L=4, calib_batches=2, qcfs_epochs=1, progress=False, seed=3)
    plain, _ = snnconv.convert(small_digits_ann, loader, **options)
    evaluated, meta = snnconv.convert(small_digits_ann, loader, eval_loader=test, eval_T=(2,),
                                      **options)
    assert set(meta.accuracy) >= {"ann", "folded", "qcfs", "snn"}
    a, b = _state(plain), _state(evaluated)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_a_loader_with_its_own_generator_gives_the_same_network_twice(small_digits_ann, digits_data):
    """DataLoader(generator=g) shuffles with g, which convert() leaves as it found it."""
    train_set, _ = digits_data
    g = torch.Generator().manual_seed(11)
    loader = DataLoader(train_set, batch_size=64, shuffle=True, generator=g)
    options = dict(T=4, L=4, calib_batches=2, qcfs_epochs=1, progress=False, seed=3)
    before = g.get_state()
    first, _ = snnconv.convert(small_digits_ann, loader, **options)
    assert torch.equal(g.get_state(), before)
    second, _ = snnconv.convert(small_digits_ann, loader, **options)
    a, b = _state(first), _state(second)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    next(iter(loader))  # the loader itself still shuffles on: its generator moves when used
    assert not torch.equal(g.get_state(), before)


# --- item 7: bias calibration in one pass ---------------------------------------------------

class _TinyResNet(torch.nn.Module):
    """conv-BN-ReLU, a residual block with a reused ReLU and a 1x1 downsample, pool, linear."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16)
        self.conv3, self.bn3 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.down = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
        self.relu = nn.ReLU(inplace=True)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(x)))
        out = self.bn3(self.conv3(out))
        out += self.down(x)
        return self.fc(torch.flatten(self.pool(self.relu(out)), 1))


def _trained_tiny_resnet(digits_data):
    from snnconv.demo import train_ann

    torch.manual_seed(0)
    loader = DataLoader(digits_data[0], batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return train_ann(_TinyResNet(), loader, epochs=3, progress=False)


def _calls(snn):
    """Forward-call counters on every Conv/Linear (hooks travel with deepcopy)."""
    counts = {}
    for name, m in snn.named_modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            counts[name] = 0
            m.register_forward_hook(lambda mod, i, o, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


@pytest.mark.parametrize("net, per_channel, horizons, reset, membrane, weights", [
    ("cnn", True, None, "subtract", False, False), ("resnet", False, None, "subtract", False, False),
    ("resnet", True, None, "subtract", False, False), ("cnn", True, (2, 6), "subtract", False, False),
    ("resnet", True, (2, 6), "subtract", False, False), ("resnet", False, None, "zero", False, False),
    ("cnn", True, None, "subtract", True, False), ("resnet", False, None, "subtract", True, False),
    ("cnn", True, None, "subtract", True, True), ("resnet", True, None, "subtract", True, True),
    ("resnet", False, None, "zero", False, True)])
def test_one_pass_bias_calibration_gives_the_shifts_of_the_rerun_algorithm(
        net, per_channel, horizons, reset, membrane, weights, small_digits_ann, digits_data):
    """The one pass counts spikes from the membrane (subtractive reset) or by a running count
    (reset to zero) and fires with the shift folded into the threshold: the same network as
    re-running every corrected layer from the input, up to float rounding."""
    from snnconv.calibration.bias import calibrate_bias, calibrate_bias_by_rerun

    model = small_digits_ann if net == "cnn" else _trained_tiny_resnet(digits_data)
    loader = DataLoader(digits_data[0], batch_size=50)  # 4 batches of 50
    qcfs = snnconv.calibrate_qcfs(snnconv.fold_batchnorm(model), loader, L=4, per_channel=per_channel,
                                  progress=False)
    snn = snnconv.to_spiking(qcfs, T=4, reset=reset)
    fast_snn, slow_snn = copy.deepcopy(snn), copy.deepcopy(snn)
    fast_calls, slow_calls = _calls(fast_snn), _calls(slow_snn)
    Tc = 8 if weights else 6  # the weights are fitted at T and 2T
    fast = calibrate_bias(fast_snn, qcfs, loader, T=Tc, horizons=horizons, membrane=membrane, weights=weights)
    slow = calibrate_bias_by_rerun(slow_snn, qcfs, loader, T=Tc, horizons=horizons, membrane=membrane,
                                    weights=weights)
    assert fast.meta["bias_calibration"]["method"] == "one-pass"
    assert slow.meta["bias_calibration"]["method"] == "rerun"
    # one pass: every layer runs once per chunk (chunk_size // T images, inside each batch; these
    # activations are far under the 16 MiB cap); sizing the chunks on one image runs no hooks
    chunks = 4 * -(-50 // (fast_snn.chunk_size // Tc))
    assert set(fast_calls.values()) == {chunks}, f"one pass over the batches in chunks: {fast_calls}"
    assert max(slow_calls.values()) > 4
    a, b = fast.meta["bias_calibration"]["mean_abs_shift"], slow.meta["bias_calibration"]["mean_abs_shift"]
    assert a.keys() == b.keys() and all(isinstance(v, float) for v in a.values())
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), (k, a[k], b[k])
    if weights:  # every layer that reads spikes was fitted (the first reads the image)
        wa, wb = fast.meta["bias_calibration"]["weights"], slow.meta["bias_calibration"]["weights"]
        layers = [n for n, m in fast.net.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
        assert sorted(wa["relative_change"]) == sorted(layers[1:]) == sorted(wb["relative_change"])
        assert all(0 < v < 1 for v in wa["relative_change"].values()), wa
    sa, sb = fast.state_dict(), slow.state_dict()
    for k in sa:  # with weight fits (normal equations), relative to the tensor's largest value
        atol = 2e-3 * max(1.0, float(sa[k].abs().max())) if weights else 1e-5
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("net, per_channel, horizons, reset, membrane, weights, spill", [
    ("cnn", True, None, "subtract", True, True, False), ("resnet", True, None, "subtract", True, True, True),
    ("resnet", True, (2, 6), "subtract", False, False, False), ("resnet", False, None, "zero", False, True, False)])
def test_calibration_in_groups_gives_the_network_of_all_images_at_once(
        net, per_channel, horizons, reset, membrane, weights, spill, small_digits_ann, digits_data, monkeypatch):
    """Where the calibration images do not fit the memory at once they go through in groups
    (here of 7 images, forced), each group run twice between corrections; spill: what the
    groups hold between corrections goes to files. The network is the one of all images at
    once, up to float rounding (the tolerances of the single pass against the re-run)."""
    from snnconv.calibration import bias

    model = small_digits_ann if net == "cnn" else _trained_tiny_resnet(digits_data)
    loader = DataLoader(digits_data[0], batch_size=50)  # 4 batches of 50
    qcfs = snnconv.calibrate_qcfs(snnconv.fold_batchnorm(model), loader, L=4, per_channel=per_channel,
                                  progress=False)
    snn = snnconv.to_spiking(qcfs, T=4, reset=reset)
    grouped_snn = copy.deepcopy(snn)
    calls = _calls(grouped_snn)
    Tc = 8 if weights else 6
    whole = bias.calibrate_bias(snn, qcfs, loader, T=Tc, horizons=horizons, membrane=membrane, weights=weights)
    if spill:
        monkeypatch.setattr(bias, "budget_bytes", lambda device: 0)
    grouped = bias.calibrate_bias(grouped_snn, qcfs, loader, T=Tc, horizons=horizons, membrane=membrane,
                                  weights=weights, group_size=7)
    assert whole.meta["bias_calibration"]["method"] == "one-pass"
    record = grouped.meta["bias_calibration"]
    assert record["method"] == "grouped" and record["groups"]["count"] == 4 * -(-50 // 7)
    assert (record["groups"]["spilled_to_disk"] > 0) == spill
    assert max(calls.values()) <= 2 * 4 * -(-50 // 7), "each group runs a layer at most twice"
    a, b = whole.meta["bias_calibration"]["mean_abs_shift"], record["mean_abs_shift"]
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), (k, a[k], b[k])
    sa, sb = whole.state_dict(), grouped.state_dict()
    for k in sa:
        atol = 2e-3 * max(1.0, float(sa[k].abs().max())) if weights else 1e-5
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


class _LateUse(torch.nn.Module):
    def __init__(self, how="method"):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(2, 3, 1), torch.nn.Conv2d(3, 3, 1)
        self.how = how

    def forward(self, x):
        s = x.sum(1, keepdim=True) * 0.5  # needed only at the end
        h = torch.relu(self.a(x))
        t = h * 3  # reads h, which the next line changes in place
        if self.how == "method":
            h.add_(1)
        elif self.how == "function":
            torch.sigmoid_(h)
        else:
            torch.nn.functional.hardtanh(h, inplace=True)
        return self.b(h) + s + t


@pytest.mark.parametrize("how", ["method", "function", "inplace"])
def test_lockstep_runs_a_node_just_before_its_first_user_unless_a_value_changes_in_place(how):
    """Values needed only later (a shortcut's scaling) are made when needed, so they are not
    alive for every chunk across the hooks in between; what reads a value that an in-place op
    changes keeps its place, and the outputs are those of the network itself."""
    from snnconv.graph import _in_place, _late_order, run_lockstep, trace

    torch.manual_seed(0)
    gm = trace(_LateUse(how))
    order = _late_order(gm, fixed=set())
    names = [n.name for n in order]
    assert sorted(names) == sorted(n.name for n in gm.graph.nodes)
    assert all(names.index(a.name) < names.index(n.name) for n in order for a in n.all_input_nodes)
    (scale,) = [n for n in order if n.op == "call_function" and n.args[1:] == (0.5,)]
    first_user = min(names.index(u.name) for u in scale.users)
    assert names.index(scale.name) == first_user - 1
    (t,) = [n for n in order if n.args[1:] == (3,)]
    (change,) = [n for n in order if _in_place(gm, n)]
    assert names.index(t.name) < names.index(change.name)
    chunks = [torch.randn(3, 2, 4, 4) for _ in range(3)]
    outs = run_lockstep(gm, chunks, {})
    for c, o in zip(chunks, outs):
        assert torch.equal(o, gm(c))


def test_lockstep_observers_see_every_chunk_before_the_node_runs_on_any():
    """An observer gets the node's input chunk by chunk (packed spikes unpacked one at a
    time) once all chunks have reached the node; what it changes in the module applies to
    every chunk, and the node's input itself is left as it was."""
    from snnconv.graph import NodeOutputs, run_lockstep, trace

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.ReLU(), torch.nn.Conv2d(3, 3, 1))
    gm = trace(net)
    (relu,) = [n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "1"]
    (last,) = [n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "2"]
    chunks = [torch.randn(4, 2, 3, 3) for _ in range(3)]
    seen = []

    def observe(xs):
        for x in xs:
            seen.append(x.clone())
        with torch.no_grad():
            net[2].weight.mul_(2)

    spikes = lambda xs: NodeOutputs([(x > 0).float() for x in xs], spikes=True)  # noqa: E731
    outs = run_lockstep(gm, chunks, {relu: spikes}, {last: observe})
    assert len(seen) == 3
    assert all(torch.equal(s, (net[0](c) > 0).float()) for s, c in zip(seen, chunks))
    with torch.no_grad():
        for o, c in zip(outs, chunks):
            assert torch.equal(o, net[2]((net[0](c) > 0).float()))  # the doubled weight, for all


class _Chain(torch.nn.Module):
    def forward(self, x):
        for _ in range(3000):  # deeper than Python's recursion limit
            x = x + 1
        return x


def test_lockstep_orders_a_graph_deeper_than_the_recursion_limit():
    from snnconv.graph import _late_order, run_lockstep, trace

    gm = trace(_Chain())
    assert [n.name for n in _late_order(gm, fixed=set())] == [n.name for n in gm.graph.nodes]
    assert torch.equal(run_lockstep(gm, [torch.zeros(2)], {})[0], torch.full((2,), 3000.0))


class _Skip(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(2, 3, 1), torch.nn.Conv2d(3, 3, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return torch.relu(self.b(h)) + h  # h outlives the second ReLU


def test_lockstep_packs_the_spikes_that_outlive_the_next_hook_and_unpacks_them_bit_for_bit(monkeypatch):
    from snnconv import graph

    spikes = (torch.rand(4, 5) > 0.5).float()
    packed = graph.Packed(spikes)
    assert packed.bits.dtype == torch.uint8 and torch.equal(packed.unpack(), spikes)
    bursts = spikes * torch.randint(1, 256, spikes.shape).float()  # a burst neuron's counts, up to 255
    assert torch.equal(graph.Packed(bursts).unpack(), bursts)
    made = []

    class Counted(graph.Packed):
        def __init__(self, value):
            super().__init__(value)
            made.append(value.shape)

    monkeypatch.setattr(graph, "Packed", Counted)
    torch.manual_seed(0)
    gm = graph.trace(_Skip())
    first, second = [n.name for n in gm.graph.nodes if n.target is torch.relu]
    chunks = [torch.randn(3, 2, 4, 4) for _ in range(2)]

    def fire(spikes):
        return lambda xs: graph.NodeOutputs(((x > 0).float() for x in xs), spikes=spikes)

    dense = graph.run_lockstep(gm, chunks, {first: fire(False), second: fire(False)})
    assert made == []
    kept = graph.run_lockstep(gm, chunks, {first: fire(True), second: fire(True)})
    assert len(made) == len(chunks)  # the first ReLU's spikes, still needed after the second
    assert all(torch.equal(a, b) for a, b in zip(dense, kept))


def test_calibration_chunks_shrink_to_the_byte_cap_and_give_the_same_network(
        small_digits_ann, digits_data, monkeypatch):
    """Wide activations get smaller chunks (page faults, see network.CHUNK_BYTES); chunking
    changes how the work is cut, never the result."""
    from snnconv.calibration import calibrate_bias
    from snnconv.graph import largest_value
    from snnconv.snn import network

    loader = DataLoader(digits_data[0], batch_size=50)
    qcfs = snnconv.calibrate_qcfs(snnconv.fold_batchnorm(small_digits_ann), loader, L=4,
                                  per_channel=True, progress=False)
    snn = snnconv.to_spiking(qcfs, T=4)
    wide, narrow = copy.deepcopy(snn), copy.deepcopy(snn)
    wide_calls, narrow_calls = _calls(wide), _calls(narrow)
    a = calibrate_bias(wide, qcfs, loader, horizons=(2, 6))
    per_image = largest_value(snn.net, digits_data[0].tensors[0][:1])  # at T=4
    monkeypatch.setattr(network, "CHUNK_BYTES", per_image // 4 * 6 * 3)  # 3 images at T=6
    b = calibrate_bias(narrow, qcfs, loader, horizons=(2, 6))
    assert set(narrow_calls.values()) == {4 * -(-50 // 3)}, narrow_calls  # sizing runs no hooks
    assert max(narrow_calls.values()) > max(wide_calls.values())
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6, msg=k)


def test_snn_forward_chunks_shrink_to_the_byte_cap_and_hooks_see_only_the_real_calls(
        small_digits_ann, digits_data, monkeypatch):
    """snn(x) on a CPU cuts its batch to chunk_size // T inputs and fewer where the largest
    value would pass the byte cap (measured once per input shape, with no hooks run): the same
    readout as one pass, and a layer's hook sees one call per chunk."""
    from snnconv.graph import largest_value
    from snnconv.snn import network

    loader = DataLoader(digits_data[0], batch_size=50)
    qcfs = snnconv.calibrate_qcfs(snnconv.fold_batchnorm(small_digits_ann), loader, L=4,
                                  per_channel=True, progress=False)
    snn = snnconv.to_spiking(qcfs, T=4)
    x = digits_data[0].tensors[0][:50]
    per_image = largest_value(snn.net, x[:1])  # all 4 steps of one image
    monkeypatch.setattr(network, "CHUNK_BYTES", per_image * 7)
    calls = _calls(snn)
    with torch.no_grad():
        chunked = snn(x)
        assert set(calls.values()) == {-(-50 // 7)}, calls
        snn.chunk_size = 0
        whole = snn(x)
    assert set(calls.values()) == {-(-50 // 7) + 1}
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


# --- item 4: no silent collapse -------------------------------------------------------------

def _silenced(model):
    """``model`` whose second conv-BN gives outputs a million times smaller: its ReLU still passes
    positive values in the ANN, but far below the smallest QCFS threshold (1e-3) on every sample."""
    with torch.no_grad():
        model.bn2.weight.mul_(1e-6)
        model.bn2.bias.mul_(1e-6)
    return model


def test_a_layer_silenced_by_conversion_raises_a_conversion_error_naming_it(small_digits_ann,
                                                                            digits_loaders):
    train, _ = digits_loaders
    with pytest.raises(snnconv.ConversionError, match="silent") as info:
        snnconv.convert(_silenced(small_digits_ann), train, T=4, L=4, progress=False)
    assert isinstance(info.value, snnconv.SnnconvError)
    assert any("qcfs_relu_1" in finding for finding in info.value.layers), info.value.layers
    assert "on_collapse='warn'" in str(info.value) and "after stage 'qcfs'" in str(info.value)


def test_the_collapse_advice_names_only_settings_that_change_something(small_digits_ann, digits_loaders):
    train, _ = digits_loaders
    with pytest.raises(snnconv.ConversionError) as info:  # the defaults: per channel, bias calibration on
        snnconv.convert(_silenced(small_digits_ann), train, T=4, L=4, progress=False)
    text = str(info.value)
    assert "What to do:" in text and "a larger T than 4" in text
    assert "per_channel=True" not in text and "bias_calibration=True" not in text
    from snnconv.config import ConvertConfig
    from snnconv.pipeline import collapse_advice

    off = ConvertConfig(T=4, per_channel=False, bias_calibration=False, reset="zero").resolved()
    assert collapse_advice(off, qcfs_trained=False) == ("per_channel=True, a larger T than 4, "
                                                        "bias_calibration=True, or reset='subtract' (no "
                                                        "charge is lost at a spike)")
    assert "QCFS training" in collapse_advice(ConvertConfig(T=4).resolved(), qcfs_trained=True)
    assert "QCFS training" not in collapse_advice(ConvertConfig(T=4).resolved(), qcfs_trained=False)


def test_on_collapse_warn_returns_the_network_and_records_the_finding(small_digits_ann, digits_loaders):
    train, _ = digits_loaders
    with pytest.warns(RuntimeWarning, match="silent"):
        snn, meta = snnconv.convert(_silenced(small_digits_ann), train, T=4, L=4, progress=False,
                                    on_collapse="warn")
    assert isinstance(snn, snnconv.SpikingNetwork)
    assert any("qcfs_relu_1" in f for f in meta.stage("qcfs").changes["collapse"])
    assert meta.stage("fold").changes["activity"]["relu_1"]["active"] > 0.2
    assert meta.stage("qcfs").changes["activity"]["qcfs_relu_1"]["active"] == 0.0
    with pytest.raises(ValueError, match="on_collapse"):
        snnconv.convert(small_digits_ann, train, on_collapse="ignore", progress=False)


def test_a_layer_dead_in_the_ann_is_reported_not_refused(small_digits_ann, digits_loaders):
    train, _ = digits_loaders
    with torch.no_grad():
        small_digits_ann.bn2.bias.fill_(-1e3)  # this ReLU never fires, in the ANN already
    with pytest.warns(RuntimeWarning, match="relu_1"):
        _, meta = snnconv.convert(small_digits_ann, train, T=4, L=4, progress=False)
    assert meta.stage("fold").changes["dead_in_ann"] == ["relu_1"]
    assert all("collapse" not in s.changes for s in meta.stages)


def test_meta_json_holds_per_layer_activity_after_every_stage(small_digits_ann, digits_loaders, tmp_path):
    import json

    train, _ = digits_loaders
    snn, meta = snnconv.convert(small_digits_ann, train, T=4, L=4, progress=False)
    meta.to_json(tmp_path / "meta.json")
    stages = {s["name"]: s["changes"] for s in json.loads((tmp_path / "meta.json").read_text())["stages"]}
    sites = set(meta.stage("qcfs").changes["sites"])
    assert set(stages["qcfs"]["activity"]) == sites
    assert set(stages["spiking"]["activity"]) == set(snn.thresholds())
    assert len(stages["fold"]["activity"]) == len(sites)
    for stage in ("fold", "qcfs", "spiking"):
        assert "collapse" not in stages[stage]
        assert 0 <= stages[stage]["check_accuracy"] <= 100
        for site, a in stages[stage]["activity"].items():
            assert 0 < a["active"] <= 1, (stage, site)
            assert a["saturated"] is None if stage == "fold" else 0 <= a["saturated"] < 1


def test_the_stage_checks_accuracy_is_that_of_the_network_on_its_two_batches(small_digits_ann, digits_data):
    """Activity and accuracy come from one pass (the SNN's own chunked forward): the recorded
    accuracy is the network's on the first two calibration batches, ANN and SNN alike."""
    loader = DataLoader(digits_data[0], batch_size=64)  # no shuffle: the first two batches are known
    snn, meta = snnconv.convert(small_digits_ann, loader, T=4, L=4, finetune_epochs=0, progress=False)
    (x1, y1), (x2, y2) = list(loader)[:2]
    x, y = torch.cat([x1, x2]), torch.cat([y1, y2])
    with torch.no_grad():
        expect = {"fold": small_digits_ann.eval()(x), "spiking": snn(x)}
    for stage, out in expect.items():
        # the folded ANN may differ from the BatchNorm one by float rounding: one image at most
        slack = 100.0 / len(y) if stage == "fold" else 1e-9
        assert meta.stage(stage).changes["check_accuracy"] == pytest.approx(
            100.0 * (out.argmax(1) == y).float().mean().item(), abs=slack), stage


def test_qcfs_training_never_returns_worse_than_the_calibrated_state(small_digits_ann, digits_data):
    """A learning rate that wrecks the network: the calibrated state (epoch 0) is kept, and a
    warning says so."""
    train = DataLoader(digits_data[0], batch_size=64)  # the same calibration batches both times
    folded = snnconv.fold_batchnorm(small_digits_ann)
    calibrated = snnconv.calibrate_qcfs(folded, train, L=4, progress=False)
    with pytest.warns(RuntimeWarning, match="did not beat the calibrated network"):
        wrecked = snnconv.calibrate_qcfs(folded, train, L=4, progress=False,
                                         train=snnconv.QCFSTrainConfig(epochs=1, lr=1e4, weight_decay=0.0))
    record = wrecked.meta["qcfs"]
    assert record["best_epoch"] == 0 and record["history"][0]["val_acc"] < record["calibrated_val_acc"]
    a, b = calibrated.state_dict(), wrecked.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- item 5: only operations that commute with the spike encoding between neurons ------------

class _Between(torch.nn.Module):
    """conv-ReLU, then ``op`` on the activations, then conv-ReLU-pool-linear."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.c1, self.c2 = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4, 10)

    def forward(self, x):
        a = torch.relu(self.c1(x))
        a = self.op(a)
        a = torch.relu(self.c2(a))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(a, 1), 1))


_X = [torch.randn(16, 1, 8, 8)]

_REFUSED = {
    "clamp": lambda a: torch.clamp(a, max=1.0),
    "abs": lambda a: a.abs(),
    "maximum": lambda a: torch.maximum(a, a.flip(-1)),
    "mul": lambda a: a * a.flip(-1),
    "max": lambda a: a.max(dim=1, keepdim=True).values.expand_as(a),
    "sigmoid_gate": lambda a: a * torch.sigmoid(a),
}


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_an_op_that_does_not_commute_with_spikes_is_refused_by_node(name):
    model = _Between(_REFUSED[name])
    with pytest.raises(snnconv.UnsupportedLayerError, match="fx node") as info:
        snnconv.convert(model, _X, T=2, progress=False, bias_calibration=False)
    word = {"sigmoid_gate": "sigmoid", "max": "max", "mul": "mul", "maximum": "maximum",
            "clamp": "clamp", "abs": "abs"}[name]
    assert word in str(info.value)


_ALLOWED = {
    "cat": lambda a: torch.cat([a[:, :2], a[:, 2:]], dim=1),
    "dropout_view": lambda a: torch.nn.functional.dropout(a, 0.3, training=False).view(a.shape),
    "scale_add": lambda a: 0.5 * a + a.flip(-1),
    "pad_slice": lambda a: torch.nn.functional.pad(a, (1, 1, 1, 1))[:, :, 1:-1, 1:-1],
    "mean_keepdim": lambda a: a + a.mean(dim=(2, 3), keepdim=True),
}


@pytest.mark.parametrize("name", sorted(_ALLOWED))
def test_linear_and_layout_ops_between_neurons_convert(name):
    snn, _ = snnconv.convert(_Between(_ALLOWED[name]), _X, T=2, progress=False, bias_calibration=False,
                             on_collapse="warn")
    assert snn(_X[0]).shape == (16, 10)


class _LinearOnLastDim(torch.nn.Module):
    """A Linear reading a 4-D activation whose last dimension (4) equals its channel count (4)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.mix = torch.nn.Linear(4, 4)
        self.fc = torch.nn.Linear(4 * 6 * 4, 10)

    def forward(self, x):
        a = torch.relu(self.conv(x))          # [B, 4, 6, 4]: channels on dim 1, width 4
        a = torch.relu(self.mix(a))           # mixes the last dimension
        return self.fc(torch.flatten(a, 1))


def test_per_channel_thresholds_are_scaled_on_the_channel_dimension_before_a_linear_on_the_last():
    torch.manual_seed(0)
    model = _LinearOnLastDim().eval()
    x = torch.randn(64, 1, 6, 4)
    qcfs = snnconv.calibrate_qcfs(model, [x], L=4, per_channel=True, progress=False)
    lam = next(iter(snnconv.activation.qcfs_sites(qcfs).values())).lam
    assert lam.shape == (4,) and lam.std() > 0.05 * lam.mean(), "channels must differ for the test"
    snn = snnconv.to_spiking(qcfs, T=4)
    with torch.no_grad():
        torch.testing.assert_close(snn.rate(x, 4), qcfs(x), rtol=1e-4, atol=1e-4)


class _SharedConvOutput(torch.nn.Module):
    """conv2's output feeds a ReLU and, unactivated, a later add (as in pre-activation ResNets)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1)
        self.c3, self.fc = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Linear(4, 10)

    def forward(self, x):
        b = self.c2(torch.relu(self.c1(x)))
        z = torch.relu(self.c3(torch.relu(b)) + b)
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(z, 1), 1))


def test_bias_calibration_falls_back_to_the_rerun_where_a_shift_would_reach_other_nodes():
    from snnconv.calibration.bias import calibrate_bias, calibrate_bias_by_rerun

    torch.manual_seed(0)
    x = [torch.randn(32, 1, 6, 6)]
    qcfs = snnconv.calibrate_qcfs(_SharedConvOutput().eval(), x, L=4, progress=False)
    snn = snnconv.to_spiking(qcfs, T=4)
    out = calibrate_bias(snn, qcfs, x)
    assert out.meta["bias_calibration"]["method"] == "rerun"
    ref = calibrate_bias_by_rerun(snn, qcfs, x)
    a, b = out.state_dict(), ref.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
