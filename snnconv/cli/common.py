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

from ..data import DATASETS

__all__ = ["UsageError", "check_device", "Parser", "FLAGS", "PARENTS", "parents", "add_command", "say", "out_dir",
           "write_json", "datasets", "loaders", "time_steps", "snn_path", "nir_path", "load_model",
           "RUN_FILES", "new_run_dir", "load_snn",
           "evaluation", "print_accuracy", "one_line", "positive_int", "positive_float", "count", "duration",
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
    "--batch-size": dict(type=positive_int, default=64, help="batch size (default 64)"),
    "--limit": dict(type=positive_int, help="use only the first N test images"),
    "--train-limit": dict(type=positive_int, help="use only the first N training images"),
    "--model": dict(help="zoo model name (small_cnn, resnet18, ...; see snnconv check --zoo)"),
    "--num-classes": dict(type=positive_int, default=10),
    "--in-channels": dict(type=positive_int, help="input channels (default: from the data, or 3)"),
    "--T": dict(type=positive_int, nargs="+", default=[1, 2, 4, 8],
                help="time steps; several values evaluate at each (default 1 2 4 8)"),
    "--L": dict(type=positive_int, default=None, help="QCFS quantisation levels (default: T)"),
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


#: What a run folder's commands write: ``convert --overwrite`` removes these (and only these).
RUN_FILES = ("ann.pt", "snn.pt", "snn_finetuned.pt", "meta.json", "evaluation.json", "finetune.json",
             "accuracy_vs_T.png", "snn.nir", "snn.prefix.pt", "report.html")
RUN_FOLDERS = ("finetune", "backends")


def new_run_dir(args, default: str) -> tuple[str, str]:
    """``--out`` (else ``default``) as the folder of a new run, and the run's id.

    A folder that holds a run (``meta.json`` or a network file) is refused unless
    ``--overwrite``, which first removes the old run's files (:data:`RUN_FILES`,
    :data:`RUN_FOLDERS`); other files are left alone. The id goes into every file of the run.
    """
    import shutil
    import uuid

    out = args.out or default
    held = [f for f in RUN_FILES if os.path.lexists(os.path.join(out, f))] \
        + [f + "/" for f in RUN_FOLDERS if os.path.isdir(os.path.join(out, f))]
    if held and not getattr(args, "overwrite", False):
        raise UsageError(f"{out} holds a run ({', '.join(held)}); give another --out, or --overwrite "
                         "to remove that run's files first")
    for f in held:
        path = os.path.join(out, f.rstrip("/"))
        shutil.rmtree(path) if f.endswith("/") else os.remove(path)
    os.makedirs(out, exist_ok=True)
    return out, uuid.uuid4().hex


def _run_id_of(folder: str) -> str | None:
    """The run id recorded in ``folder``'s meta.json, or None (no meta.json, or none recorded)."""
    try:
        with open(os.path.join(folder, "meta.json")) as fh:
            found = json.load(fh).get("settings", {}).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def load_snn(args, path: str, name: str = "snn.pt"):
    """``(snn, src)``: the network at ``path`` (a file, or a run folder's fine-tuned network, else
    its ``name``), checked to belong to the run of the folder's ``meta.json``; says which file.

    Raises:
        UsageError: no network there, or a file of another run than the folder's meta.json (a
            leftover of an earlier run in the same folder).
    """
    from ..network import SpikingNetwork

    src = snn_path(path, name)
    snn = SpikingNetwork.load(src)
    folder = os.path.dirname(src) or "."
    run, own = _run_id_of(folder), snn.meta.get("run_id") if isinstance(snn.meta, dict) else None
    if run is not None and own != run:
        raise UsageError(f"{src} belongs to another run (run id {own}) than {folder}/meta.json "
                         f"(run id {run}): it was left by an earlier run in the same folder. Delete "
                         "it, or convert into a new folder (or with --overwrite)")
    say(args, f"using {src}" + (f" (run {run[:8]})" if run else ""))
    return snn, src


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
    return path


def load_model(path: str, model_name: str | None, num_classes: int, in_channels: int,
               trust_pickle: bool, pickle_flag: bool = False):
    """A zoo model with the state dict at ``path``, or (``trust_pickle``) a whole pickled module.

    ``pickle_flag``: the command has ``--trust-pickle`` (its messages may point at it).
    """
    import pickle

    import torch

    from .. import models
    from ..errors import SnnconvError

    if not os.path.isfile(path):
        raise UsageError(f"{path} is a folder, not a saved model" if os.path.isdir(path)
                         else f"{path} does not exist")
    trusted = (" (or, for a file you trust, --trust-pickle without --model to unpickle it)"
               if pickle_flag else "")
    if model_name:
        model = models.get(model_name, num_classes=num_classes, in_channels=in_channels)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
            if found is None:  # not a pickle of objects: a damaged or foreign file
                raise SnnconvError(f"cannot read {path} as a torch file of tensors (it is damaged "
                                   "or not a torch.save file)") from None
            raise SnnconvError(
                f"{path} holds pickled Python objects ({found.group(1)}), not only tensors: a whole "
                "saved module? It is not unpickled, because that would run code from the file. Save "
                f"model.state_dict() with torch.save and give that file{trusted}") from None
        except Exception as exc:
            raise SnnconvError(f"cannot read {path} as a torch file of tensors ({type(exc).__name__}: "
                               f"{one_line(exc)[:200]})") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise SnnconvError(f"{path} holds a {type(state).__name__}, not a state dict of "
                               f"'{model_name}'; save model.state_dict() with torch.save")
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise SnnconvError(f"{path} does not fit model '{model_name}' (num_classes={num_classes}, "
                               f"in_channels={in_channels}): {exc}") from exc
        return model
    if not trust_pickle:
        raise UsageError(f"{path}: give --model NAME (one of {', '.join(models.names())}) to read it "
                         f"as that model's state dict{trusted}")
    try:
        model = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise SnnconvError(f"cannot unpickle {path} ({type(exc).__name__}: {one_line(exc)[:200]})") from None
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


def duration(seconds: float) -> str:
    """``"45 s"``, ``"3 min 20 s"``, ``"2 h 05 min"``."""
    s = int(round(seconds))
    if s < 60:
        return f"{max(seconds, 0):.0f} s" if seconds >= 1 else f"{max(seconds, 0):.1f} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


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
