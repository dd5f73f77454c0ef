"""Which experts an expert loop runs, read from its source for ``loops.py``: the hit mask that a loop over
``nonzero()`` rows reads, and the skips that leave an expert out of a loop over every expert, each a condition
under which that iteration would add nothing anyway (the argument: ``docs/detection.md``, Expert loops)."""

from __future__ import annotations

import ast
from typing import NamedTuple

from .loop_ast import _VIEWS, LoopBody, Refuse, _is_method, assignments, call_name, changed_in_place, names_bound


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


def _operands(call: ast.Call) -> list:
    """The tensor operands of ``torch.f(a, b)`` or ``a.f(b)``: ``[a, b]``."""
    f = call.func
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "torch"):
        return [f.value, *call.args]
    return list(call.args)


def _reduction(node, name: str):
    """``(M, dims)`` for ``M.name(dims)`` / ``M.name(dim=dims)`` / ``torch.name(M, dims)``, else None."""
    if not isinstance(node, ast.Call) or call_name(node) != name:
        return None
    operands = _operands(node)
    if not operands or not isinstance(operands[0], ast.Name):
        return None
    base, args = operands[0], operands[1:]
    dims = args[0] if args else next((k.value for k in node.keywords if k.arg == "dim"), None)
    extra = [k.arg for k in node.keywords if k.arg != "dim"]
    if dims is None or len(args) > 1 or extra:
        return None
    d = _const_dims(dims)
    return (base.id, d) if d is not None else None


def hit_condition(cond):
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
    elif call_name(cond) in ("greater", "gt"):
        args = _operands(cond)
        if len(args) == 2 and isinstance(args[1], ast.Constant) and args[1].value == 0:
            total = args[0]
    if total is None or (r := _reduction(total, "sum")) is None:
        return None
    return (*r, True)


def nonzero_arg(node):
    """``C`` for ``C.nonzero()`` / ``C.nonzero(as_tuple=False)`` / ``torch.nonzero(C)``."""
    if not isinstance(node, ast.Call) or call_name(node) != "nonzero":
        return None
    kw = {k.arg: k.value for k in node.keywords}
    if set(kw) - {"as_tuple"} or ("as_tuple" in kw and not (isinstance(kw["as_tuple"], ast.Constant)
                                                          and kw["as_tuple"].value is False)):
        return None
    operands = _operands(node)
    return operands[0] if len(operands) == 1 else None


def is_one_hot_view(value, name: str) -> bool:
    """``value`` is ``one_hot(...)`` or ``name`` itself, followed by view-like methods only."""
    while call_name(value) in _VIEWS and isinstance(value.func, ast.Attribute):
        value = value.func.value
    return call_name(value) == "one_hot" or (isinstance(value, ast.Name) and value.id == name)


class Skip(NamedTuple):
    """A skip of an expert: ``kind`` "rows" (a ``torch.where``'s rows are empty), "counts" (the expert's entry of
    a ``bincount`` of the expert ids is 0) or "mask" (a boolean mask holds no True); ``name`` the rows, counts or
    mask tested; ``index`` what the counts are indexed by."""

    kind: str
    name: str
    index: ast.expr | None = None


def _measured(node) -> Skip | None:
    """What ``node`` measures, zero (or False) exactly where the expert has nothing: the size of rows
    (``r.numel()``, ``len(r)``, ``r.shape[0]``, ``r.size(0)``), the expert's count (``counts[e]``), whether a mask
    holds a True (``m.any()``)."""
    base, kind = None, "rows"
    if _is_method(node, "numel") and not node.args:
        base = node.func.value
    elif call_name(node) == "len" and isinstance(node.func, ast.Name) and len(node.args) == 1:
        base = node.args[0]
    elif _is_method(node, "size") and [getattr(a, "value", None) for a in node.args] == [0]:
        base = node.func.value
    elif _is_method(node, "any") and not node.args and not node.keywords:
        base, kind = node.func.value, "mask"
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        base = node.value.value if isinstance(node.slice, ast.Constant) and node.slice.value == 0 else None
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return Skip("counts", node.value.id, node.slice)
    return Skip(kind, base.id) if isinstance(base, ast.Name) else None


def _zero(node) -> bool:
    return isinstance(node, ast.Constant) and node.value in (0, False) and not isinstance(node.value, str)


def _when_empty(test) -> Skip | None:
    """The skip ``test`` is, where it holds exactly when the expert has nothing: ``S == 0``, ``0 == S``,
    ``not S``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _measured(test.operand)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        left, right = test.left, test.comparators[0]
        return _measured(left) if _zero(right) else _measured(right) if _zero(left) else None
    return None


def _when_present(test) -> Skip | None:
    """The skip ``test`` is, where it holds exactly when the expert has something: ``S``, ``S > 0``, ``S != 0``,
    ``0 < S``."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        if isinstance(op, (ast.Gt, ast.NotEq)) and _zero(right):
            return _measured(left)
        if isinstance(op, (ast.Lt, ast.NotEq)) and _zero(left):
            return _measured(right)
        return None
    return _measured(test)


def strip_skips(body: list) -> tuple[list, list, list[Skip]]:
    """(the statements of a loop body without its skips, the same with each skip's test left in its place as a
    statement that reads it, the skips): ``if EMPTY: continue`` at the top of the body, and a last ``if PRESENT:``
    without ``else``, whose statements then run at the top."""
    kept, order, skips = [], [], []
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.If) and not stmt.orelse:
            if [type(s) for s in stmt.body] == [ast.Continue] and (skip := _when_empty(stmt.test)):
                skips.append(skip)
                order.append(ast.Expr(stmt.test))
                continue
            if i == len(body) - 1 and (skip := _when_present(stmt.test)):
                inner, inner_order, more = strip_skips(stmt.body)
                kept += inner
                order += [ast.Expr(stmt.test), *inner_order]
                skips += [skip, *more]
                continue
        kept.append(stmt)
        order.append(stmt)
    return kept, order, skips


def _bincount_of(value) -> str | None:
    """``ids`` for ``torch.bincount(F(ids), ...)`` or ``F(ids).bincount(...)``, followed by ``.tolist()``,
    ``.cpu()`` or ``.numpy()``, where ``F`` flattens (``flatten()``, ``view(-1)``, ``reshape(-1)``, ``ravel()``,
    or nothing)."""
    while call_name(value) in ("tolist", "cpu", "numpy") and isinstance(value.func, ast.Attribute) \
            and not value.args:
        value = value.func.value
    if call_name(value) != "bincount":
        return None
    operands = _operands(value)
    if len(operands) != 1 or any(k.arg != "minlength" for k in value.keywords):
        return None  # (weighted counts: a weight of 0 counts nothing)
    ids = operands[0]
    if isinstance(ids, ast.Call) and isinstance(ids.func, ast.Attribute) and not ids.keywords and (
            (ids.func.attr in ("flatten", "ravel") and not ids.args)
            or (ids.func.attr in ("view", "reshape") and [_const_int(a) for a in ids.args] == [-1])):
        ids = ids.func.value
    return ids.id if isinstance(ids, ast.Name) else None


def _equals_number(value, ids: str, number: str) -> bool:
    """``ids == e`` (either side, or ``ids.eq(e)``, ``torch.eq(ids, e)``) for the loop's number ``e``."""
    names = lambda *nodes: sorted(getattr(n, "id", "") for n in nodes)  # noqa: E731
    if isinstance(value, ast.Compare) and len(value.ops) == 1 and isinstance(value.ops[0], ast.Eq):
        return names(value.left, value.comparators[0]) == sorted([ids, number])
    if call_name(value) == "eq" and not value.keywords:
        operands = _operands(value)
        return len(operands) == 2 and names(*operands) == sorted([ids, number])
    return False


def _bound_once(loop, names) -> None:
    """Each of ``names`` bound once in ``loop``'s body: the value a skip tests is the one the effect reads."""
    stores = [n.id for s in loop.body for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    again = sorted({n for n in names if stores.count(n) != 1})
    if again:
        raise Refuse(f"{', '.join('`%s`' % n for n in again)}, which its skip and its effect read, is not bound "
                     "once in the body")


def linked(fdef, loop, number: str, checker: LoopBody, skips: list[Skip]) -> list:
    """Raises ``Refuse`` unless, wherever a skip in ``skips`` fires, the effect ``checker`` read adds nothing; returns
    the statements the skips alone read (a bincount of the counts), to drop with them. ``number``: the loop's
    variable, the expert's number."""
    at, dropped = checker.effect_at, []
    wheres = [n for s in loop.body for n in ast.walk(s) if isinstance(n, ast.Assign) and call_name(n.value) == "where"]
    for skip in skips:
        if skip.kind == "mask":
            root = checker.masks.get(skip.name)
            if root is None or checker.masks.get(at) != root:
                raise Refuse(f"the mask it skips on (`{skip.name}`) and the one it adds at (`{at}`) are not views of "
                             "one boolean mask")
            _bound_once(loop, {skip.name, at, root})
            continue
        if skip.kind == "rows" and skip.name not in checker.selections:
            raise Refuse("the rows it skips on are not those of a `torch.where` bound unconditionally before")
        # rows or counts: the effect adds at the rows of the body's one torch.where (a second could be empty where
        # the first is not)
        if len(wheres) != 1 or at not in names_bound(wheres) or (skip.kind == "rows" and
                                                                 skip.name not in names_bound(wheres)):
            raise Refuse("the rows it skips on and those it adds at are not of one `torch.where`")
        _bound_once(loop, {at} | ({skip.name} if skip.kind == "rows" else set()))
        if skip.kind == "counts":
            dropped.append(_counts_statement(fdef, loop, number, checker.where_of.get(at), skip, skips))
    return dropped


def _counts_statement(fdef, loop, number: str, where_arg, skip: Skip, skips: list[Skip]):
    """The statement ``counts = torch.bincount(ids...)`` that a skip ``if counts[e] == 0: continue`` tests, where
    ``counts[e]`` counts the rows of the body's ``torch.where(ids == e)``; raises ``Refuse`` otherwise."""
    name = skip.name
    bound = assignments(fdef, name)
    stmt = bound[0] if len(bound) == 1 else None
    ids = _bincount_of(stmt.value) if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
    if ids is None or not any(s is stmt for s in fdef.body) or stmt.lineno >= loop.lineno:
        raise Refuse(f"`{name}` is not bound once, before the loop, by `torch.bincount(ids)` of the expert ids")
    if not (isinstance(skip.index, ast.Name) and skip.index.id == number):
        raise Refuse(f"it indexes `{name}` by `{ast.unparse(skip.index)}`, not the expert's number `{number}`")
    reads = sum(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(fdef))
    if reads != sum(s.kind == "counts" and s.name == name for s in skips):
        raise Refuse(f"`{name}` is read other than by its skip")
    if where_arg is None or not _equals_number(where_arg, ids, number):
        raise Refuse(f"the rows it adds at are not those of `torch.where({ids} == {number})`, which `{name}` counts")
    if any(s.lineno > stmt.lineno for s in assignments(fdef, ids)) or changed_in_place(fdef, {ids}):
        raise Refuse(f"`{ids}` is bound again or changed after `{name}` counts it")
    return stmt
