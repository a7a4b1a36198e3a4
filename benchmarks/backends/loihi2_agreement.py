"""Decision agreement of loihi2-sim with cpu on trained ResNet-18s (the target: >= 95% at T=8).

    python -m benchmarks backends loihi2_agreement [--models tv-resnet18 zoo-resnet18]
        [--train 5000] [--epochs 3] [--images 256] [--T 8] [--finetune 0 default] [--cache DIR]

Each model is trained briefly on Fashion-MNIST (the first ``--train`` training images, SGD
Nesterov, OneCycle, cached under ``--cache``): torchvision's ``resnet18`` (``num_classes=10``,
the images resized to 32x32 and the grey channel replicated to three, as ``benchmarks.matrix.anns``
feeds torchvision's classifiers; its max-pooled stem is the analog prefix) and the zoo's CIFAR
ResNet-18 (``snnconv.models.get("resnet18")``, the same 3x32x32 input). Each is converted with
the default conversion at ``T`` (``--finetune 0``: ``finetune_epochs=0``, training-free with the
default layer-wise reconstruction; ``default``: the default BPTT fine-tuning too), exported to
NIR, and run on ``--images`` test images by ``cpu`` and by ``loihi2-sim``. Recorded: decision
agreement (argmax of the output averaged over T), each backend's accuracy, per layer the
firing rate on the chip against cpu (ratio), per connection the weights flushed to zero,
their relative mantissa error and synapse groups, and the seconds. Writes
``benchmarks/results/loihi2_agreement.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv.backends import get
from snnconv.constructs.prefix import analog_prefix
from snnconv.data import fashion_mnist
from snnconv.io.atomic import atomic_write_text

from ..common import RESULTS


def rgb32(ds: TensorDataset) -> TensorDataset:
    """Fashion-MNIST as torchvision's classifiers take it: 32x32 (bilinear), grey replicated to 3."""
    x, y = ds.tensors[0], ds.tensors[1]
    x = F.interpolate(x.float(), size=(32, 32), mode="bilinear", align_corners=False)
    return TensorDataset(x.expand(-1, 3, -1, -1).contiguous(), y)


def data(n_train: int, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    tr, te = fashion_mnist(train=True), fashion_mnist(train=False)
    idx = torch.randperm(len(tr), generator=torch.Generator().manual_seed(1000 + seed))[:n_train]
    tr = TensorDataset(*(t[idx] for t in tr.tensors))
    return rgb32(tr), rgb32(te)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "tv-resnet18":
        import torchvision.models as tvm
        return tvm.resnet18(num_classes=10)
    if name == "zoo-resnet18":
        return snnconv.models.get("resnet18", num_classes=10, in_channels=3)
    raise SystemExit(f"unknown model {name!r}")


def trained(name: str, train: TensorDataset, epochs: int, cache: str, seed: int = 0) -> tuple[nn.Module, dict]:
    """``name`` trained on ``train`` (SGD Nesterov 0.9, weight decay 5e-4, OneCycle peak 0.05,
    batch 128); the state dict cached under ``cache``."""
    model = build(name)
    path = os.path.join(cache, f"{name}-fmnist32-n{len(train)}-e{epochs}-s{seed}.pt")
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval(), {"cached": path}
    torch.manual_seed(seed)
    loader = DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=epochs * len(loader))
    t0 = time.perf_counter()
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
    os.makedirs(cache, exist_ok=True)
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
    return model.eval(), {"trained_seconds": round(time.perf_counter() - t0, 1), "cached": path}


def convert(ann: nn.Module, train: TensorDataset, T: int, finetune: str, recon: int | None) -> tuple[nn.Module, dict]:
    """The default conversion at ``T`` (``finetune``: "0" -> ``finetune_epochs=0``, "default" -> the
    default fine-tuning); ``recon``: ``reconstruction_steps`` (None: the default)."""
    loader = DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(0))
    kw: dict = {} if finetune == "default" else {"finetune_epochs": int(finetune)}
    if recon is not None:
        kw["reconstruction_steps"] = recon
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        snn, _ = snnconv.convert(ann, loader, T=T, progress=False, **kw)
    return snn, {"convert_seconds": round(time.perf_counter() - t0, 1), "settings": kw}


def exported(snn: nn.Module, test: TensorDataset, images: int) -> dict:
    """export_nir, and the graph's input for the first ``images`` test images (the analog
    prefix applied): ``{"graph", "x", "y"}``."""
    x, y = test.tensors[0][:images], test.tensors[1][:images]
    stem = analog_prefix(snn)
    with torch.no_grad():
        xin = stem(x) if stem is not None else x
    return {"graph": snnconv.export_nir(snn), "x": xin, "y": y}


def measure(graph, xin: torch.Tensor, y: torch.Tensor, T: int, **options) -> dict:
    """cpu and loihi2-sim on ``xin``: agreement, accuracies, per-layer firing-rate ratios,
    per-connection weights flushed and mantissa error."""
    images = int(xin.shape[0])
    with torch.no_grad():
        t0 = time.perf_counter()
        ref = get("cpu").compile(graph).run(xin, T)
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = get("loihi2-sim").compile(graph, **options).run(xin, T)
        t2 = time.perf_counter()
    p_cpu, p_chip = ref.outputs.mean(0).argmax(1), res.outputs.mean(0).argmax(1)
    # the float network's own decision stability: cpu again on the input times (1 + eps * N(0, 1)),
    # eps = 1e-4 (below the first layer's 13-bit rounding): no finite precision agrees better
    stability = {}
    for eps in (1e-5, 1e-4):
        noise = torch.randn(xin.shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            o = get("cpu").compile(graph).run(xin * (1 + eps * noise), T).outputs.mean(0).argmax(1)
        stability[str(eps)] = float((o == p_cpu).float().mean())
    fid = res.extra["fidelity"]
    qrep = res.extra["quantisation"]["layers"]
    conns = {}
    for pname, pr in qrep.items():
        for cname, c in pr["connections"].items():
            if c["kind"] == "bias" or cname.endswith(".lo"):
                continue
            f = fid["connections"].get(cname, {})
            conns[cname] = {"population": pname, "exp": c["exp"],
                            "groups": 2 if f"{cname}.lo" in pr["connections"] else 1,
                            "flushed": f.get("fraction"),
                            "rel_error": pr["connections"].get(f"{cname}.lo", c)["rel_error"]}
    layers = {k: {kk: v.get(kk) for kk in ("rate", "float_rate", "ratio")} for k, v in fid["layers"].items()}
    ratios = [v["ratio"] for v in layers.values() if v.get("ratio") is not None and v.get("float_rate", 0) >= 0.01]
    return {"images": images, "T": T,
            "agreement": float((p_cpu == p_chip).float().mean()),
            "cpu_self_agreement_perturbed": stability,
            "cpu_accuracy": float((p_cpu == y).float().mean()),
            "loihi2_accuracy": float((p_chip == y).float().mean()),
            "lowest_rate_ratio": min(ratios) if ratios else None,
            "highest_rate_ratio": max(ratios) if ratios else None,
            "max_flushed": max((c["flushed"] or 0.0) for c in conns.values()),
            "max_rel_error": max(c["rel_error"] for c in conns.values()),
            "runtime": res.extra["quantisation"]["runtime"],
            "warnings": fid["warnings"], "quantisation_warned": bool(caught),
            "cores": res.extra["resources"]["cores"], "chips": res.extra["resources"]["chips"],
            "latency_steps": res.extra["latency"]["steps"],
            "cpu_seconds": round(t1 - t0, 1), "loihi2_seconds": round(t2 - t1, 1),
            "layers": layers, "connections": conns}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tv-resnet18", "zoo-resnet18"])
    ap.add_argument("--train", type=int, nargs="+", default=[5000, 2000],
                    help="training images per model (one value, or one per model)")
    ap.add_argument("--epochs", type=int, nargs="+", default=[3, 1], help="ANN epochs (as --train)")
    ap.add_argument("--finetune", nargs="+", default=["0"], help="'0' (training-free) and/or 'default'")
    ap.add_argument("--reconstruction-steps", nargs="+", default=["default"],
                    help="'default' or steps of layer-wise reconstruction (as --train; 0 for speed)")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=os.path.join(RESULTS, "cache"))
    ap.add_argument("--out", default=os.path.join(RESULTS, "loihi2_agreement.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    per = lambda v, i: v[i] if len(v) > 1 else v[0]  # noqa: E731
    rows = []
    for i, name in enumerate(args.models):
        r = per(args.reconstruction_steps, i)
        recon = None if r == "default" else int(r)
        train, test = data(per(args.train, i))
        ann, info = trained(name, train, per(args.epochs, i), args.cache)
        with torch.no_grad():
            x, y = test.tensors[0][:args.images], test.tensors[1][:args.images]
            ann_acc = float((ann(x).argmax(1) == y).float().mean())
        for ft in args.finetune:
            t0 = time.perf_counter()
            key = (f"{name}-fmnist32-n{len(train)}-e{per(args.epochs, i)}-snn-T{args.T}-ft{ft}"
                   f"-r{recon}-i{args.images}.pkl")
            path = os.path.join(args.cache, key)
            if os.path.exists(path):  # the converted network, exported (trusted: written here)
                with open(path, "rb") as f:
                    ex, cinfo = pickle.load(f)
            else:
                snn, cinfo = convert(ann, train, args.T, ft, recon)
                ex = exported(snn, test, args.images)
                with open(path + ".tmp", "wb") as f:
                    pickle.dump((ex, cinfo), f)
                os.replace(path + ".tmp", path)
            row = {"model": name, "train_images": len(train), "epochs": per(args.epochs, i),
                   "ann_accuracy": ann_acc, "finetune": ft, **cinfo,
                   **measure(ex["graph"], ex["x"], ex["y"], args.T)}
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(f"{name} finetune={ft}: agreement {100 * row['agreement']:.1f}% "
                  f"(cpu {100 * row['cpu_accuracy']:.1f}%, "
                  f"loihi2-sim {100 * row['loihi2_accuracy']:.1f}%, ANN {100 * ann_acc:.1f}%), cpu self-agreement "
                  f"at 1e-4 input noise {100 * row['cpu_self_agreement_perturbed']['0.0001']:.1f}%, rate ratios "
                  f"{row['lowest_rate_ratio']:.3f}-{row['highest_rate_ratio']:.3f}, max flushed "
                  f"{100 * row['max_flushed']:.1f}%", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    atomic_write_text(args.out, json.dumps({"command": "python -m benchmarks backends loihi2_agreement " + " ".join(
        sys.argv[1:] if argv is None else argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
