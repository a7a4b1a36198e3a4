"""Weight calibration: a closed-form refit of every Conv2d/Linear that reads spikes, so that its
output on the SNN's spike rates over T steps matches the QCFS-ANN's at L = T (ridge least
squares over sampled output positions, pulled towards the present weights)."""

from __future__ import annotations

import math
from typing import Any, Iterable, cast

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from snnconv.calibration.reference import channel_mean, qcfs_levels
from snnconv.graph import call_counts, capture_pieces, module_of
from snnconv.snn.neuron import IFNeuron

__all__ = ["RIDGE", "INT32_MAX", "WeightCalibration", "WeightFit", "columns", "layer_output", "upper_gram",
           "count_gram"]

# Largest block of gathered input columns in the weight fit (the positions are taken in pieces).
_UNFOLD_BYTES = 64 * 2**20

# Positions (output pixels over the calibration images) each weight fit uses: all of them up
# to this many per feature of a group (the columns of the least squares), a seeded sample
# beyond. The normal equations cost positions x features^2: sampling keeps that at most a
# fixed multiple of features^3 (the solve's own cost) instead of growing with the image size.
_SAMPLES_PER_FEATURE = 16
_MIN_SAMPLES = 4096


def _weight_plan(gm: fx.GraphModule, ref: fx.GraphModule) -> dict[str, tuple[Any, str, Any]]:
    """The Conv2d/Linear nodes of the SNN ``gm`` whose input carries spikes (downstream of a
    neuron), each called once here and in the reference ``ref``, zero-padded: node name ->
    (layer, name of the reference node that feeds the same layer, the reference layer)."""
    calls, ref_calls = call_counts(gm), call_counts(ref)
    ref_nodes = {str(n.target): n for n in ref.graph.nodes if n.op == "call_module"}
    dynamic: set[fx.Node] = set()
    plan = {}
    for node in gm.graph.nodes:
        layer = module_of(gm, node)
        if isinstance(layer, IFNeuron) or any(a in dynamic for a in node.all_input_nodes):
            dynamic.add(node)
        if not isinstance(layer, (nn.Conv2d, nn.Linear)) or not node.args or node.args[0] not in dynamic:
            continue
        target = str(node.target)
        r = ref_nodes.get(target)
        if (r is None or calls.get(target) != 1 or ref_calls.get(target) != 1
                or not r.args or not isinstance(r.args[0], fx.Node)
                or isinstance(layer, nn.Conv2d)
                and (layer.padding_mode != "zeros" or isinstance(layer.padding, str))):
            continue
        plan[node.name] = (layer, r.args[0].name, module_of(ref, r))
    return plan


def _output_size(layer: Any, x: torch.Tensor) -> tuple[int, ...]:
    """Output positions of ``layer`` per image of ``x``: a Conv2d's output rows and columns, a
    Linear's leading dimensions."""
    if isinstance(layer, nn.Linear):
        return (x[:1].numel() // x.shape[-1],)
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = (layer.kernel_size, layer.stride, layer.dilation,
                                              layer.padding)
    return ((x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1,
            (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1)


def columns(layer: Any, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The input columns of ``layer`` on ``x`` at the output positions ``pos`` (flat indices
    over images and output pixels, in the order of :func:`layer_output`), ``[groups,
    positions, features per group]``, features in ``F.unfold``'s order (channel, then kernel
    row and column)."""
    if isinstance(layer, nn.Linear):
        return x.reshape(-1, x.shape[-1])[pos].unsqueeze(0)
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = (layer.kernel_size, layer.stride, layer.dilation,
                                              layer.padding)
    ho, wo = _output_size(layer, x)
    n, rest = pos // (ho * wo), pos % (ho * wo)
    i, j = rest // wo * sh, rest % wo * sw
    xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    taps = [xp[n, :, i + a * dh, j + b * dw] for a in range(kh) for b in range(kw)]  # [P, C] each
    u = torch.stack(taps, dim=-1).reshape(len(pos), -1)
    return u.reshape(len(pos), layer.groups, -1).transpose(0, 1)


def layer_output(layer: Any, a: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """``layer`` on ``a`` without its bias, ``[positions, outputs]`` (positions: images, then
    output rows and columns; a Linear's leading dimensions); with ``pos``, at those positions
    only (from their columns: cheaper than the whole convolution for a small sample)."""
    w = layer.weight.detach().to(a.dtype)
    if pos is not None:
        u = columns(layer, a, pos)  # [groups, P, f]
        y = torch.bmm(u, w.reshape(u.shape[0], -1, u.shape[2]).transpose(1, 2))  # [groups, P, O/g]
        return y.transpose(0, 1).reshape(len(pos), -1)
    if isinstance(layer, nn.Linear):
        return (a @ w.t()).reshape(-1, w.shape[0])
    y = F.conv2d(a, w, None, layer.stride, layer.padding, layer.dilation, layer.groups)
    return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1])


def upper_gram(u: torch.Tensor) -> torch.Tensor:
    """``u^T u`` per group (``u``: ``[groups, positions, features]``), only its upper triangle
    filled beyond the diagonal blocks: panels of 512 features against the features from
    there on, about half the multiply-adds of the full product for wide layers."""
    f = u.shape[2]
    if f <= 1024:
        return torch.bmm(u.transpose(1, 2), u)
    g = u.new_zeros(u.shape[0], f, f)
    for s in range(0, f, 512):
        g[:, s:s + 512, s:] = torch.bmm(u[:, :, s:s + 512].transpose(1, 2), u[:, :, s:])
    return g


INT32_MAX = 2**31 - 1


def count_gram(u: torch.Tensor, steps: int) -> torch.Tensor | None:
    """``u^T u`` (float64, full) of spike rates ``u`` (``[1, positions, features]``, each a
    count over ``steps`` steps divided by ``steps``) from the counts in int8 with int32 sums:
    exact, and on a CPU 7-9x faster than the float32 product (oneDNN's int8 GEMM; ResNet-18's
    layers of 2,304-4,608 columns). None where it does not apply: not a CPU, grouped, more
    than 127 steps, or no int8 product in this build."""
    if u.device.type != "cpu" or u.shape[0] != 1 or not 1 <= steps <= 127:
        return None
    counts = (u[0] * steps).round_()
    peak = int(counts.abs().max()) if counts.numel() else 0  # steps, or more for bursts of spikes
    if peak > 127:
        return None
    c = counts.to(torch.int8)
    rows = INT32_MAX // max(1, peak) ** 2  # no int32 sum can overflow within one product
    try:
        g = sum(torch._int_mm(p.T, p).double() for p in c.split(rows))
    except (RuntimeError, AttributeError):
        return None
    return (cast(torch.Tensor, g) / steps**2).unsqueeze(0)


class WeightFit:
    """The normal equations of one layer's weight fit, accumulated over calibration pieces:
    ``U^T U`` (upper triangle, :func:`upper_gram`; exact from the spike counts where ``U`` holds
    counts over ``steps`` steps, :func:`count_gram`), ``U^T Y`` and ``U^T 1`` per group, ``U``
    the SNN's input rates in the layer's columns at the sampled output positions and ``Y`` the
    reference layer's output there without its bias (float64). The columns of small chunks
    are gathered up to :data:`_UNFOLD_BYTES` before they are multiplied (a deep layer has a
    few positions per chunk: one product each would be slow and add a float64 matrix per
    chunk)."""

    def __init__(self, layer: Any, ref_layer: Any, steps: int | None = None,
                 positions: int | None = None):
        self.layer, self.ref_layer, self.steps = layer, ref_layer, steps  # steps: U holds counts / steps
        # sums over the pieces (0.0 until the first): U^T U, U^T Y, U^T 1
        self.G: Any = 0.0
        self.C: Any = 0.0
        self.s: Any = 0.0
        self.groups = getattr(layer, "groups", 1)
        features = layer.weight[0].numel() * self.groups  # columns of all groups
        self.rows = max(1, _UNFOLD_BYTES // (features * layer.weight.element_size()))
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        # fewer positions than features (a wide Linear: VGG's 25,088 inputs, one position per
        # image): the same ridge solution from the positions' Gram matrix, U U^T, positions^2
        # values instead of features^2 (5 GB of float64 for VGG's classifier)
        self.dual = positions is not None and positions < layer.weight[0].numel()
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, rates: torch.Tensor, y: torch.Tensor, pos: torch.Tensor) -> None:
        """``rates``: the layer's input (a chunk of images); ``y``: the reference layer's
        output without bias (:func:`layer_output`) at the positions ``pos`` of that chunk."""
        for p, t in zip(pos.split(self.rows), y.split(self.rows)):
            self.pending.append((columns(self.layer, rates, p), t))  # [groups, P, f], [P, O]
            if sum(len(t) for _, t in self.pending) >= self.rows:
                self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        u = torch.cat([u for u, _ in self.pending], dim=1)
        t = torch.cat([t for _, t in self.pending]).to(u.dtype)
        self.pending = []
        t = t.reshape(len(t), self.groups, -1).transpose(0, 1)
        if self.dual:
            self.kept.append((u, t.double()))
            return
        gram = count_gram(u, self.steps) if self.steps else None
        self.G = self.G + (upper_gram(u).double() if gram is None else gram)
        self.C = self.C + torch.bmm(u.transpose(1, 2), t).double()
        self.s = self.s + u.sum(1).double()

    def solve(self, ridge: float) -> float:
        """Set the layer's weight to the ridge solution towards its present weight; return the
        relative change of the weight (Frobenius norms)."""
        self._flush()
        if self.dual:
            return self._solve_dual(ridge)
        layer = self.layer
        w = layer.weight.detach().clone()
        gram = self.G.triu_()  # the upper triangle is complete; mirrored in place
        gram += gram.triu(1).transpose(1, 2)
        self.G = None
        g = gram.shape[0]
        wg = w.double().reshape(g, w.shape[0] // g, -1)
        lam = ridge * gram.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-12)  # [g]
        rhs = self.C + lam[:, None, None] * wg.transpose(1, 2)
        shift = self._bias_shift(w)
        if shift is not None:
            rhs = rhs + self.s[:, :, None] * shift
        a = gram
        a.diagonal(dim1=1, dim2=2).add_(lam[:, None])
        chol, info = torch.linalg.cholesky_ex(a)  # positive definite with the ridge, unless float32
        # rounding of a rank-deficient U^T U outweighs a tiny one
        new = torch.cholesky_solve(rhs, chol) if not info.any() else torch.linalg.solve(a, rhs)
        new = new.transpose(1, 2).reshape(w.shape)
        with torch.no_grad():
            layer.weight.copy_(new.to(w.dtype))
        return float((new - w.double()).norm() / w.double().norm().clamp_min(1e-12))

    def _bias_shift(self, w: torch.Tensor) -> torch.Tensor | None:
        """The reference's bias minus the layer's, ``[groups, 1, outputs per group]`` (None: neither
        has one): the fit's target is the reference's output with its bias, less the layer's."""
        b, ba = self.layer.bias, self.ref_layer.bias
        if b is None and ba is None:
            return None
        zero = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
        db = (zero if ba is None else ba.detach().double().to(w.device)) - (
            zero if b is None else b.detach().double())
        return db.reshape(self.groups, 1, -1)

    def _solve_dual(self, ridge: float) -> float:
        """:meth:`solve` where the positions are fewer than the features: with ``W0`` the present
        weight, ``(U^T U + lam I)^-1 (U^T Y + lam W0) = W0 + U^T (U U^T + lam I)^-1 (Y - U W0)``
        (the same solution; ``lam`` as there, ``ridge`` times the mean of ``U^T U``'s diagonal).
        The products with the weight run over pieces of its inputs, in float64 one piece at a
        time: the memory beyond the weight is positions x (features + outputs) values."""
        w = self.layer.weight.detach()
        g, o = self.groups, w.shape[0] // self.groups
        u = torch.cat([u for u, _ in self.kept], dim=1)  # [g, P, f], the rates' dtype
        y = torch.cat([t for _, t in self.kept], dim=1)  # [g, P, o], float64
        self.kept = []
        wg = w.reshape(g, o, -1)  # a view: [g, o, f]
        shift = self._bias_shift(w)
        resid = y if shift is None else y + shift
        pieces = range(0, u.shape[2], _DUAL_PIECE)
        k: Any = 0.0
        for a in pieces:  # U U^T and Y - U W0, a piece of the inputs at a time
            ua = u[:, :, a:a + _DUAL_PIECE].double()
            k = k + torch.bmm(ua, ua.transpose(1, 2))
            resid = resid - torch.bmm(ua, wg[:, :, a:a + _DUAL_PIECE].double().transpose(1, 2))
        lam = ridge * k.diagonal(dim1=1, dim2=2).sum(1).div(u.shape[2]).clamp_min(1e-12)  # [g]
        k.diagonal(dim1=1, dim2=2).add_(lam[:, None])
        alpha = torch.linalg.solve(k, resid)  # [g, P, o]
        moved, norm = 0.0, max(float(torch.linalg.vector_norm(w, dtype=torch.float64)), 1e-12)
        with torch.no_grad():
            for a in pieces:  # W = W0 + (U^T alpha)^T
                step = torch.bmm(u[:, :, a:a + _DUAL_PIECE].double().transpose(1, 2), alpha).transpose(1, 2)
                moved += float(step.pow(2).sum())
                part = wg[:, :, a:a + _DUAL_PIECE]
                part.copy_((part.double() + step).to(w.dtype))
            if wg.data_ptr() != w.data_ptr():  # a weight that reshape had to copy
                w.copy_(wg.reshape(w.shape))
        return math.sqrt(moved) / norm


#: Inputs per piece of the positions' solve (:meth:`WeightFit._solve_dual`).
_DUAL_PIECE = 2048


# Ridge of the weight fit, relative to the mean of U^T U's diagonal (per group).
RIDGE = 1e-2


class WeightCalibration:
    """Weight calibration of the layers of :func:`_weight_plan` at ``T`` steps: per layer and
    calibration batch, the sampled output positions (sorted flat indices; a generator of its
    own, so the same positions in every run and the global RNG untouched) and the reference
    layer's output there at ``L = T`` levels; and the fits done so far (layer -> relative
    weight change). With ``sites`` (QCFS module -> node name of ``ref``), the same reference
    pass also gives :func:`reference_means` at ``L = T`` (``means``; None without). ``levels``
    (default ``T``): the reference's levels, ``T * B`` for neurons of bursts of up to B spikes."""

    def __init__(self, gm: fx.GraphModule, ref: fx.GraphModule, batches: list, T: int,
                 sites: dict[str, str] | None = None, levels: int | None = None):
        self.plan, self.T = _weight_plan(gm, ref), T
        names = sorted({ref_name for _, ref_name, _ in self.plan.values()} | set((sites or {}).values()))
        images = sum(len(x) for x in batches)
        gen = torch.Generator().manual_seed(0)
        self.targets: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in self.plan}
        self.means: dict[str, torch.Tensor] | None = None if sites is None else {}
        with qcfs_levels(ref, levels or T):  # T steps of burst neurons: T * burst levels
            for x in batches:
                picks: dict[str, tuple[torch.Tensor | None, int]] = {}
                outputs: dict[str, list[torch.Tensor]] = {name: [] for name in self.plan}
                # in pieces of images where the batch's values do not fit the memory
                for lo, hi, values in capture_pieces(ref, x, names):
                    for target, name in (sites or {}).items():  # as reference_means
                        mean = channel_mean(values[name]) * ((hi - lo) / len(x))
                        assert self.means is not None  # set where there are sites
                        self.means[target] = self.means.get(target, 0) + mean / len(batches)
                    for name, (_layer, ref_name, ref_layer) in self.plan.items():
                        a = values[ref_name]
                        if name not in picks:  # the batch's sampled positions, drawn at its first piece
                            picks[name] = self._positions(ref_layer, a, len(x), images, gen)
                        pos, per_image = picks[name]
                        if pos is None:
                            outputs[name].append(layer_output(ref_layer, a))
                        else:
                            i, j = torch.searchsorted(pos, torch.tensor([lo * per_image, hi * per_image],
                                                                        device=pos.device))
                            outputs[name].append(layer_output(ref_layer, a, pos[i:j] - lo * per_image))
                    del values
                for name, (pos, per_image) in picks.items():
                    y = outputs[name][0] if len(outputs[name]) == 1 else torch.cat(outputs[name])
                    if pos is None:
                        pos = torch.arange(len(x) * per_image, device=y.device)
                    self.targets[name].append((pos, y))
        self.changes: dict[str, float] = {}

    @staticmethod
    def _positions(ref_layer: Any, a: torch.Tensor, batch: int, images: int,
                   gen: torch.Generator) -> tuple[torch.Tensor | None, int]:
        """The sampled output positions of ``ref_layer`` over a batch of ``batch`` images (sorted
        flat indices; None: all of them) and its positions per image, from ``a`` (its input, any
        number of images)."""
        per_image = math.prod(_output_size(ref_layer, a))
        n = batch * per_image
        features = ref_layer.weight[0].numel()  # per group
        budget = max(_MIN_SAMPLES, _SAMPLES_PER_FEATURE * features) * batch / images
        if budget < n:
            return torch.randperm(n, generator=gen)[:math.ceil(budget)].sort().values.to(a.device), per_image
        return None, per_image

    def fit(self, node: fx.Node, values: Iterable, spans: list, rates: list | None = None) -> None:
        """Fit the layer of ``node`` on its input ``values`` (``[T*b, ...]`` each) of the images
        ``spans`` (batch, first, end) of the calibration: least squares over the sampled
        positions, the rates over ``T`` steps against the reference at ``L = T``. ``rates``:
        those means over the steps, where already known (``values`` is then not read)."""
        acc = self.start(node, counts=rates is not None)
        self.add(node, acc, values, spans, rates)
        self.solve(node, acc)

    def start(self, node: fx.Node, counts: bool = False) -> WeightFit:
        """The empty normal equations of ``node``'s layer (``counts``: its input rates will be
        spike counts over ``T`` steps, divided by ``T``)."""
        layer, _, ref_layer = self.plan[node.name]
        return WeightFit(layer, ref_layer, steps=self.T if counts else None,
                         positions=sum(len(pos) for pos, _ in self.targets[node.name]))

    def solve(self, node: fx.Node, acc: WeightFit) -> None:
        """Set ``node``'s layer to the solution of ``acc`` (every image added)."""
        self.changes[str(node.target)] = acc.solve(RIDGE)
        del self.targets[node.name]

    def add(self, node: fx.Node, acc: WeightFit, values: Iterable, spans: list, rates: list | None = None) -> None:
        """Add the images ``spans`` of ``node``'s input ``values`` (or their ``rates``) to ``acc``."""
        layer = self.plan[node.name][0]

        def gather(group: list, k: int, lo: int, hi: int) -> None:
            # the chunks of one batch together: a few gathers of many positions (the rates
            # are a T-th of the spikes' size)
            part = group[0] if len(group) == 1 else torch.cat(group)
            pos, y = self.targets[node.name][k]
            per_image = math.prod(_output_size(layer, part))
            a, b = torch.searchsorted(pos, torch.tensor([lo * per_image, hi * per_image], device=pos.device))
            acc.add(part, y[a:b], pos[a:b] - lo * per_image)

        means = (x.reshape(self.T, len(x) // self.T, *x.shape[1:]).mean(0) for x in values)
        group: list[torch.Tensor] = []
        span: Any = None
        for r, (k, lo, hi) in zip(means if rates is None else rates, spans):
            if group and (k != span[0] or lo != span[2]):
                gather(group, *span)
                group = []
            span = (k, span[1] if group else lo, hi)
            group.append(r)
        if group:
            gather(group, *span)
