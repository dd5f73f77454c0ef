"""Small helpers over Dynamo FX graphs: op names, module stacks, slices, parameters, sub-graph extraction."""

from __future__ import annotations

import contextvars
import operator
import re
from collections import defaultdict

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy


def op_name(n: fx.Node) -> str:
    """A readable name for what a node computes: ``linear``, ``topk``, ``softmax``, ``mul``, ``getitem``..."""
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        t = n.target
        if isinstance(t, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
            return str(t)
        return getattr(t, "__name__", str(t))
    return n.op


def moe_op_name(n: fx.Node) -> str | None:
    """``"route"`` for a call of ``torch.ops.moe.route`` (packet or overload), else None."""
    target = n.target
    if n.op != "call_function":
        return None
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if isinstance(target, torch._ops.OpOverload):
        namespace, _, name = target._schema.name.partition("::")
        return name if namespace == "moe" else None
    return None


# the path of the traced frame's ``self`` in the model being run, while the passes run on its graph
# (``moecompile/tracing/frames.py``; "" when the frame is the model's own forward)
FRAME_PREFIX: contextvars.ContextVar[str] = contextvars.ContextVar("moe_frame_prefix", default="")
FRAME_TYPE: contextvars.ContextVar[str] = contextvars.ContextVar("moe_frame_type", default="")  # its class name


def clean_path(path: str) -> str:
    """``L['self'].model.layers.0.mlp`` -> ``model.layers.0.mlp``; with ``FRAME_PREFIX`` (``model``) set,
    ``L['self'].layers.0.mlp`` -> ``model.layers.0.mlp`` too. ``L['fn']`` is the compiled module too, where Dynamo
    calls it through a wrapper (a ``torch.nn`` container such as ``nn.Sequential``: ``L['fn'].1`` -> ``1``). A
    submodule Dynamo reached through the module's dict (peft's ``PeftModel`` reads ``self.base_model`` so:
    ``L['self'].__dict__['_modules']['base_model'].model``) gets its attribute path, ``base_model.model``."""
    prefix = FRAME_PREFIX.get() if path.startswith(("L['self']", "L['fn']")) else ""
    if "_modules" in path:  # (called for every node's module stack: the common path skips the regex)
        path = re.sub(r"\.?(?:__dict__\['_modules'\]|_modules)\['([^']+)'\]", r".\1", path)
    path = re.sub(r"^L\['(self|fn)'\]\.?", "", path).replace("L['self']", "")
    return f"{prefix}.{path}" if prefix and path else prefix or path


def module_stack(n: fx.Node) -> list[tuple[str, str, str]]:
    """[(key, path, type name)] from outermost to innermost module."""
    out = []
    for key, (path, typ) in (n.meta.get("nn_module_stack") or {}).items():
        out.append((key, clean_path(path), getattr(typ, "__name__", str(typ))))
    return out


def nodes_by_module(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    by_key: dict[str, list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        for key, _, _ in module_stack(n):
            by_key[key].append(n)
    return by_key


def example(n) -> object:
    return n.meta.get("example_value") if isinstance(n, fx.Node) else n


def example_above(node: fx.Node, cast: bool = True) -> torch.Tensor:
    """The first example tensor found walking up from ``node`` (the nodes that canonicalize traced carry none;
    the graph's own nodes do), in the dtype of the nearest ``.to(dtype)`` cast on the way (``canonical`` casts the
    experts' operands to their compute dtype); ``cast=False``: as found (whether it requires grad, say)."""
    todo, seen = [(node, None)], set()
    while todo:
        n, dtype = todo.pop()
        v = example(n)
        if isinstance(v, torch.Tensor):
            return v if dtype is None or v.dtype == dtype or not cast else _as_dtype(v, dtype)
        seen.add(n)
        dtype = dtype or cast_dtype(n)
        todo += [(a, dtype) for a in n.all_input_nodes if a not in seen]
    raise AssertionError("an MoE layer with no example value above its expert op")


def _as_dtype(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``v`` as an example of ``dtype`` (shape, device): a fake or meta tensor cast, a real one never copied."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(v, FakeTensor) or v.is_meta:
        return v.to(dtype)
    return torch.empty((), dtype=dtype, device=v.device).expand(v.shape)


def cast_dtype(n: fx.Node) -> torch.dtype | None:
    """The dtype of a ``tensor.to(dtype)`` call, else None."""
    if n.op == "call_method" and n.target == "to":
        return next((a for a in (*n.args[1:], *n.kwargs.values()) if isinstance(a, torch.dtype)), None)
    return None


def shape_of(n) -> tuple | None:
    v = example(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def hint(v) -> int | None:
    """A concrete int for an int or SymInt (its hint), or None."""
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        try:
            return int(v.node.hint) if v.node.hint is not None else None
        except Exception:
            return None
    return None


def _closure(nodes, step, within: set[fx.Node] | None) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen or (within is not None and n not in within):
            continue
        seen.add(n)
        stack.extend(step(n))
    return seen


def ancestors(nodes, within: set[fx.Node] | None = None) -> set[fx.Node]:
    """Nodes that ``nodes`` depend on (inclusive), staying inside ``within`` when given. In-place ops that
    write to a node taken in (``inv[perm] = arange``) are taken in too: the values read depend on them."""
    return _closure(nodes, lambda n: [*n.all_input_nodes, *(u for u in n.users if mutated_input(u) is n)], within)


def descendants(nodes, within: set[fx.Node] | None = None) -> set[fx.Node]:
    """Nodes that depend on ``nodes`` (inclusive), staying inside ``within`` when given. A tensor written in place
    by a dependent op (``out.index_add_(0, rows, y)``) depends on it, and so do its users."""
    return _closure(nodes, lambda n: [*n.users, *filter(None, [mutated_input(n)])], within)


def float_consts(n: fx.Node) -> list[float]:
    return [a for a in list(n.args) + list(n.kwargs.values()) if isinstance(a, float)]


def placeholder_values(gm: fx.GraphModule, example_inputs) -> dict[fx.Node, object]:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = dict(zip(phs, example_inputs))
    for n in phs[len(example_inputs):]:  # a sharded parameter's global stand-in (passes/sharded.py)
        values[n] = n.meta["ep_standin"]
    return values


def is_param(n: fx.Node, values: dict) -> bool:
    """A placeholder holding a parameter or buffer of the model (not an activation or a size)."""
    if n.op != "placeholder":
        return False
    v = values.get(n)
    if isinstance(v, torch.nn.Parameter):
        return True
    return isinstance(v, torch.Tensor) and ("_parameters_" in n.name or "_buffers_" in n.name)


def extract(nodes: set[fx.Node], output: fx.Node | list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A GraphModule computing ``output`` from ``nodes``; returns it and the outside nodes its inputs stand for."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    ordered = [n for n in next(iter(nodes)).graph.nodes if n in nodes]
    for n in ordered:
        for a in n.all_input_nodes:
            if a not in nodes and a not in env:
                env[a] = _input(graph, a, len(inputs))
                inputs.append(a)
        if n.op == "placeholder":
            env[n] = _input(graph, n, len(inputs))
            inputs.append(n)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    outs = [env[o] for o in output] if isinstance(output, list) else env[output]
    graph.output(outs)
    # get_attr nodes (the bodies of a higher-order op, e.g. an autograd.Function's fwd_body_0) read the owner
    root = ordered[0].graph.owning_module or torch.nn.Module()
    return fx.GraphModule(root, graph), inputs


def _input(graph: fx.Graph, outside: fx.Node, i: int) -> fx.Node:
    """A placeholder standing for ``outside``, with its example value (what the passes read shapes from)."""
    ph = graph.placeholder(f"in_{i}")
    if "example_value" in outside.meta:
        ph.meta["example_value"] = outside.meta["example_value"]
    return ph


def draws_random(n: fx.Node) -> bool:
    """Whether ``n`` draws random numbers: an ATen op tagged ``nondeterministic_seeded`` (``rand_like``,
    ``exponential_``, ``bernoulli``, ``dropout`` while training...), called as itself, a torch function or a
    method; a higher-order op's bodies (``get_attr`` graphs) are looked into."""
    if n.op == "get_attr":
        owner = n.graph.owning_module
        body = getattr(owner, n.target, None) if owner is not None and isinstance(n.target, str) else None
        return isinstance(body, fx.GraphModule) and any(draws_random(m) for m in body.graph.nodes)
    if n.op not in ("call_function", "call_method"):
        return False
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    else:
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        try:
            packet = target if isinstance(target, torch._ops.OpOverloadPacket) else getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            return False
        overloads = [getattr(packet, o) for o in packet.overloads()]
    if not any(torch.Tag.nondeterministic_seeded in op.tags for op in overloads):
        return False
    if "dropout" in op_name(n):  # dropout(x, p, train): p = 0 or train = False draws nothing
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        train = n.kwargs.get("training", n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True))
        return p != 0 and train is not False
    return True


INPLACE = {"setitem", "iadd", "isub", "imul", "itruediv", "add_", "mul_", "div_", "sub_", "index_add_", "scatter_",
           "scatter_add_", "scatter_reduce_", "index_copy_", "index_put_", "masked_scatter_", "masked_fill_", "copy_",
           "zero_", "fill_", "clamp_", "uniform_", "exponential_", "normal_"}


def mutated_input(n: fx.Node) -> fx.Node | None:
    """The node an in-place op writes to, if ``n`` is one: a listed op, any other method or function named with a
    trailing underscore (``relu_``, ``masked_fill_``), or one called with ``inplace=True`` (``F.relu``)."""
    if n.op not in ("call_function", "call_method") or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    name = _short_name(n)
    if name in INPLACE or n.kwargs.get("inplace") is True or re.fullmatch(r"[a-z]\w*[a-z0-9]_", name):
        return n.args[0]
    return None


def _short_name(n: fx.Node) -> str:
    """``op_name`` without an ATen op's namespace and overload: ``add_`` for ``aten.add_.Tensor``."""
    name = op_name(n)
    if isinstance(n.target, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        name = name.split(".")[1]
    return name


# ops whose result may share memory with their first argument: writing to it in place writes to that argument too
ALIASING = {"view", "reshape", "view_as", "reshape_as", "transpose", "permute", "t", "mT", "T", "contiguous", "to",
            "type", "type_as", "float", "half", "bfloat16", "squeeze", "unsqueeze", "flatten", "unflatten", "expand",
            "expand_as", "narrow", "select", "getitem", "detach", "as_strided", "movedim", "swapaxes", "diagonal",
            "unbind", "split", "chunk", "tensor_split", "unfold", "view_as_real", "view_as_complex"}


def written_through(n: fx.Node) -> list[fx.Node]:
    """What an in-place op ``n`` writes to: its argument, and what that may be a view of (through ``ALIASING`` ops
    and other in-place ops, whose results alias their argument); empty when ``n`` writes nothing in place."""
    chain, node = [], mutated_input(n)
    while isinstance(node, fx.Node) and node.op != "placeholder":
        chain.append(node)
        if _short_name(node) not in ALIASING and mutated_input(node) is None:
            break
        node = node.args[0] if node.args else None
    if isinstance(node, fx.Node) and node.op == "placeholder":
        chain.append(node)
    return chain


def viewed(n: fx.Node) -> list[fx.Node]:
    """What ``n`` is a view of, nearest first, through ``ALIASING`` ops (empty when it is none)."""
    chain = []
    while n.op != "placeholder" and _short_name(n) in ALIASING and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
        chain.append(n)
    return chain


# runtime checks Dynamo puts in the graph on data-dependent sizes (``u0 >= 0``, ``Eq(u0 + u1, 32)``)
CHECKS = {"aten._assert_scalar.default", "aten._assert_scalar", "aten.sym_constrain_range_for_size.default",
          "aten.sym_constrain_range.default", "aten._assert_async.msg", "_check", "_check_is_size"}


def is_check(n: fx.Node) -> bool:
    return n.op == "call_function" and op_name(n) in CHECKS


GETITEM = operator.getitem


def autocast_dtypes(device: torch.device) -> list[torch.dtype]:
    """The autocast dtype for ``device`` where the program runs under autocast (the backend compiles inside the
    user's ``torch.autocast``, and so does the proof): the original block's linears and matmuls then compute in it
    (bf16: about 1e-3 apart from float32), whatever its inputs' dtypes."""
    if not torch.is_autocast_enabled(device.type):
        return []
    return [torch.get_autocast_dtype(device.type)]


def code_signature(gm: fx.GraphModule) -> str:
    """What the graph computes, without its node names (two layers of one model run the same ops on different
    parameters): each node's op, target and arguments, nodes named by their position."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    named = lambda a: f"%{index[a]}"  # noqa: E731
    return "\n".join(f"{n.op} {getattr(n.target, '__name__', n.target) if n.op != 'placeholder' else ''} "
                     f"{fx.node.map_arg(n.args, named)} {fx.node.map_arg(n.kwargs, named)}" for n in gm.graph.nodes)


LAYOUT = {"stack", "getitem", "chunk", "transpose", "to", "contiguous", "view", "reshape", "unsqueeze", "permute"}


def weight_chain(w, limit: int = 16) -> set[fx.Node] | None:
    """The nodes that lay out ``w`` from the graph's inputs (the weights) alone, by ``LAYOUT`` ops only (the
    distribute pass's stacks, slices and canonical views of the expert weights), at most ``limit``; none where
    ``w`` is an input; None where ``w`` is computed otherwise (from activations)."""
    if not isinstance(w, fx.Node):
        return None
    chain, todo = set(), [w]
    while todo:
        n = todo.pop()
        if n.op in ("placeholder", "get_attr") or n in chain:
            continue
        if n.op not in ("call_function", "call_method") or _short_name(n) not in LAYOUT or len(chain) >= limit:
            return None
        chain.add(n)
        todo += n.all_input_nodes
    return chain


def recompute_between(sources: set[fx.Node], outputs: list[fx.Node]) -> None:
    """Mark every node on a path from ``sources`` (not themselves) to ``outputs`` for AOT autograd's partitioner to
    compute again in backward, as ``distribute`` marks a gather of ``reshard_after_forward``; also between two
    sources (a ``"dp_shard"`` copy's gather, then an expert domain's gather of what it gathered)."""
    reaches: dict[fx.Node, bool] = {}

    def visit(n: fx.Node) -> bool:
        if n not in reaches:
            reaches[n] = False  # (a DAG: no cycle reaches it again)
            upstream = any([visit(a) for a in n.all_input_nodes])  # (a list: every input visited)
            reaches[n] = upstream or n in sources
            if upstream and n not in sources:
                n.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=0)
        return reaches[n]

    for out in outputs:
        visit(out)
