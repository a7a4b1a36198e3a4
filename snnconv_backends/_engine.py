"""The dense executor the cpu and gpu backends share: a parsed NIR graph run as torch ops.

Arithmetic is the torch ``SpikingNetwork``'s, operation for operation, so that results are
bit-identical on the same device and dtype:

- layers that see only the static input (before the first neuron) run once on ``[b, ...]``;
  everything after a neuron runs with time folded into the batch, ``[T*b, ...]`` (t major);
- the batch is cut into chunks of ``max(1, chunk_size // T)`` inputs, as
  ``SpikingNetwork._steps`` does (oneDNN and MKL may round a batch of one differently from a
  larger one, so the batch composition of every conv and matmul must be the same);
- the subtractive neuron divides its input by theta (one division, broadcast on the channel
  dim), then runs ``h = v + u; s = h >= 1; v = h - s`` from ``v = 1/2``, in place (the
  spikingjelly kernel the torch network uses computes the same three operations, with copies);
- the hard-reset neuron runs ``h = v + x; s = h >= theta; v = h - h * s`` from ``v = 0``
  (equal values to spikingjelly's ``s * 0 + (1 - s) * h``; they differ at most in the sign of
  a zero membrane, which no comparison sees);
- a global ``AvgPool2d`` marked ``adaptive`` runs as ``adaptive_avg_pool2d`` (torch rounds the two
  differently), summed inputs are added in edge order.

Statistics (spike counts per step, synaptic operations, ANN MACs) come from one reduction of
each neuron's spikes over the batch. Synaptic operations of a layer fed by spikes (directly or
through pooling/flatten) are each spike times its structural fan-out through that composition
(every weight position counts, padding excluded, pooling folded into the layer), computed once
per graph; for a layer fed directly by spikes this is spikingjelly's ``SynOpCounter`` count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from snnconv.errors import BackendError

__all__ = ["Plan", "Stats", "check_options", "check_T", "compiled_loop", "WEIGHTED"]

#: Ops that carry weights (synaptic operations are counted into these).
WEIGHTED = ("conv1d", "conv2d", "affine", "linear", "scale")
#: Ops a spike passes through on its way to a weighted op without being multiplied.
_PASS = ("avgpool2d", "sumpool2d", "flatten", "sum")
_RUNNABLE = ("input", "output", "conv1d", "conv2d", "affine", "linear", "avgpool2d", "sumpool2d",
             "flatten", "scale", "sum", "neuron")


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


def _tensor(a: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(np.asarray(a)).to(device=device, dtype=dtype).contiguous()


def _flatten_dims(start: int, end: int, ndim: int) -> tuple[int, int]:
    """Batch-free flatten dims -> dims of a batched tensor (``ndim`` batch-free dims)."""
    start = start + ndim if start < 0 else start
    end = end + ndim if end < 0 else end
    return start + 1, end + 1


@dataclass
class _Step:
    op: Any                         # the parsed Op
    fn: Callable[[torch.Tensor], torch.Tensor] | None
    static: bool                    # depends only on the static input (runs once per chunk)
    last_use: int = -1              # index of the last step reading this value


class Plan:
    """A parsed graph bound to a device and dtype; ``run`` executes it on one batch.

    Args:
        parsed: a ``ParsedGraph`` from :func:`snnconv_backends.nirgraph.parse`.
        device, dtype: where and in which float type to compute.
        backend: the backend's name (for error messages).
        neuron_loop: ``(u, theta, T, static, reset, v0=None) -> (spikes, batch sums or None)``
            (``v0``: the subtractive neuron's initial membrane per channel, None for 1/2); the
            default is the exact in-place loop :func:`_if_loop`.
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
        self.neuron_loop = _if_loop if tie_tolerance is not None else (neuron_loop or _if_loop)
        ops = list(parsed.ops)
        for op in ops:
            if op.kind not in _RUNNABLE:
                raise BackendError(f"backend {backend!r} cannot run node '{op.name}' (kind "
                                   f"{op.kind!r}); it runs {', '.join(_RUNNABLE)}")
        self.ops = ops
        self.by_name = {op.name: op for op in ops}
        self.input_shape = tuple(parsed.input_shape)
        self.output_shape = tuple(parsed.output_shape)
        self.reset = parsed.reset
        self.neurons = [op.name for op in ops if op.kind == "neuron"]
        index = {op.name: i for i, op in enumerate(ops)}
        static: dict[str, bool] = {}
        self.steps: list[_Step] = []
        for op in ops:
            if op.kind == "input":
                static[op.name] = True
            elif op.kind == "neuron":
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
            and len(users.get(op.name, ())) == 1 and len(users[op.name][0].inputs) >= 2
            and users[op.name][0].kind not in ("output",)}
        self.fanout = self._fanouts()
        self.macs_per_image = self._macs()

    # --- building ---

    def _make_fn(self, op: Any) -> Callable | None:
        p, dt, dev = op.params, self.dtype, self.device
        kind = op.kind
        if kind in ("input", "output", "sum"):
            return None
        if kind in ("conv1d", "conv2d"):
            w, b = _tensor(p["weight"], dt, dev), _tensor(p["bias"], dt, dev)
            stride, padding, dilation, groups = (tuple(p["stride"]), tuple(p["padding"]),
                                                 tuple(p["dilation"]), int(p["groups"]))
            conv = F.conv2d if kind == "conv2d" else F.conv1d
            return lambda x: conv(x, w, b, stride, padding, dilation, groups)
        if kind == "affine":
            w, b = _tensor(p["weight"], dt, dev), _tensor(p["bias"], dt, dev)
            return lambda x: F.linear(x, w, b)
        if kind == "linear":
            w = _tensor(p["weight"], dt, dev)
            b = _tensor(p["bias"], dt, dev) if "bias" in p else None
            return lambda x: F.linear(x, w, b)
        if kind == "avgpool2d":
            if p.get("adaptive", False):
                out_hw = tuple(op.out_shape[-2:])
                return lambda x: F.adaptive_avg_pool2d(x, out_hw)
            k, s, pad = tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"])
            return lambda x: F.avg_pool2d(x, k, s, pad)
        if kind == "sumpool2d":
            k, s, pad = tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"])
            return lambda x: F.avg_pool2d(x, k, s, pad, divisor_override=1)
        if kind == "flatten":
            a, e = _flatten_dims(int(p["start_dim"]), int(p["end_dim"]), len(op.in_shape))
            return lambda x: x.flatten(a, e)
        if kind == "scale":
            scale = _tensor(p["scale"], dt, dev)
            scale = _broadcastable(scale, op.in_shape, op.name)

            def scaled(x: torch.Tensor) -> torch.Tensor:
                return x * scale

            scaled.factor = scale
            return scaled
        if kind == "neuron":
            nd = self.neuron_dtype
            theta = _tensor(p["theta"], nd, dev)
            if theta.dim() == 1:
                theta = theta.reshape(-1, *([1] * (len(op.out_shape) - 1)))
            reset = p["reset"]
            loop, tol = self.neuron_loop, self.tie_tolerance
            v0 = p.get("v_init")
            if v0 is not None and np.asarray(v0).ndim == 0 and float(v0) == 0.5:
                v0 = None  # the default 1/2: the fill-free first step
            if v0 is not None:
                v0 = _tensor(v0, nd, dev)
                if v0.dim() == 1:
                    v0 = v0.reshape(-1, *([1] * (len(op.out_shape) - 1)))

            def neuron(u: torch.Tensor, T: int, static: bool, stats: "Stats"):
                if u.dtype != nd:
                    u = u.to(nd)  # a copy: ours to overwrite
                if tol is None:
                    s, per_pos = loop(u, theta, T, static, reset, v0=v0)
                else:
                    s, per_pos = _if_loop(u, theta, T, static, reset, ties=(tol, stats), v0=v0)
                return (s if s.dtype == dt else s.to(dt)), per_pos

            return neuron
        raise BackendError(f"backend {self.backend!r} cannot run node '{op.name}' ({kind!r})")

    def _sources(self, op: Any) -> list[tuple[str, list[Any]]]:
        """(neuron name, ops between it and ``op``) for every spike path into ``op``."""
        found = []

        def walk(name: str, chain: list[Any]) -> None:
            src = self.by_name[name]
            if src.kind == "neuron":
                found.append((src.name, chain))
            elif src.kind in _PASS:
                for i in src.inputs:
                    walk(i, [src] + chain)

        for i in op.inputs:
            walk(i, [])
        return found

    def _fanouts(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """layer -> [(neuron, fan-out per neuron position)], the accumulates one spike causes."""
        out: dict[str, list[tuple[str, torch.Tensor]]] = {}
        with torch.inference_mode(False), torch.enable_grad():  # compile() may run under no_grad
            for op in self.ops:
                if op.kind in WEIGHTED:
                    self._fanout_of(op, out)
        return out

    def _fanout_of(self, op: Any, out: dict) -> None:
        """d(sum of ``op``'s outputs with unit weights)/d(each spike): its structural fan-out."""
        for neuron, chain in self._sources(op):
            x = torch.ones(1, *self.by_name[neuron].out_shape, dtype=torch.float64, requires_grad=True)
            y = x
            for c in chain:
                y = _structural(c, y)
            y = _structural(op, y)
            (g,) = torch.autograd.grad(y.sum(), x)
            out.setdefault(op.name, []).append((neuron, g.reshape(-1).detach()))

    def _macs(self) -> dict[str, float]:
        macs = {}
        for op in self.ops:
            p = op.params
            if op.kind in ("conv1d", "conv2d"):
                w = p["weight"]
                macs[op.name] = float(math.prod(op.out_shape) * math.prod(w.shape[1:]))
            elif op.kind in ("affine", "linear"):
                macs[op.name] = float(math.prod(p["weight"].shape))
        return macs

    # --- running ---

    def check_input(self, x: Any, T: int) -> tuple[torch.Tensor, bool]:
        """``x`` on this plan's device and dtype, and whether it is a ``[T, B, ...]`` sequence."""
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
        return x.to(device=self.device, dtype=self.dtype), seq

    def run_chunk(self, x: torch.Tensor, T: int, seq: bool, stats: "Stats") -> torch.Tensor:
        """Per-step readout ``[T, b, ...]`` of one chunk (``x``: ``[b, ...]`` or ``[T, b, ...]``)."""
        b = x.shape[1] if seq else x.shape[0]
        values: dict[str, tuple[torch.Tensor, bool]] = {}
        owned: set[str] = set()
        out = None
        for i, step in enumerate(self.steps):
            op = step.op
            if op.kind == "input":
                values[op.name] = (x.reshape(T * b, *x.shape[2:]) if seq else x, seq)
                continue
            u, dyn, fresh = self._gather(op, values, owned, T, b, i)
            if op.kind == "output":
                out = u if dyn else u.unsqueeze(0).expand(T, *u.shape).reshape(T * b, *u.shape[1:])
                break
            if op.kind == "neuron":
                if not dyn:
                    s, per_pos = step.fn(u, T, True, stats)
                else:
                    u = u.view(T, b, *u.shape[1:])
                    s, per_pos = step.fn(u if fresh else u.clone(), T, False, stats)
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


class _Scaled:
    """A Scale of spikes not yet computed: summed into its consumer as ``addcmul``."""

    __slots__ = ("spikes", "factor")

    def __init__(self, spikes: torch.Tensor, factor: torch.Tensor):
        self.spikes, self.factor = spikes, factor


def _broadcastable(scale: torch.Tensor, in_shape: Sequence[int], name: str) -> torch.Tensor:
    """A Scale's factor shaped to broadcast against a batched ``[N, *in_shape]`` tensor."""
    in_shape = tuple(in_shape)
    if scale.dim() == 0:
        return scale
    if scale.dim() == 1 and len(in_shape) >= 1 and scale.shape[0] == in_shape[0] and len(in_shape) > 1:
        return scale.reshape(-1, *([1] * (len(in_shape) - 1)))
    try:
        torch.broadcast_shapes(tuple(scale.shape), in_shape)
    except RuntimeError:
        raise BackendError(f"Scale node '{name}': factor of shape {tuple(scale.shape)} does not "
                           f"broadcast against its input {in_shape}") from None
    if len(scale.shape) > len(in_shape):
        raise BackendError(f"Scale node '{name}': factor of shape {tuple(scale.shape)} has more "
                           f"dimensions than its input {in_shape}")
    if scale.dim() >= 2:  # a per-channel factor written out over the whole map: keep [C, 1, ...]
        corner = scale[(slice(None),) + (slice(0, 1),) * (scale.dim() - 1)]
        if torch.equal(scale, corner.expand_as(scale)):
            return corner.contiguous()
    return scale


def _structural(op: Any, x: torch.Tensor) -> torch.Tensor:
    """``op`` with every weight 1 and pooling as a sum: the connectivity it has, as a function."""
    p = op.params
    if op.kind in ("conv1d", "conv2d"):
        w = torch.ones(p["weight"].shape, dtype=x.dtype)
        conv = F.conv2d if op.kind == "conv2d" else F.conv1d
        return conv(x, w, None, tuple(p["stride"]), tuple(p["padding"]), tuple(p["dilation"]),
                    int(p["groups"]))
    if op.kind in ("affine", "linear"):
        return F.linear(x, torch.ones(p["weight"].shape, dtype=x.dtype))
    if op.kind == "scale":
        return x
    if op.kind in ("avgpool2d", "sumpool2d"):
        if p.get("adaptive", False):
            return F.adaptive_avg_pool2d(x, tuple(op.out_shape[-2:])) * math.prod(
                s // o for s, o in zip(x.shape[-2:], op.out_shape[-2:]))
        return F.avg_pool2d(x, tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"]),
                            divisor_override=1)
    if op.kind == "flatten":
        a, e = _flatten_dims(int(p["start_dim"]), int(p["end_dim"]), len(op.in_shape))
        return x.flatten(a, e)
    return x  # sum


def _if_loop(u: torch.Tensor, theta: torch.Tensor, T: int, static: bool, reset: str,
             ties: tuple[float, "Stats"] | None = None, v0: torch.Tensor | None = None):
    """Exact IF dynamics, in place. ``u``: ``[T, b, ...]`` (ours to overwrite) or, ``static``,
    ``[b, ...]`` presented at every step. Returns spikes ``[T, b, ...]`` in ``u.dtype`` and
    ``None`` (the statistics are taken from the spikes). ``ties = (tol, stats)``: also count
    the updates with ``|h - threshold| <= tol * threshold`` into ``stats``. ``v0``: the
    subtractive neuron's initial membrane (broadcastable, units of theta; None: 1/2)."""
    if static:
        x = u / theta if reset == "subtract" else u
        s = torch.empty((T, *u.shape), dtype=u.dtype, device=u.device)
        xs = [x] * T
    else:
        s = u  # step t's spikes overwrite step t's input once it has been added
        xs = u
    if reset == "subtract":
        half = torch.tensor(0.5, dtype=s.dtype, device=s.device) if v0 is None else v0
        for t in range(T):
            # v[0] = 1/2 added in the first step's operation (a + b == b + a), no fill pass
            if static:
                v = torch.add(xs[0], half) if t == 0 else v.add_(xs[t])
            else:  # v + x / theta, the division rounded first (as SpikingNetwork's x / theta)
                v = torch.addcdiv(half, xs[0], theta) if t == 0 else v.addcdiv_(xs[t], theta)
            if ties is not None:
                ties[1].add_ties(((v - 1.0).abs() <= ties[0]).sum())
            torch.ge(v, 1.0, out=s[t])
            v.sub_(s[t])
    else:
        for t in range(T):
            v = xs[0].clone() if t == 0 else v.add_(xs[t])  # 0 + x[0] == x[0]
            if ties is not None:
                ties[1].add_ties(((v - theta).abs() <= ties[0] * theta).sum())
            torch.ge(v, theta, out=s[t])
            v.addcmul_(v, s[t], value=-1.0)
    return s, None


def _if_fused(T: int, static: bool, reset: str, calibrated: bool = False) -> Callable:
    """The IF dynamics of :func:`_if_loop` unrolled over ``T`` steps, written out of place so
    that ``torch.compile`` fuses them into one kernel (one read of the input, one write of the
    spikes, the membrane in registers), with the batch sum of the spikes per step and position
    (the statistics) in the same pass. Same operations in the same order: same bits. Only
    additions, subtractions, comparisons and products by 0/1 are fused (exact in any kernel);
    the division by theta stays outside (Triton's fp32 ``/`` may be approximate)."""

    def fused(x: torch.Tensor, theta: torch.Tensor, v0: torch.Tensor | None = None):
        v = (torch.full_like(x if static else x[0], 0.5 if reset == "subtract" else 0.0)
             if v0 is None else v0 + torch.zeros_like(x if static else x[0]))
        out = []
        for t in range(T):
            h = v + (x if static else x[t])
            s = (h >= (1.0 if reset == "subtract" else theta)).to(x.dtype)
            v = h - s if reset == "subtract" else h - h * s
            out.append(s)
        s = torch.stack(out)
        per_pos = s.reshape(T, s.shape[1], -1).sum(1)
        return s, per_pos

    # dynamo keeps compiled variants per code object (and caps their number): give each
    # (T, static, reset) its own code object so that they do not evict one another
    tag = f"if_fused_T{T}_{'static' if static else 'seq'}_{reset}{'_v0' if calibrated else ''}"
    fused.__code__ = fused.__code__.replace(co_name=tag)
    fused.__name__ = fused.__qualname__ = tag
    return fused


_COMPILED: dict[tuple, Callable] = {}


def compiled_loop(u: torch.Tensor, theta: torch.Tensor, T: int, static: bool, reset: str,
                  v0: torch.Tensor | None = None):
    """:func:`_if_fused` through ``torch.compile``, cached for the process.

    The input is viewed as ``[T, b, C, M]`` (``[b, C, M]`` when static) and theta as ``[C, 1]``
    or ``[1, 1]``, so that one compiled kernel (shapes dynamic) serves every layer of a kind;
    the views change no value. Should dynamo give up on a shape, it runs the same function
    eagerly: slower, same bits.
    """
    lead = 1 if static else 2
    shape = u.shape
    C = max(theta.numel(), 1 if v0 is None else v0.numel())
    rest = shape[lead:]
    if C == 1:
        M = math.prod(rest)
        th = theta.reshape(1, 1)
        view = (*shape[:lead], 1, M)
    else:
        M = math.prod(rest[1:])
        th = theta.reshape(-1, 1).expand(C, 1)
        view = (*shape[:lead], C, M)
    if reset == "subtract":  # IEEE division by torch, as SpikingNetwork's x / theta
        u = u / theta if static else u.div_(theta)
    key = (T, static, reset, C == 1, M == 1, u.device.type, v0 is not None)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = torch.compile(_if_fused(T, static, reset, v0 is not None), dynamic=True)
    try:
        args = (u.reshape(view), th) if v0 is None else (u.reshape(view), th, v0.reshape(-1, 1).expand(C, 1))
        s, per_pos = fn(*args)
    except Exception as exc:  # inductor needs a working C++ (CPU) or Triton (CUDA) toolchain
        raise BackendError(f"torch.compile of the neuron update failed ({type(exc).__name__}: "
                           f"{str(exc)[:300]}); use neuron='loop'") from exc
    return s.reshape(T, *shape[lead - 1:]), per_pos


class Stats:
    """Spike counts per neuron and step, and synaptic operations per layer, over a run.

    Batch sums are accumulated where the spikes are (no device synchronisation per layer) and
    brought to the CPU once, by :meth:`finish`.
    """

    def __init__(self, plan: Plan, T: int):
        self.T = T
        self.names = list(plan.neurons)
        self.acc: dict[str, torch.Tensor] = {}
        self.ties = 0.0
        self._ties: list[torch.Tensor] = []

    def add_neuron(self, name: str, s: torch.Tensor, per_pos: torch.Tensor | None = None) -> None:
        """Record spikes ``s`` ``[T, b, ...]`` (or their batch sum ``per_pos`` ``[T, M]``)."""
        if per_pos is None:
            # exact: at most b <= 2**24 ones are summed in float32
            per_pos = s.reshape(s.shape[0], s.shape[1], -1).sum(1, dtype=torch.float32)
        per_pos = per_pos.to(torch.float64)
        self.acc[name] = self.acc[name] + per_pos if name in self.acc else per_pos

    def add_ties(self, count: torch.Tensor) -> None:
        self._ties.append(count)

    def finish(self, plan: Plan) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """(spikes per neuron ``[T]`` float64 on the CPU, synaptic operations per layer)."""
        acc = {k: v.cpu() for k, v in self.acc.items()}
        spikes = {n: acc[n].sum(1) if n in acc else torch.zeros(self.T, dtype=torch.float64)
                  for n in self.names}
        positions = {n: a.sum(0) for n, a in acc.items()}
        synops = {}
        for layer, pairs in plan.fanout.items():
            total = 0.0
            for neuron, fan in pairs:
                if neuron in positions:
                    total += float((positions[neuron] * fan).sum())
            synops[layer] = total
        self.ties = float(sum(float(t) for t in self._ties))
        return spikes, synops
