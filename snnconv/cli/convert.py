"""``snnconv demo``, ``snnconv convert`` and ``snnconv finetune``: from an ANN to a run folder."""

from __future__ import annotations

import io
import os

from snnconv.cli.common import (
    UsageError,
    add_command,
    count,
    evaluation,
    load_model,
    load_snn,
    loaders,
    model_builder,
    new_run_dir,
    num_classes,
    out_dir,
    positive_int,
    print_accuracy,
    say,
    subset_record,
    time_steps,
    warn,
    write_json,
)
from snnconv.data import DATASETS

__all__ = ["add_demo", "add_convert", "add_finetune", "recorded_size"]

_WEIGHTS_OR_TRAIN = ("give --weights FILE (a trained state dict of --model) or --train-epochs N "
                     "(train --model on --data here first)")


def _cmd_demo(args) -> int:
    from snnconv.demo import run_demo

    run_demo(args.out or "runs/demo", seed=args.seed, progress=not args.quiet, device=args.device)
    return 0


def _cmd_convert(args) -> int:
    from snnconv.io.atomic import StagedFolder

    build = model_builder(args.model)  # an unknown model is said first, before any other advice
    fixed = [f for f, v in (("--num-classes", args.num_classes), ("--in-channels", args.in_channels)) if v]
    if ":" in args.model and fixed:
        raise UsageError(f"{' and '.join(fixed)} shape(s) a zoo model; --model {args.model} builds its own "
                         "(called without arguments): leave them out, or build what you need in the factory")
    if not args.weights and not args.train_epochs:
        raise UsageError(_WEIGHTS_OR_TRAIN)
    Ts = time_steps(args)
    out, run_id, replaces = new_run_dir(args, "runs/convert")  # checked; nothing created yet
    # written beside --out, moved in once complete: an interrupted run leaves the old one as it was
    with StagedFolder(out, replaces=replaces) as staged:
        _convert_into(args, build, Ts, staged, run_id)
        staged.commit()
    say(args, f"\nwrote {out}/snn.pt, meta.json, evaluation.json, accuracy_vs_T.png")
    return 0


def _convert_into(args, build, Ts: list[int], staged, run_id: str) -> None:
    import torch

    from snnconv.analysis.plots import plot_accuracy_vs_T
    from snnconv.demo import train_ann
    from snnconv.io.atomic import atomic_write_bytes
    from snnconv.pipeline import convert

    train, test = loaders(args)
    x0 = train.dataset[0][0]
    in_channels = args.in_channels or x0.shape[0]
    classes = num_classes(args, train.dataset)
    if args.weights:
        model = load_model(args.weights, args.model, classes, in_channels, False)
    else:
        torch.manual_seed(args.seed)  # the initialisation too: the same --seed, the same network
        model = build(classes, in_channels)
    _takes(model, x0, args)
    _say_images(args, model, x0, train, test)
    if not args.weights:
        say(args, f"[1/3] training {args.model} on {args.data} for {args.train_epochs} epoch(s) ...")
        torch.manual_seed(args.seed)
        model = train_ann(model, train, epochs=args.train_epochs, lr=args.lr, progress=not args.quiet,
                          device=args.device)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        atomic_write_bytes(os.path.join(staged.path, "ann.pt"), buf.getvalue())
    epochs = "default" if args.qcfs_epochs is None else args.qcfs_epochs
    say(args, f"[2/3] converting (T={max(Ts)}, QCFS epochs {epochs}, fine-tuning "
              f"{'default' if args.finetune_epochs is None else args.finetune_epochs}) ...")
    snn, meta = convert(model, train, T=max(Ts), L=args.L, per_channel=args.per_channel,
                        qcfs_epochs=args.qcfs_epochs, finetune_epochs=args.finetune_epochs,
                        reconstruction_steps=args.reconstruction_steps, burst=args.burst, early_exit=args.early_exit,
                        eval_loader=test, eval_T=Ts,
                        seed=args.seed, device=args.device, progress=not args.quiet)
    snn.meta["run_id"] = meta.settings["run_id"] = run_id
    meta.settings.update(model=args.model, data=args.data, eval_images=len(test.dataset),
                         image_size=list(x0.shape[1:]))
    if os.path.isdir(args.data):  # a folder: where later commands find it by default
        meta.settings["data_path"] = os.path.abspath(args.data)
    subset = subset_record(test.dataset)
    if subset is not None:
        meta.settings["test_subset"] = subset
    out = staged.path
    snn.to("cpu").save(os.path.join(out, "snn.pt"))
    meta.to_json(os.path.join(out, "meta.json"))
    acc = meta.accuracy
    plot_accuracy_vs_T({"SNN": {t: acc["snn"][str(t)] for t in Ts}},
                       os.path.join(out, "accuracy_vs_T.png"),
                       references={"ANN": acc["ann"], "QCFS-ANN": acc["qcfs"]},
                       title=f"{args.data}: {args.model or 'model'} converted to an SNN")
    say(args, "[3/3] spike statistics ...")
    ev = evaluation(args, snn.to(args.device), test, [max(Ts)], "snn.pt")
    ev["accuracy"] = acc["snn"]
    ev["run_id"] = run_id
    write_json(os.path.join(out, "evaluation.json"), ev)
    print_accuracy(args, [("ANN", acc["ann"]), ("ANN, BatchNorm folded", acc["folded"]),
                          (f"QCFS-ANN (L={meta.settings['L']})", acc["qcfs"])]
                   + [(f"SNN T={t}", acc["snn"][str(t)]) for t in Ts],
                   images=len(test.dataset))


#: Where a model may record the input size it was built or trained for: (attribute, key), the
#: key None for the attribute itself (an int, or a (C,) H, W sequence).
_SIZE_ATTRIBUTES = (("pretrained_cfg", "input_size"), ("default_cfg", "input_size"), ("input_size", None),
                    ("image_size", None), ("img_size", None))


def recorded_size(model) -> tuple[tuple[int, int], str] | None:
    """``((H, W), where)``: the input size ``model`` records (timm's ``pretrained_cfg`` /
    ``default_cfg["input_size"]``, or an ``input_size``, ``image_size`` or ``img_size``
    attribute), or None where it records none."""
    for attr, key in _SIZE_ATTRIBUTES:
        value = getattr(model, attr, None)
        if key is not None:
            value = value.get(key) if isinstance(value, dict) else None
            attr = f"{attr}[{key!r}]"
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return (value, value), f"model.{attr}"
        if isinstance(value, (tuple, list)) and len(value) in (2, 3) and all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            return (int(value[-2]), int(value[-1])), f"model.{attr}"
    return None


def _say_images(args, model, x0, train, test) -> None:
    """The images the run uses (their size, and whether --image-size resized them), in the plan;
    a warning where the model records another input size."""
    shape = "x".join(map(str, x0.shape))
    how = (f"resized to {args.image_size}x{args.image_size} by --image-size" if args.image_size
           else "as they are in the folder (--image-size N resizes them)" if args.data not in DATASETS
           else f"the size of {args.data}")
    say(args, f"data: {args.data}, {len(train.dataset):,} training and {len(test.dataset):,} test images of "
              f"{shape} (C x H x W), {how}")
    found = recorded_size(model)
    if found is not None and x0.dim() == 3 and found[0] != tuple(x0.shape[1:]):
        (h, w), where = found
        fix = (f"give --image-size {h} to resize them" if h == w and args.data not in DATASETS
               else "give images of that size")
        warn(f"--model {args.model} records an input size of {h}x{w} ({where}), but the images of --data "
             f"{args.data} are {x0.shape[1]}x{x0.shape[2]}: it runs, on images it was not built for, and its "
             f"accuracy may drop far; {fix}")


def _takes(model, x0, args) -> None:
    """UsageError unless ``model`` takes an image of ``--data`` (one, in eval mode; its mode kept)."""
    import torch

    was = model.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()(x0.unsqueeze(0))
    except Exception as exc:
        raise UsageError(f"--model {args.model} does not take the images of --data {args.data} (one is "
                         f"{'x'.join(map(str, x0.shape))}): {type(exc).__name__}: {str(exc)[:160]}. Give "
                         "data of the shape the model was built for (--image-size N resizes a folder's "
                         "images), or a model for this data") from None
    finally:
        model.train(was)


def _teacher(args, src: str, train):
    """The ANN to distil from: ``--teacher FILE``, else the run folder's ``ann.pt``, as a state
    dict of ``--model``; None where there is neither."""
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
    return load_model(path, args.model, num_classes(args, train.dataset), in_channels, False).eval()


def _cmd_finetune(args) -> int:
    from snnconv.defaults import CONVERT_FINETUNE, FINETUNE_MAX_STEPS, default_finetune_epochs, finetune_recipe
    from snnconv.stages.finetune import finetune
    # a run folder: fine-tune the converted network, not a previous result
    inside = os.path.join(args.snn, "snn.pt")
    snn, src = load_snn(args, inside if os.path.isfile(inside) else args.snn)
    out = out_dir(args, args.snn if os.path.isdir(args.snn) else os.path.dirname(src) or ".")
    Ts = time_steps(args)
    train, test = loaders(args)
    T_train = args.train_T
    teacher = _teacher(args, src, train)
    # convert()'s recipe: BPTT through 2T steps, readouts at T/2, T and 2T (from every step on at
    # T >= ANYTIME_FROM_T), distillation
    epochs = default_finetune_epochs(train) if args.epochs is None else args.epochs
    config = finetune_recipe(T_train, train, epochs=epochs, seed=args.seed,
                             reset=snn.meta.get("reset", "subtract"),
                             max_steps=args.max_steps or FINETUNE_MAX_STEPS, lr=args.lr, alpha=args.alpha,
                             train_thresholds=not args.freeze_thresholds,
                             distill=CONVERT_FINETUNE["distill"] if teacher is not None else 0.0,
                             checkpoint_dir=os.path.join(out, "finetune"), resume=args.resume)
    say(args, f"fine-tuning {src} with BPTT for T={T_train} ({config.T} steps unrolled, readouts at "
              f"{', '.join(map(str, config.horizons))}) for {epochs} epoch(s), "
              + ("distilling from the ANN ..." if teacher is not None else "labels only (no ANN given) ..."))
    tuned, history = finetune(snn, train, config=config, teacher=teacher, device=args.device,
                              progress=not args.quiet)
    run_id = snn.meta.get("run_id")
    tuned.meta["run_id"] = run_id
    tuned.to("cpu").save(os.path.join(out, "snn_finetuned.pt"))
    ev = evaluation(args, tuned.to(args.device), test, Ts, "snn_finetuned.pt")
    ev["run_id"] = run_id
    write_json(os.path.join(out, "evaluation.json"), ev)
    write_json(os.path.join(out, "finetune.json"),
               {"source": src, "T": T_train, "epochs": epochs, "lr": args.lr, "alpha": args.alpha,
                "config": {k: v for k, v in vars(config).items() if k != "checkpoint_dir"},
                "history": history, "accuracy": {"snn": ev["accuracy"]}, "images": ev["images"],
                "data": args.data, "run_id": run_id})
    print_accuracy(args, [(f"SNN fine-tuned T={t}", ev["accuracy"][str(t)]) for t in Ts], images=ev["images"])
    say(args, f"\nwrote {out}/snn_finetuned.pt, finetune.json, evaluation.json")
    return 0


# --- the parsers ----------------------------------------------------------------------------

def add_demo(sub, pa: dict) -> None:
    add_command(sub, "demo", "train a small BN CNN on scikit-learn digits and convert it",
                "snnconv demo --out runs/demo", [pa["common"]], _cmd_demo)


def add_convert(sub, pa: dict) -> None:
    example = "snnconv convert --model small_cnn --data digits --train-epochs 30 --T 1 2 4 8 --out runs/d"
    p = add_command(sub, "convert", "train or load an ANN, convert it to an SNN, evaluate it by T", example,
                    [pa["common"], pa["data"], pa["model"], pa["time"], pa["levels"]], _cmd_convert)
    p.add_argument("--weights", help="a trained state dict of --model (torch.load weights_only)")
    p.add_argument("--train-epochs", type=count, default=0, help="train --model here for N epochs first")
    p.add_argument("--lr", type=float, default=0.05, help="ANN training learning rate (default 0.05)")
    p.add_argument("--finetune-epochs", type=count, default=None,
                   help="BPTT epochs, at most 2000 steps each (default: convert()'s, at T <= 8 the "
                        "epochs that reach 512 steps; 0 converts without training)")
    p.add_argument("--qcfs-epochs", type=count, default=None,
                   help="QCFS-aware training epochs (default: convert()'s, none unless max-pooling "
                        "became average pooling)")
    p.add_argument("--reconstruction-steps", type=count, default=None,
                   help="Adam steps fitting each IF layer to the QCFS-ANN on the calibration images "
                        "(default: convert()'s, 300 at T <= 8 where no QCFS training ran; 0: none)")
    p.add_argument("--burst", type=positive_int, default=1, metavar="B",
                   help="up to B spikes a neuron may emit in one step (default 1): T*B levels in T steps; "
                        "NIR export writes B Threshold nodes per neuron and their sum (graded spikes on "
                        "loihi2-sim and lava)")
    p.add_argument("--early-exit", action="store_true",
                   help="convert for early exit: fine-tune every readout from the first step and store an "
                        "exit rule calibrated on held-out images (snnconv evaluate and run use it)")
    p.add_argument("--overwrite", action="store_true",
                   help="--out holds a run: replace its files once the new run is complete (without it, "
                        "such a folder is refused)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--per-channel", dest="per_channel", action="store_const", const=True, default=None,
                   help="one threshold per channel (the default)")
    g.add_argument("--per-layer", dest="per_channel", action="store_const", const=False,
                   help="one threshold per layer")


def add_finetune(sub, pa: dict) -> None:
    p = add_command(sub, "finetune", "fine-tune a converted SNN with BPTT (atan surrogate)",
                    "snnconv finetune runs/d --data digits --T 2 4 8 --train-T 4 --epochs 2",
                    [pa["common"], pa["data"], pa["model"], pa["time"]], _cmd_finetune)
    p.add_argument("snn", help="a saved SNN (snn.pt) or the run folder holding it")
    p.add_argument("--train-T", type=positive_int, default=4,
                   help="the T to fine-tune for (default 4): convert()'s recipe unrolls 2T steps "
                        "and trains the readouts at T/2, T and 2T")
    p.add_argument("--teacher", help="the ANN to distil from, a state dict of --model (default: the "
                                     "run folder's ann.pt where --model is given)")
    p.add_argument("--epochs", type=count, default=None,
                   help="BPTT epochs (default: convert()'s, the epochs that reach 512 steps)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--alpha", type=float, default=4.0,
                   help="ATan surrogate sharpness (default 4)")
    p.add_argument("--freeze-thresholds", action="store_true", help="keep the thresholds fixed")
    p.add_argument("--max-steps", type=positive_int, help="at most N steps per epoch (default 2000)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/finetune/finetune.ckpt")
