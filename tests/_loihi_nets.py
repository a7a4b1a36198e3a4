"""Small NIR graphs (conv, average pooling, a residual add, linear) for the Loihi 2 tests."""

from __future__ import annotations

import nir
import numpy as np

from snnconv.nir.format import COMPARE, fire_threshold, graph_metadata, spec_threshold

__all__ = ["small_graph"]


def _neuron(nodes, edges, name, src, theta, reset, shape, v_init=None, burst=1):
    """Add neuron ``name`` (per-channel ``theta`` over ``shape``) fed by ``src``; returns the node
    consumers read spikes from. ``v_init``: per-channel initial membranes (subtractive reset);
    ``burst``: up to this many spikes a step (B Thresholds and their sum)."""
    theta = np.asarray(theta, np.float32)
    theta = np.broadcast_to(theta.reshape(-1, *([1] * (len(shape) - 1))), shape).astype(np.float32).copy()
    if reset == "zero":
        nodes[name] = nir.IF(r=np.ones_like(theta), v_threshold=spec_threshold(theta),
                             v_reset=np.zeros_like(theta),
                             metadata={"snnconv_neuron": "if", "reset": "zero", "v_init": 0.0,
                                       "compare": COMPARE})
        edges.append((src, name))
        return name
    v0 = 0.5 if v_init is None else [float(v) for v in np.asarray(v_init, np.float32)]
    nodes[name] = nir.I(r=np.ones_like(theta), metadata={"snnconv_neuron": "if", "reset": "subtract",
                                                         "v_init": v0, "compare": COMPARE,
                                                         **({"burst": burst} if burst > 1 else {})})
    full = (np.float32(0.5) if v_init is None
            else np.asarray(v_init, np.float32).reshape(-1, *([1] * (len(shape) - 1))))
    edges.append((src, name))
    fires = [f"{name}_fire{k if k > 1 else ''}" for k in range(1, burst + 1)]
    for k, fire in enumerate(fires, start=1):
        nodes[fire] = nir.Threshold(spec_threshold(fire_threshold(theta, np.broadcast_to(full, shape), k)))
        edges.append((name, fire))
    out = fires[0]
    if burst > 1:
        out = f"{name}_spikes"
        nodes[out] = nir.Scale(np.ones_like(theta), metadata={"snnconv_op": "sum"})
        edges += [(f, out) for f in fires]
    nodes[f"{name}_reset"] = nir.Scale(-theta)
    edges += [(out, f"{name}_reset"), (f"{name}_reset", name)]
    return out


def small_graph(reset: str, seed: int = 0, channels: int = 4, size: int = 8, classes: int = 3,
                per_channel: bool = True, T: int = 4, calibrated: bool = False, burst: int = 1) -> nir.NIRGraph:
    """A tiny residual network with every structure the Loihi mapping handles::

        input (1, S, S) -> conv1 -> n1 -> conv2 -> n2 -> conv3 --+--> n3 -> avgpool 2 -> conv4 -> n4
                            |                                    |
                            +------ Scale(theta1) shortcut ------+    (arrives one step later)
        n4 -> global avgpool -> flatten -> affine -> output

    Random weights scaled so that neurons fire at moderate rates; thresholds per channel (or
    per layer with ``per_channel=False``); with ``calibrated``, per-channel initial membranes
    in [0, 1] (the subtractive neurons of a membrane-calibrated conversion); with ``burst`` B,
    subtractive neurons that emit up to B spikes a step.
    """
    rng = np.random.default_rng(seed)
    rng_v = np.random.default_rng(seed + 1000)

    def v0(c):
        return rng_v.uniform(0.0, 1.0, c).astype(np.float32) if calibrated and reset == "subtract" else None
    C, S = channels, size
    nodes: dict = {}
    edges: list = []

    def th(c):
        v = rng.uniform(0.6, 1.4, c) if per_channel else np.full(c, rng.uniform(0.6, 1.4))
        return v.astype(np.float32)

    def add_conv(name, cin, cout, hw, stride, scale):
        w = rng.normal(0, scale, (cout, cin, 3, 3)).astype(np.float32)
        b = rng.normal(0.05, 0.1, cout).astype(np.float32)
        nodes[name] = nir.Conv2d(input_shape=(hw, hw), weight=w, stride=(stride, stride),
                                 padding=(1, 1), dilation=(1, 1), groups=1, bias=b)

    meta_sum = {"snnconv_op": "sum"}
    nodes["input"] = nir.Input(input_type=np.array([1, S, S]))
    add_conv("conv1", 1, C, S, 1, 0.8)
    edges.append(("input", "conv1"))
    th1, th2, th3, th4 = th(C), th(C), th(C), th(C)
    s1 = _neuron(nodes, edges, "n1", "conv1", th1, reset, (C, S, S), v0(C), burst)
    add_conv("conv2", C, C, S, 1, 0.35)
    edges.append((s1, "conv2"))
    s2 = _neuron(nodes, edges, "n2", "conv2", th2, reset, (C, S, S), v0(C), burst)
    add_conv("conv3", C, C, S, 1, 0.3)
    edges.append((s2, "conv3"))
    nodes["short"] = nir.Scale(np.broadcast_to(th1.reshape(C, 1, 1) * 0.5, (C, S, S)).astype(np.float32).copy())
    edges.append((s1, "short"))
    nodes["add"] = nir.Scale(np.ones((C, S, S), np.float32), metadata=meta_sum)
    edges += [("conv3", "add"), ("short", "add")]
    s3 = _neuron(nodes, edges, "n3", "add", th3, reset, (C, S, S), v0(C), burst)
    nodes["pool"] = nir.AvgPool2d(kernel_size=np.array([2, 2]), stride=np.array([2, 2]),
                                  padding=np.array([0, 0]))
    edges.append((s3, "pool"))
    add_conv("conv4", C, C, S // 2, 1, 0.6)
    edges.append(("pool", "conv4"))
    s4 = _neuron(nodes, edges, "n4", "conv4", th4, reset, (C, S // 2, S // 2), v0(C), burst)
    h = S // 2
    nodes["gap"] = nir.AvgPool2d(kernel_size=np.array([h, h]), stride=np.array([h, h]),
                                 padding=np.array([0, 0]))
    edges.append((s4, "gap"))
    nodes["flat"] = nir.Flatten(input_type={"input": np.array([C, 1, 1])}, start_dim=0, end_dim=-1)
    edges.append(("gap", "flat"))
    w = (rng.normal(0, 1.0, (classes, C)) * th4[None, :]).astype(np.float32)
    nodes["fc"] = nir.Affine(weight=w, bias=rng.normal(0, 0.1, classes).astype(np.float32))
    edges.append(("flat", "fc"))
    nodes["output"] = nir.Output(output_type=np.array([classes]))
    edges.append(("fc", "output"))
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata=graph_metadata(T, reset))
