"""SSMB's cut (``moe_tp="ssmb"``, X-MoE §4.3): each tp rank runs the MoE block on its own slice of the block's
tokens, from the block's input on, router and shared experts included (``runtime/comm/tp.py``'s ops).

    X [*lead, H], T = prod(lead) tokens  --moe.tp_slice-->  this rank's rows, [n, H]

A node of the block that works token by token then runs on the rows: it holds the physical [n, *rest] of its
logical [*lead, *rest] (``Rows``). Such nodes are views and reshapes that keep the tokens leading, casts,
pointwise ops and comparisons, linear, softmax and sums over a feature dimension (identity experts' share),
top-k over the last, ``moe.route``, and the canonical ``moe.build_pft`` / ``moe.expert_mlp`` / ``moe.combine``
(its token count: the rows). Whatever else reads rows (the residual add after the block, the graph's output, an
op not listed here) reads their ``moe.tp_gather``, reshaped back to the logical shape: exact, so an op not listed
costs a gather, never a wrong value.

Gradients (x-moe.md Fig. 8): the slice's adjoint gathers the token gradients whole on every tp rank, the gather's
takes this rank's slice. A replicated tensor that needs a gradient and meets rows (the router's weight, a shared
expert's) gets from this rank only its slice's part: ``moe.tp_linear`` (for a linear's weight and bias) and
``moe.tp_copy`` (for any other operand) sum it over tp in backward, so every tp rank holds the whole gradient,
as tensor parallelism and FSDP2 expect of a replicated parameter.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import FRAME_PREFIX, example, module_stack

EXPERT_MLP = (torch.ops.moe.expert_mlp, torch.ops.moe.expert_mlp.default)
COMBINE = (torch.ops.moe.combine, torch.ops.moe.combine.default)
PFT = (torch.ops.moe.build_pft, torch.ops.moe.build_pft.default)
ROUTE = (torch.ops.moe.route, torch.ops.moe.route.default)
VIEWS = {"view", "reshape"}
SAME_METHODS = {"to", "type", "float", "half", "bfloat16", "double", "contiguous", "sigmoid", "exp", "neg", "relu",
                "tanh", "clone", "rsqrt", "sqrt", "abs"}
SAME_FUNCTIONS = {torch.sigmoid, torch.exp, torch.neg, torch.relu, torch.tanh, torch.rsqrt, torch.sqrt, torch.abs,
                  F.silu, F.gelu, F.relu, F.sigmoid, operator.neg}
COMPARE = {operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne}
BINARY = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul, torch.div,
          *COMPARE}
BINARY_METHODS = {"add", "sub", "mul", "div", "ge", "gt", "le", "lt", "eq", "ne"}
SUM = {torch.sum}
SOFTMAX = {torch.softmax, F.softmax, torch.log_softmax, F.log_softmax}
LINEAR = {F.linear, torch._C._nn.linear}
TOPK = {torch.topk}


@dataclass(frozen=True)
class Rows:
    """A tensor cut to this rank's tokens: logically [*lead, *rest] (prod(lead) = the block's T), held as
    [n, *rest]."""

    lead: tuple
    rest: tuple


class _Local:
    """A value of the canonical ops that holds this slice's routed rows (build_pft's outputs, expert_mlp's)."""


LOCAL = _Local()


def cut_before_router(gm: fx.GraphModule, node: fx.Node, tp_group: str, layer: str) -> bool:
    """Cut the block of the ``moe.expert_mlp`` ``node`` at its input; False (nothing changed) where its token input
    does not come from one static-shaped [*lead, H] tensor by views and casts."""
    H = node.meta["moe_spec"].experts.hidden
    root = _root(node.args[0], H)
    tok = node.args[1]
    pft = tok.args[0] if tok.op == "call_function" and tok.target is operator.getitem else None
    if root is None or pft is None or pft.target not in PFT:
        return False
    Cut(gm, node, pft, root, Rows(tuple(example(root).shape[:-1]), (H,)), tp_group, layer).run()
    return True


def _root(x, H: int) -> fx.Node | None:
    """The block's input: the experts' [T, H] rows read back through reshapes to [-1, H] and casts."""
    while isinstance(x, fx.Node) and x.op == "call_method" and isinstance(x.args[0], fx.Node):
        if not ((x.target in VIEWS and _ints(x.args[1:])[-1:] == [H])
                or (x.target in SAME_METHODS and not any(isinstance(a, fx.Node) for a in x.args[1:]))):
            break
        x = x.args[0]
    value = example(x)
    if not _plain(value) or value.dim() < 2 or value.shape[-1] != H:
        return None
    return x


def _ints(args) -> list:
    flat = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else list(args)
    return flat if all(isinstance(a, int) for a in flat) else []


class Cut:
    """One block's walk: every node after the block's input, in graph order."""

    def __init__(self, gm, node, pft, root, rows: Rows, tp_group: str, layer: str):
        self.gm, self.graph, self.node, self.pft, self.root = gm, gm.graph, node, pft, root
        self.T, self.group, self.layer = math.prod(rows.lead), tp_group, layer
        self.key = node.meta.get("moe_layer", "<root>")
        self.rows: dict[fx.Node, object] = {root: rows}  # Rows, a list of them (a tuple), or LOCAL
        self.phys: dict[fx.Node, fx.Node] = {}  # root -> its slice; a rewritten node is its own
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.copies: dict[fx.Node, fx.Node] = {}
        self.rewritten: list[fx.Node] = []
        self.trainable: dict[fx.Node, bool] = {}

    def run(self) -> None:
        order = list(self.graph.nodes)
        with self.graph.inserting_after(self.root):
            flat = self._new("call_method", "reshape", (self.root, self.T, *self.rows[self.root].rest))
            with self.graph.inserting_after(flat):
                self.phys[self.root] = self._new("call_function", torch.ops.moe.tp_slice.default, (flat, self.group))
        for n in order[order.index(self.root) + 1:]:
            touched = [a for a in n.all_input_nodes if a in self.rows]
            if not touched and n is not self.pft:  # (a kept router left whole: its top-k sliced here)
                continue
            if n.op == "call_method" and n.target == "size" and n.users and all(u.target in COMBINE for u in n.users):
                continue  # the combine's token count: the rule for the combine puts in the rows'
            if self._in_block(n) and self._rowwise(n):
                self.rewritten.append(n)
                continue
            if any(self.rows[a] is LOCAL for a in touched):
                raise NotImplementedError(f"moe_tp='ssmb': {n.format_node()} reads the layer's routed rows; only "
                                          "moe.expert_mlp and moe.combine can")
            n.args, n.kwargs = fx.map_arg((n.args, n.kwargs), self._whole)
        for n in order:
            if n.op == "call_method" and n.target == "size" and not n.users:
                self.graph.erase_node(n)
        self._examples()

    # ---- what a node reads -------------------------------------------------------------------------------------

    def _new(self, op, target, args) -> fx.Node:
        n = self.graph.create_node(op, target, args)
        n.meta.update({k: self.node.meta[k] for k in ("nn_module_stack", "moe_layer") if k in self.node.meta})
        return n

    def _in_block(self, n: fx.Node) -> bool:
        if self.key in ("<root>", "", FRAME_PREFIX.get()) or n.meta.get("moe_layer") == self.key:  # (the frame's)
            return n.op != "output"
        return self.key in [path for _, path, _ in module_stack(n)]

    def _whole(self, a):
        """``a`` as the rest of the graph expects it: its rows gathered over tp and reshaped (the root: itself)."""
        if not isinstance(a, fx.Node) or a not in self.rows or a is self.root:
            return a
        if a not in self.gathered:
            r = self.rows[a]
            with self.graph.inserting_after(a):
                g = self._new("call_function", torch.ops.moe.tp_gather.default, (a, self.T, self.group, self.layer))
                with self.graph.inserting_after(g):
                    self.gathered[a] = g if len(r.lead) == 1 else self._new("call_method", "reshape",
                                                                            (g, *r.lead, *r.rest))
        return self.gathered[a]

    def _sliced(self, a, n: fx.Node):
        """A tensor the canonical ops need as this rank's rows: its rows, or (a whole [T, ...] one, e.g. a kept
        router's top-k) its tp_slice."""
        if a in self.phys:
            return self.phys[a]
        if a in self.rows:
            return a
        with self.graph.inserting_before(n):
            return self._new("call_function", torch.ops.moe.tp_slice.default, (a, self.group))

    def _replicated(self, a, n: fx.Node):
        """An operand that is not rows, beside rows: a copy whose gradient is summed over tp, if it needs one."""
        if not isinstance(a, fx.Node) or not self._trainable(a):
            return a
        if a not in self.copies:
            with self.graph.inserting_before(n):
                self.copies[a] = self._new("call_function", torch.ops.moe.tp_copy.default, (a, self.group))
        return self.copies[a]

    # ---- the rules -----------------------------------------------------------------------------------------------

    def _rowwise(self, n: fx.Node) -> bool:  # noqa: C901 (one rule per kind of op)
        rows, args, kw = self.rows, list(n.args), dict(n.kwargs)
        x = args[0] if args else None
        r = rows.get(x) if isinstance(x, fx.Node) else None
        if n.target is operator.getitem and isinstance(r, list):  # an element of a sliced tuple
            return self._set(n, r[args[1]], args, kw)
        if n.target is operator.getitem and r is LOCAL:
            return self._set(n, LOCAL, args, kw)
        if n.target in PFT:
            return self._set(n, LOCAL, [self._sliced(args[0], n), self._sliced(args[1], n), *args[2:]], kw)
        if n.target in EXPERT_MLP:
            if len(args) > 9 and args[9] is not None:  # the routing weights scaling each row (Llama 4)
                args[9] = self._sliced(args[9], n)
            return self._set(n, LOCAL, [self._sliced(args[0], n), *args[1:]], kw)
        if n.target in COMBINE:
            mlp = args[0]
            if not (isinstance(mlp, fx.Node) and mlp.target in EXPERT_MLP and rows.get(mlp) is LOCAL):
                return False
            x_rows = mlp.args[0]
            with self.graph.inserting_before(n):
                count = self._new("call_method", "size", (x_rows, 0))
            return self._set(n, Rows((self.T,), (example(self.root).shape[-1],)), [*args[:3], count, *args[4:]], kw)
        if not isinstance(r, Rows) or any(isinstance(a, fx.Node) and rows.get(a) is LOCAL for a in n.all_input_nodes):
            return False
        if n.target in ROUTE and len(r.lead) == 1:
            k = args[2]
            return self._set(n, [Rows(r.lead, (k,)), Rows(r.lead, (k,))], [self.phys.get(x, x), *args[1:]], kw)
        if n.op == "call_method" and n.target in VIEWS:
            return self._reshape(n, r, args)
        if (n.op == "call_method" and n.target in SAME_METHODS) or (n.op == "call_function"
                                                                    and n.target in SAME_FUNCTIONS):
            if any(isinstance(a, fx.Node) for a in (*args[1:], *kw.values())):
                return False
            return self._set(n, r, [self.phys.get(x, x), *args[1:]], kw)
        if n.target in SOFTMAX or (n.op == "call_method" and n.target in ("softmax", "log_softmax")):
            return self._along(n, r, args, kw, "dim", r)
        if n.target in TOPK or (n.op == "call_method" and n.target == "topk"):
            k = args[1] if len(args) > 1 else kw.get("k")
            dim = args[2] if len(args) > 2 else kw.get("dim", -1)
            if not isinstance(k, int) or dim not in (-1, len(r.lead) + len(r.rest) - 1):
                return False
            out = Rows(r.lead, (*r.rest[:-1], k))
            return self._set(n, [out, out], [self.phys.get(x, x), *args[1:]], kw)
        if n.target in SUM or (n.op == "call_method" and n.target == "sum"):
            return self._sum(n, r, args, kw)
        if n.target in LINEAR:
            return self._linear(n, r, args, kw)
        if n.target in BINARY or (n.op == "call_method" and n.target in BINARY_METHODS):
            return self._binary(n, args, kw)
        return False

    def _set(self, n: fx.Node, rows, args, kw) -> bool:
        n.args, n.kwargs = tuple(args), kw
        self.rows[n] = rows
        return True

    def _reshape(self, n, r: Rows, args) -> bool:
        target = _ints(args[1:])
        if not target or target.count(-1) > 1:
            return False
        numel = self.T * math.prod(r.rest)
        if -1 in target:
            known = math.prod(d for d in target if d != -1)
            if known == 0 or numel % known:
                return False
            target[target.index(-1)] = numel // known
        for k in range(1, len(target) + 1):
            if math.prod(target[:k]) == self.T:
                n.target = "reshape"
                return self._set(n, Rows(tuple(target[:k]), tuple(target[k:])), [self.phys.get(args[0], args[0]),
                                                                                 -1, *target[k:]], {})
            if math.prod(target[:k]) > self.T:
                break
        return False

    def _along(self, n, r: Rows, args, kw, name, out) -> bool:
        """An op along one feature dimension (softmax): its logical dim read as the rows' dim."""
        if name in kw:
            dim = _phys_dim(kw[name], r)
            if dim is None:
                return False
            kw[name] = dim
        elif len(args) > 1:
            dim = _phys_dim(args[1], r)
            if dim is None:
                return False
            args[1] = dim
        else:
            return False
        args[0] = self.phys.get(args[0], args[0])
        return self._set(n, out, args, kw)

    def _sum(self, n, r: Rows, args, kw) -> bool:
        """A sum over one feature dimension (identity experts' share of a token's routing weights)."""
        keep = args[2] if len(args) > 2 else kw.get("keepdim", False)
        dim = _phys_dim(args[1] if len(args) > 1 else kw.get("dim"), r)
        if dim is None or not isinstance(keep, bool) or set(kw) - {"dim", "keepdim"} or len(args) > 3:
            return False
        d = dim - 1 if dim > 0 else len(r.rest) + dim  # (in r.rest)
        out = Rows(r.lead, (*r.rest[:d], *([1] if keep else []), *r.rest[d + 1:]))
        return self._along(n, r, args, kw, "dim", out)

    def _linear(self, n, r: Rows, args, kw) -> bool:
        w = args[1] if len(args) > 1 else kw.get("weight")
        b = args[2] if len(args) > 2 else kw.get("bias")
        wv, bv = example(w), example(b) if isinstance(b, fx.Node) else None
        if not _plain(wv) or wv.dim() != 2 or (b is not None and not _plain(bv)):
            return False
        out = Rows(r.lead, (*r.rest[:-1], wv.shape[0]))
        x = self.phys.get(args[0], args[0])
        if self._trainable(w) or (isinstance(b, fx.Node) and self._trainable(b)):
            n.target = torch.ops.moe.tp_linear.default
            return self._set(n, out, [x, w, b, self.group], {})
        return self._set(n, out, [x, *args[1:]], kw)

    def _binary(self, n, args, kw) -> bool:
        if kw or len(args) != 2:
            return False
        sliced = [self.rows[a] for a in args if isinstance(a, fx.Node) and isinstance(self.rows.get(a), Rows)]
        if len({s.lead for s in sliced}) != 1 or len({len(s.rest) for s in sliced}) != 1:
            return False  # (rows of different ranks broadcast over the tokens: not row by row)
        rest = max((s.rest for s in sliced), key=len)
        shapes = [s.rest for s in sliced]
        for a in args:
            if isinstance(a, fx.Node) and a not in self.rows:
                v = example(a)
                if not _plain(v) or v.dim() > len(rest):
                    return False
                shapes.append(tuple(v.shape))
            elif not isinstance(a, (fx.Node, int, float, bool)):
                return False
        try:
            out = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            return False
        if len(out) != len(rest):
            return False
        new = [self.phys.get(a, a) if a in self.rows else self._replicated(a, n) for a in args]
        return self._set(n, Rows(sliced[0].lead, out), new, kw)

    def _trainable(self, a: fx.Node) -> bool:
        """Whether ``a``'s value reaches back to a graph input that needs a gradient."""
        stack, seen = [a], []
        while stack:
            n = stack.pop()
            if n in self.trainable or n in seen:
                continue
            seen.append(n)
            value = example(n)
            if n.op in ("placeholder", "get_attr"):
                if n.op == "get_attr":
                    value = self.gm
                    for part in str(n.target).split("."):
                        value = getattr(value, part, None)
                self.trainable[n] = bool(getattr(value, "requires_grad", False))
            elif isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
                self.trainable[n] = False
            else:
                stack.extend(n.all_input_nodes)
        pending = [n for n in seen if n not in self.trainable]
        while pending:  # each once its inputs are known
            ready = [n for n in pending if all(i in self.trainable for i in n.all_input_nodes)]
            for n in ready:
                self.trainable[n] = any(self.trainable[i] for i in n.all_input_nodes)
            pending = [n for n in pending if n not in self.trainable]
        return self.trainable[a]

    # ---- after -----------------------------------------------------------------------------------------------

    def _examples(self) -> None:
        """The rewritten nodes' example values cut to this rank's rows (the passes after read their shapes)."""
        for n in [self.phys[self.root], *self.rewritten]:
            r = self.rows.get(n, self.rows[self.root])
            value = example(self.root if n is self.phys[self.root] else n)
            if isinstance(r, Rows) and isinstance(value, torch.Tensor):
                try:
                    n.meta["example_value"] = torch.ops.moe.tp_slice(value.reshape(self.T, *r.rest), self.group)
                except Exception:  # noqa: BLE001 (a shape the passes after will not read)
                    n.meta.pop("example_value", None)
            elif n.op != "placeholder":
                n.meta.pop("example_value", None)


def _phys_dim(d, r: Rows):
    """The rows' dimension for logical dimension ``d`` (None where ``d`` is a token dimension)."""
    if not isinstance(d, int):
        return None
    if d < 0:
        return d if -d <= len(r.rest) else None
    return d - len(r.lead) + 1 if d >= len(r.lead) else None


def _plain(v) -> bool:
    """A tensor whose shape is known and whose value is the same on every tp rank's graph (not a DTensor: a
    tensor-parallel weight inside the block needs every tp rank's tokens)."""
    from torch.distributed.tensor import DTensor

    return isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and all(isinstance(s, int) for s in v.shape)
