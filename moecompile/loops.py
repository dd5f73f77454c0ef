"""Loops over the experts that received tokens, given to Dynamo as the same loop over every expert.

transformers' ``experts_implementation="eager"``, dbrx and longcat_flash run their experts as::

    mask = F.one_hot(top_k_index, num_classes=E).permute(2, 1, 0)     # [E, K, T], entries 0 or 1
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()         # [n, 1]: the experts that got tokens
    for row in hit:
        e = row[0]
        pos, tok = torch.where(mask[e])
        out.index_add_(0, tok, expert_e(x[tok]) * w[tok, pos, None])

The trip count n depends on the data. Dynamo unrolls Python loops and cannot unroll that one, so the graph breaks
at the ``for`` and the experts run outside any graph. But an expert that received no tokens adds nothing: its
``where`` finds no rows, and ``index_add_`` of no rows leaves ``out`` as it was. So the loop over every expert,
``for e in range(mask.shape[0])``, computes the same ``out``, and Dynamo unrolls it (each ``where`` a
data-dependent shape it captures), like a jetmoe or ``nn.ModuleList`` loop.

``rewrite(fn)`` proves that from the function's source and returns the new code, or the reason it cannot:

1. the loop runs over a name bound once by ``C.nonzero()`` (or ``torch.nonzero(C)``), where ``C`` is
   ``M.sum(dims) > 0`` (any spelling: ``torch.greater``, ``gt``) with ``M`` a view of a ``one_hot`` (entries 0 or
   1, so a positive sum means a nonzero entry), or ``M.any(dims)``; ``dims`` are constants;
2. the body selects its rows with ``torch.where(M[row])`` (``.squeeze(0)`` allowed) on that same ``M``, and its one
   effect is ``out.index_add_(0, rows, ...)`` into a tensor bound outside the loop: every other statement binds
   local names (``with torch.no_grad()``, ``if``/``continue`` allowed), no call in it is in place (a trailing
   ``_``) or mutates a container, and no name it binds is read after the loop;
3. the loop row is used as ``row[0]``, ``row.item()`` or an index ``x[row]`` (which become the expert's number
   ``e``, ``e`` and ``x[e:e + 1]``); ``if rows.numel() == 0: continue`` (a skip of an empty expert, which the
   argument above makes redundant) is dropped, since Dynamo cannot branch on a data-dependent size.

The new loop sits under ``if M.dim() == len(dims) + 1:`` (the sum then covers every dimension but the expert's),
with the original loop as its ``else``, so a mask of another rank runs the code as written. Modules called in the
body are assumed free of side effects, as a forward pass is.

How it is used: while Dynamo traces for the moe backend (``moecompile.capture``), every module class reachable from
the frame being compiled whose ``forward`` holds such a loop has its function's ``__code__`` swapped for the
rewritten one, and put back when that compile ends. Dynamo inlines the rewritten loop; the user's class is as it
was before and after (eager calls, other backends and later compiles for other backends see the original code).
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
import types
from typing import NamedTuple

from torch import nn

ROW = "_moecompile_expert"  # the loop variable of the rewritten loop: the expert's number

_VIEWS = {"permute", "transpose", "view", "reshape", "squeeze", "unsqueeze", "contiguous", "to", "long", "int",
          "float", "bool", "flatten"}
_MUTATING = {"append", "extend", "insert", "pop", "update", "add", "remove", "clear", "setdefault", "discard"}


class Rewrite(NamedTuple):
    code: types.CodeType | None  # the function's new code, or None
    reason: str  # why not (empty when rewritten)
    where: str  # file:line of the loop (or of the function)
    source: str = ""  # the rewritten function, as Python source (for explain() and the tests)
    found: bool = False  # whether it holds a loop over nonzero() rows at all (rewritten or not)


class _Refuse(Exception):
    pass


def _call_name(node) -> str | None:
    """``f`` for ``f(...)``, ``torch.nn.functional.f(...)`` or ``x.f(...)``."""
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name):
            return f.id
        if isinstance(f, ast.Attribute):
            return f.attr
    return None


def _is_method(node, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name


def _const_int(node) -> int | None:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _const_dims(node) -> tuple[int, ...] | None:
    """The constant dims of ``1``, ``-1`` or ``(-1, -2)``, else None."""
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
    dims = [_const_int(e) for e in elts]
    return tuple(dims) if dims and None not in dims else None


def _reduction(node, name: str):
    """``(M, dims)`` for ``M.name(dims)`` / ``M.name(dim=dims)`` / ``torch.name(M, dims)``, else None."""
    if not isinstance(node, ast.Call) or _call_name(node) != name:
        return None
    args = list(node.args)
    if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id != "torch":
        base = node.func.value
    elif args and isinstance(args[0], ast.Name):
        base = args.pop(0)
    else:
        return None
    dims = args[0] if args else next((k.value for k in node.keywords if k.arg == "dim"), None)
    extra = [k.arg for k in node.keywords if k.arg != "dim"]
    if dims is None or len(args) > 1 or extra:
        return None
    d = _const_dims(dims)
    return (base.id, d) if d is not None else None


def _hit_condition(cond):
    """``(M, dims, needs_nonnegative)`` for the forms of ``C`` that say "expert row M[e] has a nonzero entry"."""
    if (r := _reduction(cond, "any")) is not None:
        return (*r, False)
    total = None
    if isinstance(cond, ast.Compare) and len(cond.ops) == 1:
        left, op, right = cond.left, cond.ops[0], cond.comparators[0]
        if isinstance(op, ast.Gt) and isinstance(right, ast.Constant) and right.value == 0:
            total = left
        elif isinstance(op, ast.Lt) and isinstance(left, ast.Constant) and left.value == 0:
            total = right
    elif _call_name(cond) in ("greater", "gt"):
        args = list(cond.args)
        if isinstance(cond.func, ast.Attribute) and not (
            isinstance(cond.func.value, ast.Name) and cond.func.value.id == "torch"
        ):
            args.insert(0, cond.func.value)
        if len(args) == 2 and isinstance(args[1], ast.Constant) and args[1].value == 0:
            total = args[0]
    if total is None or (r := _reduction(total, "sum")) is None:
        return None
    return (*r, True)


def _nonzero_arg(node):
    """``C`` for ``C.nonzero()`` / ``C.nonzero(as_tuple=False)`` / ``torch.nonzero(C)``."""
    if not isinstance(node, ast.Call) or _call_name(node) != "nonzero":
        return None
    kw = {k.arg: k.value for k in node.keywords}
    if set(kw) - {"as_tuple"} or ("as_tuple" in kw and not (isinstance(kw["as_tuple"], ast.Constant)
                                                          and kw["as_tuple"].value is False)):
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "torch"):
        return f.value if not node.args else None
    return node.args[0] if len(node.args) == 1 else None


def _assignments(fdef, name: str) -> list[ast.Assign]:
    out = []
    for node in ast.walk(fdef):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(t)):
                    out.append(node)
    return out


def _is_one_hot_view(value, name: str) -> bool:
    """``value`` is ``one_hot(...)`` or ``name`` itself, followed by view-like methods only."""
    while _call_name(value) in _VIEWS and isinstance(value.func, ast.Attribute):
        value = value.func.value
    return _call_name(value) == "one_hot" or (isinstance(value, ast.Name) and value.id == name)


def _pure(node) -> bool:
    """``self.a.b``, ``name`` or a view of one (``w.view(shape)``): evaluating it again has no effect."""
    while True:
        if isinstance(node, ast.Name):
            return True
        if isinstance(node, ast.Attribute):
            node = node.value
        elif _call_name(node) in _VIEWS and isinstance(node.func, ast.Attribute):
            if not all(_pure(a) or isinstance(a, ast.Constant) for a in node.args) or node.keywords:
                return False
            node = node.func.value
        else:
            return False


def _changed_in_place(fdef, names: set[str]) -> str | None:
    """One of ``names`` that the function changes in place (``m.zero_()``, ``m[i] = ...``), or None."""
    for node in ast.walk(fdef):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            attr = node.func.attr
            if node.func.value.id in names and attr.endswith("_") and not attr.endswith("__"):
                return node.func.value.id
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name) and t.value.id in names:
                    return t.value.id
    return None


def _names_bound(stmts) -> set[str]:
    out = set()
    for s in stmts:
        for node in ast.walk(s):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
    return out


class _RowUses(ast.NodeTransformer):
    """Rewrite the uses of the loop row (a ``[1]`` tensor ``[e]``) in terms of the expert's number ``e``."""

    def __init__(self, rows: set[str], ints: set[str]):
        self.rows, self.ints = rows, ints

    def _is_row(self, node) -> bool:
        return isinstance(node, ast.Name) and node.id in self.rows

    def _is_int(self, node) -> bool:
        return isinstance(node, ast.Name) and (node.id in self.ints or node.id == ROW)

    def visit_Subscript(self, node):
        if self._is_row(node.value):
            if isinstance(node.slice, ast.Constant) and node.slice.value in (0, -1):
                return ast.copy_location(ast.Name(ROW, ast.Load()), node)
            raise _Refuse(f"it indexes the loop row `{node.value.id}` other than as `{node.value.id}[0]`")
        if self._is_row(node.slice):  # x[row] -> x[e:e + 1], the same [1, ...] selection
            node.value = self.visit(node.value)
            node.slice = ast.Slice(ast.Name(ROW, ast.Load()),
                                   ast.BinOp(ast.Name(ROW, ast.Load()), ast.Add(), ast.Constant(1)))
            return node
        return self.generic_visit(node)

    def visit_Call(self, node):
        if _is_method(node, "item") and not node.args:
            base = node.func.value
            if self._is_row(base) or self._is_int(base):
                return ast.copy_location(ast.Name(ROW if self._is_row(base) else base.id, ast.Load()), node)
            if isinstance(base, ast.Subscript) and self._is_row(base.value):
                return self.visit(base)
        return self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in self.rows and isinstance(node.ctx, ast.Load):
            raise _Refuse(f"it uses the loop row `{node.id}` other than as `{node.id}[0]`, `{node.id}.item()` or "
                          "an index")
        return node


class _Body:
    """Check and rewrite the loop body; see the module docstring, point 2."""

    def __init__(self, target: str, mask: str, outside_loop: set[str]):
        self.rows, self.ints = {target}, set()
        self.mask, self.outside = mask, outside_loop
        self.selections: set[str] = set()  # names bound by torch.where(mask[row])
        self.effect = None
        self.pending: list = []  # guards of the statement being read (_guard_indexing)

    def _expr(self, node):
        node = _RowUses(self.rows, self.ints).visit(node)
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Lambda, ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)):
                raise _Refuse(f"its body holds a {type(sub).__name__.lower()}")
            name = _call_name(sub)
            if name and isinstance(sub.func, ast.Attribute):
                if (name.endswith("_") and not name.endswith("__")) or name in _MUTATING:
                    raise _Refuse(f"its body calls `.{name}(...)`, which changes a tensor or container in place")
            if name in ("setattr", "delattr", "print", "exec", "eval", "globals", "locals"):
                raise _Refuse(f"its body calls `{name}(...)`")
        self._guard_indexing(node)
        return node

    def _guard_indexing(self, node) -> None:
        """For each ``x[e]`` by the expert's number, the guard ``e < len(x)``: an expert past the end of ``x`` would
        raise in the original loop, so it never received tokens in a run that works, and the new loop skips it
        (dbrx's one_hot has a class more than its experts)."""
        def int_row(n):
            return isinstance(n, ast.Name) and (n.id == ROW or n.id in self.ints)

        short = [n for n in ast.walk(node) if isinstance(n, (ast.IfExp, ast.BoolOp, ast.ListComp, ast.SetComp,
                                                               ast.DictComp, ast.GeneratorExp))]
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Subscript) or (isinstance(sub.value, ast.Name) and sub.value.id == self.mask):
                continue
            uses = [n for n in ast.walk(sub.slice) if int_row(n)]
            if not uses:
                continue
            if not int_row(sub.slice):
                raise _Refuse("it indexes by the expert's number in a form whose range cannot be checked "
                              f"(`{ast.unparse(sub)}`)")
            if any(sub in list(ast.walk(s)) for s in short):
                raise _Refuse(f"it indexes by the expert's number under a condition (`{ast.unparse(sub)}`)")
            if not _pure(sub.value):
                raise _Refuse(f"it indexes by the expert's number into `{ast.unparse(sub.value)}`, which is not "
                              "an attribute or a view of one")
            length = ast.Call(ast.Name("len", ast.Load()), [copy.deepcopy(sub.value)], [])
            self.pending.append(ast.Compare(ast.Name(sub.slice.id, ast.Load()), [ast.Lt()], [length]))

    def _take(self) -> list:
        """``if not (e < len(x) and ...): continue`` for the guards of the statement just read, or nothing."""
        guards, self.pending = self.pending, []
        if not guards:
            return []
        test = guards[0] if len(guards) == 1 else ast.BoolOp(ast.And(), guards)
        return [ast.If(ast.UnaryOp(ast.Not(), test), [ast.Continue()], [])]

    def _selection(self, value) -> bool:
        """``torch.where(mask[e])`` / ``torch.where(mask[e:e+1].squeeze(0))`` on the loop's mask."""
        if not (_call_name(value) == "where" and len(value.args) == 1 and not value.keywords):
            return False
        sel = value.args[0]
        if _is_method(sel, "squeeze") and [getattr(a, "value", None) for a in sel.args] == [0]:
            sel = sel.func.value
        if not (isinstance(sel, ast.Subscript) and isinstance(sel.value, ast.Name) and sel.value.id == self.mask):
            return False
        s = sel.slice
        if isinstance(s, ast.Name):
            return s.id == ROW or s.id in self.ints
        return (isinstance(s, ast.Slice) and isinstance(s.lower, ast.Name) and s.lower.id == ROW)

    def _assign(self, stmt):
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            raise _Refuse("its body assigns in a form other than `name = ...` or `a, b = ...`")
        target = stmt.targets[0]
        names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
        if not names or not all(isinstance(n, ast.Name) for n in names):
            raise _Refuse("its body assigns to an attribute or an element (`x.a = ...`, `x[i] = ...`)")
        stmt.value = self._expr(stmt.value)
        bound = {n.id for n in names}
        self.rows -= bound
        self.ints -= bound
        self.selections -= bound
        if isinstance(target, ast.Name) and (
            (isinstance(stmt.value, ast.Name) and (stmt.value.id == ROW or stmt.value.id in self.ints))
            or (_call_name(stmt.value) == "int" and len(stmt.value.args) == 1
                and isinstance(stmt.value.args[0], ast.Name) and stmt.value.args[0].id == ROW)
        ):
            self.ints.add(target.id)
        if len(names) > 1 and self._selection(stmt.value):
            self.selections |= bound
        return stmt

    def _empty_skip(self, stmt) -> bool:
        """``if rows.numel() == 0: continue`` (or ``rows.shape[0] == 0``, ``len(rows) == 0``) on a selection."""
        t = stmt.test
        if not (isinstance(stmt, ast.If) and [type(s) for s in stmt.body] == [ast.Continue] and not stmt.orelse):
            return False
        if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
                and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value == 0):
            return False
        x = t.left
        if _is_method(x, "numel") and not x.args:
            x = x.func.value
        elif _call_name(x) == "len" and isinstance(x.func, ast.Name) and len(x.args) == 1:
            x = x.args[0]
        elif (isinstance(x, ast.Subscript) and isinstance(x.value, ast.Attribute) and x.value.attr == "shape"
              and isinstance(x.slice, ast.Constant) and x.slice.value == 0):
            x = x.value.value
        else:
            return False
        return isinstance(x, ast.Name) and x.id in self.selections

    def block(self, stmts, top: bool) -> list:
        out = []
        for stmt in stmts:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                out.append(stmt)
            elif isinstance(stmt, ast.Expr) and _is_method(stmt.value, "index_add_"):
                if not top or self.effect is not None:
                    raise _Refuse("its `index_add_` is not one statement at the top of the body")
                self.effect = self._effect(stmt)
                out += self._take() + [self.effect]
            elif isinstance(stmt, ast.Assign):
                stmt = self._assign(stmt)
                out += self._take() + [stmt]
            elif isinstance(stmt, ast.With):
                for item in stmt.items:
                    if item.optional_vars is not None or _call_name(item.context_expr) not in ("no_grad", "enable_grad"):
                        raise _Refuse("its body opens a `with` other than `torch.no_grad()`")
                stmt.body = self.block(stmt.body, top)
                out.append(stmt)
            elif isinstance(stmt, ast.If):
                if self._empty_skip(stmt):
                    continue  # redundant: an expert with no rows adds nothing (module docstring, point 3)
                stmt.test = self._expr(stmt.test)
                out += self._take()
                stmt.body = self.block(stmt.body, False) or [ast.Pass()]
                stmt.orelse = self.block(stmt.orelse, False)
                out.append(stmt)
            elif isinstance(stmt, (ast.Continue, ast.Pass)):
                out.append(stmt)
            elif isinstance(stmt, ast.Expr):
                raise _Refuse(f"its body runs `{ast.unparse(stmt.value)}` for an effect other than the index_add_")
            else:
                raise _Refuse(f"its body holds a `{type(stmt).__name__.lower()}` statement, which may do more than "
                              "bind local names")
        return out

    def _effect(self, stmt):
        call = stmt.value
        out = call.func.value
        if not (isinstance(out, ast.Name) and out.id in self.outside):
            raise _Refuse("its `index_add_` writes to a tensor not bound before the loop")
        if len(call.args) != 3 or call.keywords:
            raise _Refuse("its `index_add_` is not `out.index_add_(0, rows, values)`")
        dim, rows, _ = call.args
        if not (isinstance(dim, ast.Constant) and dim.value == 0):
            raise _Refuse("its `index_add_` adds along a dimension other than 0")
        if not (isinstance(rows, ast.Name) and rows.id in self.selections):
            raise _Refuse("the rows its `index_add_` adds at are not the `torch.where(mask[e])` of the mask whose "
                          "nonzero() it loops over")
        call.args = [self._expr(a) for a in call.args]
        return stmt


def rewrite(fn) -> Rewrite:
    """The code of ``fn`` with each loop over ``nonzero()`` rows rewritten as a loop over every expert, or why not.
    ``code`` is None when ``fn`` holds no such loop or one could not be proved (``reason`` says which)."""
    code = fn.__code__
    where = f"{code.co_filename}:{code.co_firstlineno}"
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return Rewrite(None, "its source is not available", where)
    src = textwrap.dedent("".join(lines))
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return Rewrite(None, "its source does not parse on its own", where)
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) or fdef.name != code.co_name:
        return Rewrite(None, "its source is not one function definition", where)
    fdef.decorator_list = []
    loops = [n for n in ast.walk(fdef) if isinstance(n, ast.For)]
    reasons, done = [], 0
    for loop in loops:
        line = f"{code.co_filename}:{first + loop.lineno - 1}"
        try:
            replaced = _rewrite_loop(fdef, loop)
        except _Refuse as why:
            reasons.append(f"the loop at {line} looks like one over the experts that received tokens, but {why}")
            continue
        if replaced is None:
            continue
        _replace(fdef, loop, replaced)
        done += 1
        where = line
    if not done:
        return Rewrite(None, "; ".join(reasons) or "it holds no loop over nonzero() rows", where, found=bool(reasons))
    ast.fix_missing_locations(tree)
    source = ast.unparse(fdef)
    new = _compile(tree, fdef, fn, first)
    if isinstance(new, str):
        return Rewrite(None, new, where, found=True)
    return Rewrite(new, "", where, source, found=True)


def _rewrite_loop(fdef, loop):
    """The ``if``/``else`` that replaces ``loop``, None when it is not a loop over ``nonzero()`` rows; raises
    ``_Refuse`` with the reason when it is one that cannot be proved."""
    if not (isinstance(loop.iter, ast.Name) and isinstance(loop.target, ast.Name)):
        return None
    bound = _assignments(fdef, loop.iter.id)
    cond = _nonzero_arg(bound[0].value) if len(bound) == 1 and isinstance(bound[0], ast.Assign) else None
    if cond is None:
        return None
    if loop.orelse:
        raise _Refuse("it has an `else:`")
    hit = _hit_condition(cond)
    if hit is None:
        raise _Refuse("the condition its nonzero() reads is not `mask.sum(dims) > 0` or `mask.any(dims)` with "
                      "constant dims")
    mask, dims, needs_nonnegative = hit
    sources = _assignments(fdef, mask)
    if any(s.lineno >= bound[0].lineno for s in sources):
        raise _Refuse(f"`{mask}` is bound again after the nonzero() the loop runs over")
    if needs_nonnegative:
        if not sources or not all(isinstance(s, ast.Assign) and _is_one_hot_view(s.value, mask) for s in sources):
            raise _Refuse(f"`{mask}` is not a one_hot (a positive sum of it need not mean a nonzero entry)")
    n = len(dims) + 1
    if len(set(dims)) != len(dims) or set(dims) not in (set(range(-len(dims), 0)), set(range(1, n))):
        raise _Refuse(f"the dims {dims} it reduces over are not every dimension but the first")
    changed = _changed_in_place(fdef, {mask, loop.iter.id})
    if changed:
        raise _Refuse(f"`{changed}` is changed in place")
    body_names = _names_bound(loop.body) | {loop.target.id}
    loop_nodes = {id(n) for n in ast.walk(loop)}
    read_after = sorted({n.id for n in ast.walk(fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                         and n.id in body_names and id(n) not in loop_nodes})
    if read_after:
        raise _Refuse(f"{', '.join('`%s`' % r for r in read_after)}, bound in the loop, is read outside it")
    args = fdef.args
    outside = {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
               and id(n) not in loop_nodes} | {
        a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg] if a is not None}
    outside -= body_names
    checker = _Body(loop.target.id, mask, outside)
    body = checker.block(copy.deepcopy(loop.body), top=True)
    if checker.effect is None:
        raise _Refuse("its body has no `out.index_add_(0, rows, values)`")
    every = ast.For(
        target=ast.Name(ROW, ast.Store()),
        iter=ast.Call(ast.Name("range", ast.Load()), [ast.parse(f"{mask}.shape[0]", mode="eval").body], []),
        body=body, orelse=[],
    )
    guard = ast.parse(f"{mask}.dim() == {n}", mode="eval").body
    return ast.copy_location(ast.If(test=guard, body=[ast.copy_location(every, loop)], orelse=[copy.deepcopy(loop)]),
                             loop)


def _replace(fdef, old, new) -> None:
    for parent in ast.walk(fdef):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(parent, field, None)
            if isinstance(stmts, list) and any(s is old for s in stmts):
                stmts[[id(s) for s in stmts].index(id(old))] = new
                return
    raise AssertionError("loop not found in its function")


def _compile(tree, fdef, fn, first: int):
    """Compile the rewritten definition so that its code has ``fn``'s free variables (``super()``'s ``__class__``
    or a closure's), and return that code, or why not."""
    code = fn.__code__
    inner = fdef
    free = list(code.co_freevars)
    if free:
        wrapper = ast.parse("def _moecompile_outer():\n    pass").body[0]
        wrapper.body = [ast.parse(f"{v} = None").body[0] for v in free if v != "__class__"] + [fdef]
        if "__class__" in free:
            cls = ast.parse("class _moecompile_cls:\n    pass").body[0]
            cls.body = [fdef]
            wrapper.body[-1] = cls
        tree.body = [wrapper]
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, first - 1)
    try:
        module = compile(tree, code.co_filename, "exec")
    except SyntaxError as err:  # pragma: no cover - the rewrite builds valid Python
        return f"the rewritten loop does not compile ({err})"

    def find(c):
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                if const.co_name == code.co_name:
                    return const
                if (hit := find(const)) is not None:
                    return hit
        return None

    new = find(module)
    if new is None or new.co_freevars != code.co_freevars:
        return "its rewritten code does not keep the function's free variables"
    return new


_REWRITES: dict[types.CodeType, Rewrite] = {}  # by the function's original code
seen: dict[str, Rewrite] = {}  # "module.Class.forward" -> its rewrite or why not, for the compile running now


def _candidates(roots):
    """The forward functions (unwrapped) of the module classes reachable from ``roots`` whose code calls
    ``nonzero``."""
    classes, out = set(), []
    for root in roots:
        for module in root.modules():
            cls = type(module)
            if cls in classes:
                continue
            classes.add(cls)
            try:
                fn = inspect.unwrap(getattr(cls, "forward", None))
            except ValueError:  # a cycle of __wrapped__
                continue
            code = getattr(fn, "__code__", None)
            if isinstance(code, types.CodeType) and "nonzero" in code.co_names:
                out.append((f"{cls.__module__}.{cls.__qualname__}.forward", fn))
    return out


def _roots(namespaces) -> list[nn.Module]:
    roots, ids = [], set()
    for ns in namespaces:
        for value in ns:
            if isinstance(value, nn.Module) and id(value) not in ids:
                ids.add(id(value))
                roots.append(value)
    return roots


def swap(namespaces, swapped: list) -> None:
    """Give every forward reachable from the nn.Modules in ``namespaces`` (iterables of values: the locals, closure
    and globals of the frame Dynamo compiles) its rewritten loop, appending ``(function, original code)`` to
    ``swapped`` as it goes (for ``restore``, even if something here fails half-way)."""
    seen.clear()
    for name, fn in _candidates(_roots(namespaces)):
        original = fn.__code__
        if original not in _REWRITES:
            try:
                _REWRITES[original] = rewrite(fn)
            except Exception as exc:  # noqa: BLE001 - a loop we cannot read stays as written, and is reported
                _REWRITES[original] = Rewrite(None, f"moecompile could not read it ({exc!r})", name, found=True)
        result = seen[name] = _REWRITES[original]
        if result.code is not None:
            fn.__code__ = result.code
            swapped.append((fn, original))


def restore(swapped) -> None:
    for fn, original in reversed(swapped):
        fn.__code__ = original
