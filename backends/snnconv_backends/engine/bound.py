"""The dense executor's bound: a parsed NIR graph bound to a device and dtype, run on one chunk
of a batch with time folded into it; and the checks of a backend's options, ``T`` and input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from snnconv.errors import BackendError
from snnconv.nir.leaky import SPIKING, STATEFUL
from snnconv_backends.engine.kernels import if_loop
from snnconv_backends.engine.leaky import leaky_fn
from snnconv_backends.engine.ops import OP_BUILDERS, RUNNABLE, to_tensor
from snnconv_backends.engine.stats import Stats, fanouts, macs_per_image
from snnconv_backends.registry import check_finite

__all__ = ["BoundGraph", "Carry", "check_options", "check_T"]


def check_options(backend: str, options: dict[str, Any], allowed: dict[str, Any]) -> dict[str, Any]:
    """``allowed`` updated with ``options``; BackendError naming any unknown option."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise BackendError(f"backend {backend!r} has no option {', '.join(map(repr, unknown))}; "
                           f"its options are {', '.join(sorted(allowed))}")
    out = dict(allowed)
    out.update(options)
    return out


def check_T(T: Any) -> int:
    """``T`` as an int >= 1 (BackendError otherwise)."""
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        try:
            ok = not isinstance(T, bool) and int(T) == T and T >= 1
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise BackendError(f"T (number of time steps) must be an integer >= 1, got {T!r}")
    return int(T)


@dataclass
class _Step:
    op: Any                         # the parsed Op
    fn: Any                         # the op's executor (a neuron's takes (u, T, static, stats, state)); None for input
    static: bool                    # depends only on the static input (runs once per chunk)
    last_use: int = -1              # index of the last step reading this value


class BoundGraph:
    """A parsed graph bound to a device and dtype; ``run`` executes it on one batch.

    Args:
        parsed: a ``ParsedGraph`` from :func:`snnconv.nir.reader.parse`.
        device, dtype: where and in which float type to compute.
        backend: the backend's name (for error messages).
        neuron_loop: ``(u, theta, T, static, reset, v0=None, burst=1) -> (spikes, batch sums or None)``
            (``v0``: the subtractive neuron's initial membrane per channel, None for 1/2); the
            default is the exact in-place loop :func:`if_loop`.
        neuron_dtype: the dtype of the membrane (default ``dtype``; float32 under bfloat16
            layers: spikes are exact in either, the membrane is not).
        tie_tolerance: count neuron updates with ``|h - threshold| <= tol * threshold`` (the
            spikes another rounding could flip); forces the loop.
    """

    def __init__(self, parsed: Any, *, device: torch.device, dtype: torch.dtype, backend: str,
                 neuron_loop: Callable | None = None, neuron_dtype: torch.dtype | None = None,
                 tie_tolerance: float | None = None):
        self.parsed = parsed
        self.device = torch.device(device)
        self.dtype = dtype
        self.neuron_dtype = neuron_dtype or dtype
        self.backend = backend
        self.tie_tolerance = tie_tolerance
        self.neuron_loop = if_loop if tie_tolerance is not None else (neuron_loop or if_loop)
        ops = list(parsed.ops)
        for op in ops:
            if op.kind not in RUNNABLE:
                raise BackendError(f"backend {backend!r} cannot run node '{op.name}' (kind "
                                   f"{op.kind!r}); it runs {', '.join(RUNNABLE)}")
        self.ops = ops
        self.by_name = {op.name: op for op in ops}
        self.input_shape = tuple(parsed.input_shape)
        self.output_shape = tuple(parsed.output_shape)
        self.reset = parsed.reset
        self.neurons = [op.name for op in ops if op.kind in SPIKING]
        index = {op.name: i for i, op in enumerate(ops)}
        static: dict[str, bool] = {}
        self.steps: list[_Step] = []
        for op in ops:
            if op.kind == "input":
                static[op.name] = True
            elif op.kind in STATEFUL:
                static[op.name] = False
            else:
                static[op.name] = all(static[i] for i in op.inputs)
            self.steps.append(_Step(op, self._make_fn(op), static[op.name]))
        for i, step in enumerate(self.steps):
            for src in step.op.inputs:
                self.steps[index[src]].last_use = max(self.steps[index[src]].last_use, i)
        self.static_ops = [s.op.name for s in self.steps if s.static and s.op.kind not in ("input",)]
        self.index = index
        # spikes x theta that only feed a sum: fused into it as addcmul (exact: s * theta is)
        users: dict[str, list[Any]] = {}
        for op in ops:
            for src in op.inputs:
                users.setdefault(src, []).append(op)
        self.lazy_scales = {
            op.name for op in ops
            if op.kind == "scale" and len(op.inputs) == 1 and self.by_name[op.inputs[0]].kind == "neuron"
            and int(self.by_name[op.inputs[0]].params.get("burst", 1)) == 1  # s * theta exact for s in {0, 1}
            and len(users.get(op.name, ())) == 1 and len(users[op.name][0].inputs) >= 2
            and users[op.name][0].kind not in ("output",)}
        self.fanout = fanouts(ops, self.by_name)
        self.macs_per_image = macs_per_image(ops)

    # --- building ---

    def _make_fn(self, op: Any) -> Callable | None:
        if op.kind == "neuron":
            return self._neuron_fn(op)
        if op.kind in STATEFUL:
            return self._leaky_fn(op)
        build = OP_BUILDERS.get(op.kind)
        if build is None:
            raise BackendError(f"backend {self.backend!r} cannot run node '{op.name}' ({op.kind!r})")
        return build(op, self.dtype, self.device)

    def _neuron_fn(self, op: Any) -> Callable:
        p, dt, dev = op.params, self.dtype, self.device
        nd = self.neuron_dtype
        theta = to_tensor(p["theta"], nd, dev)
        if theta.dim() == 1:
            theta = theta.reshape(-1, *([1] * (len(op.out_shape) - 1)))
        reset, burst = p["reset"], int(p.get("burst", 1))
        loop, tol = self.neuron_loop, self.tie_tolerance
        v0 = p.get("v_init")
        if v0 is not None and np.asarray(v0).ndim == 0 and float(v0) == 0.5:
            v0 = None  # the default 1/2: the fill-free first step
        if v0 is not None:
            v0 = to_tensor(v0, nd, dev)
            if v0.dim() == 1:
                v0 = v0.reshape(-1, *([1] * (len(op.out_shape) - 1)))

        def neuron(u: torch.Tensor, T: int, static: bool, stats: "Stats", state: dict | None = None):
            if u.dtype != nd:
                u = u.to(nd)  # a copy: ours to overwrite
            if state is not None:  # a run continued: the membranes it stopped with, kept for the next
                end: list = []
                s, per_pos = if_loop(u, theta, T, static, reset, ties=None if tol is None else (tol, stats),
                                     v0=v0, burst=burst, v_start=state.get(op.name), v_end=end)
                state[op.name] = end[0]
            elif tol is None:
                s, per_pos = loop(u, theta, T, static, reset, v0=v0, burst=burst)
            else:
                s, per_pos = if_loop(u, theta, T, static, reset, ties=(tol, stats), v0=v0, burst=burst)
            return (s if s.dtype == dt else s.to(dt)), per_pos

        return neuron

    def _leaky_fn(self, op: Any) -> Callable:
        """A leaky neuron (state in the neuron dtype, outputs in the layer dtype)."""
        fn, dt = leaky_fn(op, self.neuron_dtype, self.device), self.dtype

        def leaky(u: torch.Tensor, T: int, static: bool, stats: "Stats", state: dict | None = None):
            if state is not None:
                raise BackendError(f"backend {self.backend!r}: early exit runs IF neurons step by step; "
                                   f"the leaky neuron '{op.name}' ({op.kind}) cannot be continued. Run "
                                   "without an exit rule")
            out, per_pos = fn(u, T, static, stats)
            return (out if out.dtype == dt else out.to(dt)), per_pos

        return leaky

    # --- running ---

    def check_input(self, x: Any, T: int) -> tuple[torch.Tensor, bool]:
        """``x`` on this bound's device and dtype, and whether it is a ``[T, B, ...]`` sequence."""
        if not isinstance(x, torch.Tensor):
            raise BackendError(f"backend {self.backend!r}: input must be a torch.Tensor, got "
                               f"{type(x).__name__}")
        if not (x.is_floating_point()):
            raise BackendError(f"backend {self.backend!r}: input dtype {x.dtype} is not a floating "
                               f"point type; give float32 (or {self.dtype}) values")
        shape = tuple(x.shape)
        n = len(self.input_shape)
        if shape[1:] == self.input_shape and x.dim() == n + 1:
            seq = False
        elif x.dim() == n + 2 and shape[2:] == self.input_shape:
            if shape[0] != T:
                raise BackendError(f"backend {self.backend!r}: a sequence input [T, B, ...] has "
                                   f"{shape[0]} steps but T={T}")
            seq = True
        else:
            dims = ", ".join(map(str, self.input_shape))
            raise BackendError(f"backend {self.backend!r}: input shape {shape} does not fit the "
                               f"graph's input {self.input_shape}; give [B, {dims}] (static) or "
                               "[T, B, ...] (a sequence)")
        if shape[-n - 1 if not seq else 1] == 0:
            raise BackendError(f"backend {self.backend!r}: the batch is empty (shape {shape})")
        check_finite(x, self.backend)
        return x.to(device=self.device, dtype=self.dtype), seq

    def run_chunk(self, x: torch.Tensor, T: int, seq: bool, stats: "Stats",
                  carry: "Carry | None" = None) -> torch.Tensor:
        """Per-step readout ``[T, b, ...]`` of one chunk (``x``: ``[b, ...]`` or ``[T, b, ...]``).

        ``carry``: continue a run (a static ``x``): the neurons start from the membranes in
        ``carry.v`` and leave theirs there; the ops that see only the static input are computed
        once, on the first call, and read from ``carry.static`` after (so that the images of a
        batch keep their bits when others leave it, :meth:`Carry.keep`)."""
        b = x.shape[1] if seq else x.shape[0]
        values: dict[str, tuple[Any, bool]] = {}  # a tensor, or a lazily scaled one (_Scaled)
        owned: set[str] = set()
        out = None
        for i, step in enumerate(self.steps):
            op = step.op
            if carry is not None and op.name in carry.static:
                values[op.name] = (carry.static[op.name], False)  # not owned: never written in place
                continue
            if op.kind == "input":
                values[op.name] = (x.reshape(T * b, *x.shape[2:]) if seq else x, seq)
                continue
            u, dyn, fresh = self._gather(op, values, owned, T, b, i)
            if op.kind == "output":
                out = u if dyn else u.unsqueeze(0).expand(T, *u.shape).reshape(T * b, *u.shape[1:])
                break
            if op.kind in STATEFUL:
                state = None if carry is None else carry.v
                if not dyn:
                    s, per_pos = step.fn(u, T, True, stats, state)
                else:
                    u = u.view(T, b, *u.shape[1:])
                    s, per_pos = step.fn(u if fresh else u.clone(), T, False, stats, state)
                if op.kind in SPIKING:
                    stats.add_neuron(op.name, s, per_pos)
                values[op.name] = (s.view(T * b, *s.shape[2:]), True)
                owned.add(op.name)
            elif op.kind == "sum":
                values[op.name] = (u, dyn)
                if fresh:
                    owned.add(op.name)
            elif op.name in self.lazy_scales:
                values[op.name] = (_Scaled(u, step.fn.factor), dyn)
            else:
                values[op.name] = (step.fn(u), dyn)
                if op.kind != "flatten" or fresh:
                    owned.add(op.name)
            if carry is not None and step.static and op.kind not in STATEFUL and not seq:
                carry.static[op.name] = values[op.name][0]  # once per image, then read
                owned.discard(op.name)
            # free what nobody reads any more
            for src in op.inputs:
                if self.steps[self.index[src]].last_use == i:
                    values.pop(src, None)
        if out is None:  # pragma: no cover - parse guarantees an output op
            raise BackendError(f"backend {self.backend!r}: the graph has no output op")
        return out.reshape(T, b, *out.shape[1:])

    def _gather(self, op: Any, values: dict, owned: set, T: int, b: int, i: int):
        """The summed input of ``op``: (tensor, dynamic?, may it be modified in place?)."""
        srcs = op.inputs
        items = [values[s] for s in srcs]
        dyn = any(d for _, d in items)

        def timed(t: torch.Tensor, d: bool) -> torch.Tensor:
            if dyn and not d:  # TimeExpand: the static value presented at every step
                return t.unsqueeze(0).expand(T, *t.shape).reshape(T * b, *t.shape[1:])
            return t

        if len(items) == 1:
            t, d = items[0]
            src = srcs[0]
            fresh = (src in owned and self.steps[self.index[src]].last_use == i
                     and srcs.count(src) == 1 and d == dyn)
            return timed(t, d), dyn, fresh
        entries = list(zip(items, srcs))
        if len(entries) == 2 and isinstance(entries[0][0][0], _Scaled) \
                and not isinstance(entries[1][0][0], _Scaled):
            entries.reverse()  # a + b == b + a, exactly
        (t0, d0), s0 = entries[0]
        if isinstance(t0, _Scaled):
            acc, acc_fresh = t0.spikes * t0.factor, True
        else:
            acc = timed(t0, d0)
            acc_fresh = (s0 in owned and self.steps[self.index[s0]].last_use == i
                         and srcs.count(s0) == 1 and d0 == dyn)
        for (t, d), _ in entries[1:]:
            # in place into a temporary nobody else reads: same bits, no allocation
            if isinstance(t, _Scaled):  # acc + s * theta with s in {0, 1}: s * theta is exact
                acc = acc.addcmul_(t.spikes, t.factor) if acc_fresh else torch.addcmul(acc, t.spikes, t.factor)
            else:
                t = timed(t, d)
                acc = acc.add_(t) if acc_fresh else acc + t
            acc_fresh = True
        return acc, dyn, True


class Carry:
    """What a run continued step by step keeps between its calls of :meth:`BoundGraph.run_chunk`: each
    neuron's membrane (``v``) and the values of the ops that see only the static input
    (``static``), all with the batch first."""

    __slots__ = ("v", "static")

    def __init__(self) -> None:
        self.v: dict[str, torch.Tensor] = {}
        self.static: dict[str, torch.Tensor] = {}

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the images ``rows`` (a bool mask or indices over the batch)."""
        for d in (self.v, self.static):
            for k, t in d.items():
                d[k] = t[rows]


class _Scaled:
    """A Scale of spikes not yet computed: summed into its consumer as ``addcmul``."""

    __slots__ = ("spikes", "factor")

    def __init__(self, spikes: torch.Tensor, factor: torch.Tensor):
        self.spikes, self.factor = spikes, factor
