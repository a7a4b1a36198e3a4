"""What the commands share: the shared flags (defined once, as argparse parents), the parser
class, and the helpers that load a model, data or a saved SNN and write a run folder's files."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import threading
import time
from typing import Any, Callable

from snnconv.data import DATASETS, TEST_EVERY
from snnconv.progress import duration

__all__ = ["UsageError", "check_device", "Parser", "FLAGS", "PARENTS", "parents", "add_command", "say", "out_dir",
           "write_json", "datasets", "loaders", "num_classes", "model_builder", "data_source", "DOWNLOAD_HINT",
           "time_steps", "snn_path", "nir_path", "load_model",
           "RUN_FILES", "new_run_dir", "load_snn",
           "evaluation", "print_accuracy", "warn", "subset_record", "MIN_TEST_IMAGES", "one_line",
           "positive_int", "positive_float", "count", "duration",
           "Heartbeat"]


class UsageError(Exception):
    """A command line that cannot be acted on (exit 2, one line on stderr)."""


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def one_line(exc: BaseException | str) -> str:
    """An error message as one line of plain text: terminal escape codes removed, whitespace
    (newlines, tabs) collapsed."""
    return " ".join(_ANSI.sub("", str(exc)).split())


def check_device(device: str | None) -> None:
    """``--device`` names a device this machine has (UsageError, exit 2, before any work); the
    scripts that take ``--device`` (scripts/gpu_run.py) share it."""
    if device is None or device == "cpu":
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA GPU is visible here (torch.cuda.is_available() "
                             "is False: no NVIDIA driver or GPU, or a CPU-only torch build); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise UsageError(f"--device {device}: snnconv runs on cpu or cuda devices")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a time step)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def count(text: str) -> int:
    """An argparse type: an integer >= 0 (epochs, steps)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value


def data_source(text: str) -> str:
    """An argparse type: a dataset of :data:`snnconv.data.DATASETS`, or a folder of images."""
    if text in DATASETS or os.path.isdir(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a dataset ({', '.join(DATASETS)}) nor a folder of images "
        "(torchvision's ImageFolder layout: DIR/CLASS/image.png)")


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit 2) that points at ``--help``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# --- the shared flags -----------------------------------------------------------------------

#: Every shared flag, defined once: its argparse keywords.
FLAGS: dict[str, dict[str, Any]] = {
    "--out": dict(help="output folder (or file, where the command writes one)"),
    "--device": dict(default="cpu", help="torch device: cpu, cuda, cuda:1 (default cpu)"),
    "--seed": dict(type=int, default=0, help="random seed (default 0)"),
    "--quiet": dict(action="store_true", help="no progress bars or tables"),
    "--data": dict(type=data_source, metavar="NAME|DIR",
                   help="a dataset (default: the data the run was converted on, as its meta.json records "
                        "it, else digits): digits (embedded), fashion_mnist, cifar10, synthetic "
                        "(CIFAR-shaped, made here); or a folder of your images in torchvision's "
                        "ImageFolder layout, DIR/CLASS/*.png (DIR/train/CLASS and DIR/test/CLASS, "
                        f"else one image in {TEST_EVERY} is the test split), scaled to [0, 1]"),
    "--image-size": dict(type=positive_int, metavar="N",
                         help="with --data DIR: resize every image to N x N (default: as they are, "
                              "all of one size)"),
    "--data-root": dict(help="folder of the dataset's files (Fashion-MNIST IDX, CIFAR-10)"),
    "--download": dict(action="store_true", help="download the dataset if missing"),
    "--batch-size": dict(type=positive_int, default=64, help="batch size (default 64)"),
    "--limit": dict(type=positive_int, help="use only N test images, a sample that keeps each class's "
                                           "share (the same for every command and --seed)"),
    "--train-limit": dict(type=positive_int, help="use only N training images, a sample that keeps each "
                                                  "class's share"),
    "--model": dict(metavar="NAME|MODULE:FACTORY",
                    help="a zoo model (snnconv check --zoo lists them: small_cnn, resnet18, ...), or "
                         "your own as package.module:factory, a function that returns the nn.Module "
                         "(called without arguments; the current folder is importable)"),
    "--num-classes": dict(type=positive_int,
                          help="classes of a zoo model (default: the folder's with --data DIR, else 10)"),
    "--in-channels": dict(type=positive_int, help="input channels (default: from the data, or 3)"),
    "--T": dict(type=positive_int, nargs="+", default=[1, 2, 4, 8],
                help="time steps; several values evaluate at each (default 1 2 4 8)"),
    "--L": dict(type=positive_int, default=None, help="QCFS quantisation levels (default: T)"),
}

#: The parents a command picks from: name -> (help group, flags of :data:`FLAGS`).
PARENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "common": ("common", ("--out", "--device", "--seed", "--quiet")),
    "data": ("data", ("--data", "--image-size", "--data-root", "--download", "--batch-size", "--limit",
                      "--train-limit")),
    "test_data": ("data", ("--data", "--image-size", "--data-root", "--download", "--limit")),  # a test split
    "model": ("model", ("--model", "--num-classes", "--in-channels")),
    "time": ("time", ("--T",)),
    "levels": ("conversion", ("--L",)),
}


def parents() -> dict[str, argparse.ArgumentParser]:
    """One argparse parent per entry of :data:`PARENTS`, its flags in one help group."""
    out = {}
    for name, (title, flags) in PARENTS.items():
        parent = argparse.ArgumentParser(add_help=False)
        group = parent.add_argument_group(title)
        for flag in flags:
            group.add_argument(flag, **copy.deepcopy(FLAGS[flag]))  # a default list of its own
        out[name] = parent
    return out


def add_command(sub, name: str, help: str, example: str, parents: list,
                func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` states what it does and ends with an example."""
    p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                       epilog=f"example:\n  {example}", parents=parents,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func)
    return p


# --- helpers --------------------------------------------------------------------------------

def say(args, *msg) -> None:
    """Print unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        print(*msg, flush=True)


def out_dir(args, default: str) -> str:
    """``--out`` (else ``default``), created."""
    out = args.out or default
    os.makedirs(out, exist_ok=True)
    return out


#: What a run folder's commands write: ``convert --overwrite`` replaces these (and only these).
RUN_FILES = ("ann.pt", "snn.pt", "snn_finetuned.pt", "meta.json", "evaluation.json", "finetune.json",
             "accuracy_vs_T.png", "snn.nir", "snn.prefix.pt", "report.html", "diagnosis.json", "diagnosis.png")
RUN_FOLDERS = ("finetune", "backends")


def new_run_dir(args, default: str) -> tuple[str, str, list[str]]:
    """``--out`` (else ``default``) as the folder of a new run, the run's id, and the entries of
    an old run there that the new one replaces.

    A folder that holds a run (``meta.json`` or a network file) is refused unless
    ``--overwrite``; the old run's files (:data:`RUN_FILES`, :data:`RUN_FOLDERS`) are replaced
    only once the new run is complete (:class:`snnconv.io.atomic.StagedFolder`), and other files
    are left alone. The id goes into every file of the run. Nothing is created here.
    """
    import uuid

    out = args.out or default
    held = [f for f in RUN_FILES if os.path.lexists(os.path.join(out, f))] \
        + [f + "/" for f in RUN_FOLDERS if os.path.isdir(os.path.join(out, f))]
    if held and not getattr(args, "overwrite", False):
        raise UsageError(f"{out} holds a run ({', '.join(held)}); give another --out, or --overwrite "
                         "to replace that run's files once the new run is complete")
    return out, uuid.uuid4().hex, [f.rstrip("/") for f in held]


def recorded(folder: str, key: str) -> str | None:
    """The setting ``key`` (``run_id``, ``model``) recorded in ``folder``'s meta.json, or None (no
    meta.json, none recorded, or not a string)."""
    try:
        with open(os.path.join(folder, "meta.json")) as fh:
            found = json.load(fh).get("settings", {}).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and found else None


def load_snn(args, path: str, name: str = "snn.pt"):
    """``(snn, src)``: the network at ``path`` (a file, or a run folder's fine-tuned network, else
    its ``name``), checked to belong to the run of the folder's ``meta.json``; says which file.

    Raises:
        UsageError: no network there, or a file of another run than the folder's meta.json (a
            leftover of an earlier run in the same folder).
    """
    from snnconv.snn.network import SpikingNetwork

    src = snn_path(path, name)
    snn = SpikingNetwork.load(src)
    folder = os.path.dirname(src) or "."
    run, own = recorded(folder, "run_id"), snn.meta.get("run_id") if isinstance(snn.meta, dict) else None
    if run is not None and own != run:
        raise UsageError(f"{src} belongs to another run (run id {own}) than {folder}/meta.json "
                         f"(run id {run}): it was left by an earlier run in the same folder. Delete "
                         "it, or convert into a new folder (or with --overwrite)")
    say(args, f"using {src}" + (f" (run {run[:8]})" if run else ""))
    return snn, src


def write_json(path: str, data) -> None:
    """``data`` as indented JSON, written atomically."""
    from snnconv.io.atomic import atomic_write_text
    from snnconv.meta import jsonable

    atomic_write_text(path, json.dumps(data, indent=2, default=jsonable) + "\n")


#: What a message for missing dataset files says about downloading them, on the command line.
DOWNLOAD_HINT = "give --download (with --data-root DIR: where the files go)"


def _full_datasets(args):
    """``(train, test)`` of ``--data``: a dataset by name, or a folder of images."""
    from snnconv.data import image_folder, load

    if args.data not in DATASETS:  # a folder (data_source checked it)
        return image_folder(args.data, image_size=args.image_size)
    if args.image_size:
        raise UsageError(f"--image-size applies to a folder of images (--data DIR); --data {args.data} "
                         "has its own size")
    return load(args.data, root=args.data_root, download=args.download, seed=args.seed,
                download_hint=DOWNLOAD_HINT)


#: A test split of fewer images than this warns: one image moves its accuracy by more than a point.
MIN_TEST_IMAGES = 100
#: The seed of the stratified samples ``--limit`` and ``--train-limit`` draw: the same images
#: for every command and every ``--seed``, so that their results compare.
SUBSET_SEED = 0


def warn(text: str) -> None:
    """One line on stderr, ``warning: ...``, even with ``--quiet``."""
    print(f"warning: {one_line(text)}", file=sys.stderr, flush=True)


def recorded_data(args) -> None:
    """Fill ``--data`` (and, for a folder, ``--image-size``) where the command line left it out:
    the data the run that the command reads was converted on (``meta.json`` beside its network),
    else digits. Says which, once.

    Raises:
        UsageError: the run recorded a folder that is not there from here.
    """
    if getattr(args, "data", "") is not None:
        return
    path = getattr(args, "snn", None) or getattr(args, "file", None)
    settings: dict = {}
    meta = None
    if path:
        run_dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        meta = os.path.join(run_dir, "meta.json")
        try:
            if os.path.getsize(meta) < 64 * 2**20:  # a run's own record: small
                with open(meta, encoding="utf-8") as fh:
                    settings = (json.load(fh) or {}).get("settings") or {}
        except (OSError, ValueError, AttributeError):
            settings = {}
    data = settings.get("data_path") or settings.get("data") if isinstance(settings, dict) else None
    if not isinstance(data, str) or not data:
        args.data = "digits"
        return
    if data not in DATASETS and not os.path.isdir(data):
        raise UsageError(f"the run was converted on --data {data} ({meta}), which is not a folder from here; "
                         "give --data")
    args.data = data
    size = settings.get("image_size")
    if (data not in DATASETS and args.image_size is None and isinstance(size, list) and len(size) == 2
            and size[0] == size[1] and isinstance(size[0], int) and size[0] > 0):
        args.image_size = size[0]
    resized = f" --image-size {args.image_size}" if data not in DATASETS and args.image_size else ""
    say(args, f"data: --data {data}{resized}, as the run recorded it ({meta})")


def datasets(args):
    """``(train, test)`` for ``--data``, cut to ``--train-limit`` / ``--limit`` images: stratified
    samples (each class keeps its share, :func:`snnconv.data.stratified_subset`, seed
    :data:`SUBSET_SEED`). Says what a reader of the numbers must know: a folder that mixes gray and
    colour images, a sample that could not be stratified."""
    import warnings

    from snnconv.data import labels_of, stratified_subset

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        train, test = _full_datasets(args)
    for w in caught:
        warn(str(w.message))
    for flag, attr, split in (("--train-limit", "train_limit", "training"), ("--limit", "limit", "test")):
        n = getattr(args, attr, None)
        data = train if split == "training" else test
        if not n or n >= len(data):
            continue
        if labels_of(data) is None:
            warn(f"{flag} {n}: the labels of the {split} split are not known without reading every image, "
                 f"so the first {n} of its {len(data)} images are used, not a sample that keeps the "
                 "classes' shares")
        cut = stratified_subset(data, n, seed=SUBSET_SEED)
        if split == "training":
            train = cut
        else:
            test = cut
    return train, test


def subset_record(dataset) -> dict | None:
    """What a run records of a test split that ``--limit`` cut: the images used, of how many, and
    how they were drawn; None for a whole split."""
    from torch.utils.data import Subset

    from snnconv.data import labels_of

    if not isinstance(dataset, Subset):
        return None
    stratified = labels_of(dataset.dataset) is not None
    return {"images": len(dataset), "of": len(dataset.dataset),  # type: ignore[arg-type]  # sized
            "drawn": f"stratified by class, seed {SUBSET_SEED}" if stratified else "the first ones"}


def num_classes(args, dataset) -> int:
    """``--num-classes``, else the class folders of ``--data DIR``, else 10."""
    if args.num_classes:
        return args.num_classes
    while hasattr(dataset, "dataset") and not hasattr(dataset, "classes"):  # a Subset
        dataset = dataset.dataset
    return len(dataset.classes) if hasattr(dataset, "classes") else 10


def loaders(args):
    """``(train, test)`` loaders: the training one shuffled with ``--seed``."""
    import torch
    from torch.utils.data import DataLoader

    train, test = datasets(args)
    return (DataLoader(train, batch_size=args.batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(args.seed)),
            DataLoader(test, batch_size=max(args.batch_size, 256)))


def time_steps(args) -> list[int]:
    """``--T`` sorted, without repeats; UsageError below 1."""
    Ts = sorted(set(args.T))
    if Ts[0] < 1:
        raise UsageError(f"--T takes time steps >= 1, got {args.T}")
    return Ts


#: What a file is, by its first bytes: (magic, what it is, the command that reads it).
_FILE_KINDS = ((b"PK\x03\x04", "a torch.save file", ""),
               (b"\x89HDF\r\n\x1a\n", "an HDF5 file (a NIR graph?)", "snnconv inspect and snnconv run read it"),
               (b"\x89PNG", "a PNG image", ""),
               (b"{", "a JSON file (a run's record)", "snnconv report reads the run folder holding it"),
               (b"<", "an HTML or XML file", ""))


def _file_kind(path: str) -> tuple[str, str]:
    """``(what the file is, what reads it)`` by its first bytes; ``("", "")`` when unknown or not
    a regular file (a FIFO or a device is never opened here: the reader refuses it by name)."""
    if not os.path.isfile(path):
        return "", ""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64).lstrip()
    except OSError:
        return "", ""
    return next(((what, reader) for magic, what, reader in _FILE_KINDS if head.startswith(magic)), ("", ""))


def _not_a(path: str, want: str, kind: tuple[str, str], hint: str) -> UsageError:
    what, reader = kind
    return UsageError(f"{path} is {what}, not {want}{' (' + reader + ')' if reader else ''}; {hint}")


def snn_path(path: str, name: str = "snn.pt") -> str:
    """A saved SpikingNetwork: the file itself, or ``name`` in a run folder (the fine-tuned one
    first); a file that is plainly something else (JSON, NIR, an image) is refused by what it is."""
    if os.path.isdir(path):
        for candidate in ("snn_finetuned.pt", name):
            if os.path.exists(os.path.join(path, candidate)):
                return os.path.join(path, candidate)
        raise UsageError(f"{path} holds no snn.pt; run 'snnconv convert --out {path}' first")
    if not os.path.exists(path):
        raise UsageError(f"{path} does not exist")
    kind = _file_kind(path)
    if kind[0] and kind[0] != "a torch.save file":
        folder = os.path.dirname(path) or "."
        raise _not_a(path, "a saved network", kind,
                     f"give a network file (snn.pt, written by snnconv convert) or its run folder ({folder})")
    return path


def nir_path(path: str) -> str:
    """A NIR file: the file itself, or ``snn.nir`` in a run folder (UsageError otherwise)."""
    if os.path.isdir(path):
        inside = os.path.join(path, "snn.nir")
        if os.path.isfile(inside):
            return inside
        raise UsageError(f"{path} is a folder without snn.nir; give a NIR file, or a run folder "
                         f"holding snn.nir (snnconv export {path} writes it)")
    if not os.path.exists(path):
        raise UsageError(f"{path} does not exist; give a NIR file (snnconv export writes one)")
    kind = _file_kind(path)
    if kind[0] and not kind[0].startswith("an HDF5"):
        raise _not_a(path, "a NIR file", kind, f"give a NIR file (snnconv export {path} writes one "
                     "from a network file)" if kind[0] == "a torch.save file" else
                     "give a NIR file (snnconv export writes one)")
    return path


def _zoo_or_import(spec: str) -> Callable[[int, int], Any]:
    """``--model``: a builder ``(num_classes, in_channels) -> nn.Module`` for a zoo name, or for
    ``package.module:factory`` (called without arguments, the current folder importable)."""
    import importlib

    from snnconv import models

    if ":" not in spec:
        if spec in models.names():
            return lambda classes, channels: models.get(spec, num_classes=classes, in_channels=channels)
        import torchvision.models as tvm

        tv = (f"; torchvision's is --model torchvision.models:{spec} (its default classes and input)"
              if callable(getattr(tvm, spec, None)) else "")
        raise UsageError(f"--model {spec}: no such zoo model (the zoo: {', '.join(models.names())}); give "
                         f"your own as --model package.module:factory{tv}")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--model {spec}: expected package.module:factory (e.g. mynets:build)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error of theirs, said in one line
        raise UsageError(f"--model {spec}: cannot import {module_name} ({type(exc).__name__}: "
                         f"{one_line(exc)[:200]}); it must be importable from the current folder or "
                         "PYTHONPATH") from None
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise UsageError(f"--model {spec}: {module_name} has no function {attr!r} (found "
                         f"{type(factory).__name__})")

    def build(classes: int, channels: int):
        import torch.nn as nn

        try:
            model = factory()
        except Exception as exc:
            raise UsageError(f"--model {spec}: {attr}() raised {type(exc).__name__}: "
                             f"{one_line(exc)[:200]}") from None
        if not isinstance(model, nn.Module):
            raise UsageError(f"--model {spec}: {attr}() returned a {type(model).__name__}, not an "
                             "nn.Module")
        return model

    return build


def model_builder(spec: str | None) -> Callable[[int, int], Any]:
    """The builder of ``--model`` (:func:`_zoo_or_import`); UsageError without ``--model``."""
    if not spec:
        from snnconv import models

        raise UsageError(f"give --model NAME (a zoo model: {', '.join(models.names())}) or your own "
                         "as --model package.module:factory")
    return _zoo_or_import(spec)


def _read_state(path: str, trusted: str):
    """The tensors of a ``torch.save`` file, read with :func:`snnconv.io.torchfile.load_untrusted`
    (weights only); a file of pickled objects is refused, naming what it holds."""
    import torch

    from snnconv.errors import CheckpointError
    from snnconv.io.torchfile import load_untrusted

    try:
        return load_untrusted(path, "state dict")
    except CheckpointError as exc:
        if "UnpicklingError" not in str(exc):
            raise
        try:
            found = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(path)[:3])
        except Exception:
            found = "objects"
        raise CheckpointError(
            f"{path} holds pickled Python objects ({found}), not only tensors: a whole saved "
            "module? It is not unpickled, because that would run code from the file. Save "
            f"model.state_dict() with torch.save and give that file{trusted}") from None


def load_model(path: str, model_name: str | None, num_classes: int, in_channels: int,
               trust_pickle: bool, pickle_flag: bool = False):
    """``--model`` (a zoo name or ``package.module:factory``) with the state dict at ``path``, or
    (``trust_pickle``) a whole pickled module.

    ``pickle_flag``: the command has ``--trust-pickle`` (its messages may point at it).
    """
    import torch

    from snnconv import models
    from snnconv.errors import CheckpointError

    if not os.path.isfile(path):
        raise UsageError(f"{path} is a folder, not a saved model" if os.path.isdir(path)
                         else f"{path} does not exist")
    trusted = (" (or, for a file you trust, --trust-pickle without --model to unpickle it)"
               if pickle_flag else "")
    if model_name:
        model = model_builder(model_name)(num_classes, in_channels)
        state = _read_state(path, trusted)
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict of "
                               f"'{model_name}'; save model.state_dict() with torch.save")
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            fits = "" if ":" in model_name else f" (num_classes={num_classes}, in_channels={in_channels})"
            raise CheckpointError(f"{path} does not fit model '{model_name}'{fits}: {exc}") from exc
        return model
    if not trust_pickle:
        raise UsageError(f"{path}: give --model NAME (one of {', '.join(models.names())}) or "
                         f"package.module:factory to read it as that model's state dict{trusted}")
    try:
        model = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot unpickle {path} ({type(exc).__name__}: {one_line(exc)[:200]})") from None
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"{path} holds a {type(model).__name__}, not an nn.Module")
    return model


def evaluation(args, snn, test_loader, Ts: list[int], label: str) -> dict:
    """``evaluation.json``'s record (:func:`snnconv.analysis.activity.evaluation_record`), announced, with
    the data it was measured on (``data``, ``images``) and the network's run id."""
    from snnconv.analysis.activity import evaluation_record
    from snnconv.analysis.summary import images_in

    say(args, f"evaluating {label} at T = {', '.join(map(str, Ts))} ...")
    rec = evaluation_record(snn, test_loader, Ts, device=args.device, label=label,
                            progress=not args.quiet)
    rec.update(data=args.data, images=images_in(test_loader),
               run_id=snn.meta.get("run_id") if isinstance(snn.meta, dict) else None)
    subset = subset_record(getattr(test_loader, "dataset", None))
    if subset is not None:
        rec["test_subset"] = subset
    return rec


def few_images(args, images: int | None) -> None:
    """Warn (even with ``--quiet``) where accuracies rest on fewer than :data:`MIN_TEST_IMAGES`."""
    if images is not None and images < MIN_TEST_IMAGES:
        warn(f"the accuracies of this run were measured on {images} test image(s) of --data {args.data}: on fewer "
             f"than {MIN_TEST_IMAGES}, one image moves an accuracy by {100 / max(1, images):.0f} point(s), "
             "so they say little; give more test images (a folder DIR/test/CLASS, or more images per class)")


def print_accuracy(args, rows: list[tuple[str, float]], images: int | None = None) -> None:
    """A two-column table: what was measured, its accuracy in percent (on ``images`` test images);
    fewer than :data:`MIN_TEST_IMAGES` images warn (even with ``--quiet``)."""
    few_images(args, images)
    say(args, f"\n{'':28}accuracy (%)" + (f" on {images:,} test images" if images else ""))
    for name, value in rows:
        say(args, f"{name:28}{value:6.2f}")


class Heartbeat:
    """Progress of a long loop on stderr: a line every ``interval`` seconds (from a thread, so a
    single long step still shows signs of life) and, once the first step is done, how long
    the whole loop will take, when that is more than ``interval``. Nothing when ``quiet`` or
    when the loop ends within ``interval``.

        with Heartbeat("lava", total=449, unit="images") as beat:
            for batch in batches:
                ...
                beat.update(len(batch))
    """

    def __init__(self, desc: str, total: int, *, unit: str = "images", interval: float = 5.0,
                 quiet: bool = False, file: Any = None):
        self.desc, self.total, self.unit = desc, int(total), unit
        self.interval, self.quiet, self.file = float(interval), quiet, file
        self.done = 0
        self.start = self._updated = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _print(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self.file if self.file is not None else sys.stderr, flush=True)

    def line(self) -> str:
        """``"32/449 images, 1 min 05 s elapsed, about 12 min left"``."""
        now = time.monotonic()
        text = f"{self.done}/{self.total} {self.unit}, {duration(now - self.start)} elapsed"
        if self.done:  # at the pace measured up to the last update, less the time since then
            at_update = self._updated - self.start
            left = at_update / self.done * (self.total - self.done) - (now - self._updated)
            text += f", about {duration(max(left, 0.0))} left"
        return text

    def update(self, n: int) -> None:
        """``n`` more items done; after the first step, the estimate for the whole loop."""
        first = self.done == 0
        self.done += int(n)
        self._updated = time.monotonic()
        if first and not self.quiet and self.done < self.total:
            elapsed = self._updated - self.start
            whole = elapsed / self.done * self.total
            if whole > self.interval:
                self._print(f"the first {self.done} {self.unit} took {duration(elapsed)}: about "
                            f"{duration(whole)} for all {self.total} (--limit N runs fewer)")

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self._print(self.line())

    def __enter__(self) -> "Heartbeat":
        if not self.quiet:
            self._thread = threading.Thread(target=self._beat, name="snnconv-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
