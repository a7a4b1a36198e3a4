"""Accuracy of loihi2-sim (8-bit weights, 24-bit membranes) against the float SNN, both reset modes.

    python -m benchmarks backends loihi2_accuracy --dataset fmnist --T 8 [--device cuda] [--limit N]
    python -m benchmarks backends loihi2_accuracy --dataset digits --T 8

Fashion-MNIST: the accuracy benchmark's BN ResNet-14 (``common.trained_ann``: loaded from
results/cache or trained, 3 epochs), converted with ``snnconv.convert`` (per-channel thresholds)
for reset "subtract" and "zero"; each SNN is run on the test set by the torch SpikingNetwork
(the float reference ``cpu`` reproduces bit for bit) and by loihi2-sim. ``--limit`` evaluates
the first N test images only. Digits: the demo SmallCNN trained for 15 epochs on scikit-learn
digits (seconds on a CPU); digits-resnet8: ResNet-8 (residual) on digits upsampled to 16x16,
15 epochs, cached under results/cache. ``--two-groups [DEPTH ...]`` also runs loihi2-sim
with ``weight_groups=2`` (~15-bit weights from two 8-bit synapse groups) on every connection,
or on those into the first DEPTH layers, and reports the synapse cost. Also measures, per connection, what its
8-bit budget costs: the
accuracy with that one connection at 8 bits and every other at 16 (``--per-layer``).
Writes results/loihi2_accuracy_<dataset>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
from torch.utils.data import DataLoader, Subset

import snnconv
from snnconv.snn.nir_io import export_nir
from snnconv_backends.loihi2 import Loihi2Program, quantize
from snnconv_backends.loihi2.backend import OPTIONS

from ..common import CACHE, RESULTS, loaders, trained_ann


def data(name: str, limit: int | None):
    if name == "digits-resnet8":  # residual: snnconv.models.resnet8 on digits upsampled to 16x16
        import torch.nn.functional as F
        from torch.utils.data import TensorDataset

        from snnconv.data import digits
        from snnconv.demo import train_ann
        from snnconv.models import resnet8

        def up(ds):
            x, y = ds.tensors
            return TensorDataset(F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False), y)

        tr, te = (up(d) for d in digits(seed=0))
        path = os.path.join(CACHE, "digits16-resnet8-e15-s0.pt")
        torch.manual_seed(0)
        ann = resnet8(num_classes=10, in_channels=1)
        if os.path.exists(path):
            ann.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        else:
            train = DataLoader(tr, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
            ann = train_ann(ann, train, epochs=15, progress=False)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(ann.state_dict(), path + ".tmp")
            os.replace(path + ".tmp", path)
        return ann.eval(), DataLoader(tr, batch_size=256), te
    if name == "digits":
        from snnconv.data import digits
        from snnconv.demo import train_ann
        from snnconv.models import small_cnn

        torch.manual_seed(0)
        tr, te = digits(seed=0)
        train = DataLoader(tr, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
        ann = train_ann(small_cnn(num_classes=10, in_channels=1), train, epochs=15, progress=False)
        return ann, DataLoader(tr, batch_size=256), te

    ann, _ = trained_ann("resnet14", epochs=3)
    train, test = loaders(128)
    te = test.dataset
    if limit:
        te = Subset(te, range(limit))
    return ann, train, te


def layer_table(graph) -> str:
    """Per connection: exponent, sign mode and relative weight error of the 8-bit mantissas, and
    with the residual group of ``weight_groups=2`` (markdown)."""
    q1, q2 = quantize(graph), quantize(graph, weight_groups=2)
    lo = {c.name[:-3]: c for p in q2.populations for c in p.conns if c.name.endswith(".lo")}
    rows = ["| target (depth) | connection | exp | sign mode | rel. error, 8 bits | two groups (exp of the second) |",
            "|---|---|---|---|---|---|"]
    for p in q1.populations:
        for c in p.conns:
            r, second = c.report, lo.get(c.name)
            two = f"{100 * second.report['rel_error']:.4f}% ({second.exp})" if second else "-"
            rows.append(f"| {p.name} ({p.depth}) | {c.name} | {r['exp']} | {r['sign_mode']} | "
                        f"{100 * r['rel_error']:.2f}% | {two} |")
    return "\n".join(rows)


def evaluate(fn, dataset, batch: int):
    preds, ys = [], []
    for x, y in DataLoader(dataset, batch_size=batch):
        with torch.no_grad():
            preds.append(fn(x).mean(0).argmax(1).cpu())
        ys.append(y)
    p, y = torch.cat(preds), torch.cat(ys)
    return p, float((p == y).float().mean()) * 100


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="digits", choices=["digits", "digits-resnet8", "fmnist"])
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--per-layer", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", action="store_true", help="print each connection's quantisation")
    ap.add_argument("--layers-only", action="store_true", help="--layers, then skip the evaluation")
    ap.add_argument("--two-groups", type=int, nargs="*", default=None, metavar="DEPTH",
                    help="also run loihi2-sim with weight_groups=2 (a connection's rounding residual as "
                         "a second synapse group) on the connections into populations at depth <= "
                         "DEPTH, for each DEPTH given (none given: all connections)")
    ap.add_argument("--qcfs-epochs", type=int, default=0, help="QCFS training epochs in convert()")
    ap.add_argument("--resets", nargs="*", default=["subtract", "zero"], choices=["subtract", "zero"],
                    help="reset modes to run (the JSON keeps the other's earlier record)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ann, calib, test = data(args.dataset, args.limit)
    out = {"dataset": args.dataset, "T": args.T, "n_test": len(test), "device": args.device,
           "load_average": os.getloadavg()}
    path = os.path.join(RESULTS, f"loihi2_accuracy_{args.dataset}.json")
    if os.path.exists(path) and set(args.resets) != {"subtract", "zero"}:
        with open(path) as f:
            earlier = json.load(f)
        out.update({r: earlier[r] for r in ("subtract", "zero") if r in earlier and r not in args.resets})
    for reset in args.resets:
        torch.manual_seed(0)
        snn, meta = snnconv.convert(copy.deepcopy(ann), calib, T=args.T, reset=reset, per_channel=True,
                                    qcfs_epochs=args.qcfs_epochs, device=args.device, progress=False)
        graph = export_nir(snn.cpu())
        snn = snn.to(args.device)
        if args.layers or args.layers_only:
            print(layer_table(graph))
            if args.layers_only:
                continue
        t0 = time.perf_counter()
        ref_backend = "cpu" if args.device == "cpu" else "gpu"
        ref_prog = snnconv.backends.get(ref_backend).compile(graph)
        p_ref, acc_ref = evaluate(lambda x, prog=ref_prog: prog.run(x, args.T).outputs, test, args.batch)
        t_ref = time.perf_counter() - t0
        q = quantize(graph)
        prog = Loihi2Program(q, dict(OPTIONS, device=args.device))
        t0 = time.perf_counter()
        p_sim, acc_sim = evaluate(lambda x, prog=prog: prog.run(x, args.T).outputs, test, args.batch)
        t_sim = time.perf_counter() - t0
        rec = {"convert_settings": {k: meta.settings[k] for k in ("per_channel", "bias_calibration_T", "L")},
               "reference_backend": ref_backend, "float_snn": acc_ref, "loihi2_sim": acc_sim,
               "difference": acc_sim - acc_ref,
               "agreement": float((p_ref == p_sim).float().mean()) * 100,
               "seconds_float": t_ref, "seconds_sim": t_sim}
        if args.two_groups is not None:  # connections as two synapse groups (~15-bit weights)
            from snnconv_backends.loihi2 import resources

            rec["synapses"], rec["cores"] = resources(q)["synapses"], resources(q)["cores"]
            rec["two_groups"] = {}
            for dmax in args.two_groups or [q.depth]:
                groups = {c.name: 2 for p in q.populations for c in p.conns if p.depth <= dmax}
                q2 = quantize(graph, weight_groups=groups)
                prog2 = Loihi2Program(q2, dict(OPTIONS, device=args.device))
                t0 = time.perf_counter()
                p2, acc2 = evaluate(lambda x, prog=prog2: prog.run(x, args.T).outputs, test, args.batch)
                key = "all" if dmax >= q.depth else f"depth<={dmax}"
                rec["two_groups"][key] = {
                    "connections": len(groups), "loihi2_sim": acc2, "difference": acc2 - acc_ref,
                    "agreement": float((p_ref == p2).float().mean()) * 100,
                    "synapses": resources(q2)["synapses"], "cores": resources(q2)["cores"],
                    "seconds_sim": time.perf_counter() - t0}
        if args.per_layer:
            names = [c.name for p in q.populations for c in p.conns]
            rec["all_16_bits"] = evaluate(lambda x, graph=graph: Loihi2Program(quantize(graph, weight_bits=16), dict(
                OPTIONS, device=args.device)).run(x, args.T).outputs, test, args.batch)[1]
            rec["one_at_8_bits"] = {}
            for n in names:
                prog_n = Loihi2Program(quantize(graph, weight_bits={"*": 16, n: 8}),
                                       dict(OPTIONS, device=args.device))
                rec["one_at_8_bits"][n] = evaluate(lambda x, prog=prog_n: prog.run(x, args.T).outputs, test,
                                                   args.batch)[1]
        out[reset] = rec
        print(reset, json.dumps(rec, indent=1), flush=True)
    if args.layers_only:
        return
    from snnconv.io.atomic import atomic_write_bytes

    atomic_write_bytes(path, (json.dumps(out, indent=2) + "\n").encode())
    print("wrote", path)


if __name__ == "__main__":
    main()
