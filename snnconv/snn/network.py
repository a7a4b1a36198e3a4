"""The converted network (:class:`SpikingNetwork`) and its file format.

A file holds weights, thresholds, T, metadata and the graph as plain data (no pickled code), so
that ``torch.load(weights_only=True)`` reads it. The graph is written and read with one schema
(:mod:`snnconv.snn.graphfile`): every field is validated against allow-lists before torch.fx sees
it, so loading a file never runs code from it. Version 2 files also hold ``"digest"``, the
:func:`snnconv.io.digest.content_digest` of
everything else in the payload, checked on load; every module's parameter shapes are computed
from its config and compared with the stored tensors before a module is built.
"""

from __future__ import annotations

import io
import math
import numbers
import os
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.config import MAX_T
from snnconv.errors import CheckpointError, ConfigError, DataError
from snnconv.exit_rule import ExitRule, stored_rule
from snnconv.graph import largest_value
from snnconv.io.atomic import atomic_write_bytes
from snnconv.io.digest import content_digest
from snnconv.io.torchfile import load_untrusted
from snnconv.snn.graphfile import FUNCTIONS, graph_from_dict, graph_to_dict
from snnconv.snn.neuron import IFNeuron, LeakyNeuron, Scale, TimeExpand, neurons
from snnconv.snn.stepping import ExitRun, Stepper, run_chunk_with_exit

__all__ = ["FORMAT", "FORMAT_VERSION", "CHUNK_BYTES", "EXIT_CHUNK_STEPS", "FUNCTIONS", "SpikingNetwork", "check_T",
           "images_per_chunk", "graph_to_dict", "graph_from_dict"]

FORMAT = "snnconv.spiking"  # the format's name, written in every file (not a module path)
#: 2: with a content digest (the only version read)
FORMAT_VERSION = 2

# Largest value of one chunk, in SpikingNetwork's forward and in bias calibration's lockstep
# (which keeps every chunk's values alive at once): blocks above glibc's largest mmap threshold
# (32 MiB) are mapped afresh for every value, and the page faults cost more than the arithmetic
# (ResNet-18 at T=8: 7.8 million faults, 1.9x a T-step pass; 0.5 million and 1.3x in chunks
# under this size).
CHUNK_BYTES = 16 * 2**20
#: :meth:`SpikingNetwork.run_with_exit` steps the images of one chunk of this many steps at a time.
EXIT_CHUNK_STEPS = 4


def check_T(T: Any, name: str = "T (number of time steps)") -> None:
    """Refuse a step count that is not an integer >= 1 (``ValueError`` naming ``name``)."""
    if isinstance(T, bool) or not isinstance(T, numbers.Integral) or T < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {T!r}")


def images_per_chunk(chunk_size: int, T: int, per_image: int) -> int:
    """Inputs per chunk of a CPU pass at ``T`` steps: ``chunk_size // T``, fewer where the largest
    value (``per_image`` bytes for one input, all T steps) would pass :data:`CHUNK_BYTES`; at
    least one."""
    return max(1, min(chunk_size // T, CHUNK_BYTES // max(1, per_image)))


class SpikingNetwork(nn.Module):
    """A converted SNN: direct encoding, IF neurons, readout averaged over ``T`` steps.

    ``snn(x)`` takes a static batch ``[B, ...]``, presents it at every step and returns the
    readout averaged over T, ``[B, classes]``. ``snn.run(x)`` returns per-step readouts
    ``[T, B, ...]`` (and per-layer spike counts on request); ``snn.run_with_exit(x)`` stops
    each image at the step where its answer is sure (early exit). Neuron state starts fresh at
    every call.

    Time is folded into the batch (``[T*B, ...]`` through every layer). Without gradients on
    CPU, the batch is cut into chunks of at most ``chunk_size`` time-folded samples
    (``chunk_size // T`` inputs, fewer where a value would exceed 16 MiB) so that activations
    stay cache-sized: the same result, about 2x faster on the Fashion-MNIST ResNet-14 at T=8.
    ``chunk_size = 0`` turns this off.
    """

    def __init__(self, net: fx.GraphModule, T: int = 8):
        super().__init__()
        self.net = net
        self.meta: dict[str, Any] = {}
        self.chunk_size = 256
        self._largest: dict[tuple, int] = {}  # largest value per (graph, input shape, dtype, T)
        self.T = T

    @property
    def T(self) -> int:
        return self._T

    @T.setter
    def T(self, value: int) -> None:
        check_T(value)
        value = int(value)
        self._T = value
        for m in self.net.modules():
            if isinstance(m, (IFNeuron, LeakyNeuron, TimeExpand)):
                m.T = value

    def check_input(self, x: torch.Tensor) -> None:
        """Refuse an input that is not a static batch ``[B, *input_shape]`` of finite values
        (``DataError`` saying what was given)."""
        shape = self.meta.get("input_shape") if isinstance(self.meta, dict) else None
        if isinstance(x, torch.Tensor) and shape is not None and x.dim() != len(shape) + 1:
            raise DataError(f"the network takes a static batch [B, {', '.join(map(str, shape))}] "
                            f"(presented at each of the T steps); got an input of shape "
                            f"{tuple(x.shape)}. A sequence [T, B, ...] runs on a backend: "
                            "snnconv.backends.get('cpu').compile(export_nir(snn)).run(x)")
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise DataError(f"the input holds {int((~torch.isfinite(x)).sum())} NaN or infinite "
                            f"value(s) (shape {tuple(x.shape)}); give finite values (check the data "
                            "and its preprocessing)")

    def _steps(self, x: torch.Tensor, T: int) -> torch.Tensor:
        self.check_input(x)
        parts = [x]
        old = self.T
        self.T = T
        try:
            if self.chunk_size and x.device.type == "cpu" and not torch.is_grad_enabled():
                parts = x.split(self._chunk_images(x, T))
            outs = [self.net(part) for part in parts]
        finally:
            self.T = old
        outs = [o.reshape(T, len(p), *o.shape[1:]) for o, p in zip(outs, parts)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _chunk_images(self, x: torch.Tensor, T: int) -> int:
        """Inputs per chunk (:func:`images_per_chunk`), the largest value measured once per input
        shape and T, on one input (ResNet-18 at T=16: a 64 MiB value per chunk of 256 samples)."""
        key = (id(self.net), tuple(x.shape[1:]), x.dtype, T)
        sizes = self._largest
        if key not in sizes:
            old = self.T
            self.T = T
            try:
                sizes[key] = largest_value(self.net, x[:1])
            finally:
                self.T = old
        return images_per_chunk(self.chunk_size, T, sizes[key])

    def forward(self, x: torch.Tensor, per_step: bool = False) -> torch.Tensor:
        """The readout averaged over T steps, ``[B, ...]`` (``per_step=True``: ``[T, B, ...]``)."""
        steps = self._steps(x, self.T)
        return steps if per_step else steps.mean(0)

    def rate(self, x: torch.Tensor, levels: int) -> torch.Tensor:
        """The network's rate function with ``levels`` quantisation steps, in one pass, ``[B, ...]``.

        Every IF neuron is replaced by the spike rate it reaches on a constant input in
        ``levels`` steps, ``clamp(floor(levels * x / theta + 1/2), 0, levels) / levels`` (QCFS),
        with a straight-through gradient; the weights are the SNN's. This is the QCFS-ANN the
        network computes when every layer's input is constant in time, and what ``snn(x)``
        tends to as T grows (for a large ``levels``): after BPTT at a few steps, compare the two
        to see what fine-tuning did to the many-step behaviour. A calibrated initial membrane
        (``IFNeuron.v_init``) is not part of this limit: every neuron uses QCFS's shift of 1/2.
        """
        check_T(levels, "levels (quantisation steps)")
        units = list(neurons(self.net).values())
        old = self.T
        self.T = 1
        try:
            for m in units:
                m.rate_levels = int(levels)
            return self.net(x)
        finally:
            for m in units:
                m.rate_levels = 0
            self.T = old

    def run(self, x: torch.Tensor, T: int | None = None, *, spike_counts: bool = False):
        """Per-step readouts ``[T, B, ...]``; with ``spike_counts``, also ``{layer: [T] counts}``.

        The counts are the number of spikes each IF layer emitted at each step, summed over
        the batch and the layer's neurons.
        """
        T = self.T if T is None else T
        check_T(T)
        T = int(T)
        counts: dict[str, torch.Tensor] = {}
        handles = []
        if spike_counts:
            for name, m in neurons(self.net).items():
                def hook(mod, inp, out, name=name):
                    # summed over the chunks of one call (see ``chunk_size``)
                    counts[name] = counts.get(name, 0) + out.detach().reshape(mod.T, -1).sum(1)
                handles.append(m.register_forward_hook(hook))
        try:
            out = self._steps(x, T)
        finally:
            for h in handles:
                h.remove()
        return (out, counts) if spike_counts else out

    def run_with_exit(self, x: torch.Tensor, rule: ExitRule | None | str = "stored", T: int | None = None
                      ) -> ExitRun:
        """Each image run until its answer is sure: ``(output [B, classes], steps [B])``.

        The batch runs one step at a time (:class:`~snnconv.snn.stepping.Stepper`); after step
        ``k`` the images whose accumulated readout meets ``rule`` (:meth:`ExitRule.met
        <snnconv.exit_rule.ExitRule.met>`) leave the batch, so the later steps run only on the
        others. An image that exits at step ``k`` gets ``steps = k`` and its readout averaged
        over the steps it ran, ``accumulate(run(x, T))[k - 1] / k`` (the readouts of steps 1..k
        summed in step order, :func:`snnconv.exit_rule.accumulate`, divided by k; up to the
        rounding of the layers' kernels at another batch size, see
        :mod:`snnconv.snn.stepping`); one that never meets the rule runs all T steps. Without
        gradients; on CPU in chunks of the images of a 4-step chunk of :meth:`forward`
        (``chunk_size // 4``, 64 by default).

        Args:
            x: a static batch ``[B, ...]``.
            rule: an :class:`~snnconv.exit_rule.ExitRule`; ``"stored"`` (the default): the rule
                :func:`snnconv.calibrate_exit` stored in ``self.meta``, if any; ``None``: no
                early exit, every image runs T steps and ``output`` is ``self(x)`` at T, bit for bit.
            T: the most steps an image runs (default ``self.T``).

        Returns:
            :class:`~snnconv.snn.stepping.ExitRun` ``(output, steps)``.

        Raises:
            ConfigError: ``rule`` is neither an ExitRule, ``None`` nor ``"stored"``, or the rule
                stored in ``self.meta`` is malformed.
            DataError: ``x`` is not a batch this network takes, or its readout is not
                ``[B, classes]``.
        """
        T = self.T if T is None else T
        check_T(T)
        T = int(T)
        if isinstance(rule, str):
            if rule != "stored":
                raise ConfigError(f"rule must be an ExitRule, None (no early exit) or 'stored' (the rule "
                                  f"calibrate_exit stored with the network), got {rule!r}")
            rule = stored_rule(self.meta)
        elif rule is not None and not isinstance(rule, ExitRule):
            raise ConfigError(f"rule must be an ExitRule, None (no early exit) or 'stored', got a "
                              f"{type(rule).__name__}")
        was = self.training
        self.eval()
        try:
            with torch.no_grad():
                if rule is None:
                    out = self._steps(x, T)
                    return ExitRun(out.mean(0), torch.full((len(x),), T, dtype=torch.long, device=out.device))
                self.check_input(x)
                parts = [x]
                if self.chunk_size and x.device.type == "cpu":
                    # the images of a 4-step chunk at a time: each neuron's membrane stays cache-sized
                    # from step to step (measured on three Fashion-MNIST networks, steps cost 0.85-1.04x
                    # a step of the fixed-T pass in chunks of 64 images, 1.07-1.25x in chunks of 256)
                    parts = list(x.split(self._chunk_images(x, EXIT_CHUNK_STEPS)))
                stepper = Stepper(self.net)
                runs = [run_chunk_with_exit(stepper, part, rule, T) for part in parts]
        finally:
            self.train(was)
        if len(runs) == 1:
            return runs[0]
        return ExitRun(torch.cat([r.output for r in runs]), torch.cat([r.steps for r in runs]))

    def thresholds(self) -> dict[str, torch.Tensor]:
        """Each IF layer's threshold theta."""
        return {n: m.theta.detach().clone() for n, m in neurons(self.net).items()}

    # --- save / load (weights_only, no pickled code) ---

    def save(self, path: str | os.PathLike) -> None:
        """Write weights, thresholds, graph, T, metadata and their digest to ``path``.

        The file loads with ``torch.load(weights_only=True)``. ``path`` holds its old content or
        the whole new file, never a part; see :func:`snnconv.io.atomic.atomic_write_bytes` for what an
        interrupted write leaves and when it is removed.
        """
        payload = {"format": FORMAT, "version": FORMAT_VERSION, "T": self.T,
                   "graph": graph_to_dict(self.net), "state_dict": self.net.state_dict(),
                   "meta": _plain(self.meta)}
        payload["digest"] = content_digest(payload)
        buf = io.BytesIO()
        torch.save(payload, buf)
        atomic_write_bytes(path, buf.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike | io.BytesIO) -> "SpikingNetwork":
        """Read a network written by :meth:`save` (``torch.load(weights_only=True)``), in eval mode.

        A version 2 file must match its digest. Every module's parameter and buffer shapes are
        computed from its config and compared with the stored tensors before any module is
        built, so a config that declares more than the file stores allocates nothing.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointError: not a saved network, another format version, a digest that does
                not match, a T above :data:`snnconv.config.MAX_T`, a graph that cannot be
                rebuilt, or weights that do not match their modules (naming the layer, declared
                and stored shapes).
        """
        if isinstance(path, io.BytesIO):  # a file's bytes, read and checked by the caller
            payload = load_untrusted("<bytes>", "saved SpikingNetwork", data=path.getvalue())
        else:
            payload = load_untrusted(path, "saved SpikingNetwork")
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise CheckpointError(f"{path} is not a saved snnconv SpikingNetwork (format {found})")
        version = payload.get("version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise CheckpointError(f"{path} has format version {version!r}; this snnconv reads version "
                                  f"{FORMAT_VERSION} (files with a digest): convert the network again")
        _verify(path, payload)
        T = payload.get("T")
        if isinstance(T, numbers.Integral) and not isinstance(T, bool) and int(T) > MAX_T:
            raise CheckpointError(f"{path} declares T={T}, above the bound of {MAX_T} time steps")
        state = payload.get("state_dict")
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path}: its state_dict is not a dict of tensors")
        try:
            net = graph_from_dict(payload["graph"], state)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        except Exception as exc:  # KeyError, TypeError, RuntimeError from fx on a damaged graph
            raise CheckpointError(f"{path}: the saved graph cannot be rebuilt: "
                                  f"{type(exc).__name__}: {exc}") from exc
        _check_values(path, net)
        try:
            snn = cls(net, payload.get("T"))  # type: ignore[arg-type]  # checked by the constructor
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        meta = payload.get("meta", {})
        snn.meta = meta if isinstance(meta, dict) else {}
        _dry_run(path, snn)
        return snn.eval()  # freshly built modules start in training mode (dropout would be live)


#: The most values per channel an adaptive pooling layer of a saved network may produce (a
#: torchvision VGG's 7 x 7 is 49): its output is allocated at the first forward, unstored.
MAX_POOL_OUTPUT = 2**16


def _check_values(path: Any, net: fx.GraphModule) -> None:
    """What :func:`snnconv.snn.nir_io.load_nir`'s reader refuses is refused here too: non-finite
    weights, thresholds that are not positive, initial membranes outside [0, 1] (in units of
    theta), and adaptive pooling to more than :data:`MAX_POOL_OUTPUT` values per channel."""
    for name, t in net.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{path}: '{name}' holds {int((~torch.isfinite(t)).sum())} NaN or "
                                  "infinite value(s)")
    for name, mod in net.named_modules():
        if isinstance(mod, (IFNeuron, Scale)) and bool((mod.theta <= 0).any()):
            raise CheckpointError(f"{path}: '{name}' has a threshold <= 0 ({float(mod.theta.min())}); "
                                  "thresholds are positive")
        if isinstance(mod, IFNeuron) and bool(((mod.v_init < 0) | (mod.v_init > 1)).any()):
            raise CheckpointError(f"{path}: '{name}' starts its membrane outside [0, 1] x theta "
                                  f"(v_init from {float(mod.v_init.min())} to {float(mod.v_init.max())})")
        size = getattr(mod, "output_size", None)
        if isinstance(mod, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                            nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
            dims = size if isinstance(size, (tuple, list)) else (size,)
            count = 1
            for d in dims:
                count *= 1 if d is None else int(d)
            if count > MAX_POOL_OUTPUT or any(d is not None and int(d) < 1 for d in dims):
                raise CheckpointError(f"{path}: '{name}' pools to {tuple(dims)} ({count:,} values per "
                                      f"channel; at most {MAX_POOL_OUTPUT:,})")


def _dry_run(path: Any, snn: "SpikingNetwork") -> None:
    """One step on one zero input of the declared input shape: a graph that cannot run on it
    (arguments of the wrong kind, shapes that do not chain) is refused at load, not at first use."""
    shape = snn.meta.get("input_shape")
    if not (isinstance(shape, list) and 0 < len(shape) <= 4
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= 4096 for d in shape)):
        return  # a network without a recorded input shape (built by hand): checked at its first use
    if math.prod(shape) > 2**26:
        raise CheckpointError(f"{path}: its input shape {shape} is larger than snnconv runs")
    try:
        with torch.no_grad():
            snn.eval()._steps(torch.zeros(1, *shape), 1)
    except Exception as exc:  # what the graph does with its declared input: any failure is the file's
        raise CheckpointError(f"{path}: the saved network cannot run on its declared input shape "
                              f"{shape}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                              ) from None


def _verify(path: Any, payload: dict) -> None:
    stored = payload.get("digest")
    if not isinstance(stored, str):
        raise CheckpointError(f"{path} is a version {FORMAT_VERSION} SpikingNetwork file without "
                              "its digest: damaged or edited. Save the network again")
    try:
        actual = content_digest({k: v for k, v in payload.items() if k != "digest"})
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: its payload holds an unexpected value: {exc}") from exc
    if actual != stored:
        raise CheckpointError(f"{path} was changed after it was saved: its content does not match "
                              "its digest (damaged or edited). Save the network again")


def _plain(obj: Any) -> Any:
    """``obj`` with tensors as lists and tuples as lists: loadable with ``weights_only=True``."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)
