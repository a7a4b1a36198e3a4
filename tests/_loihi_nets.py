"""Small NIR graphs (conv, average pooling, a residual add, linear) for the Loihi 2 tests."""

from __future__ import annotations

import nir
import numpy as np

__all__ = ["small_graph"]


def _neuron(nodes, edges, name, src, theta, reset, shape):
    """Add neuron ``name`` (per-channel ``theta`` over ``shape``) fed by ``src``; returns the node
    consumers read spikes from."""
    theta = np.asarray(theta, np.float32)
    theta = np.broadcast_to(theta.reshape(-1, *([1] * (len(shape) - 1))), shape).astype(np.float32).copy()
    if reset == "zero":
        nodes[name] = nir.IF(r=np.ones_like(theta), v_threshold=theta, v_reset=np.zeros_like(theta),
                             metadata={"snnconv_neuron": "if", "reset": "zero", "v_init": 0.0,
                                       "compare": ">="})
        edges.append((src, name))
        return name
    nodes[name] = nir.I(r=np.ones_like(theta), metadata={"snnconv_neuron": "if", "reset": "subtract",
                                                         "v_init": 0.5, "compare": ">="})
    nodes[f"{name}_fire"] = nir.Threshold(theta / np.float32(2))
    nodes[f"{name}_reset"] = nir.Scale(-theta)
    edges += [(src, name), (name, f"{name}_fire"), (f"{name}_fire", f"{name}_reset"),
              (f"{name}_reset", name)]
    return f"{name}_fire"


def small_graph(reset: str, seed: int = 0, channels: int = 4, size: int = 6, classes: int = 3,
                per_channel: bool = True, T: int = 4) -> nir.NIRGraph:
    """input (1, S, S) -> conv3x3 -> n1 -> conv3x3 (+ Scale(theta1) shortcut from n1) -> n2
    -> conv3x3 stride 2 -> n3 -> global avgpool -> flatten -> affine -> output.

    Weights are random but scaled so that the neurons fire at moderate rates.
    """
    rng = np.random.default_rng(seed)
    C, S = channels, size
    nodes: dict = {}
    edges: list = []

    def th(c):
        return (rng.uniform(0.6, 1.4, c) if per_channel else np.full(c, rng.uniform(0.6, 1.4))).astype(np.float32)

    def conv(cin, cout, stride, scale):
        w = (rng.normal(0, scale, (cout, cin, 3, 3))).astype(np.float32)
        b = rng.normal(0.05, 0.1, cout).astype(np.float32)
        return w, b, stride

    def add_conv(name, cin, cout, hw, stride, scale):
        w, b, s = conv(cin, cout, stride, scale)
        nodes[name] = nir.Conv2d(input_shape=(hw, hw), weight=w, stride=(s, s), padding=(1, 1),
                                 dilation=(1, 1), groups=1, bias=b)
        return (hw + 2 - 3) // s + 1

    nodes["input"] = nir.Input(input_type=np.array([1, S, S]))
    add_conv("conv1", 1, C, S, 1, 0.8)
    edges.append(("input", "conv1"))
    th1, th2, th3 = th(C), th(C), th(C)
    s1 = _neuron(nodes, edges, "n1", "conv1", th1, reset, (C, S, S))
    add_conv("conv2", C, C, S, 1, 0.35)
    edges.append((s1, "conv2"))
    # residual: conv2 + theta1 * spikes(n1) -> n2
    nodes["short"] = nir.Scale(np.broadcast_to(th1.reshape(C, 1, 1), (C, S, S)).astype(np.float32).copy())
    edges.append((s1, "short"))
    nodes["add"] = nir.Scale(np.ones((C, S, S), np.float32), metadata={"snnconv_op": "sum"})
    edges += [("conv2", "add"), ("short", "add")]
    s2 = _neuron(nodes, edges, "n2", "add", th2, reset, (C, S, S))
    h = add_conv("conv3", C, C, S, 2, 0.35)
    edges.append((s2, "conv3"))
    s3 = _neuron(nodes, edges, "n3", "conv3", th3, reset, (C, h, h))
    nodes["pool"] = nir.AvgPool2d(kernel_size=np.array([h, h]), stride=np.array([h, h]), padding=np.array([0, 0]))
    edges.append((s3, "pool"))
    nodes["flat"] = nir.Flatten(input_type={"input": np.array([C, 1, 1])}, start_dim=0, end_dim=-1)
    edges.append(("pool", "flat"))
    w = (rng.normal(0, 1.0, (classes, C)) * th3[None, :]).astype(np.float32)
    nodes["fc"] = nir.Affine(weight=w, bias=rng.normal(0, 0.1, classes).astype(np.float32))
    edges.append(("flat", "fc"))
    nodes["output"] = nir.Output(output_type=np.array([classes]))
    edges.append(("fc", "output"))
    meta = {"producer": "snnconv", "snnconv_format": 1, "T": T, "reset": reset, "encoding": "direct",
            "readout": "mean_over_T"}
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata=meta)
