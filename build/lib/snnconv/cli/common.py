"""What the commands share: the shared flags (defined once, as argparse parents), the parser
class, and the helpers that load a model, data or a saved SNN and write a run folder's files."""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any, Callable

from ..data import DATASETS

__all__ = ["UsageError", "Parser", "FLAGS", "PARENTS", "parents", "add_command", "say", "out_dir",
           "write_json", "datasets", "loaders", "time_steps", "snn_path", "load_model",
           "evaluation", "print_accuracy"]


class UsageError(Exception):
    """A command line that cannot be acted on (exit 2, one line on stderr)."""


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
    "--data": dict(default="digits", choices=DATASETS,
                   help="dataset (default digits, embedded; synthetic: CIFAR-shaped, made here)"),
    "--data-root": dict(help="folder of the dataset's files (Fashion-MNIST IDX, CIFAR-10)"),
    "--download": dict(action="store_true", help="download the dataset if missing"),
    "--batch-size": dict(type=int, default=64, help="batch size (default 64)"),
    "--limit": dict(type=int, help="use only the first N test images"),
    "--train-limit": dict(type=int, help="use only the first N training images"),
    "--model": dict(help="zoo model name (small_cnn, resnet18, ...; see snnconv check --zoo)"),
    "--num-classes": dict(type=int, default=10),
    "--in-channels": dict(type=int, help="input channels (default: from the data, or 3)"),
    "--T": dict(type=int, nargs="+", default=[1, 2, 4, 8],
                help="time steps; several values evaluate at each (default 1 2 4 8)"),
    "--L": dict(type=int, default=None, help="QCFS quantisation levels (default: T)"),
}

#: The parents a command picks from: name -> (help group, flags of :data:`FLAGS`).
PARENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "common": ("common", ("--out", "--device", "--seed", "--quiet")),
    "data": ("data", ("--data", "--data-root", "--download", "--batch-size", "--limit", "--train-limit")),
    "test_data": ("data", ("--data", "--data-root", "--limit")),  # a test split only, no loader
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


def write_json(path: str, data) -> None:
    """``data`` as indented JSON, written atomically."""
    from ..meta import atomic_write_text, jsonable

    atomic_write_text(path, json.dumps(data, indent=2, default=jsonable) + "\n")


def datasets(args):
    """``(train, test)`` for ``--data``, cut to ``--train-limit`` / ``--limit`` images."""
    from torch.utils.data import Subset

    from ..data import load

    train, test = load(args.data, root=args.data_root, download=args.download, seed=args.seed)
    if args.train_limit:
        train = Subset(train, range(min(args.train_limit, len(train))))
    if args.limit:
        test = Subset(test, range(min(args.limit, len(test))))
    return train, test


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


def snn_path(path: str, name: str = "snn.pt") -> str:
    """A saved SpikingNetwork: the file itself, or ``name`` in a run folder (the fine-tuned one first)."""
    if os.path.isdir(path):
        for candidate in ("snn_finetuned.pt", name):
            if os.path.exists(os.path.join(path, candidate)):
                return os.path.join(path, candidate)
        raise UsageError(f"{path} holds no snn.pt; run 'snnconv convert --out {path}' first")
    if not os.path.exists(path):
        raise UsageError(f"{path} does not exist")
    return path


def load_model(path: str, model_name: str | None, num_classes: int, in_channels: int,
               trust_pickle: bool):
    """A zoo model with the state dict at ``path``, or (``trust_pickle``) a whole pickled module."""
    import torch

    from .. import models
    from ..errors import SnnconvError

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


def evaluation(args, snn, test_loader, Ts: list[int], label: str) -> dict:
    """``evaluation.json``'s record (:func:`snnconv.analysis.evaluation_record`), announced."""
    from ..analysis import evaluation_record

    say(args, f"evaluating {label} at T = {', '.join(map(str, Ts))} ...")
    return evaluation_record(snn, test_loader, Ts, device=args.device, label=label,
                             progress=not args.quiet)


def print_accuracy(args, rows: list[tuple[str, float]]) -> None:
    """A two-column table: what was measured, its accuracy in percent."""
    say(args, f"\n{'':28}accuracy (%)")
    for name, value in rows:
        say(args, f"{name:28}{value:6.2f}")
