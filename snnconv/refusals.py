"""One refusal for all the constructs of a model that no integrate-and-fire network computes.

:func:`snnconv.activation.check_activations` finds them (every one, in one pass over the
graph); this module says where each sits (its module path, the fx node beside it) and groups
them by kind, each kind with the advice that fits it: an activation other than ReLU can be
replaced and the ANN fine-tuned, a product of two activations cannot be computed by IF
neurons at all, a normalisation between spiking layers has to go or become a BatchNorm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

__all__ = ["Construct", "KINDS", "module_path", "refusal_message"]


@dataclass(frozen=True)
class Construct:
    """One construct without an IF form.

    Attributes:
        kind: a key of :data:`KINDS` (``"activation"``, ``"product"``, ...).
        path: the qualified name of the module it is or sits in (``""``: the model's own forward).
        node: the fx node's name.
        what: what it is (``"Hardswish"``, ``"'mul' of two activations"``).
        note: where it sits, or what it belongs to (a normalisation's neighbours, a gate's product).
        source: the line of the model's code that made it, where torch.fx recorded one.
    """

    kind: str
    path: str
    node: str
    what: str
    note: str = ""
    source: str = ""

    def line(self) -> str:
        """``"features.1.block.1: 'mul' of two activations (fx node 'mul')"``."""
        where = self.path or "the model's forward()"
        beside = f"fx node '{self.node}'" + (f", {self.source}" if self.source and not self.path else "")
        return f"{where}: {self.what} ({beside})" + (f"; {self.note}" if self.note else "")

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "path": self.path, "node": self.node, "what": self.what,
                "note": self.note}


def module_path(node: fx.Node) -> str:
    """The qualified name of the module ``node`` is (a ``call_module``) or was traced inside
    (the innermost entry of torch.fx's ``nn_module_stack``); ``""`` for the model's own forward."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in reversed(list(stack.items())):
        path = value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else key
        if path:
            return str(path)
    return ""


def source_line(node: fx.Node) -> str:
    """``"at model.py:12 ..."``: the last line of the stack torch.fx recorded for ``node``, if any."""
    stack = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in stack.strip().splitlines() if ln.strip()]
    return f"at {lines[-2] if len(lines) > 1 else lines[-1]}" if lines else ""


def _paths(found: list[Construct]) -> list[str]:
    return list(dict.fromkeys(c.path for c in found if c.path))


def _code(*lines: str) -> str:
    """A snippet inside a message: its own indented lines, then the text goes on."""
    return "\n" + "\n".join("      " + ln for ln in lines) + "\n  "


def _activation_advice(found: list[Construct]) -> str:
    classes = sorted({c.what for c in found if c.what[:1].isupper()})  # module classes: nn.X
    text = ("Only ReLU maps onto integrate-and-fire neurons (QCFS). Replace each with nn.ReLU and "
            "fine-tune the ANN (a few epochs) before converting; its accuracy drops until then.")
    if classes:
        types = ", ".join(f"nn.{k}" for k in classes) + ("," if len(classes) == 1 else "")
        text += _code("import torch.nn as nn",
                      "def to_relu(module):",
                      "    for name, child in module.named_children():",
                      f"        if isinstance(child, ({types})):",
                      "            setattr(module, name, nn.ReLU())",
                      "        else:",
                      "            to_relu(child)",
                      "to_relu(model)  # then train model as before, then convert it")
    else:
        text += " "
    if any(not c.what[:1].isupper() for c in found):
        text += "A functional call (F.gelu, torch.sigmoid, ...) is in forward(): call F.relu there. "
    if any(c.note.startswith("the gate") for c in found):
        text += "An activation that gates a product goes with the product (below)."
    return text


def _product_advice(found: list[Construct]) -> str:
    text = ("Between spiking layers only spike trains travel, and a layer sees the average of its "
            "input over the T steps. An IF neuron adds up weighted inputs; the average of a product "
            "of two spike trains is not the product of their averages, so no IF network computes "
            "x * gate(x) (squeeze-excitation, gating, attention) or x / y. What you can do: remove "
            "the gate and fine-tune the ANN, or start from an architecture without products of "
            "activations (ResNet, VGG, MobileNetV2, the zoo's models).")
    paths = _paths(found)
    if paths:
        text += " To remove the gates whose modules return gate * input:" + _code(
            f"for path in ({', '.join(repr(p) for p in paths)},):",
            "    parent, _, name = path.rpartition('.')",
            "    setattr(model.get_submodule(parent), name, nn.Identity())")
    else:
        text += " "
    if len(paths) < len(found):
        text += "A product in the model's own forward(): edit forward() there."
    return text


def _normalisation_advice(found: list[Construct]) -> str:
    return ("A normalisation such as LayerNorm, GroupNorm or InstanceNorm divides each input by "
            "statistics of the values it receives; between spiking layers those are spike trains, "
            "and the division is not linear in the spike rates, so no IF layer computes it (each "
            "entry says where it sits). Replace it with a BatchNorm (fixed statistics at inference, "
            "folded into the layer before it) or remove it, and fine-tune the ANN.")


def _maxpool_advice(found: list[Construct]) -> str:
    hints = list(dict.fromkeys(c.note for c in found if c.note))
    return ("A max over spike trains is not the spike train of the max, so max-pooling has no exact "
            "IF equivalent. " + " ".join(hints))


def _operation_advice(found: list[Construct]) -> str:
    return ("Between spiking layers only operations that commute with averaging over time steps are "
            "exact: conv, linear, average pooling, flatten/reshape/view, add/sub, concatenation, "
            "slicing, zero padding, dropout and stochastic depth (identities at inference), identity, "
            "scaling by a constant. Remove or replace the "
            "operation (e.g. a clamp by a ReLU, max-pooling by average pooling) and retrain the ANN.")


#: The kinds of refusal, in the order the message lists them: kind -> (title, advice).
KINDS: dict[str, tuple[str, Callable[[list[Construct]], str]]] = {
    "activation": ("activation other than ReLU", _activation_advice),
    "product": ("product (or quotient) of two activations", _product_advice),
    "normalisation": ("normalisation between spiking layers", _normalisation_advice),
    "max-pooling": ("max-pooling", _maxpool_advice),
    "operation": ("operation on spike trains that does not commute with averaging over time",
                  _operation_advice),
}


def refusal_message(found: list[Construct], stage: str) -> str:
    """The one message for every construct in ``found``: a header, then per kind (in the order
    of :data:`KINDS`) its entries, one a line, and the advice for that kind."""
    parts = [f"{len(found)} construct(s) of the model have no integrate-and-fire equivalent "
             f"(found at {stage}); all of them, by kind:"]
    for kind, (title, advice) in KINDS.items():
        group = [c for c in found if c.kind == kind]
        if group:
            parts.append(f"\n[{title}: {len(group)}]")
            parts.extend(f"  - {c.line()}" for c in group)
            parts.append(f"  What to do: {advice(group)}")
    return "\n".join(p.rstrip() for p in parts)
