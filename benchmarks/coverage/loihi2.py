"""Which torchvision classifiers reach Loihi 2: every ReLU-family model trained briefly, converted,
run on loihi2-sim against the cpu backend.

For every model of :data:`snnconv.models.tv.RELU_FAMILY` at each input size asked for (its
coverage size, and 64 px): trained briefly on Fashion-MNIST (resized, grey replicated to three
channels; ``--train-images`` images, ``--epochs`` epochs, SGD Nesterov with OneCycle; the ANN is
cached under ``--cache``; its BatchNorm statistics recomputed over the training images), converted with
``convert(model, loader, T=8, finetune_epochs=0)``
(training-free: BN folding, calibration and the layer-wise reconstruction of convert's default,
whose steps ``--reconstruction-steps`` sets),
exported to NIR, then run on ``--images`` test images by the cpu backend (the exact reference)
and by loihi2-sim. A row: whether loihi2-sim runs it or refuses (the reason), the decision
agreement with cpu (argmax of the readout averaged over T; also with every connection on one
synapse group, 8-bit weights, and the cores that takes), cpu's agreement with itself on the
input times (1 + 1e-4 noise) and with every weight times (1 + 1e-3 noise) (the float network's
own decision stability, which bounds what any finite-precision executor can reach) and the agreement on the
images whose decision that noise
leaves unchanged, both accuracies, the lowest
per-layer firing-rate ratio chip / float, the largest fraction of a connection's weights that
rounds to zero, whether the fidelity check warned, neuro cores and Loihi 2 chips (128 cores a
chip), and the latency in steps (T plus the pipeline depth). ``--finetune`` adds rows with
convert's default fine-tuning for the models named. Rows are written as they finish
(``results/loihi2_coverage.json``, ``.md``); a rerun skips the rows it already has.

    python -m benchmarks coverage loihi2 [--models resnet18,vgg11]
        [--sizes coverage 64] [--finetune resnet18,zoo_resnet18] [--images 256]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv import models
from snnconv.backends import get
from snnconv.constructs.prefix import analog_prefix
from snnconv.data import fashion_mnist
from snnconv.errors import SnnconvError
from snnconv.io.atomic import atomic_write_text
from snnconv.models.tv import RELU_FAMILY, TVModel, build
from snnconv_backends.loihi2.quantisation import SECOND_GROUP_ERROR

from ..common import RESULTS

T = 8
ZOO = "zoo_resnet18"  # the tutorials' CIFAR ResNet-18 (snnconv.models), a row of its own


def log(*msg) -> None:
    print(time.strftime("%H:%M:%S"), *msg, file=sys.stderr, flush=True)


def fmnist(size: int, train_images: int, test_images: int) -> tuple[TensorDataset, TensorDataset]:
    """Fashion-MNIST at ``size`` x ``size``, three channels, the first images of each split."""
    out = []
    for split, n in ((True, train_images), (False, test_images)):
        x, y = fashion_mnist(train=split).tensors
        x = F.interpolate(x[:n], size=(size, size), mode="bilinear", align_corners=False)
        out.append(TensorDataset(x.expand(-1, 3, -1, -1).contiguous(), y[:n]))
    return out[0], out[1]


def model_of(name: str, size: int) -> nn.Module:
    if name == ZOO:
        torch.manual_seed(0)
        return models.get("resnet18", num_classes=10, in_channels=3)
    spec = next(s for s in RELU_FAMILY if s.name == name)
    return build(TVModel(spec.name, size, spec.large, spec.kwargs))


def trained(name: str, size: int, train: TensorDataset, epochs: int, cache: str) -> nn.Module:
    """The model trained on ``train`` (SGD Nesterov 0.9, wd 5e-4, OneCycle, batch 64, gradient
    norm clipped at 5; peak lr 0.05, retried at 0.01 and 0.002 where the loss diverges), from
    ``cache`` when it holds it."""
    path = os.path.join(cache, f"{name}_{size}px_{len(train)}x{epochs}.pt")
    if os.path.exists(path):
        model = model_of(name, size)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return recalibrated(model, train)
    for lr in (0.05, 0.01, 0.002):
        model = model_of(name, size)
        if _train(model, name, train, epochs, lr):
            break
        log(f"  {name}: the loss diverged at peak lr {lr}; again with a lower one")
    os.makedirs(cache, exist_ok=True)
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
    return recalibrated(model, train)


def recalibrated(model: nn.Module, train: TensorDataset) -> nn.Module:
    """The model in eval mode with its BatchNorm statistics recomputed over ``train`` (the
    cumulative average of one pass). A brief training leaves running statistics that lag the
    weights, most where the momentum is small (MNASNet's 0.0003): the eval-mode network is then
    near chance while the training-mode one is not."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return model.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for x, _ in DataLoader(train, batch_size=64):
            model(x)
    return model.eval()


def _train(model: nn.Module, name: str, train: TensorDataset, epochs: int, lr: float) -> bool:
    """Train in place; False where the loss became NaN or infinite."""
    torch.manual_seed(0)
    loader = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(loader))
    model.train()
    last = time.perf_counter()
    for epoch in range(epochs):
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            if not torch.isfinite(loss):
                return False
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if time.perf_counter() - last > 30:
                log(f"  {name}: epoch {epoch + 1} batch {i + 1}/{len(loader)} loss {float(loss.detach()):.3f}")
                last = time.perf_counter()
    return True


def run_backend(name: str, graph, x: torch.Tensor, batch: int, **options) -> tuple[torch.Tensor, list]:
    """Predictions ``[B, classes]`` (the readout averaged over T) and each batch's result."""
    program = get(name).compile(graph, **options)
    preds, results = [], []
    for part in x.split(batch):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the rows record the fidelity check's findings
            res = program.run(part, T)
        preds.append(res.prediction)
        results.append(res)
    return torch.cat(preds), results


def label_of(finetune: bool, args) -> str:
    """The conversion a row ran: convert()'s default, training-free, or either with the
    reconstruction's steps set."""
    label = "default fine-tuning" if finetune else "training-free (finetune_epochs=0)"
    if args.reconstruction_steps is not None:
        label += f", reconstruction_steps={args.reconstruction_steps}"
    return label


def converted(model: nn.Module, name: str, size: int, finetune: bool, train: TensorDataset,
              args) -> tuple[snnconv.SpikingNetwork, dict]:
    """``model`` converted as the row asks, and the conversion's own figures; cached under
    ``--cache`` (network and figures), so that a change of the mapping is measured again
    without converting again. The key is the row, not convert()'s code: after a change of
    convert(), remove the cached ``snn_*`` files (the ANNs stay valid)."""
    key = f"{name}_{size}px_{len(train)}x{args.epochs}_{label_of(finetune, args)}"
    key = "snn_" + "".join(c if c.isalnum() else "_" for c in key)
    path = os.path.join(args.cache, key + ".pt")
    if os.path.exists(path) and os.path.exists(path + ".json"):
        return snnconv.SpikingNetwork.load(path), json.load(open(path + ".json"))
    t0 = time.perf_counter()
    calib = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        snn, meta = snnconv.convert(model, calib, T=T, progress=True,
                                    reconstruction_steps=args.reconstruction_steps,
                                    **({} if finetune else {"finetune_epochs": 0}))
    done = {"convert_seconds": round(time.perf_counter() - t0, 1),
            "reconstruction_steps_run": (meta.settings.get("budget") or {}).get("reconstruction_steps_run", 0)}
    os.makedirs(args.cache, exist_ok=True)
    snn.save(path)
    atomic_write_text(path + ".json", json.dumps(done))
    return snn, done


def row_for(name: str, size: int, finetune: bool, args) -> dict:
    train, test = fmnist(size, args.train_images, args.images)
    row: dict = {"model": name, "input": [3, size, size], "conversion": label_of(finetune, args),
                 "T": T, "images": len(test)}
    t0 = time.perf_counter()
    try:
        model = trained(name, size, train, args.epochs, args.cache)
        x, y = test.tensors
        with torch.no_grad():
            row["ann_accuracy"] = round(100 * float((model(x).argmax(1) == y).float().mean()), 2)
        snn, done = converted(model, name, size, finetune, train, args)
        row.update(done)
        graph = snnconv.export_nir(snn)
        stem = analog_prefix(snn)
        with torch.no_grad():
            xin = stem(x) if stem is not None else x
        cpu, _ = run_backend("cpu", graph, xin, args.batch)
        row["cpu_accuracy"] = round(100 * float((cpu.argmax(1) == y).float().mean()), 2)
        # the float network's own stability: cpu on the input times (1 + 1e-4 N(0, 1)), below the
        # first layer's 13-bit rounding: no finite-precision executor can agree better than this
        noise = torch.randn(xin.shape, generator=torch.Generator().manual_seed(0))
        nudged, _ = run_backend("cpu", graph, xin * (1 + 1e-4 * noise), args.batch)
        row["cpu_self_agreement_1e-4"] = round(100 * float((nudged.argmax(1) == cpu.argmax(1)).float().mean()), 2)
        # the same network with every weight times (1 + 1e-3 N(0, 1)), a tenth of the chip's
        # typical rounding (8-bit mantissas: ~1% RMS per connection): where this already moves
        # the decisions as far as the chip does, the chip's disagreement is the network's
        # sensitivity, not a broken mapping
        shaken = copy.deepcopy(snn)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in shaken.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)):
                    m.weight.mul_(1 + 1e-3 * torch.randn(m.weight.shape, generator=gen))
            stem2 = analog_prefix(shaken)
            xin2 = stem2(x) if stem2 is not None else x
        noisy, _ = run_backend("cpu", snnconv.export_nir(shaken), xin2, args.batch)
        same = (noisy.argmax(1) == cpu.argmax(1)).float().mean()
        row["cpu_weight_noise_agreement_1e-3"] = round(100 * float(same), 2)
    except SnnconvError as exc:
        row["refused_by"] = "convert/export"
        row["refusal"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return row
    t1 = time.perf_counter()
    try:
        chip, results = run_backend("loihi2-sim", graph, xin, args.batch)
    except SnnconvError as exc:
        row["loihi2_runs"] = False
        row["refusal"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return row
    row["loihi2_runs"] = True
    row["second_group_above"] = SECOND_GROUP_ERROR
    row["loihi2_seconds"] = round(time.perf_counter() - t1, 1)
    row["loihi2_accuracy"] = round(100 * float((chip.argmax(1) == y).float().mean()), 2)
    row["agreement"] = round(100 * float((chip.argmax(1) == cpu.argmax(1)).float().mean()), 2)
    # on the images whose float decision survives the 1e-4 perturbation (not near-ties)
    stable = nudged.argmax(1) == cpu.argmax(1)
    row["agreement_on_stable"] = round(100 * float((chip.argmax(1) == cpu.argmax(1))[stable].float().mean()), 2)
    row["decisions"] = {"cpu": cpu.argmax(1).tolist(), "nudged": nudged.argmax(1).tolist(),
                        "loihi2": chip.argmax(1).tolist(), "labels": y.tolist()}
    fids = [r.extra.get("fidelity") for r in results if r.extra.get("fidelity")]
    ratios = [f["lowest_rate_ratio"] for f in fids if f.get("lowest_rate_ratio") is not None]
    row["lowest_rate_ratio"] = round(min(ratios), 3) if ratios else None
    if fids:
        conns = fids[0]["connections"]
        worst = max(conns.items(), key=lambda kv: kv[1]["fraction"], default=(None, {"fraction": 0.0}))
        row["most_flushed"] = {"connection": worst[0], "fraction": round(worst[1]["fraction"], 4)}
        row["weights_flushed"] = sum(c["flushed"] for c in conns.values())
        row["warned"] = any(f["warnings"] for f in fids)
        row["warnings"] = sorted({w for f in fids for w in f["warnings"]})[:5]
    _judge_decisions(row)
    res = results[0].extra.get("resources", {})
    row["cores"], row["chips"] = res.get("cores"), res.get("chips")
    # every connection on one synapse group (8-bit weights, the fewest synapses): what the
    # second groups of the default weight_groups="auto" buy, and what they cost in cores
    coarse, coarse_results = run_backend("loihi2-sim", graph, xin, args.batch, weight_groups=1)
    row["agreement_one_group"] = round(100 * float((coarse.argmax(1) == cpu.argmax(1)).float().mean()), 2)
    row["decisions"]["loihi2_one_group"] = coarse.argmax(1).tolist()
    row["cores_one_group"] = coarse_results[0].extra.get("resources", {}).get("cores")
    depth = max((layer.get("depth", 0) for layer in res.get("layers", {}).values()), default=0)
    row["latency_steps"] = T + depth
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _judge_decisions(row: dict) -> None:
    """What ``snnconv run`` judges over all images: decisions below the fidelity check's
    tolerance warn (the per-run check sees one batch at a time)."""
    from snnconv_backends.loihi2.fidelity import DECISION_TOLERANCE, MIN_IMAGES

    if row.get("agreement") is not None and row["images"] >= MIN_IMAGES \
            and row["agreement"] < 100 * DECISION_TOLERANCE:
        row["warned"] = True
        note = f"decisions agree on {row['agreement']}% of {row['images']} images"
        row["warnings"] = sorted(set(row.get("warnings", [])) | {note})


def _pair(a, b) -> str:
    return "" if a is None else (f"{a}, {b}" if b is not None else f"{a}")


def _group_rule(row: dict) -> str:
    """The weight_groups="auto" threshold a row ran with (relative RMS rounding error)."""
    t = row.get("second_group_above")
    return "" if t is None else f"{100 * t:g}%"


def markdown(rows: list[dict]) -> str:
    head = ("| model | input | conversion | ANN | cpu | loihi2-sim | agreement | on stable images | "
            "second group above | one synapse group everywhere: agreement, cores | "
            "cpu vs itself: input x (1 + 1e-4 N), weights x (1 + 1e-3 N) | lowest rate ratio | most flushed | "
            "warned | cores | chips | latency (steps) | refusal |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mf = r.get("most_flushed") or {}
        flush = f"{100 * mf['fraction']:.1f}%" if mf else ""
        lines.append(
            f"| {r['model']} | {'x'.join(map(str, r['input']))} | {r['conversion']} | {r.get('ann_accuracy', '')} | "
            f"{r.get('cpu_accuracy', '')} | {r.get('loihi2_accuracy', '')} | {r.get('agreement', '')} | "
            f"{r.get('agreement_on_stable', '')} | "
            f"{_group_rule(r)} | {_pair(r.get('agreement_one_group'), r.get('cores_one_group'))} | "
            f"{_pair(r.get('cpu_self_agreement_1e-4'), r.get('cpu_weight_noise_agreement_1e-3'))} | "
            f"{r.get('lowest_rate_ratio', '')} | {flush} | "
            f"{'yes' if r.get('warned') else ('no' if 'warned' in r else '')} | {r.get('cores', '')} | "
            f"{r.get('chips', '')} | {r.get('latency_steps', '')} | {r.get('refusal', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help=f"comma-separated names (default: all, and {ZOO})")
    ap.add_argument("--sizes", nargs="+", default=["coverage"], help="'coverage' (each model's) and/or pixels")
    ap.add_argument("--finetune", default="resnet18," + ZOO,
                    help="models also converted with the default fine-tuning ('' for none)")
    ap.add_argument("--finetuned-only", action="store_true", help="only the rows with the default fine-tuning")
    ap.add_argument("--images", type=int, default=256, help="test images (default 256)")
    ap.add_argument("--train-images", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="images per backend run")
    ap.add_argument("--reconstruction-steps", type=int, default=None,
                    help="convert()'s layer-wise reconstruction steps (default: convert's, 300 here)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: every core)")
    ap.add_argument("--train-only", action="store_true", help="only train (and cache) the ANNs")
    ap.add_argument("--render", action="store_true", help="only write the table again from the JSON")
    ap.add_argument("--redo", action="store_true",
                    help="measure the rows asked for again (from the cached networks), replacing them")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/snnconv/loihi2_coverage"))
    ap.add_argument("--out", default=os.path.join(RESULTS, "loihi2_coverage.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    names = [s.name for s in RELU_FAMILY] + [ZOO]
    if args.models:
        names = [n for n in args.models.split(",") if n]
    tuned = {n for n in args.finetune.split(",") if n}
    rows = json.load(open(args.out))["rows"] if os.path.exists(args.out) else []
    for row in rows:
        _judge_decisions(row)
    if args.render:
        atomic_write_text(os.path.splitext(args.out)[0] + ".md", markdown(rows))
        return 0
    done = {(r["model"], r["input"][1], r["conversion"]) for r in rows}
    plan = []
    large = {s.name for s in RELU_FAMILY if s.large}
    names = sorted(names, key=lambda n: n in large)  # the large models last (the longest to train)
    for name in names:
        spec = next((s for s in RELU_FAMILY if s.name == name), None)
        for size in args.sizes:
            px = (spec.size if spec else 32) if size == "coverage" else int(size)
            for ft in ([True] if args.finetuned_only else [False, True] if name in tuned else [False]):
                plan.append((name, px, ft))
    for i, (name, px, ft) in enumerate(plan):
        label = label_of(ft, args)
        if (name, px, label) in done and not args.redo:
            continue
        if args.train_only:
            if not ft:
                log(f"[{i + 1}/{len(plan)}] training {name} at {px} px ...")
                trained(name, px, fmnist(px, args.train_images, 0)[0], args.epochs, args.cache)
            continue
        log(f"[{i + 1}/{len(plan)}] {name} at {px} px, {label} ...")
        row = row_for(name, px, ft, args)
        log(f"  -> agreement {row.get('agreement')}, {row.get('refusal', '')[:120]} ({row.get('seconds')} s)")
        rows = [r for r in rows if (r["model"], r["input"][1], r["conversion"]) != (name, px, label)]
        rows.append(row)
        atomic_write_text(args.out, json.dumps({"T": T, "train_images": args.train_images,
                                                "epochs": args.epochs, "rows": rows}, indent=1) + "\n")
        atomic_write_text(os.path.splitext(args.out)[0] + ".md", markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
