"""Where the SNN at T = L parts from its QCFS-ANN: the rate error of each IF layer.

    .venv/bin/python -m benchmarks.studies.layer_error --cache CACHE [--archs resnet20 mobilenet ...]

CACHE is the ANN cache of a robustness sweep (``<out>_cache`` of benchmarks/matrix/robustness.py,
Fashion-MNIST, ``--train-subset`` images, seed ``--seed``; loaded, never trained here). Each
network goes through the few-step matrix's QCFS path, ``convert(model, loader, T=4, L=4,
qcfs_epochs=3, finetune_epochs=0)``, once with convert()'s calibration and once without any
(``bias_calibration=False, threshold_calibration=False``: the SNN then has the QCFS-ANN's
weights and thresholds exactly, and ``SpikingNetwork.rate(x, 4)`` is that QCFS-ANN). On the
first ``--images`` test images, for every IF layer: the relative error
``||r_snn - r_qcfs|| / ||r_qcfs||`` of its spike rate over T steps against the rate of the
same layer in ``snn.rate(x, L)``, and the relative mean ``mean(r_snn - r_qcfs) / mean(r_qcfs)``
(a bias that calibration can remove; the rest is the spread of spike timing). Writes
results/layer_error.json and results/layer_error.png.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

import snnconv
from snnconv.calibration.bias import bias_path
from snnconv.graph import module_of
from snnconv.io.atomic import atomic_write_text
from snnconv.snn.neuron import neurons

from ..common import STUDIES_RESULTS
from ..matrix import anns as R

VARIANTS = {"calibrated": {}, "uncalibrated": dict(bias_calibration=False, threshold_calibration=False)}


def _kind(snn, name: str) -> str:
    """The layer that feeds IF layer ``name``: conv<k>, depthwise<k>, linear, or input."""
    node = next(n for n in snn.net.graph.nodes if n.op == "call_module" and n.target == name)
    hit = bias_path(snn.net, node)
    m = None if hit is None else module_of(snn.net, hit[0])
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, nn.Conv2d):
        return f"{'depthwise' if m.groups > 1 and m.groups == m.in_channels else 'conv'}{m.kernel_size[0]}"
    return "input"


def _rates(snn, run, T: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each IF layer's spike rate over T steps (``[B, ...]``) in one call of ``run``."""
    out: dict[str, list] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: out.setdefault(n, []).append(
        o.detach().reshape(T, -1, *o.shape[1:]).mean(0))) for n, m in neurons(snn.net).items()]
    try:
        with torch.no_grad():
            logits = run()
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in out.items()}, logits


def layer_errors(snn, x: torch.Tensor, y: torch.Tensor, T: int, L: int) -> dict:
    ref, ref_logits = _rates(snn, lambda: snn.rate(x, L), 1)
    got, logits = _rates(snn, lambda: snn.run(x, T).mean(0), T)
    layers = []
    for n, r in ref.items():
        d = got[n] - r
        layers.append({"layer": n, "kind": _kind(snn, n), "rate": r.mean().item(),
                       "rel_error": (d.norm() / r.norm().clamp_min(1e-12)).item(),
                       "rel_mean": (d.mean() / r.mean().clamp_min(1e-12)).item()})
    acc = lambda z: 100.0 * (z.argmax(1) == y).float().mean().item()  # noqa: E731
    return {"snn": acc(logits), "rate_ann": acc(ref_logits), "layers": layers}


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    for i, (key, r) in enumerate(sorted(res.items())):
        for variant, style in (("uncalibrated", "-"), ("calibrated", "--")):
            if variant in r:
                errs = [layer["rel_error"] for layer in r[variant]["layers"]]
                ax.plot(range(1, len(errs) + 1), errs, style, color=f"C{i}", marker=".",
                        label=f"{key}, {variant}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("IF layer (input side first)")
    ax.set_ylabel("relative rate error at T = L = 4")
    ax.set_title("SNN against its QCFS-ANN, layer by layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True)
    ap.add_argument("--archs", nargs="*", default=["resnet20", "mobilenet", "tv_resnet", "small_cnn"])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--train-subset", type=int, default=5000)
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the cached ANN's seed (and the loader's)")
    ap.add_argument("--out", default=os.path.join(STUDIES_RESULTS, "layer_error.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    train, test = R.datasets("fmnist", args.train_subset, args.seed)
    x, y = test.tensors[0][:args.images], test.tensors[1][:args.images]
    res = json.load(open(args.out)) if os.path.exists(args.out) else {}
    for arch in args.archs:
        key = f"{arch}-s{args.seed}"
        job = dict(dataset="fmnist", arch=arch, epochs=args.epochs, seed=args.seed, subset=args.train_subset,
                   smoke=False, cache=args.cache)
        ann, cached = R.cached_ann(job, train, torch.device("cpu"))
        if not cached:
            raise SystemExit(f"{arch}: no cached ANN under {args.cache}; run benchmarks/matrix/robustness.py first")
        for variant, options in VARIANTS.items():
            if variant in res.get(key, {}):
                continue
            loader = DataLoader(train, batch_size=128, shuffle=True,
                                generator=torch.Generator().manual_seed(args.seed))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                snn, meta = snnconv.convert(ann, loader, T=4, L=4, qcfs_epochs=3, finetune_epochs=0,
                                            seed=args.seed, progress=False, on_collapse="warn", **options)
            out = layer_errors(snn, x, y, T=4, L=4)
            res.setdefault(key, {})[variant] = out
            worst = max(out["layers"], key=lambda layer: layer["rel_error"])
            print(f"{key} {variant}: SNN T=4 {out['snn']:.1f}%, QCFS-ANN of its weights {out['rate_ann']:.1f}%; "
                  f"last layer error {out['layers'][-1]['rel_error']:.3f} (worst {worst['layer']} "
                  f"{worst['rel_error']:.3f})", flush=True)
            atomic_write_text(args.out, json.dumps(res, indent=1) + "\n")
    plot(res, os.path.splitext(args.out)[0] + ".png")
    for key, r in res.items():
        for variant, out in r.items():
            print(f"\n{key}, {variant}: SNN {out['snn']:.1f}, QCFS-ANN {out['rate_ann']:.1f}")
            print("| layer | fed by | rate | relative error | relative mean |\n|---|---|---|---|---|")
            for layer in out["layers"]:
                print(f"| {layer['layer']} | {layer['kind']} | {layer['rate']:.3f} | {layer['rel_error']:.3f} "
                      f"| {layer['rel_mean']:+.3f} |")


if __name__ == "__main__":
    main()
