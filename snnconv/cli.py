"""The ``snnconv`` command line: one tool, shared flags, exit codes scripts can rely on.

    snnconv demo                                       digits -> small CNN -> SNN, in a minute
    snnconv convert --model small_cnn --data digits --train-epochs 30 --out runs/d
    snnconv finetune runs/d --data digits --T 4 --epochs 2
    snnconv export runs/d && snnconv run runs/d/snn.nir --backend cpu --data digits
    snnconv report runs/d                              one HTML page with every plot

Exit codes: 0 success, 1 a check failed (``check``: BatchNorm remains), 2 a usage or input
error (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def _load_model(path: str, model_name: str | None, num_classes: int, in_channels: int,
                trust_pickle: bool):
    import torch

    from . import models
    from .errors import SnnconvError

    if model_name:
        model = models.get(model_name, num_classes=num_classes, in_channels=in_channels)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise SnnconvError(
                f"cannot read {path} as a state dict ({type(exc).__name__}: {exc}). A whole pickled "
                "module needs --trust-pickle (only for files you trust) and no --model.") from exc
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise SnnconvError(f"{path} does not fit model '{model_name}' (num_classes={num_classes}, "
                               f"in_channels={in_channels}): {exc}") from exc
        return model
    if not trust_pickle:
        raise SnnconvError(
            f"{path}: give --model NAME (one of {models.names()}) to load a state dict safely, or "
            "--trust-pickle to unpickle a whole saved module (this runs code from the file).")
    try:
        model = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise SnnconvError(f"cannot unpickle {path} ({type(exc).__name__}: {exc})") from exc
    if not isinstance(model, torch.nn.Module):
        raise SnnconvError(f"{path} holds a {type(model).__name__}, not an nn.Module")
    return model


def _check(args) -> int:
    from . import models
    from .errors import BatchNormRemainsError, SnnconvError
    from .fold import fold_batchnorm
    from .guards import find_batchnorm

    targets = []
    try:
        if args.zoo:
            for name in models.names():
                targets.append((f"zoo:{name}", models.get(name, in_channels=args.in_channels,
                                                          num_classes=args.num_classes)))
        elif args.path:
            targets.append((args.path, _load_model(args.path, args.model, args.num_classes,
                                                   args.in_channels, args.trust_pickle)))
        else:
            print("snnconv check: give PATH (with --model NAME) or --zoo", file=sys.stderr)
            return 2
        failed = False
        for label, model in targets:
            if args.fold:
                model = fold_batchnorm(model)
            offenders = find_batchnorm(model)
            if offenders:
                failed = True
                print(f"FAIL {label}: {len(offenders)} BatchNorm(s) remain"
                      f"{' after folding' if args.fold else ''}:")
                for o in offenders:
                    print(f"  - {o}")
            else:
                print(f"ok   {label}: no BatchNorm{' after folding' if args.fold else ''}")
        return 1 if failed else 0
    except (SnnconvError, BatchNormRemainsError, FileNotFoundError) as exc:
        print(f"snnconv check: {exc}", file=sys.stderr)
        return 2


# --- shared helpers -------------------------------------------------------------------------
class UsageError(Exception):
    """A command line that cannot be acted on (exit 2, one line on stderr)."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit 2) that points at ``--help``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _say(args, *msg) -> None:
    if not getattr(args, "quiet", False):
        print(*msg, flush=True)


def _out_dir(args, default: str) -> str:
    import os

    out = args.out or default
    os.makedirs(out, exist_ok=True)
    return out


def _write_json(path: str, data) -> None:
    import json

    from .meta import _jsonable, atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=2, default=_jsonable) + "\n")


def _datasets(args):
    """``(train, test)`` for ``--data``, cut to ``--train-limit`` / ``--limit`` images."""
    from torch.utils.data import Subset

    from .data import load

    train, test = load(args.data, root=args.data_root, download=args.download, seed=args.seed)
    if args.train_limit:
        train = Subset(train, range(min(args.train_limit, len(train))))
    if args.limit:
        test = Subset(test, range(min(args.limit, len(test))))
    return train, test


def _loaders(args):
    import torch
    from torch.utils.data import DataLoader

    train, test = _datasets(args)
    return (DataLoader(train, batch_size=args.batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(args.seed)),
            DataLoader(test, batch_size=max(args.batch_size, 256)))


def _Ts(args) -> list[int]:
    Ts = sorted(set(args.T))
    if Ts[0] < 1:
        raise UsageError(f"--T takes time steps >= 1, got {args.T}")
    return Ts


def _snn_path(path: str, name: str = "snn.pt") -> str:
    """A saved SpikingNetwork: the file itself, or ``name`` in a run folder (the fine-tuned one first)."""
    import os

    if os.path.isdir(path):
        for candidate in ("snn_finetuned.pt", name):
            if os.path.exists(os.path.join(path, candidate)):
                return os.path.join(path, candidate)
        raise UsageError(f"{path} holds no snn.pt; run 'snnconv convert --out {path}' first")
    if not os.path.exists(path):
        raise UsageError(f"{path} does not exist")
    return path


def _evaluation(snn, test_loader, Ts, args, label: str) -> dict:
    """Accuracy at every T and spike statistics on one test batch (``evaluation.json``)."""
    import torch

    from .analysis import analyse
    from .data import first_batch
    from .metrics import accuracy_by_T

    from .progress import progress_bar

    _say(args, f"evaluating {label} at T = {', '.join(map(str, Ts))} ...")
    batches = progress_bar(test_loader, desc=f"evaluate T<={max(Ts)}", disable=args.quiet, leave=False)
    acc = accuracy_by_T(snn, batches, Ts, args.device)
    x, _ = first_batch(test_loader, where="the test loader")
    with torch.no_grad():
        stats = analyse(snn, x[:64].to(args.device), T=max(Ts))
    return {"network": label, "accuracy": {str(t): a for t, a in acc.items()},
            "analysis": stats.to_dict()}


def _print_accuracy(args, rows: list[tuple[str, float]]) -> None:
    _say(args, f"\n{'':28}accuracy (%)")
    for name, value in rows:
        _say(args, f"{name:28}{value:6.2f}")


# --- commands: demo, convert, finetune, evaluate, report ------------------------------------

def _cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(args.out or "runs/demo", seed=args.seed, progress=not args.quiet)
    return 0


def _cmd_check(args) -> int:
    args.in_channels = args.in_channels or 3
    return _check(args)


def _cmd_convert(args) -> int:
    import os

    import torch

    from . import models
    from .demo import train_ann
    from .pipeline import convert
    from .plots import plot_accuracy_vs_T

    if not args.weights and not args.train_epochs:
        raise UsageError("give --weights FILE (a trained state dict of --model) or --train-epochs N "
                         "(train --model on --data here first)")
    Ts = _Ts(args)
    train, test = _loaders(args)
    out = _out_dir(args, "runs/convert")
    x0 = train.dataset[0][0]
    in_channels = args.in_channels or x0.shape[0]
    if args.weights:
        model = _load_model(args.weights, args.model, args.num_classes, in_channels, False)
    elif args.train_epochs:
        try:
            model = models.get(args.model, num_classes=args.num_classes, in_channels=in_channels)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        _say(args, f"[1/3] training {args.model} on {args.data} for {args.train_epochs} epoch(s) ...")
        torch.manual_seed(args.seed)
        model = train_ann(model, train, epochs=args.train_epochs, lr=args.lr, progress=not args.quiet)
        from .meta import atomic_write_bytes
        import io

        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        atomic_write_bytes(os.path.join(out, "ann.pt"), buf.getvalue())
    else:
        raise UsageError("give --weights FILE (a trained state dict of --model) or --train-epochs N "
                         "(train --model on --data here first)")
    epochs = "default" if args.qcfs_epochs is None else args.qcfs_epochs
    _say(args, f"[2/3] converting (T={max(Ts)}, QCFS epochs {epochs}, fine-tuning "
               f"{'default' if args.finetune_epochs is None else args.finetune_epochs}) ...")
    snn, meta = convert(model, train, T=max(Ts), L=args.L, per_channel=args.per_channel,
                        qcfs_epochs=args.qcfs_epochs, finetune_epochs=args.finetune_epochs,
                        eval_loader=test, eval_T=Ts, seed=args.seed,
                        device=args.device, progress=not args.quiet)
    snn.to("cpu").save(os.path.join(out, "snn.pt"))
    meta.to_json(os.path.join(out, "meta.json"))
    acc = meta.accuracy
    plot_accuracy_vs_T({"SNN": {t: acc["snn"][str(t)] for t in Ts}},
                       os.path.join(out, "accuracy_vs_T.png"),
                       references={"ANN": acc["ann"], "QCFS-ANN": acc["qcfs"]},
                       title=f"{args.data}: {args.model or 'model'} converted to an SNN")
    _say(args, "[3/3] spike statistics ...")
    ev = _evaluation(snn.to(args.device), test, [max(Ts)], args, "snn.pt")
    ev["accuracy"] = acc["snn"]
    _write_json(os.path.join(out, "evaluation.json"), ev)
    _print_accuracy(args, [("ANN", acc["ann"]), ("ANN, BatchNorm folded", acc["folded"]),
                           (f"QCFS-ANN (L={meta.settings['L']})", acc["qcfs"])]
                    + [(f"SNN T={t}", acc["snn"][str(t)]) for t in Ts])
    _say(args, f"\nwrote {out}/snn.pt, meta.json, evaluation.json, accuracy_vs_T.png")
    return 0


def _teacher(args, src: str, train):
    """The ANN to distil from: ``--teacher FILE``, else the run folder's ``ann.pt``, as a state
    dict of ``--model``; None where there is neither."""
    import os

    path = args.teacher or os.path.join(os.path.dirname(src), "ann.pt")
    if not os.path.exists(path):
        if args.teacher:
            raise UsageError(f"--teacher {args.teacher}: no such file")
        return None
    if not args.model:
        if args.teacher:
            raise UsageError("--teacher needs --model NAME (the teacher is read as a state dict of it)")
        return None
    in_channels = args.in_channels or train.dataset[0][0].shape[0]
    return _load_model(path, args.model, args.num_classes, in_channels, False).eval()


def _cmd_finetune(args) -> int:
    import os

    from .finetune import finetune
    from .network import SpikingNetwork
    from .pipeline import CONVERT_FINETUNE, FINETUNE_MAX_STEPS, finetune_recipe

    src = _snn_path(args.snn, "snn.pt")
    if os.path.basename(src) == "snn_finetuned.pt" and os.path.isdir(args.snn):
        src = os.path.join(args.snn, "snn.pt")  # fine-tune the converted network, not a previous result
    out = _out_dir(args, args.snn if os.path.isdir(args.snn) else os.path.dirname(src) or ".")
    Ts = _Ts(args)
    train, test = _loaders(args)
    snn = SpikingNetwork.load(src)
    T_train = args.train_T
    teacher = _teacher(args, src, train)
    # convert()'s recipe: BPTT through 2T steps, readouts at T/2, T and 2T, distillation
    config = finetune_recipe(T_train, train, epochs=args.epochs, seed=args.seed,
                             max_steps=args.max_steps or FINETUNE_MAX_STEPS, lr=args.lr, alpha=args.alpha,
                             train_thresholds=not args.freeze_thresholds,
                             distill=CONVERT_FINETUNE["distill"] if teacher is not None else 0.0,
                             checkpoint_dir=os.path.join(out, "finetune"), resume=args.resume)
    _say(args, f"fine-tuning {src} with BPTT for T={T_train} ({config.T} steps unrolled, readouts at "
               f"{', '.join(map(str, config.horizons))}) for {args.epochs} epoch(s), "
               + ("distilling from the ANN ..." if teacher is not None else "labels only (no ANN given) ..."))
    tuned, history = finetune(snn, train, config=config, teacher=teacher, device=args.device,
                              progress=not args.quiet)
    tuned.to("cpu").save(os.path.join(out, "snn_finetuned.pt"))
    ev = _evaluation(tuned.to(args.device), test, Ts, args, "snn_finetuned.pt")
    _write_json(os.path.join(out, "evaluation.json"), ev)
    _write_json(os.path.join(out, "finetune.json"),
                {"source": src, "T": T_train, "epochs": args.epochs, "lr": args.lr, "alpha": args.alpha,
                 "history": history, "accuracy": {"snn": ev["accuracy"]}})
    _print_accuracy(args, [(f"SNN fine-tuned T={t}", ev["accuracy"][str(t)]) for t in Ts])
    _say(args, f"\nwrote {out}/snn_finetuned.pt, finetune.json, evaluation.json")
    return 0


def _cmd_evaluate(args) -> int:
    import os

    from .network import SpikingNetwork

    src = _snn_path(args.snn)
    Ts = _Ts(args)
    _, test = _loaders(args)
    snn = SpikingNetwork.load(src).to(args.device)
    ev = _evaluation(snn, test, Ts, args, os.path.basename(src))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        _write_json(os.path.join(args.out, "evaluation.json"), ev)
    _print_accuracy(args, [(f"SNN T={t}", ev["accuracy"][str(t)]) for t in Ts])
    rates = ev["analysis"]["firing_rate"]
    e = ev["analysis"]["energy"]
    _say(args, f"mean firing rate {100 * sum(rates.values()) / max(1, len(rates)):.2f}% per step; "
               f"energy estimate {e['snn_pj'] / 1e3:.1f} nJ (SNN) vs {e['ann_pj'] / 1e3:.1f} nJ (ANN) per image")
    return 0


def _cmd_report(args) -> int:
    from .report import write_report

    path = write_report(args.run_dir, args.out)
    print(path)
    return 0


# --- commands owned by the nir helper: export, inspect (issue 10) ---------------------------

def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _cmd_export(args) -> int:
    """``snnconv export NETWORK.pt OUT.nir``: a SpikingNetwork.save file to a NIR file."""
    import os

    from .errors import SnnconvError
    from .network import SpikingNetwork
    from .nir_io import export_nir, save_nir

    try:
        args.network = _snn_path(args.network)
        args.out = args.nir_out or args.out or os.path.join(os.path.dirname(args.network), "snn.nir")
        snn = SpikingNetwork.load(args.network)
        shape = None
        if args.input_shape:
            try:
                shape = tuple(int(v) for v in args.input_shape.split(","))
            except ValueError:
                raise SnnconvError(f"--input-shape {args.input_shape!r} is not like 3,32,32") from None
        graph = export_nir(snn, input_shape=shape)
        save_nir(graph, args.out)
    except (SnnconvError, OSError, UsageError) as exc:
        print(f"snnconv export: {_one_line(exc)}", file=sys.stderr)
        return 2
    neurons = sum(1 for n in graph.nodes.values() if type(n).__name__ in ("I", "IF"))
    print(f"wrote {args.out}: {len(graph.nodes)} nodes, {len(graph.edges)} edges, {neurons} neuron "
          f"layers, reset={graph.metadata['reset']}, T={graph.metadata['T']}, "
          f"{os.path.getsize(args.out) / 1e6:.2f} MB")
    return 0


def _inspect_rows(graph) -> tuple[list[list[str]], dict[str, int]]:
    import numpy as np

    from snnconv_backends.nirgraph import parse

    parsed = parse(graph)
    rows, totals = [], {"ops": 0, "neuron layers": 0, "neurons": 0, "parameters": 0}
    for op in parsed.ops:
        node = graph.nodes[op.name]
        kind = type(node).__name__
        theta, count = "", 0
        if op.kind == "neuron":
            t = np.asarray(op.params["theta"], dtype=np.float64)
            theta = f"{t.min():.4g} / {t.mean():.4g} / {t.max():.4g}"
            kind = "IF (reset zero)" if kind == "IF" else "I+Threshold+Scale (subtract)"
            count = t.size
            totals["neuron layers"] += 1
            totals["neurons"] += int(np.prod(op.out_shape))
        elif op.kind == "sum":
            kind = "sum"
        else:
            count = sum(int(np.asarray(op.params[k]).size) for k in ("weight", "bias") if k in op.params)
            if op.kind == "scale":
                count = int(np.unique(np.asarray(op.params["scale"])).size)
        if op.kind == "avgpool2d" and op.params["adaptive"]:
            kind += " (adaptive)"
        totals["ops"] += 1
        totals["parameters"] += count
        rows.append([op.name, kind, "x".join(map(str, op.out_shape)), theta, str(count) if count else ""])
    return rows, totals


def _cmd_inspect(args) -> int:
    """``snnconv inspect FILE.nir``: one row per op (node, type, shape, thresholds, parameters)."""
    import os

    from .errors import SnnconvError
    from .nir_io import load_nir

    try:
        graph = load_nir(args.file)
        rows, totals = _inspect_rows(graph)
    except (SnnconvError, OSError) as exc:
        print(f"snnconv inspect: {_one_line(exc)}", file=sys.stderr)
        return 2
    header = ["node", "type", "shape", "theta min / mean / max", "parameters"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    meta = {k: v for k, v in graph.metadata.items()}
    print(f"total: {totals['ops']} ops, {totals['neuron layers']} neuron layers "
          f"({totals['neurons']} neurons), {totals['parameters']} parameters; "
          f"reset={meta.get('reset')}, T={meta.get('T')}, producer={meta.get('producer')}, "
          f"{os.path.getsize(args.file) / 1e6:.2f} MB")
    return 0


# --- commands owned by the backends helper: run, backends (issue 11) ------------------------

# (commands run and backends: the backends helper, issue 11)
E_AC_PJ, E_MAC_PJ = 0.9, 4.6
_RUN_DATA = ("digits", "fashion_mnist", "cifar10")


def _run_dataset(name: str, root: str | None):
    from .data import cifar10, digits, fashion_mnist
    from .errors import DataError

    if name == "digits":
        return digits(seed=0)[1]
    if name == "fashion_mnist":
        return fashion_mnist(root, train=False)
    if name == "cifar10":
        if not root:
            raise DataError("--data cifar10 needs --data-root DIR (holding cifar-10-batches-py)")
        return cifar10(root, train=False)
    raise DataError(f"unknown --data {name!r}; choose one of {', '.join(_RUN_DATA)}")


def _backend_options(pairs: list[str]) -> dict:
    import json

    from .errors import BackendError

    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BackendError(f"--option {pair!r} is not KEY=VALUE (e.g. dtype=float64)")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _cmd_run(args) -> int:
    """``snnconv run FILE.nir --backend cpu --data digits --T 8``: accuracy, spikes, synops, energy.

    Also writes ``OUT/backends/BACKEND.json`` (default OUT: the NIR file's folder) for
    ``snnconv report``: accuracy, agreement with the torch network read from the same file,
    operation counts, energy and the backend's own report.
    """
    import os
    import time

    import torch
    from torch.utils.data import DataLoader

    from . import backends
    from .errors import SnnconvError
    from .nir_io import from_nir, load_nir

    try:
        graph = load_nir(args.file)
        program = backends.get(args.backend).compile(graph, **_backend_options(args.option))
        dataset = _run_dataset(args.data, args.data_root)
        if args.limit:
            dataset = torch.utils.data.Subset(dataset, range(min(args.limit, len(dataset))))
        T = args.T if args.T is not None else graph.metadata.get("T")
        if T is None:
            raise SnnconvError(f"{args.file} records no T; give --T")
        correct = torch.zeros(int(T), dtype=torch.float64)
        reference = from_nir(graph)
        refs, outputs, labels, extra, t_start = [], [], [], {}, time.perf_counter()
        n, spikes, synops, macs, seconds = 0, {}, {}, {}, 0.0
        chip_runs = []  # loihi2-sim / lava: their quantisation, resources and energy reports
        for x, y in DataLoader(dataset, batch_size=args.batch):
            r = program.run(x, int(T))
            # accuracy of the readout averaged over the first t steps, t = 1..T
            mean_t = r.outputs.float().cpu().cumsum(0) / torch.arange(1, int(T) + 1).view(-1, 1, 1)
            correct += (mean_t.argmax(-1) == y.view(1, -1)).sum(1).double()
            n += len(y)
            seconds += float(r.extra.get("seconds", 0.0))
            for d, new in ((spikes, r.spikes), (synops, r.synops), (macs, r.macs)):
                for k, v in new.items():
                    d[k] = d[k] + v if k in d else v
            static = set(r.extra.get("static_ops", ()))
            if "quantisation" in r.extra:
                chip_runs.append(r)
            with torch.no_grad():  # the torch network read back from the same file: the reference
                refs.append(reference.run(x, T=int(T)).mean(0).argmax(1))
            outputs.append(r.outputs.float().cpu())
            labels.append(y)
            extra = dict(r.extra or {})
    except (SnnconvError, OSError) as exc:
        print(f"snnconv run: {_one_line(exc)}", file=sys.stderr)
        return 2
    T = int(T)
    from snnconv_backends.nirgraph import parse

    sizes = {op.name: op.out_shape for op in parse(graph).ops if op.kind == "neuron"}
    print(f"{args.file} on backend '{args.backend}', {args.data} test set ({n} images), T={T}: "
          f"{seconds:.2f} s ({n * T / max(seconds, 1e-9):.0f} image-steps/s)")
    print(f"accuracy (mean readout over T={T}): {100 * correct[-1] / n:.2f}%")
    by_t = ", ".join(f"{t + 1}: {100 * c / n:.1f}" for t, c in enumerate(correct.tolist()))
    print(f"accuracy by t: {by_t}")
    print("\nspikes per neuron layer (rate = spikes per neuron per step)")
    rows = [["layer", "neurons", "spikes", "rate", "by step"]]
    for name, counts in spikes.items():
        units = int(torch.Size(sizes[name]).numel())
        rate = float(counts.sum()) / (units * n * T)
        rows.append([name, str(units), f"{float(counts.sum()):.0f}", f"{rate:.4f}",
                     " ".join(f"{float(c) / (units * n):.3f}" for c in counts)])
    _print_table(rows)
    print("\nsynaptic operations (accumulates, per image over T steps) vs the ANN's MACs (per image)")
    rows = [["layer", "SNN AC", "ANN MAC", "AC / MAC"]]
    e_snn = 0.0
    for name, m in macs.items():
        ac = synops.get(name)
        if ac is None:  # not fed by spikes: dense MACs, once for a static layer, else every step
            e_snn += m / n * (1 if name in static else T) * E_MAC_PJ
            rows.append([name, "(dense: " + ("once" if name in static else f"x{T}") + ")",
                         f"{m / n:.4g}", ""])
        else:
            e_snn += ac / n * E_AC_PJ
            rows.append([name, f"{ac / n:.4g}", f"{m / n:.4g}", f"{ac / m:.3f}"])
    for name, ac in synops.items():
        if name not in macs:  # an identity-shortcut Scale: one add per spike
            e_snn += ac / n * E_AC_PJ
            rows.append([name, f"{ac / n:.4g}", "0", ""])
    tot_ac, tot_mac = sum(synops.values()) / n, sum(macs.values()) / n
    rows.append(["total", f"{tot_ac:.4g}", f"{tot_mac:.4g}", f"{tot_ac / max(tot_mac, 1e-9):.3f}"])
    _print_table(rows)
    e_ann = tot_mac * E_MAC_PJ
    print(f"\nenergy estimate per image (synaptic arithmetic only; neuron updates and memory "
          f"traffic not counted): SNN {e_snn / 1e6:.3f} uJ vs ANN {e_ann / 1e6:.3f} uJ "
          f"({e_snn / max(e_ann, 1e-12):.2f}x), at {E_AC_PJ} pJ per AC and {E_MAC_PJ} pJ per MAC "
          "(45 nm, 32-bit float; Horowitz, ISSCC 2014, as spikingjelly's SimpleEnergyProfiler)")
    if chip_runs:
        from snnconv_backends.loihi2 import format_report

        print("\nLoihi 2 (" + args.backend + ")\n" + format_report(chip_runs))
    from .analysis import backend_record

    class _Merged:  # the batches as one RunResult-like record
        pass

    merged = _Merged()
    merged.outputs, merged.synops, merged.macs, merged.extra = torch.cat(outputs, 1), synops, macs, extra
    rec = backend_record(args.backend, merged, torch.cat(labels), torch.cat(refs), T=T,
                         wall_s=time.perf_counter() - t_start)
    rec["energy_45nm_per_image_nj"] = {"snn": e_snn / 1e3, "ann": e_ann / 1e3}
    out = args.out or os.path.dirname(os.path.abspath(args.file))
    os.makedirs(os.path.join(out, "backends"), exist_ok=True)
    _write_json(os.path.join(out, "backends", f"{args.backend}.json"), rec)
    print(f"\nagreement with the torch network read from the same file: {rec['agreement']:.2f}%; "
          f"wrote {os.path.join(out, 'backends', args.backend + '.json')}")
    return 0


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _cmd_backends(args) -> int:
    """``snnconv backends``: every installed backend, usable or not, and why not."""
    from . import backends

    rows = [["backend", "usable", "why not"]]
    for name, (ok, reason) in backends.available().items():
        rows.append([name, "yes" if ok else "no", reason])
    _print_table(rows)
    return 0


# --- the parser -----------------------------------------------------------------------------

def _parents() -> dict[str, argparse.ArgumentParser]:
    """The shared flags, defined once: ``common``, ``data``, ``model``, ``time``."""
    from .data import DATASETS

    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("common")
    g.add_argument("--out", help="output folder (or file, where the command writes one)")
    g.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default cpu)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--quiet", action="store_true", help="no progress bars or tables")

    data = argparse.ArgumentParser(add_help=False)
    g = data.add_argument_group("data")
    g.add_argument("--data", default="digits", choices=DATASETS,
                   help="dataset (default digits, embedded; synthetic: CIFAR-shaped, made here)")
    g.add_argument("--data-root", help="folder of the dataset's files (Fashion-MNIST IDX, CIFAR-10)")
    g.add_argument("--download", action="store_true", help="download the dataset if missing")
    g.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    g.add_argument("--limit", type=int, help="use only the first N test images")
    g.add_argument("--train-limit", type=int, help="use only the first N training images")

    model = argparse.ArgumentParser(add_help=False)
    g = model.add_argument_group("model")
    g.add_argument("--model", help="zoo model name (small_cnn, resnet18, ...; see snnconv check --zoo)")
    g.add_argument("--num-classes", type=int, default=10)
    g.add_argument("--in-channels", type=int, help="input channels (default: from the data, or 3)")

    time = argparse.ArgumentParser(add_help=False)
    g = time.add_argument_group("time")
    g.add_argument("--T", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="time steps; several values evaluate at each (default 1 2 4 8)")
    levels = argparse.ArgumentParser(add_help=False)
    levels.add_argument_group("conversion").add_argument(
        "--L", type=int, default=None, help="QCFS quantisation levels (default: T)")
    return {"common": common, "data": data, "model": model, "time": time, "levels": levels}


def _add(sub, name: str, help: str, example: str, parents: list, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                       epilog=f"example:\n  {example}", parents=parents,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``snnconv`` parser: one subcommand per task, shared flags from :func:`_parents`."""
    pa = _parents()
    common, data, model, time = pa["common"], pa["data"], pa["model"], pa["time"]
    parser = _Parser(prog="snnconv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"snnconv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add(sub, "demo", "train a small BN CNN on scikit-learn digits and convert it",
         "snnconv demo --out runs/demo", [common], _cmd_demo)

    p = _add(sub, "convert", "train or load an ANN, convert it to an SNN, evaluate it by T",
             "snnconv convert --model small_cnn --data digits --train-epochs 30 --T 1 2 4 8 --out runs/d",
             [common, data, model, time, pa["levels"]], _cmd_convert)
    p.add_argument("--weights", help="a trained state dict of --model (torch.load weights_only)")
    p.add_argument("--train-epochs", type=int, default=0, help="train --model here for N epochs first")
    p.add_argument("--lr", type=float, default=0.05, help="ANN training learning rate (default 0.05)")
    p.add_argument("--finetune-epochs", type=int, default=None,
                   help="BPTT epochs, at most 2000 steps each (default: convert()'s, one at T <= 8; "
                        "0 converts without training)")
    p.add_argument("--qcfs-epochs", type=int, default=None,
                   help="QCFS-aware training epochs (default: convert()'s, none unless max-pooling "
                        "became average pooling)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--per-channel", dest="per_channel", action="store_const", const=True, default=None,
                   help="one threshold per channel (the default)")
    g.add_argument("--per-layer", dest="per_channel", action="store_const", const=False,
                   help="one threshold per layer")

    p = _add(sub, "finetune", "fine-tune a converted SNN with BPTT (atan surrogate)",
             "snnconv finetune runs/d --data digits --T 2 4 8 --train-T 4 --epochs 2",
             [common, data, model, time], _cmd_finetune)
    p.add_argument("snn", help="a saved SNN (snn.pt) or the run folder holding it")
    p.add_argument("--train-T", type=int, default=4,
                   help="the T to fine-tune for (default 4): convert()'s recipe unrolls 2T steps "
                        "and trains the readouts at T/2, T and 2T")
    p.add_argument("--teacher", help="the ANN to distil from, a state dict of --model (default: the "
                                     "run folder's ann.pt where --model is given)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--alpha", type=float, default=4.0,
                   help="ATan surrogate sharpness (default 4)")
    p.add_argument("--freeze-thresholds", action="store_true", help="keep the thresholds fixed")
    p.add_argument("--max-steps", type=int, help="at most N steps per epoch (default 2000)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/finetune/finetune.ckpt")

    p = _add(sub, "evaluate", "accuracy by T, firing rates, synaptic operations and energy of an SNN",
             "snnconv evaluate runs/d/snn.pt --data digits --T 1 2 4 8 16 --out runs/d",
             [common, data, time], _cmd_evaluate)
    p.add_argument("snn", help="a saved SNN (snn.pt) or a run folder")

    p = _add(sub, "check", "exit 1 (listing them) when BatchNorm remains in a model",
             "snnconv check model_state.pt --model resnet18 --fold", [common, model], _cmd_check)
    p.add_argument("path", nargs="?", help="a saved state dict (with --model) or module")
    p.add_argument("--fold", action="store_true", help="fold BatchNorm first, then check")
    p.add_argument("--zoo", action="store_true", help="check every zoo model")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling a whole saved module (runs code from the file)")

    p = _add(sub, "report", "write one self-contained HTML page from a run folder",
             "snnconv report runs/d   # writes runs/d/report.html", [common], _cmd_report)
    p.add_argument("run_dir", help="a run folder (meta.json, finetune.json, evaluation.json, backends/)")

    # SLOT export / inspect (nir helper, issue 10): bodies in _cmd_export / _cmd_inspect
    p = _add(sub, "export", "write an SNN as a NIR graph file (HDF5)",
             "snnconv export runs/d/snn.pt runs/d/snn.nir", [common], _cmd_export)
    p.add_argument("network", help="a saved SNN (snn.pt, SpikingNetwork.save) or a run folder")
    p.add_argument("nir_out", nargs="?", help="the NIR file to write (default: --out, or snn.nir "
                   "beside the network)")
    p.add_argument("--input-shape", help="batch-free input shape, e.g. 3,32,32 (default: recorded "
                   "by convert)")
    p = _add(sub, "inspect", "print the nodes, shapes, thresholds and metadata of a NIR file",
             "snnconv inspect runs/d/snn.nir", [common], _cmd_inspect)
    p.add_argument("file", help="a NIR (HDF5) file")

    # run / backends (backends helper, issue 11)
    p = _add(sub, "run", "run a NIR file on a backend: accuracy, spikes, synops, energy",
             "snnconv run runs/d/snn.nir --backend loihi2-sim --data digits --T 8",
             [common], _cmd_run)
    p.add_argument("file", help="a NIR (HDF5) file")
    p.add_argument("--data", default="digits", choices=_RUN_DATA, help="test set to evaluate on (default digits)")
    p.add_argument("--data-root", help="dataset folder (Fashion-MNIST IDX files, CIFAR-10)")
    p.add_argument("--limit", type=int, default=0, help="first N test images only")
    p.add_argument("--backend", default="cpu", help="cpu, gpu, loihi2-sim, lava (see: snnconv backends)")
    p.add_argument("--T", type=int, help="time steps (default: the T recorded in the file)")
    p.add_argument("--batch", type=int, default=256, help="images per backend call (default 256)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="a backend option, e.g. --option dtype=float64 (repeatable)")
    _add(sub, "backends", "list the installed backends and why one is unavailable",
         "snnconv backends", [common], _cmd_backends)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit code (0 ok, 1 a check failed, 2 usage or input error)."""
    from .errors import SnnconvError

    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse prints one line and exits 2
    try:
        return args.func(args)
    except (UsageError, SnnconvError, OSError, ValueError) as exc:
        print(f"snnconv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"snnconv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
