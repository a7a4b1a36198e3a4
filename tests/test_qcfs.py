"""Stage 2, QCFS calibration: the activation, one QCFS per ReLU call site, lambda, refusals, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv import models
from snnconv.activation import QCFS, qcfs_sites, relu_sites
from snnconv.errors import BatchNormRemainsError, ConfigError, DataError, UnsupportedLayerError
from snnconv.stages.fold import fold_batchnorm
from snnconv.stages.qcfs import QCFSTrainConfig, make_optimizer

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

# --------------------------------------------------------------------------------------------
# helpers


def _batches(shape: tuple[int, ...], n: int = 2, seed: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=g) for _ in range(n)]


class Act(nn.Module):
    """Linear -> ``act`` -> Linear, where ``act`` is any callable (a module or a function)."""

    def __init__(self, act):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 3)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Fn(nn.Module):
    """Like :class:`Act` but with a plain function, so fx records the call itself."""

    def __init__(self, fn):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 3)
        self.fn = fn

    def forward(self, x):
        return self.fc2(self.fn(self.fc1(x)))


def _close_to_relu_net(qann: nn.Module, ann: nn.Module, x: torch.Tensor) -> bool:
    """With percentile 100 and a large L, the QCFS-ANN is the ReLU net up to lambda/(2L)."""
    with torch.no_grad():
        return torch.allclose(qann(x), ann(x), rtol=0, atol=2e-2)


# --------------------------------------------------------------------------------------------
# the QCFS activation


def test_qcfs_formula_per_layer_and_per_channel():
    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(64, 5, 3, 3, generator=g)
    for lam in (torch.tensor(1.3), 0.2 + torch.rand(5, generator=g)):
        for L, phi in ((4, 0.5), (8, 0.5), (3, 0.0)):
            q = QCFS(L, lam, phi=phi)
            lv = lam if lam.dim() == 0 else lam.reshape(1, -1, 1, 1)
            expected = lv * torch.clamp(torch.floor(z * L / lv + phi) / L, 0, 1)
            assert torch.allclose(q(z), expected, rtol=0, atol=1e-6)
            levels = q(z) / lv * L
            assert torch.allclose(levels, levels.round(), atol=1e-4)  # L + 1 levels only
            assert (q(z) >= 0).all() and (q(z) <= lv + 1e-6).all()


def test_qcfs_gradient_is_straight_through_and_reaches_lambda():
    q = QCFS(4, 1.0)
    z = torch.tensor([-0.5, 0.3, 0.6, 2.0], requires_grad=True)
    q(z).sum().backward()
    assert z.grad.tolist() == [0.0, 1.0, 1.0, 0.0]  # floor passes the gradient, clip blocks it
    assert q.lam.grad is not None and torch.isfinite(q.lam.grad)


@pytest.mark.parametrize("kwargs", [dict(L=0), dict(L=2.5), dict(lam=0.0), dict(lam=-1.0),
                                    dict(lam=float("nan")), dict(lam=torch.ones(2, 2))])
def test_qcfs_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        QCFS(**{"L": 4, "lam": 1.0, **kwargs})


# --------------------------------------------------------------------------------------------
# every ReLU call site becomes its own QCFS


def _inplace_F(x):
    return F.relu(x, inplace=True)


def _by_keyword(x):
    return F.relu(input=x)


RELU_FORMS = {
    "nn.ReLU": lambda: Act(nn.ReLU()),
    "nn.ReLU(inplace=True)": lambda: Act(nn.ReLU(inplace=True)),
    "F.relu": lambda: Fn(F.relu),
    "F.relu(inplace=True)": lambda: Fn(_inplace_F),
    "F.relu(input=x)": lambda: Fn(_by_keyword),
    "F.relu_": lambda: Fn(F.relu_),
    "torch.relu": lambda: Fn(torch.relu),
    "torch.relu_": lambda: Fn(torch.relu_),
    "Tensor.relu": lambda: Fn(lambda x: x.relu()),
    "Tensor.relu_": lambda: Fn(lambda x: x.relu_()),
}


@pytest.mark.parametrize("form", sorted(RELU_FORMS))
def test_each_relu_call_site_form_becomes_a_qcfs(form):
    torch.manual_seed(0)
    ann = RELU_FORMS[form]().eval()
    batches = _batches((128, 4), 2)
    assert len(relu_sites(torch.fx.symbolic_trace(ann))) == 1
    qann = snnconv.calibrate_qcfs(ann, batches, L=1024, percentile=100, progress=False)
    sites = qcfs_sites(qann)
    assert len(sites) == 1
    assert relu_sites(qann) == []
    node = next(n for n in qann.graph.nodes if n.op == "call_module" and str(n.target) in sites)
    assert [u.target for u in node.users] == ["fc2"]
    assert _close_to_relu_net(qann, ann, batches[0])


def test_an_inplace_relu_whose_result_is_discarded_still_activates_its_input():
    """``relu_(h)`` then reading ``h``: the later reader must see the QCFS output."""

    class Discard(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.act = nn.Linear(4, 16), nn.Linear(16, 3), nn.ReLU(inplace=True)

        def forward(self, x):
            h = self.fc1(x)
            self.act(h)
            return self.fc2(h)

    torch.manual_seed(0)
    ann = Discard().eval()
    batches = _batches((128, 4), 2)
    qann = snnconv.calibrate_qcfs(ann, batches, L=1024, percentile=100, progress=False)
    assert _close_to_relu_net(qann, ann, batches[0])


def test_one_relu_module_at_two_call_sites_becomes_two_qcfs_with_separate_lambdas():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
            self.relu = nn.ReLU()

        def forward(self, x):
            h = self.relu(self.fc1(x))
            return self.fc3(self.relu(10 * self.fc2(h)))  # ten times larger pre-activations

    torch.manual_seed(0)
    ann = Twice().eval()
    qann = snnconv.calibrate_qcfs(ann, _batches((256, 4), 2), progress=False)
    sites = qcfs_sites(qann)
    assert len(sites) == 2
    a, b = sites.values()
    assert a is not b and a.lam is not b.lam
    assert b.lam.item() > 3 * a.lam.item()  # each lambda comes from its own site's data
    with torch.no_grad():
        a.lam.fill_(123.0)
    assert b.lam.item() != 123.0
    records = qann.meta["qcfs"]["sites"]
    assert set(records) == set(sites)
    assert all("relu" in r["replaces"] for r in records.values())


def test_resnet_blocks_get_one_qcfs_per_call_site():
    torch.manual_seed(0)
    ann = models.resnet8(num_classes=10, in_channels=3).eval()
    relu_modules = [m for m in ann.modules() if isinstance(m, nn.ReLU)]
    batches = _batches((2, 3, 8, 8), 2)
    qann = snnconv.calibrate_qcfs(fold_batchnorm(ann), batches, progress=False)
    sites = qcfs_sites(qann)
    assert len(relu_modules) == 4 and len(sites) == 7
    assert len({id(q.lam) for q in sites.values()}) == 7
    assert not any(isinstance(m, nn.ReLU) for m in qann.modules())


def test_calibrate_does_not_change_its_input():
    torch.manual_seed(0)
    ann = Act(nn.ReLU()).eval()
    before = {k: v.clone() for k, v in ann.state_dict().items()}
    snnconv.calibrate_qcfs(ann, _batches((32, 4), 2), progress=False)
    assert isinstance(ann.act, nn.ReLU)
    assert all(torch.equal(before[k], v) for k, v in ann.state_dict().items())


def test_a_model_that_already_holds_a_qcfs_keeps_it():
    seq = nn.Sequential(nn.Linear(4, 8), QCFS(4, 1.0), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    qann = snnconv.calibrate_qcfs(seq, _batches((32, 4), 2), progress=False)
    assert len(qcfs_sites(qann)) == 2
    assert qann.get_submodule("1").lam.item() == 1.0


# --------------------------------------------------------------------------------------------
# lambda from data


@pytest.mark.parametrize("percentile", [100.0, 99.0, 50.0])
def test_lambda_is_the_percentile_of_the_pre_activation(percentile):
    torch.manual_seed(0)
    ann = Act(nn.ReLU()).eval()
    batches = _batches((200, 4), 3)
    qann = snnconv.calibrate_qcfs(ann, batches, percentile=percentile, num_batches=2, progress=False)
    with torch.no_grad():
        pre = torch.cat([ann.fc1(b) for b in batches[:2]])  # num_batches=2: the third is unused
    lam = next(iter(qcfs_sites(qann).values())).lam.detach()
    assert lam.dim() == 0
    assert torch.allclose(lam, torch.quantile(pre.reshape(-1), percentile / 100), rtol=1e-5)


def test_lambda_per_channel():
    torch.manual_seed(0)
    ann = nn.Sequential(nn.Conv2d(2, 5, 3), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 36, 3)).eval()
    batches = _batches((16, 2, 8, 8), 2)
    qann = snnconv.calibrate_qcfs(ann, batches, percentile=100, per_channel=True, progress=False)
    with torch.no_grad():
        pre = torch.cat([ann[0](b) for b in batches])
    lam = next(iter(qcfs_sites(qann).values())).lam.detach()
    assert lam.shape == (5,)
    assert torch.allclose(lam, pre.amax(dim=(0, 2, 3)), rtol=1e-6)


def _loader_forms(x: torch.Tensor, y: torch.Tensor) -> dict[str, object]:
    xs, ys = x.split(32), y.split(32)
    return {
        "tuples": [(a, b) for a, b in zip(xs, ys)],
        "lists": [[a, b] for a, b in zip(xs, ys)],
        "bare": list(xs),
        "DataLoader(x, y)": DataLoader(TensorDataset(x, y), batch_size=32),
        "DataLoader(x)": DataLoader(TensorDataset(x), batch_size=32),
    }


def test_loaders_of_pairs_lists_or_bare_inputs_all_calibrate_the_same():
    torch.manual_seed(0)
    ann = Act(nn.ReLU()).eval()
    x, y = torch.randn(96, 4), torch.randint(0, 3, (96,))
    lams = {}
    for form, loader in _loader_forms(x, y).items():
        qann = snnconv.calibrate_qcfs(ann, loader, progress=False)
        lams[form] = next(iter(qcfs_sites(qann).values())).lam.item()
    assert len(set(lams.values())) == 1, lams


# --------------------------------------------------------------------------------------------
# refusals

UNSUPPORTED = {
    "GELU": lambda: Act(nn.GELU()),
    "SiLU": lambda: Act(nn.SiLU()),
    "LeakyReLU": lambda: Act(nn.LeakyReLU()),
    "Sigmoid": lambda: Act(nn.Sigmoid()),
    "gelu": lambda: Fn(F.gelu),
    "silu": lambda: Fn(F.silu),
    "leaky_relu": lambda: Fn(lambda x: F.leaky_relu(x, 0.1)),
    "sigmoid": lambda: Fn(torch.sigmoid),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_other_activations_are_refused_by_name(name):
    with pytest.raises(UnsupportedLayerError, match=name) as info:
        snnconv.calibrate_qcfs(UNSUPPORTED[name]().eval(), _batches((8, 4)), progress=False)
    assert "ReLU" in str(info.value)  # and says what to do


class Pooled(nn.Module):
    def __init__(self, functional: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 3)
        self.functional = functional

    def forward(self, x):
        x = F.relu(self.conv(x))
        x = F.max_pool2d(x, 2) if self.functional else self.pool(x)
        return self.fc(torch.flatten(x, 1))


def test_max_pooling_is_refused_unless_replaced_by_average_pooling():
    batches = _batches((8, 1, 8, 8))
    with pytest.raises(UnsupportedLayerError, match="maxpool='avg'") as info:
        snnconv.calibrate_qcfs(Pooled().eval(), batches, progress=False)
    assert "'pool'" in str(info.value)
    qann = snnconv.calibrate_qcfs(Pooled().eval(), batches, maxpool="avg", progress=False)
    assert not any(isinstance(m, nn.MaxPool2d) for m in qann.modules())
    assert isinstance(qann.get_submodule("pool"), nn.AvgPool2d)
    assert qann.meta["qcfs"]["maxpool_replaced"] == ["pool"]
    snn = snnconv.to_spiking(qann, T=4)
    assert snn(batches[0]).shape == (8, 3)


def test_functional_max_pooling_is_refused_even_with_avg():
    with pytest.raises(UnsupportedLayerError, match="max_pool2d"):
        snnconv.calibrate_qcfs(Pooled(functional=True).eval(), _batches((8, 1, 8, 8)),
                               maxpool="avg", progress=False)


def test_batchnorm_is_refused_by_name():
    ann = models.small_cnn(num_classes=10, in_channels=1).eval()
    with pytest.raises(BatchNormRemainsError, match="bn1") as info:
        snnconv.calibrate_qcfs(ann, _batches((4, 1, 8, 8)), progress=False)
    assert len(info.value.offenders) == 4


def test_empty_or_nan_data_is_refused():
    ann = Act(nn.ReLU()).eval()
    with pytest.raises(DataError, match="empty"):
        snnconv.calibrate_qcfs(ann, [], progress=False)
    bad = _batches((8, 4), 3)
    bad[2][0, 1] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        snnconv.calibrate_qcfs(ann, bad, progress=False)


@pytest.mark.parametrize("kwargs", [dict(L=0), dict(L=1.5), dict(percentile=0),
                                    dict(percentile=101), dict(maxpool="max"), dict(num_batches=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        snnconv.calibrate_qcfs(Act(nn.ReLU()).eval(), _batches((8, 4)), progress=False, **kwargs)


# --------------------------------------------------------------------------------------------
# QCFS-aware training


def _labelled(n: int = 256, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def test_training_without_labels_is_refused():
    x = torch.randn(128, 4)
    with pytest.raises(DataError, match="labels"):
        snnconv.calibrate_qcfs(Act(nn.ReLU()).eval(), list(x.split(16)),
                               train=QCFSTrainConfig(epochs=1), progress=False)


def test_distilled_training_needs_no_labels_and_validates_against_the_teacher(small_digits_ann, digits_data):
    """distill=1 with a teacher: an unlabelled loader trains exactly as the same images labelled
    by the teacher's top-1 (the loss reads only the teacher's outputs), validation is agreement
    with the teacher, and a teacher without distillation (or the other way round) is refused."""
    ann = fold_batchnorm(small_digits_ann.eval())
    x = digits_data[0].tensors[0][:512]
    with torch.no_grad():
        top1 = small_digits_ann(x).argmax(1)
    train = QCFSTrainConfig(epochs=2, lr=0.02, distill=1.0, val_fraction=0.25)
    runs = []
    for data in (TensorDataset(x), TensorDataset(x, top1)):
        loader = DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
        runs.append(snnconv.calibrate_qcfs(ann, loader, L=4, train=train, teacher=small_digits_ann,
                                           progress=False))
    free, told = runs
    h_free, h_told = free.meta["qcfs"]["history"], told.meta["qcfs"]["history"]
    assert [h["val_acc"] for h in h_free] == pytest.approx([h["val_acc"] for h in h_told])
    assert free.meta["qcfs"]["calibrated_val_acc"] == pytest.approx(told.meta["qcfs"]["calibrated_val_acc"])
    assert all(h["steps"] > 0 for h in h_free)
    for (name, a), b in zip(free.state_dict().items(), told.state_dict().values()):
        assert torch.equal(a, b), name
    unlabelled = DataLoader(TensorDataset(x), batch_size=64)
    with pytest.raises(DataError, match="distill=1.0"):
        snnconv.calibrate_qcfs(ann, unlabelled, train=QCFSTrainConfig(epochs=1, distill=0.5),
                               teacher=small_digits_ann, progress=False)
    with pytest.raises(ConfigError, match="teacher"):
        snnconv.calibrate_qcfs(ann, unlabelled, train=QCFSTrainConfig(epochs=1, distill=1.0), progress=False)
    with pytest.raises(ConfigError, match="teacher"):
        snnconv.calibrate_qcfs(ann, unlabelled, teacher=small_digits_ann, progress=False)
    with pytest.raises(ConfigError, match="distill"):
        QCFSTrainConfig(epochs=1, distill=1.5)


def test_lambda_stays_positive_during_training():
    """A huge lambda learning rate throws lambda far past zero; every forward still sees lam > 0."""
    torch.manual_seed(0)
    ann = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    seen: list[float] = []

    def record(module, inputs):
        if isinstance(module, QCFS) and module.training:
            seen.append(module.lam.detach().min().item())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        qann = snnconv.calibrate_qcfs(
            ann.eval(), _labelled(), L=4, progress=False,
            train=QCFSTrainConfig(epochs=3, lr=0.05, lambda_lr=50.0, val_fraction=0.2))
    finally:
        handle.remove()
    assert len(seen) > 10
    assert min(seen) > 0
    lams = torch.stack([q.lam.detach() for q in qcfs_sites(qann).values()])
    assert (lams > 0).all() and torch.isfinite(lams).all()
    history = qann.meta["qcfs"]["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert all(0 <= h["val_acc"] <= 100 for h in history)
    lam_init = [s["lambda_init"] for s in qann.meta["qcfs"]["sites"].values()]
    lam_final = [s["lambda"] for s in qann.meta["qcfs"]["sites"].values()]
    assert lam_init != lam_final  # lambda is trained


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_weight_decay_is_not_applied_to_lambda(optimizer):
    torch.manual_seed(0)
    ann = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 8), nn.ReLU(),
                        nn.Linear(8, 2)).eval()
    qann = snnconv.calibrate_qcfs(ann, _batches((8, 1, 5, 5)), per_channel=True, progress=False)
    lams = [q.lam for q in qcfs_sites(qann).values()]
    opt = make_optimizer(qann, optimizer, 0.1, weight_decay=0.5, threshold_params=lams)
    for group in opt.param_groups:
        if any(p is lam for p in group["params"] for lam in lams):
            assert group["weight_decay"] == 0.0
            assert all(any(p is lam for lam in lams) for p in group["params"])
    # behaviour: with zero gradients, decay shrinks the weights and leaves lambda alone
    before_lam = [lam.detach().clone() for lam in lams]
    before_w = qann.get_submodule("0").weight.detach().clone()
    for p in qann.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(a, lam.detach()) for a, lam in zip(before_lam, lams))
    assert qann.get_submodule("0").weight.detach().abs().sum() < before_w.abs().sum()


def test_training_records_history_and_keeps_accuracy():
    torch.manual_seed(0)
    ann = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    loader = _labelled(512)
    opt = torch.optim.Adam(ann.parameters(), lr=0.02)
    for _ in range(20):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(ann(x), y).backward()
            opt.step()
    ann.eval()
    from snnconv.analysis.metrics import evaluate

    base = snnconv.calibrate_qcfs(ann, loader, L=2, progress=False)
    trained = snnconv.calibrate_qcfs(ann, loader, L=2, progress=False,
                                     train=QCFSTrainConfig(epochs=5, lr=0.01))
    test = _labelled(512, seed=1)
    assert not trained.training
    assert evaluate(trained, test) >= evaluate(base, test) - 2.0
