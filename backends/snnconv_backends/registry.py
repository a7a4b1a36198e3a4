"""The backend registry: what runs a NIR graph, found by name.

Built-in backends are a table ``name -> "module:Class"`` imported lazily (a backend whose
dependencies are missing costs nothing until it is asked for); third parties add theirs through
the entry-point group ``snnconv.backends`` (an entry point names a :class:`Backend` subclass or
instance). Built-in names win over entry points of the same name.

    >>> from snnconv_backends import available, get
    >>> available()                          # {"cpu": (True, ""), "gpu": (False, "no CUDA device"), ...}
    >>> result = get("cpu").compile(graph).run(x, T=8)
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch

from snnconv.errors import BackendError

__all__ = ["Backend", "Program", "RunResult", "Report", "RunWarning", "readout_exit", "BUILTINS",
           "ENTRY_POINT_GROUP", "available", "get", "names", "check_finite", "parse_graph"]

#: Built-in backends, imported only when asked for.
BUILTINS: dict[str, str] = {
    "cpu": "snnconv_backends.cpu:CPUBackend",
    "gpu": "snnconv_backends.gpu:GPUBackend",
    "loihi2-sim": "snnconv_backends.loihi2:Loihi2SimBackend",
    "lava": "snnconv_backends.lava:LavaBackend",
}

#: The entry-point group third-party backends register in (``pyproject.toml``:
#: ``[project.entry-points."snnconv.backends"] mine = "my_pkg.backend:MyBackend"``).
ENTRY_POINT_GROUP = "snnconv.backends"


@dataclass(frozen=True)
class RunResult:
    """What one run of a compiled graph gives.

    Attributes:
        outputs: per-step readout ``[T, B, *out_shape]``; its mean over T is the prediction.
        spikes: neuron op name -> ``[T]`` spike counts (summed over the batch and the neurons).
        synops: layer name -> synaptic operations (accumulates) over the whole run: for each
            layer fed by spikes, the sum over steps of (input spikes x fan-out).
        macs: layer name -> multiply-accumulates the ANN does for the same batch (once, not x T).
        extra: backend-specific records (quantisation, resources, energy, threshold ties...).
    """

    outputs: torch.Tensor
    spikes: dict[str, torch.Tensor]
    synops: dict[str, float]
    macs: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prediction(self) -> torch.Tensor:
        """The readout averaged over time, ``[B, *out_shape]``."""
        return self.outputs.mean(0)


def check_rule(rule: Any, backend: str) -> None:
    """Refuse an ``exit_rule`` that is neither None nor an :class:`snnconv.exit_rule.ExitRule`."""
    from snnconv.exit_rule import ExitRule

    if rule is not None and not isinstance(rule, ExitRule):
        raise BackendError(f"backend {backend!r}: exit_rule must be an snnconv.exit_rule.ExitRule or None, "
                           f"got a {type(rule).__name__}")


def readout_exit(result: RunResult, rule: Any, backend: str, steps: torch.Tensor | None = None) -> RunResult:
    """``result`` (a run of all T steps) with ``extra["early_exit"]``: ``rule`` applied to its
    readout, each image's exit step and answer (its readout averaged over the steps up to it).
    ``steps``: the exit steps where the backend counted each image's work up to them
    (``counted: "to exit"``); without, the counts and energy stay those of all T (``"all T"``)."""
    from snnconv.exit_rule import accumulate, exit_histogram

    check_rule(rule, backend)
    out = result.outputs.detach().float().cpu()
    counted = "all T" if steps is None else "to exit"
    if steps is None:
        steps = rule.exit_steps(out.reshape(out.shape[0], out.shape[1], -1))
    steps = steps.cpu()
    totals = accumulate(out)
    answers = totals[steps - 1, torch.arange(len(steps))] / steps.reshape(-1, *[1] * (out.dim() - 2)).float()
    result.extra["early_exit"] = {"rule": rule.to_dict(), "steps": steps, "output": answers,
                                  "mean_steps": float(steps.double().mean()),
                                  "histogram": exit_histogram(steps, out.shape[0]), "dropped": False,
                                  "counted": counted}
    return result


def check_finite(x: torch.Tensor, backend: str) -> None:
    """Refuse an input holding NaN or infinite values (``BackendError`` with their count and the
    first one's index): a spiking network would turn them into ordinary-looking outputs."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise BackendError(f"backend {backend!r}: the input holds {int(bad.sum())} NaN or infinite "
                           f"value(s), the first at index {first}; give finite values (check the "
                           "data and its preprocessing)")


def parse_graph(graph: Any, backend: str, dt: Any = 1.0, compare: Any = None):
    """``graph`` (a ``nir.NIRGraph``) read by the strict reader at time step ``dt`` (and the
    IF comparison ``compare``: None, the file's or the spec's; see ``snnconv.nir.reader.parse``); what it
    refuses (a node type or parameter no executor runs, a malformed graph) is a
    ``BackendError`` naming ``backend``, the reader's ``NIRError`` its cause."""
    import nir

    from snnconv.errors import NIRError
    from snnconv.nir.reader import parse

    if not isinstance(graph, nir.NIRGraph):
        raise BackendError(f"backend {backend!r} compiles a nir.NIRGraph, got {type(graph).__name__}"
                           " (read a file with nir.read or snnconv.snn.nir_io.load_nir)")
    try:
        return parse(graph, dt=dt, compare=compare)
    except NIRError as exc:
        raise BackendError(f"backend {backend!r} cannot run this graph: {exc}") from exc


class RunWarning(UserWarning):
    """A backend's warning about one run whose results may depart from what the graph means (a
    quantised network's rates, say); :meth:`Program.report` judges all the runs of a command at
    once, so a caller that runs many batches may silence it per batch."""


@dataclass(frozen=True)
class Report:
    """What a backend says about a command's runs beyond their outputs and counts.

    Attributes:
        text: its own report (resources, quantisation, energy on its hardware), printed under
            the results; empty where it has none.
        verdict: one line on whether the results can be trusted, printed always; None: nothing
            to say.
        warnings: departures beyond the backend's tolerances (a strict caller fails on any).
        record: entries for the run's JSON record.
        extra: the runs' ``extra`` merged into one (per-image figures over all the images);
            None: the last run's stands.
    """

    text: str = ""
    verdict: str | None = None
    warnings: tuple[str, ...] = ()
    record: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] | None = None


class Program(abc.ABC):
    """A graph compiled for one backend; :meth:`run` may be called many times."""

    #: images per :meth:`run` call a caller should use where it chooses (None: its own default)
    default_batch: int | None = None

    def report(self, runs: list[RunResult], *, analog_macs_per_image: float = 0.0) -> Report:
        """What the backend says about ``runs`` (the batches of one command, in order) beyond
        their outputs and counts; ``analog_macs_per_image``: the MACs of an analog prefix the
        caller ran before the graph (off this backend), for energy figures that compare whole
        networks. The default says nothing."""
        return Report()

    @abc.abstractmethod
    def run(self, x: torch.Tensor, T: int, *, exit_rule: Any = None) -> RunResult:
        """Run ``T`` steps on ``x``: a static batch ``[B, ...]`` (direct encoding) or ``[T, B, ...]``.

        ``exit_rule``: an :class:`snnconv.exit_rule.ExitRule`; each image's exit step and answer
        go to ``extra["early_exit"]`` (``rule``, ``steps`` ``[B]``, ``output``, ``mean_steps``,
        ``histogram``, ``dropped``). ``cpu`` and ``gpu`` drop an image from the batch at its exit
        (``dropped``: True); the chip backends run all T steps and apply the rule to the readout
        (:func:`readout_exit`).

        Raises:
            BackendError: ``x`` has the wrong shape or dtype, an empty batch, NaN or infinite
                values, or ``T < 1``.
        """


class Backend(abc.ABC):
    """One executor of NIR graphs (stateless; one instance per backend)."""

    #: The registry name ("cpu", "gpu", ...).
    name: str = ""

    def availability(self) -> tuple[bool, str]:
        """``(usable here?, why not)``; the reason is ``""`` when usable."""
        return True, ""

    @abc.abstractmethod
    def compile(self, graph: Any, **options: Any) -> Program:
        """Check ``graph`` (a ``nir.NIRGraph``) and prepare it to run.

        Raises:
            BackendError: a node or an option this backend does not support (named), or a
                malformed graph (never ``NIRError``: see :func:`parse_graph`).
        """


def _entry_points() -> dict[str, metadata.EntryPoint]:
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def names() -> list[str]:
    """Every backend name known here: the built-ins, then third parties' (sorted)."""
    extra = sorted(n for n in _entry_points() if n not in BUILTINS)
    return list(BUILTINS) + extra


def _instantiate(name: str, obj: Any, where: str) -> Backend:
    if isinstance(obj, type) and issubclass(obj, Backend):
        obj = obj()
    if not isinstance(obj, Backend):
        raise BackendError(
            f"backend {name!r} ({where}) is a {type(obj).__name__}, not a "
            "snnconv_backends.Backend subclass or instance; register a Backend subclass")
    if not obj.name:
        obj.name = name
    return obj


def _load(name: str) -> Backend:
    """Import backend ``name`` (BackendError when unknown or its module cannot be imported)."""
    if name in BUILTINS:
        target = BUILTINS[name]
        module, _, attr = target.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise BackendError(f"backend {name!r} is not installed: importing {target} failed "
                               f"({type(exc).__name__}: {exc})") from exc
        except AttributeError as exc:
            raise BackendError(f"backend {name!r}: {module} has no {attr}") from exc
        return _instantiate(name, obj, target)
    eps = _entry_points()
    if name not in eps:
        raise BackendError(
            f"unknown backend {name!r}; known: {', '.join(names())}. Third-party backends "
            f"register a Backend subclass in the entry-point group {ENTRY_POINT_GROUP!r}.")
    ep = eps[name]
    try:
        obj = ep.load()
    except Exception as exc:  # a third party's import error, whatever it is
        raise BackendError(f"backend {name!r}: loading entry point {ep.value!r} failed "
                           f"({type(exc).__name__}: {exc})") from exc
    return _instantiate(name, obj, f"entry point {ep.value}")


def available() -> dict[str, tuple[bool, str]]:
    """Every known backend -> ``(usable here?, why not)``; never raises."""
    out: dict[str, tuple[bool, str]] = {}
    for name in names():
        try:
            backend = _load(name)
            ok, reason = backend.availability()
            out[name] = (bool(ok), "" if ok else str(reason))
        except BackendError as exc:
            out[name] = (False, str(exc))
        except Exception as exc:  # a broken availability() must not hide the others
            out[name] = (False, f"availability check failed: {type(exc).__name__}: {exc}")
    return out


def get(name: str) -> Backend:
    """The backend called ``name``, ready to compile graphs.

    Raises:
        BackendError: no backend has this name (the message lists those that exist), or it
            cannot run here (the message says why).
    """
    if not isinstance(name, str):
        raise BackendError(f"a backend name is a string, got {type(name).__name__}")
    backend = _load(name)
    ok, reason = backend.availability()
    if not ok:
        raise BackendError(f"backend {name!r} is not usable here: {reason}")
    return backend
