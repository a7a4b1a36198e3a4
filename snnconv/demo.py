"""The embedded demo: digits -> small BN CNN -> convert -> accuracy by T, meta.json, plot."""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from snnconv.analysis.plots import plot_accuracy_vs_T
from snnconv.data import digits
from snnconv.guards import find_batchnorm
from snnconv.models import small_cnn
from snnconv.pipeline import convert, seed_everything
from snnconv.progress import progress_bar
from snnconv.stages.fold import fold_batchnorm

__all__ = ["train_ann", "run_demo", "DEMO_T"]

DEMO_T = (1, 2, 4, 8, 16, 32)


def train_ann(model: nn.Module, loader: DataLoader, *, epochs: int, lr: float = 0.05,
              progress: bool = True, device: str | torch.device | None = None) -> nn.Module:
    """Plain SGD + cosine training of an ANN (used by the demo, tests and benchmarks), on
    ``device`` (the model moves there) or where the model is."""
    if device is not None:
        model.to(device)
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(loader))
    model.train()
    for _ in progress_bar(range(epochs), desc="train ANN", disable=not progress, leave=False):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
            sched.step()
    return model.eval()


def run_demo(out: str = "runs/demo", *, seed: int = 0, progress: bool = True,
             device: str | torch.device = "cpu") -> dict:
    """Train, convert and evaluate on digits, on ``device``; write ``meta.json`` and
    ``accuracy_vs_T.png``."""
    start = time.perf_counter()
    seed_everything(seed)
    train_set, test_set = digits(seed=seed)
    train = DataLoader(train_set, batch_size=64, shuffle=True,
                       generator=torch.Generator().manual_seed(seed))
    test = DataLoader(test_set, batch_size=256)
    print(f"scikit-learn digits: {len(train_set)} train / {len(test_set)} test images, 8x8, on {device}")

    ann = train_ann(small_cnn(num_classes=10, in_channels=1), train, epochs=30, progress=progress,
                    device=device)
    folded = fold_batchnorm(ann, next(iter(test))[0].to(device))
    diffs = [p["max_abs_diff"] for p in folded.meta["folded"]]
    print(f"BatchNorm folding: {len(diffs)} pairs folded, max abs difference per pair "
          f"{max(diffs):.2e}; BatchNorm left: {len(find_batchnorm(folded))}")

    # convert()'s defaults: T=8, one epoch of BPTT fine-tuning (the loader is labelled)
    snn, meta = convert(ann, train, eval_loader=test, eval_T=DEMO_T, seed=seed, device=device,
                        progress=progress)
    acc = meta.accuracy
    print(f"\n{'':24}accuracy (%)")
    print(f"{'ANN (BatchNorm)':24}{acc['ann']:6.2f}")
    print(f"{'ANN folded':24}{acc['folded']:6.2f}")
    print(f"{'QCFS-ANN (L=' + str(meta.settings['L']) + ')':24}{acc['qcfs']:6.2f}")
    for t in DEMO_T:
        print(f"{f'SNN T={t}':24}{acc['snn'][str(t)]:6.2f}")
    os.makedirs(out, exist_ok=True)
    meta.to_json(os.path.join(out, "meta.json"))
    plot_accuracy_vs_T({"snnconv SNN": {t: acc["snn"][str(t)] for t in DEMO_T}},
                       os.path.join(out, "accuracy_vs_T.png"),
                       references={"ANN": acc["ann"], "QCFS-ANN": acc["qcfs"]},
                       title="digits: small CNN converted to an SNN")
    print(f"\nwrote {out}/meta.json and {out}/accuracy_vs_T.png in {time.perf_counter() - start:.0f} s")
    return acc
