"""torch.fx helpers shared by the stages: prepare a copy, trace it, edit nodes, capture values."""

from __future__ import annotations

import copy
import operator
import os
import traceback
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.errors import UnsupportedModelError

__all__ = [
    "prepare",
    "drop_eval_identities",
    "trace",
    "parent_name",
    "set_module",
    "module_of",
    "call_sites",
    "call_counts",
    "capture",
    "capture_pieces",
    "run_lockstep",
    "run_grouped",
    "GroupStore",
    "NodeOutputs",
    "describe_node",
]


def _restore_flags(model: nn.Module, flags: dict[str, bool]) -> None:
    for name, module in model.named_modules():
        if name in flags:
            module.training = flags[name]


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _runs_torch_forward(m: nn.Module) -> bool:
    """True when ``m``'s ``forward`` is a torch.nn layer's own (a subclass that does not override it)."""
    for cls in type(m).__mro__:
        if "forward" in vars(cls):
            return cls.__module__.startswith(("torch.nn.", "torch.ao.nn."))
    return False


class _Tracer(fx.Tracer):
    """Keeps torch.nn layers, their subclasses that keep the layer's ``forward`` (a user's
    ``class MyBN(nn.BatchNorm2d)``), and the given module types as leaves of the graph."""

    def __init__(self, leaf_types: tuple[type, ...] = ()):
        super().__init__()
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if self.leaf_types and isinstance(m, self.leaf_types):
            return True
        if not isinstance(m, _CONTAINERS) and _runs_torch_forward(m):
            return True
        return super().is_leaf_module(m, qualname)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _user_frame(exc: BaseException) -> str:
    """Where in the user's code tracing failed: ``' at FILE:LINE in FUNC: CODE'`` or ``''``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
              and os.path.abspath(f.filename) != os.path.abspath(__file__)]
    if not frames:
        return ""
    f = frames[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f" at {f.filename}:{f.lineno} in {f.name}(){code}"


def trace(model: nn.Module, leaf_types: tuple[type, ...] = ()) -> fx.GraphModule:
    """Symbolically trace ``model`` (not copied) into a GraphModule.

    Raises:
        UnsupportedModelError: torch.fx cannot trace the model; the message names the construct.
    """
    if isinstance(model, fx.GraphModule):
        return model
    tracer = _Tracer(leaf_types)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError...
        raise UnsupportedModelError(
            f"torch.fx cannot trace {type(model).__name__}{_user_frame(exc)}: "
            f"{type(exc).__name__}: {exc}. "
            "Data-dependent control flow (if/for on tensor values), tensor-to-Python conversions "
            "(.item(), int(x), len(x)) or unsupported builtins break symbolic tracing. Move such "
            "logic out of forward(), wrap it in a function marked with torch.fx.wrap, or pass a "
            "model whose forward uses only tensor operations."
        ) from exc
    name = type(model).__name__
    return fx.GraphModule(tracer.root, graph, name)


def prepare(model: nn.Module, leaf_types: tuple[type, ...] = ()) -> fx.GraphModule:
    """The `prepare` stage's first step: an eval-mode deep copy of ``model``, traced with torch.fx.

    The caller's model (parameters, buffers, ``training`` flags) is never changed.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"expected a torch.nn.Module, got {type(model).__name__}; pass the model object itself"
        )
    flags = {name: m.training for name, m in model.named_modules()}
    try:
        clone = copy.deepcopy(model)
    except Exception as exc:
        raise UnsupportedModelError(
            f"cannot deep-copy {type(model).__name__}: {exc}. snnconv never edits the caller's "
            "model, so it must be copyable; remove un-copyable attributes (open files, locks)."
        ) from exc
    finally:
        _restore_flags(model, flags)
    clone.eval()
    gm = trace(clone, leaf_types)
    gm.eval()
    drop_eval_identities(gm)
    return gm


#: Calls that are the identity in eval mode, as data: ``(module, name)`` of the function (or of
#: a leaf module's class) -> the position and keyword of its ``training`` argument (None for a
#: module: its own ``training`` flag) and of its drop probability.
EVAL_IDENTITIES: dict[tuple[str, str], tuple[tuple[int, str] | None, tuple[int, str] | None]] = {
    ("torchvision.ops.stochastic_depth", "stochastic_depth"): ((3, "training"), (1, "p")),
    ("torchvision.ops.stochastic_depth", "StochasticDepth"): (None, None),
}


def _argument(node: fx.Node, where: tuple[int, str], default: Any) -> Any:
    pos, key = where
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(key, default)


def _eval_identity(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is a call of :data:`EVAL_IDENTITIES` that returns its input as it is."""
    mod = module_of(gm, node)
    target: Any = type(mod) if mod is not None else node.target if node.op == "call_function" else None
    entry = EVAL_IDENTITIES.get((getattr(target, "__module__", ""), getattr(target, "__name__", "")))
    if entry is None or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    training, p = entry
    if mod is not None or training is None or p is None:
        return mod is not None and not mod.training
    return _argument(node, training, True) is False or _argument(node, p, None) == 0.0


def drop_eval_identities(gm: fx.GraphModule) -> list[str]:
    """Remove from ``gm``, in place, every call that is the identity in eval mode (torchvision's
    ``stochastic_depth(x, p, mode, training=False)`` and ``StochasticDepth`` in eval mode:
    :data:`EVAL_IDENTITIES`), its users reading its input instead; the names of the nodes removed."""
    removed = []
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_module") and _eval_identity(gm, node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed.append(node.name)
    if removed:
        gm.recompile()
    return removed


def parent_name(target: str) -> tuple[str, str]:
    """Split ``'a.b.c'`` into ``('a.b', 'c')``."""
    *parent, name = target.rsplit(".", 1)
    return (parent[0] if parent else ""), name


def set_module(gm: nn.Module, target: str, module: nn.Module) -> None:
    """Install ``module`` at the qualified name ``target`` of ``gm``."""
    parent, name = parent_name(target)
    owner = gm.get_submodule(parent) if parent else gm
    setattr(owner, name, module)


def module_of(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The module a ``call_module`` node calls, else None."""
    if node.op != "call_module":
        return None
    return gm.get_submodule(str(node.target))


def call_sites(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Map each called module's qualified name to the nodes that call it."""
    sites: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sites.setdefault(str(node.target), []).append(node)
    return sites


def call_counts(gm: fx.GraphModule) -> dict[str, int]:
    """How many call sites each called module has (qualified name -> count)."""
    return {target: len(nodes) for target, nodes in call_sites(gm).items()}


def describe_node(node: fx.Node) -> str:
    """A short, user-facing description of where a node comes from."""
    if node.op == "call_module":
        return f"module '{node.target}' (fx node '{node.name}')"
    if node.op in ("call_function", "call_method"):
        target = getattr(node.target, "__name__", str(node.target))
        stack = node.meta.get("stack_trace")
        where = ""
        if stack:
            lines = [ln.strip() for ln in stack.strip().splitlines() if ln.strip()]
            if lines:
                where = f" at {lines[-2] if len(lines) > 1 else lines[-1]}"
        return f"{node.op} '{target}' (fx node '{node.name}'){where}"
    return f"{node.op} node '{node.name}'"


class _Capture(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, want: Callable[[fx.Node], bool],
                 reduce: Callable[[torch.Tensor], Any] | None = None):
        super().__init__(gm, garbage_collect_values=True)
        self.want = want
        self.reduce = reduce
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if self.want(n) and isinstance(out, torch.Tensor):
            # reduced or cloned now: a later in-place op (nn.ReLU(inplace=True)) would overwrite it
            self.values[n.name] = self.reduce(out) if self.reduce else out.detach().clone()
        elif self.want(n):
            self.values[n.name] = out
        return out


def capture(gm: fx.GraphModule, inputs: Iterable[Any], names: Iterable[str],
            *, with_output: bool = False, reduce: Callable[[torch.Tensor], Any] | None = None) -> Any:
    """Run ``gm`` on ``inputs`` and return the outputs of the nodes called ``names``
    (``reduce(output)`` instead, taken as each is computed, where given).

    With ``with_output=True`` returns ``(values, model_output)``.
    """
    wanted = set(names)
    interp = _Capture(gm, lambda n: n.name in wanted, reduce)
    with torch.no_grad():
        out = interp.run(*inputs)
    return (interp.values, out) if with_output else interp.values


def capture_pieces(gm: fx.GraphModule, x: torch.Tensor, names: Iterable[str], *,
                   reduce: Callable[[torch.Tensor], Any] | None = None) -> Iterator[tuple[int, int, dict]]:
    """:func:`capture` over the images of ``x``, in pieces whose values fit the memory
    (:func:`snnconv.memory.budget_bytes`; sized from one image: what it keeps and twice its
    largest value): ``(first, end, values)`` per piece, all of ``x`` at once where it fits."""
    from snnconv.memory import budget_bytes, refuse_one_image

    names = list(names)
    budget = budget_bytes(x.device)
    if budget is not None and len(x) > 1:
        one = capture(gm, (x[:1],), names, reduce=reduce)
        per_image = 2 * largest_value(gm, x[:1]) + sum(
            v.numel() * v.element_size() for v in one.values() if isinstance(v, torch.Tensor))
        refuse_one_image(per_image, x.device, "a calibration forward", "lower the input size")
        per = max(1, budget // max(1, per_image))
        if per < len(x):
            for lo in range(0, len(x), per):
                yield lo, min(len(x), lo + per), capture(gm, (x[lo:lo + per],), names, reduce=reduce)
            return
    yield 0, len(x), capture(gm, (x,), names, reduce=reduce)


class _Largest(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.largest = 0

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel() * out.element_size())
        return out

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        # the module's own forward: a measurement is not a call that hooks should see
        return self.fetch_attr(target).forward(*args, **kwargs)


def largest_value(gm: fx.GraphModule, x: torch.Tensor) -> int:
    """Bytes of the largest tensor that any node of ``gm`` produces on input ``x`` (modules
    run without their hooks)."""
    interp = _Largest(gm)
    with torch.no_grad():
        interp.run(x)
    return interp.largest


class NodeOutputs(list):
    """What a :func:`run_lockstep` hook returns to stand in for its node: the node's output for
    every chunk (the node itself is then not run). ``spikes=True`` says they hold only spike
    counts (0 or 1, or a burst's up to 255; then kept :class:`Packed` where they outlive the
    next hook)."""

    def __init__(self, values: Iterable[Any] = (), spikes: bool = False):
        super().__init__(values)
        self.spikes = spikes


class Packed:
    """A tensor of spike counts (0 or 1, up to 255 for a burst neuron) kept as ``uint8``, a
    quarter of float32's memory, in :func:`run_lockstep`'s values and unpacked to its dtype,
    bit for bit, for each use."""

    __slots__ = ("bits", "dtype")

    def __init__(self, spikes: torch.Tensor):
        # uint8, not bool: torch converts uint8 to float several times faster than bool (0.12
        # against 0.77 ms for 16 MiB of float32 on a 2-core CPU), and it keeps a burst's count
        self.bits, self.dtype = spikes.to(torch.uint8), spikes.dtype

    def unpack(self) -> torch.Tensor:
        return self.bits.to(self.dtype)


def _unpacked(value: Any) -> Any:
    return value.unpack() if isinstance(value, Packed) else value


_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
             operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
             operator.irshift, operator.imatmul, operator.setitem}


def _in_place(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether ``n`` may change one of its inputs (``operator.iadd``, ``x.add_(y)``,
    ``torch.relu_(x)``, ``inplace=True``, ``out=``)."""
    if n.kwargs.get("inplace") or "out" in n.kwargs:
        return True
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        return n.target in _IN_PLACE or (name.endswith("_") and not name.startswith("_"))
    if n.op == "call_method":
        return str(n.target).endswith("_") and not str(n.target).startswith("_")
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(str(n.target)), "inplace", False))
    return False


def _late_order(gm: fx.GraphModule, fixed: set[str]) -> list[fx.Node]:
    """The nodes of ``gm`` in an order that runs each node just before its first user, where
    that is safe (nodes named in ``fixed`` keep their place, as does anything that changes or
    reads a value changed in place): a value that only a later node needs (a shortcut's
    scaling) is then made when it is needed, not kept alive across the nodes in between."""
    nodes = list(gm.graph.nodes)
    changed = {a for n in nodes if _in_place(gm, n) for a in n.all_input_nodes}
    order: list[fx.Node] = []
    waiting: set[fx.Node] = set()

    def emit(n: fx.Node) -> None:  # n after its waiting inputs, depth first (no recursion)
        stack = [(n, iter(n.all_input_nodes))]
        while stack:
            node, inputs = stack[-1]
            for a in inputs:
                if a in waiting:
                    waiting.discard(a)
                    stack.append((a, iter(a.all_input_nodes)))
                    break
            else:
                stack.pop()
                order.append(node)

    for n in nodes:
        if (n.op in ("call_module", "call_function", "call_method") and n.name not in fixed and n.users
                and not _in_place(gm, n) and not any(a in changed for a in n.all_input_nodes)):
            waiting.add(n)
        else:
            emit(n)
    return order


class _Lockstep(fx.Interpreter):
    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return fx.node.map_aggregate(args, _unpacked), fx.node.map_aggregate(kwargs, _unpacked)


def run_lockstep(gm: fx.GraphModule, chunks: list[torch.Tensor],
                 before: dict[str, Callable[..., Any]],
                 observe: dict[str, Callable[[Iterator[Any]], None]] | None = None) -> list[Any]:
    """Run ``gm`` on each of ``chunks``, every chunk up to a hooked node before any goes past
    it; returns the outputs per chunk.

    ``before[node_name](firsts)`` receives that node's first argument for every chunk and
    returns the ones it should run on (or a :class:`NodeOutputs`, the node's outputs): a
    correction computed from the whole data set takes effect before the next layer, while
    every operation still runs on one chunk (small, cache-sized tensors) and the graph is
    interpreted once, each node as late as it can run (:func:`_late_order`). From one hooked
    node to the next,
    each chunk runs the whole stretch before the next chunk starts (its values stay in cache).
    Values are freed after their last use, as ``fx.Interpreter.run`` does. Every chunk of
    every batch is alive at once at a hook, so a hook's spikes (``NodeOutputs(...,
    spikes=True)``) that are still needed after the next hook (a shortcut) are kept
    :class:`Packed`, a quarter of the memory (packing costs an operation per use: only there).

    ``observe[node_name](firsts)`` is a hook that only reads: it gets an iterator over that
    node's first argument, chunk by chunk (a packed value unpacked as it is reached, never all
    at once), when every chunk has reached the node, which then runs unchanged (a change the
    observer makes to the node's module, such as refitted weights, applies to every chunk).
    """
    observe = observe or {}
    its = [_Lockstep(gm, garbage_collect_values=True) for _ in chunks]
    for it, c in zip(its, chunks):
        it.env = {}
        it.args_iter = iter([c])
    order = _late_order(gm, set(before) | set(observe))
    last_user = {a: n for n in order for a in n.all_input_nodes}
    last: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_user.items():
        last.setdefault(user, []).append(value)
    at = {n: i for i, n in enumerate(order)}
    hooks_at = [i for i, n in enumerate(order) if n.name in before or n.name in observe] + [len(order)]
    # the hooked nodes whose value is still needed after the next hook
    outlive = {n for n, i in at.items() if n.name in before and n in last_user
               and at[last_user[n]] > next(h for h in hooks_at if h > i)}

    def run(it, node, first=None):
        if first is None:
            it.env[node] = it.run_node(node)
        else:
            args, kwargs = it.fetch_args_kwargs_from_env(node)
            it.env[node] = getattr(it, node.op)(node.target, (first[0], *args[1:]), kwargs)
        for dead in last.get(node, []):
            del it.env[dead]

    # the stretch from one hooked node to the next runs chunk by chunk (its values stay in
    # cache); only the hooks see all chunks at once
    segment: list[fx.Node] = []
    firsts: list[Any] = [None] * len(its)
    for node in order:
        hook = before.get(node.name)
        if hook is None and node.op != "output" and node.name not in observe:
            segment.append(node)
            continue
        for k, it in enumerate(its):
            for i, n in enumerate(segment):
                run(it, n, firsts[k] if i == 0 else None)
        if node.op == "output":
            return [it.run_node(node) for it in its]
        if hook is None:
            observe[node.name](it.fetch_args_kwargs_from_env(node)[0][0] for it in its)
            firsts, segment = [None] * len(its), [node]
            continue
        got = hook([it.fetch_args_kwargs_from_env(node)[0][0] for it in its])
        if isinstance(got, NodeOutputs):
            pack = got.spikes and node in outlive
            for i, (it, value) in enumerate(zip(its, got)):
                got[i] = None  # the float spikes go as they are packed
                it.env[node] = Packed(value) if pack else value
                for dead in last.get(node, []):
                    del it.env[dead]
            firsts, segment = [None] * len(its), []
        else:
            firsts, segment = [(f,) for f in got], [node]
    raise UnsupportedModelError("the graph has no output node")


class GroupStore:
    """What each group of chunks holds between two hooks of :func:`run_grouped`: in memory up
    to ``limit`` bytes (None: no limit), beyond that in files of a private temporary folder
    (spikes as ``bool``), read back and deleted when the group runs on."""

    def __init__(self, limit: int | None):
        self.limit, self.held, self.spilled = limit, 0, 0
        self.mem: dict[int, tuple[list[dict], int]] = {}
        self.files: dict[int, str] = {}
        self.folder: Any = None

    def put(self, g: int, envs: list[dict]) -> None:
        size = sum(_nbytes(v) for env in envs for v in env.values())
        if self.limit is None or self.held + size <= self.limit:
            self.mem[g] = (envs, size)
            self.held += size
            return
        import tempfile

        if self.folder is None:
            self.folder = tempfile.TemporaryDirectory(prefix="snnconv-calibration-")
        path = os.path.join(self.folder.name, f"group{g}.pt")
        torch.save([{n.name: (("packed", v.bits) if isinstance(v, Packed) else v) for n, v in env.items()}
                    for env in envs], path)
        self.files[g] = path
        self.spilled += 1

    def take(self, g: int, nodes: dict[str, fx.Node]) -> list[dict]:
        if g in self.mem:
            envs, size = self.mem.pop(g)
            self.held -= size
            return envs
        path = self.files.pop(g)
        saved = torch.load(path, weights_only=True)
        os.remove(path)
        return [{nodes[k]: (_packed_bits(v[1]) if isinstance(v, tuple) and v[:1] == ("packed",) else v)
                 for k, v in env.items()} for env in saved]

    def close(self) -> None:
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None


def _packed_bits(bits: torch.Tensor) -> Packed:
    p = Packed.__new__(Packed)
    p.bits, p.dtype = bits, torch.float32
    return p


def _nbytes(v: Any) -> int:
    t = v.bits if isinstance(v, Packed) else v
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def run_grouped(gm: fx.GraphModule, chunks: list[torch.Tensor], groups: list[list[int]],
                hooks: dict[str, Any], store: GroupStore) -> None:
    """:func:`run_lockstep`'s calibration, a group of chunks at a time: memory for one group's
    values and what every group holds between two hooks (``store``), not for every chunk at once.

    ``hooks[node_name]`` has ``prepare(firsts)`` (that node's first argument for each chunk of
    one group; it may change them in place, and returns what the other two read),
    ``measure(prepared, members)`` (``members``: the chunks' indices), ``settle()`` once every
    group was measured, and ``emit(prepared, members)``, which returns the node's outputs
    (``hook.replaces``; kept :class:`Packed` where ``hook.spikes``) or the first arguments it
    should run on; ``done()`` after the last group's emit. Between two
    hooks each group runs the stretch twice, to measure and to emit (the last group measured
    keeps its values and runs it once); a change a hook makes to a module applies from the
    emit on. Nothing after the last hook runs.
    """
    order = _late_order(gm, set(hooks))
    last_user = {a: n for n in order for a in n.all_input_nodes}
    last: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_user.items():
        last.setdefault(user, []).append(value)
    nodes = {n.name: n for n in order}
    its = [_Lockstep(gm) for _ in chunks]

    def advance(members: list[int], envs: list[dict], segment: list[fx.Node], node: fx.Node) -> list:
        firsts = []
        for i, env in zip(members, envs):
            it = its[i]
            it.env, it.args_iter = env, iter([chunks[i]])
            for n in segment:
                it.env[n] = it.run_node(n)
                for dead in last.get(n, []):
                    del it.env[dead]
            firsts.append(it.fetch_args_kwargs_from_env(node)[0][0])
        return hooks[node.name].prepare(firsts)

    for g, members in enumerate(groups):
        store.put(g, [{} for _ in members])
    start = 0
    try:
        for q, node in enumerate(order):
            hook = hooks.get(node.name)
            if hook is None:
                continue
            segment, kept = order[start:q], None
            for g, members in enumerate(groups):
                envs = store.take(g, nodes)
                if g == len(groups) - 1:
                    kept = (envs, advance(members, envs, segment, node))
                    continue
                copies = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in env.items()}
                          for env in envs]
                hook.measure(advance(members, copies, segment, node), members)
                store.put(g, envs)
                del copies
            assert kept is not None  # the last group's members were advanced above
            hook.measure(kept[1], groups[-1])
            hook.settle()
            for g in [len(groups) - 1, *range(len(groups) - 1)]:
                members = groups[g]
                if kept is not None:
                    (envs, firsts), kept = kept, None
                else:
                    envs = store.take(g, nodes)
                    firsts = advance(members, envs, segment, node)
                outs = hook.emit(firsts, members)
                del firsts
                for k, (i, env) in enumerate(zip(members, envs)):
                    it = its[i]
                    it.env = env
                    if hook.replaces:
                        env[node] = Packed(outs[k]) if hook.spikes else outs[k]
                    else:
                        args, kwargs = it.fetch_args_kwargs_from_env(node)
                        env[node] = getattr(it, node.op)(node.target, (outs[k], *args[1:]), kwargs)
                    outs[k] = None
                    for dead in last.get(node, []):
                        del env[dead]
                store.put(g, envs)
            hook.done()
            start = q + 1
    finally:
        store.close()
