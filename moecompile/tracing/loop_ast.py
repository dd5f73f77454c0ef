"""Reading an expert loop's source for ``loops.py``: which loops run over ``nonzero()`` rows, and what their body
may do for the loop over every expert to compute the same (the argument: ``docs/detection.md``, Expert loops).
``LoopBody`` checks a body statement by statement and rewrites its uses of the loop row in terms of the expert's
number; anything it cannot vouch for raises ``Refuse`` with the reason a user reads in ``explain()``."""

from __future__ import annotations

import ast
import copy

ROW = "_moecompile_expert"  # the loop variable of the rewritten loop: the expert's number

_VIEWS = {"permute", "transpose", "view", "reshape", "squeeze", "unsqueeze", "contiguous", "to", "long", "int",
          "float", "bool", "flatten"}
_SHAPE_VIEWS = _VIEWS - {"to", "long", "int", "float", "bool"}  # (the views that keep the dtype)
_MUTATING = {"append", "extend", "insert", "pop", "update", "add", "remove", "clear", "setdefault", "discard"}


class Refuse(Exception):
    pass


def call_name(node) -> str | None:
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


def _in_place(method: str) -> bool:
    """``add_``, ``index_add_``: a tensor method that writes to its receiver (dunders aside)."""
    return method.endswith("_") and not method.endswith("__")


def _targets(node) -> list:
    """What an assignment statement binds or writes to ([] for any other node)."""
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []


def assignments(fdef, name: str) -> list[ast.Assign]:
    return [node for node in ast.walk(fdef)
            if any(isinstance(n, ast.Name) and n.id == name for t in _targets(node) for n in ast.walk(t))]


def _pure(node) -> bool:
    """``self.a.b``, ``name`` or a view of one (``w.view(shape)``): evaluating it again has no effect."""
    while True:
        if isinstance(node, ast.Name):
            return True
        if isinstance(node, ast.Attribute):
            node = node.value
        elif call_name(node) in _VIEWS and isinstance(node.func, ast.Attribute):
            if not all(_pure(a) or isinstance(a, ast.Constant) for a in node.args) or node.keywords:
                return False
            node = node.func.value
        else:
            return False


def changed_in_place(fdef, names: set[str]) -> str | None:
    """One of ``names`` that the function changes in place (``m.zero_()``, ``m[i] = ...``), or None."""
    for node in ast.walk(fdef):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in names and _in_place(f.attr):
            return f.value.id
        for t in _targets(node):
            into = t.value if isinstance(t, (ast.Subscript, ast.Attribute)) else None
            if isinstance(into, ast.Name) and into.id in names:
                return into.id
    return None


def names_bound(stmts) -> set[str]:
    out = set()
    for s in stmts:
        for node in ast.walk(s):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
    return out


def empty_skip(stmt) -> str | None:
    """``x`` for ``if x.numel() == 0: continue`` (or ``x.shape[0] == 0``, ``len(x) == 0``), else None."""
    t = getattr(stmt, "test", None)
    if not (isinstance(stmt, ast.If) and [type(s) for s in stmt.body] == [ast.Continue] and not stmt.orelse):
        return None
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
            and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value == 0):
        return None
    x = t.left
    if _is_method(x, "numel") and not x.args:
        x = x.func.value
    elif call_name(x) == "len" and isinstance(x.func, ast.Name) and len(x.args) == 1:
        x = x.args[0]
    elif (isinstance(x, ast.Subscript) and isinstance(x.value, ast.Attribute) and x.value.attr == "shape"
          and isinstance(x.slice, ast.Constant) and x.slice.value == 0):
        x = x.value.value
    else:
        return None
    return x.id if isinstance(x, ast.Name) else None


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
            raise Refuse(f"it indexes the loop row `{node.value.id}` other than as `{node.value.id}[0]`")
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
            raise Refuse(f"it uses the loop row `{node.id}` other than as `{node.id}[0]`, `{node.id}.item()` or "
                          "an index")
        return node


def _number_key(node, is_number):
    """A copy of ``f"expert_{e}"`` (an f-string whose only fields are the expert's number, as written), else None."""
    fields = [v for v in node.values if isinstance(v, ast.FormattedValue)] if isinstance(node, ast.JoinedStr) else []
    keyed = fields and all(is_number(v.value) and v.conversion == -1 and v.format_spec is None for v in fields)
    return copy.deepcopy(node) if keyed else None


class LoopBody:
    """Check and rewrite the loop body; see the module docstring, point 2."""

    def __init__(self, target: str, mask: str, outside_loop: set[str], number: bool = False):
        """``target``: the loop row, or with ``number`` the expert's number itself (a loop over ``range(E)``,
        which runs over the same experts with or without its skips: any ``torch.where`` selects its rows, and no
        index by the number needs a guard)."""
        self.rows, self.ints = ({target}, set()) if not number else (set(), {target})
        self.number = number
        self.mask, self.outside = mask, outside_loop
        self.selections: set[str] = set()  # names bound by torch.where(mask[row])
        self.where_of: dict[str, ast.expr] = {}  # each selection's torch.where argument
        self.masks: dict[str, str] = {}  # (a loop over numbers) boolean masks bound at the top, each to the name
        # of the mask it views (itself, or b for a = b.view(-1)): one tensor's elements, True at the same rows
        self.effect = None
        self.effect_at = ""  # the rows (a selection) or the boolean mask the effect adds at
        self.pending: list = []  # guards of the statement being read (_guard_indexing)

    def _expr(self, node):
        node = _RowUses(self.rows, self.ints).visit(node)
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Lambda, ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)):
                raise Refuse(f"its body holds a {type(sub).__name__.lower()}")
            name = call_name(sub)
            if name and isinstance(sub.func, ast.Attribute):
                if _in_place(name) or name in _MUTATING:
                    raise Refuse(f"its body calls `.{name}(...)`, which changes a tensor or container in place")
            if name in ("setattr", "delattr", "print", "exec", "eval", "globals", "locals"):
                raise Refuse(f"its body calls `{name}(...)`")
        self._guard_indexing(node)
        return node

    def _guard_indexing(self, node) -> None:
        """For each ``x[e]`` by the expert's number, the guard ``e < len(x)`` (``f"expert_{e}" in x`` for a
        ModuleDict's key): an expert past the end of ``x`` would raise in the original loop, so it never received
        tokens in a run that works, and the new loop skips it (dbrx's one_hot has a class more than its experts)."""
        if self.number:
            return

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
            key = _number_key(sub.slice, int_row)
            if not int_row(sub.slice) and key is None:
                raise Refuse("it indexes by the expert's number in a form whose range cannot be checked "
                              f"(`{ast.unparse(sub)}`)")
            if any(sub in list(ast.walk(s)) for s in short):
                raise Refuse(f"it indexes by the expert's number under a condition (`{ast.unparse(sub)}`)")
            if not _pure(sub.value):
                raise Refuse(f"it indexes by the expert's number into `{ast.unparse(sub.value)}`, which is not "
                              "an attribute or a view of one")
            length = ast.Call(ast.Name("len", ast.Load()), [copy.deepcopy(sub.value)], [])
            self.pending.append(ast.Compare(key, [ast.In()], [copy.deepcopy(sub.value)]) if key is not None
                                else ast.Compare(ast.Name(sub.slice.id, ast.Load()), [ast.Lt()], [length]))

    def _take(self) -> list:
        """``if not (e < len(x) and ...): continue`` for the guards of the statement just read, or nothing."""
        guards, self.pending = self.pending, []
        if not guards:
            return []
        test = guards[0] if len(guards) == 1 else ast.BoolOp(ast.And(), guards)
        return [ast.If(ast.UnaryOp(ast.Not(), test), [ast.Continue()], [])]

    def _selection(self, value) -> bool:
        """``torch.where(mask[e])`` / ``torch.where(mask[e:e+1].squeeze(0))`` on the loop's mask."""
        if not (call_name(value) == "where" and len(value.args) == 1 and not value.keywords):
            return False
        if self.number:
            return True
        sel = value.args[0]
        if _is_method(sel, "squeeze") and [getattr(a, "value", None) for a in sel.args] == [0]:
            sel = sel.func.value
        if not (isinstance(sel, ast.Subscript) and isinstance(sel.value, ast.Name) and sel.value.id == self.mask):
            return False
        s = sel.slice
        if isinstance(s, ast.Name):
            return s.id == ROW or s.id in self.ints
        return (isinstance(s, ast.Slice) and isinstance(s.lower, ast.Name) and s.lower.id == ROW)

    def _assign(self, stmt, top: bool):
        """Read ``name = ...`` / ``a, b = ...``. Only an unconditional one (``top``) makes an alias of the expert's
        number or a selection: one bound in a branch may hold something else when the branch is not taken."""
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            raise Refuse("its body assigns in a form other than `name = ...` or `a, b = ...`")
        target = stmt.targets[0]
        names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
        if not names or not all(isinstance(n, ast.Name) for n in names):
            raise Refuse("its body assigns to an attribute or an element (`x.a = ...`, `x[i] = ...`)")
        stmt.value = self._expr(stmt.value)
        bound = {n.id for n in names}
        self.rows -= bound
        self.ints -= bound
        self.selections -= bound
        for name in [m for m, root in self.masks.items() if m in bound or root in bound]:
            del self.masks[name]
        if top and self.number and isinstance(target, ast.Name) and (root := self._mask_root(stmt.value, target.id)):
            self.masks[target.id] = root
        if top and isinstance(target, ast.Name) and (
            (isinstance(stmt.value, ast.Name) and (stmt.value.id == ROW or stmt.value.id in self.ints))
            or (call_name(stmt.value) == "int" and len(stmt.value.args) == 1
                and isinstance(stmt.value.args[0], ast.Name) and stmt.value.args[0].id == ROW)
        ):
            self.ints.add(target.id)
        if top and len(names) > 1 and self._selection(stmt.value):
            self.selections |= bound
            self.where_of.update((n, stmt.value.args[0]) for n in bound)
        return stmt

    def _mask_root(self, value, name: str) -> str | None:
        """``name`` where ``value`` is boolean (a comparison, ``.any()``, ``.all()``, ``.bool()``); the viewed
        mask's root where it is a view (``view``, ``reshape``, ``flatten``, ``squeeze``, ...) of a mask."""
        if isinstance(value, ast.Compare) and len(value.ops) == 1 and not isinstance(value.ops[0], (ast.In, ast.NotIn)):
            return name
        if call_name(value) in ("any", "all", "bool", "eq", "ne"):
            return name
        if call_name(value) in _SHAPE_VIEWS and isinstance(value.func, ast.Attribute):
            base = value.func.value
            return self.masks.get(base.id) if isinstance(base, ast.Name) else None
        return None

    def _empty_skip(self, stmt) -> bool:
        """``if rows.numel() == 0: continue`` (``empty_skip``) on a selection of the loop's mask. Not in a loop over
        numbers, whose selections may be any ``torch.where``'s: there ``loop_experts.linked`` drops only the skips
        it ties to the effect, and any other stays (a skip on unrelated rows changes the output)."""
        return not self.number and empty_skip(stmt) in self.selections

    def block(self, stmts, top: bool) -> list:
        out = []
        for stmt in stmts:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                out.append(stmt)
            elif (isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Subscript)) or (
                    isinstance(stmt, ast.Expr) and _is_method(stmt.value, "index_add_")):
                if not top or self.effect is not None:
                    raise Refuse("its `index_add_` (or `out[rows] += ...`) is not one statement at the top of the "
                                 "body")
                self.effect = self._effect(stmt) if isinstance(stmt, ast.Expr) else self._add_at(stmt)
                out += self._take() + [self.effect]
            elif isinstance(stmt, ast.Assign):
                stmt = self._assign(stmt, top)
                out += self._take() + [stmt]
            elif isinstance(stmt, ast.With):
                for item in stmt.items:
                    grad_mode = call_name(item.context_expr) in ("no_grad", "enable_grad")
                    if item.optional_vars is not None or not grad_mode:
                        raise Refuse("its body opens a `with` other than `torch.no_grad()`")
                stmt.body = self.block(stmt.body, top) or [ast.Pass()]
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
                raise Refuse(f"its body runs `{ast.unparse(stmt.value)}` for an effect other than the index_add_")
            else:
                raise Refuse(f"its body holds a `{type(stmt).__name__.lower()}` statement, which may do more than "
                              "bind local names")
        return out

    def _effect(self, stmt):
        call = stmt.value
        out = call.func.value
        if not (isinstance(out, ast.Name) and out.id in self.outside):
            raise Refuse("its `index_add_` writes to a tensor not bound before the loop")
        if len(call.args) != 3 or call.keywords:
            raise Refuse("its `index_add_` is not `out.index_add_(0, rows, values)`")
        dim, rows, _ = call.args
        if not (isinstance(dim, ast.Constant) and dim.value == 0):
            raise Refuse("its `index_add_` adds along a dimension other than 0")
        if not (isinstance(rows, ast.Name) and rows.id in self.selections):
            raise Refuse("the rows its `index_add_` adds at are not the `torch.where(mask[e])` of the mask whose "
                          "nonzero() it loops over")
        call.args = [self._expr(a) for a in call.args]
        self.effect_at = rows.id
        return stmt

    def _add_at(self, stmt):
        """``out[rows] += values`` at a selection, or (a loop over numbers) at a boolean mask."""
        t = stmt.target
        if not (isinstance(stmt.op, ast.Add) and isinstance(t, ast.Subscript)):
            raise Refuse(f"its body runs `{ast.unparse(stmt)}`, which is not `out[rows] += values`")
        if not (isinstance(t.value, ast.Name) and t.value.id in self.outside):
            raise Refuse("its `+=` writes to a tensor not bound before the loop")
        at = t.slice
        if not (isinstance(at, ast.Name) and (at.id in self.selections or at.id in self.masks)):
            raise Refuse(f"the rows its `+=` adds at (`{ast.unparse(at)}`) are not a `torch.where`'s rows"
                          + (" nor a boolean mask" if self.number else ""))
        stmt.value = self._expr(stmt.value)
        self.effect_at = at.id
        return stmt
