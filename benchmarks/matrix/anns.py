"""The robustness matrix's networks, data and trained ANNs.

Five architectures written the way people write them (``build``), the Fashion-MNIST, digits and
3x32x32 Fashion-MNIST splits (``datasets``), the ANN training recipe (``train_ann``) and the
checkpoint cache every matrix script shares (``cached_ann``). Imported by ``robustness`` and the
studies that reuse its cache.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

FT_ARCHS = ("tv_resnet", "mobilenet", "resnet20", "small_cnn")
#: Peak learning rate of the ANN's training where 0.1 fails: torchvision's VGG-11-BN (random
#: initialisation, a 25,088-input classifier) reached 13.4% at 0.1 (seed 0; NaN on seed 1) and
#: 9.8% at 0.05, 84.7% at 0.01 (3 epochs of 5,000 images at 32x32, first 2,000 test images).
ANN_LR = {"tvm_vgg11_bn": 0.01}
#: torchvision's own builds (``--torchvision``), on Fashion-MNIST at 3x32x32 ("fmnist32").
TV_ARCHS = {"tvm_resnet18": "resnet18", "tvm_vgg11_bn": "vgg11_bn", "tvm_mobilenet_v2": "mobilenet_v2"}


# --- architectures, written the way people write them ---------------------------------------

def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, 1, bias=False)


class TVBasicBlock(nn.Module):
    """torchvision's BasicBlock: one ReLU module used twice, ``downsample``, ``out += identity``."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class TVResNet(nn.Module):
    """A torchvision-style ResNet for small grey images: 3 stages of 2 blocks, width 16."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16):
        super().__init__()
        self.inplanes = width
        self.conv1 = _conv3x3(in_channels, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(width, 2)
        self.layer2 = self._make_layer(2 * width, 2, stride=2)
        self.layer3 = self._make_layer(4 * width, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(4 * width, num_classes)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [TVBasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [TVBasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def _dw_separable(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin), nn.ReLU(inplace=True),
        nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class MobileNetish(nn.Module):
    """Depthwise-separable blocks (MobileNet v1 style, ReLU) and a BatchNorm1d MLP head."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16):
        super().__init__()
        w = width
        self.stem = nn.Sequential(_conv3x3(in_channels, w), nn.BatchNorm2d(w), nn.ReLU(inplace=True))
        self.features = nn.Sequential(_dw_separable(w, 2 * w, 1), _dw_separable(2 * w, 4 * w, 2),
                                      _dw_separable(4 * w, 4 * w, 1), _dw_separable(4 * w, 8 * w, 2),
                                      _dw_separable(8 * w, 8 * w, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * w, 4 * w, bias=False), nn.BatchNorm1d(4 * w),
                                  nn.ReLU(inplace=True), nn.Dropout(0.2), nn.Linear(4 * w, num_classes))

    def forward(self, x):
        return self.head(self.pool(self.features(self.stem(x))))


class VGGMax(nn.Module):
    """A VGG with max-pooling and a dropout MLP classifier (for 28x28 or 8x8 inputs)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32, size: int = 28):
        super().__init__()
        cfg = [width, "M", 2 * width, "M", 4 * width, 4 * width, "M"]
        layers, cin = [], in_channels
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
                size //= 2
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(cin * size * size, 256), nn.ReLU(True), nn.Dropout(0.3),
                                        nn.Linear(256, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = x.view(x.size(0), -1)
        return self.classifier(x)


def build(arch: str, dataset: str, smoke: bool = False) -> nn.Module:
    """The network ``arch`` for ``dataset`` ("fmnist": 1x28x28, "digits": 1x8x8, "fmnist32":
    3x32x32 for torchvision's builds, :data:`TV_ARCHS`, full widths)."""
    from snnconv import models

    if arch in TV_ARCHS:
        import torchvision.models as tvm

        return getattr(tvm, TV_ARCHS[arch])(num_classes=10)
    size = 28 if dataset == "fmnist" else 8
    if arch == "tv_resnet":
        return TVResNet(width=4 if smoke else 16)
    if arch == "mobilenet":
        return MobileNetish(width=4 if smoke else 16)
    if arch == "vgg_max":
        return VGGMax(width=8 if smoke else 32, size=size)
    if arch == "resnet20":
        return models.resnet20(num_classes=10, in_channels=1)
    if arch == "small_cnn":
        return models.small_cnn(num_classes=10, in_channels=1, width=8 if smoke else 32)
    raise ValueError(f"unknown architecture {arch!r}")


# --- data and ANN training ------------------------------------------------------------------

def datasets(dataset: str, subset: int | None, seed: int, fashion_root: str | None = None):
    """(train, test) TensorDatasets; the training set subsampled (seeded) to ``subset`` images."""
    from snnconv.data import digits, fashion_mnist

    if dataset == "digits":
        train, test = digits(seed=0)
    else:
        train, test = fashion_mnist(fashion_root, train=True), fashion_mnist(fashion_root, train=False)
    if subset and subset < len(train):
        idx = torch.randperm(len(train), generator=torch.Generator().manual_seed(1000 + seed))[:subset]
        train = TensorDataset(*(t[idx] for t in train.tensors))
    if dataset == "fmnist32":
        train, test = _rgb32(train), _rgb32(test)
    return train, test


def _rgb32(data: TensorDataset) -> TensorDataset:
    """Fashion-MNIST as torchvision's classifiers take it: resized to 32x32 (bilinear), the
    grey channel replicated to three."""
    x, y = data.tensors
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return TensorDataset(x.expand(-1, 3, -1, -1).contiguous(), y)


class Diverged(RuntimeError):
    """The ANN's training loss became NaN or infinite."""


def train_ann(model: nn.Module, train: TensorDataset, epochs: int, seed: int, device: torch.device,
              batch: int = 128, lr: float = 0.1) -> nn.Module:
    """SGD Nesterov 0.9, weight decay 5e-4, OneCycle peak ``lr``, batch 128; data on the device.
    Raises :class:`Diverged` at a non-finite loss."""
    torch.manual_seed(seed)
    x, y = (t.to(device) for t in train.tensors)
    model.to(device)
    steps = epochs * (len(x) // batch)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(1, steps))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen).to(device)
        for i in range(len(x) // batch):
            j = perm[i * batch:(i + 1) * batch]
            loss = F.cross_entropy(model(x[j]), y[j])
            if not torch.isfinite(loss):
                raise Diverged(f"loss {float(loss)} at step {sched.last_epoch} of {steps} (peak lr {lr})")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return model.eval().cpu()


def cached_ann(job: dict, train: TensorDataset, device: torch.device) -> tuple[nn.Module, bool]:
    path = os.path.join(job["cache"], f"{job['dataset']}-{job['arch']}-e{job['epochs']}-s{job['seed']}"
                        f"-n{job['subset'] or 'all'}{'-smoke' if job['smoke'] else ''}.pt")
    torch.manual_seed(job["seed"])  # the initialisation depends on the seed alone
    model = build(job["arch"], job["dataset"], job["smoke"])
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval(), True
    start = {k: v.clone() for k, v in model.state_dict().items()}
    peak = ANN_LR.get(job["arch"], 0.1)
    for lr in (peak, peak / 2, peak / 4):  # a run that diverges is trained again at half the peak rate
        try:
            model = train_ann(model, train, job["epochs"], job["seed"], device, lr=lr)
            break
        except Diverged as exc:
            print(f"{job['arch']} seed {job['seed']} diverged ({exc}); training again", flush=True)
            model.load_state_dict(start)
    else:
        raise Diverged(f"{job['arch']} seed {job['seed']} diverged at every peak rate")
    job["ann_lr"] = lr
    os.makedirs(job["cache"], exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return model, False


# --- one job: train (or load) one ANN, run its cells ----------------------------------------
