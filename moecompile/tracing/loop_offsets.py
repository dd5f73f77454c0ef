"""Loops that run each expert on its slice of rows sorted by expert, at a running offset, and skip an expert with
no rows (DeepSeek-V2/V3's remote code ``moe_infer``, and the models that copy it), for ``loops.py``:

    counts = tokens_per_expert.cpu().numpy()          # or .tolist()
    outputs, start = [], 0
    for i, n in enumerate(counts):
        end = start + n
        if n == 0:                                    # dropped: Dynamo cannot branch on n
            continue
        outputs.append(self.experts[i](rows[start:end]))
        start = end
    out = torch.cat(outputs, dim=0) if len(outputs) else rows.new_empty(0)

Where ``n`` is 0, ``end`` is ``start``: the slice is empty, the expert's output has no rows, ``torch.cat`` of the
list is unchanged by it and ``start = end`` keeps ``start``. ``drop_offset_skip`` proves the rest from the source
(the conditions: ``docs/detection.md``, Expert loops)."""

from __future__ import annotations

import ast
import copy

from .loop_ast import Refuse, assignments, call_name, names_bound


def _zero_test(test, count: str) -> bool | None:
    """True for ``count == 0`` / ``not count`` (the expert has no rows), False for ``count > 0`` / ``count != 0`` /
    ``count`` (it has some), None for anything else."""
    is_count = lambda n: isinstance(n, ast.Name) and n.id == count  # noqa: E731
    zero = lambda n: isinstance(n, ast.Constant) and n.value == 0 and not isinstance(n.value, bool)  # noqa: E731
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and is_count(test.operand):
        return True
    if is_count(test):
        return False
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        if zero(left):
            left, right = right, left
            op = {ast.Gt: ast.Lt(), ast.Lt: ast.Gt()}.get(type(op), op)
        if is_count(left) and zero(right):
            if isinstance(op, ast.Eq):
                return True
            if isinstance(op, (ast.Gt, ast.NotEq)):
                return False
    return None


def _split_skip(body: list, count: str) -> tuple[list, list] | None:
    """(the statements before the skip, those it skips) for ``if count == 0: continue`` at the body's top level,
    or a last ``if count > 0:`` around the rest; None without such a skip."""
    for i, stmt in enumerate(body):
        if not isinstance(stmt, ast.If) or stmt.orelse:
            continue
        empty = _zero_test(stmt.test, count)
        if empty is True and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Continue):
            return body[:i], body[i + 1:]
        if empty is False and i == len(body) - 1:
            return body[:i], stmt.body
    return None


def _offset(stmt, start: str, count: str) -> str | None:
    """``end`` for ``end = start + count`` (or ``count + start``), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    v = stmt.value
    if isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add) and isinstance(v.left, ast.Name) \
            and isinstance(v.right, ast.Name) and {v.left.id, v.right.id} == {start, count} and start != count:
        return stmt.targets[0].id
    return None


def _reads(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _slice_of(value, start: str, end: str) -> bool:
    """``value`` is ``x[start:end]`` (``x`` any name or attribute)."""
    s = value.slice if isinstance(value, ast.Subscript) else None
    return (isinstance(s, ast.Slice) and s.step is None and isinstance(s.lower, ast.Name) and s.lower.id == start
            and isinstance(s.upper, ast.Name) and s.upper.id == end)


def drop_offset_skip(fdef, loop) -> ast.For | None:
    """``loop`` without its skip of an expert with no rows, where the body slices sorted rows at a running offset
    (module docstring); None when ``loop`` is not of that form; raises ``Refuse`` where it is but the skip cannot be
    shown to change nothing."""
    target, count = loop.target, None
    if isinstance(target, ast.Name):
        count = target.id
    elif (isinstance(target, ast.Tuple) and len(target.elts) == 2 and call_name(loop.iter) == "enumerate"
          and isinstance(target.elts[1], ast.Name)):
        count = target.elts[1].id
    parts = _split_skip(loop.body, count) if count and count not in names_bound(loop.body) else None
    if parts is None:
        return None
    before, skipped = parts
    last = skipped[-1] if skipped else None
    if not (isinstance(last, ast.Assign) and len(last.targets) == 1 and isinstance(last.targets[0], ast.Name)
            and isinstance(last.value, ast.Name)):
        return None
    start, end = last.targets[0].id, last.value.id
    ends = [s for s in before + skipped[:-1] if _offset(s, start, count) == end]
    if len(ends) != 1:
        return None  # not a running offset: not this form
    if loop.orelse:
        raise Refuse("it has an `else:`")
    for node in ast.walk(ast.Module(body=loop.body, type_ignores=[])):
        if isinstance(node, (ast.Break, ast.Return, ast.Yield, ast.YieldFrom, ast.Global, ast.Nonlocal)):
            raise Refuse(f"its body has a `{type(node).__name__.lower()}`")
    bound_in_loop = names_bound(loop.body) | names_bound([target])
    if [a for a in assignments(fdef, start) if any(a is s for s in ast.walk(loop))] != [last]:
        raise Refuse(f"`{start}` is bound in the loop other than by its last statement `{start} = {end}`")
    if sum(1 for a in assignments(fdef, end) if any(a is s for s in ast.walk(loop))) != 1:
        raise Refuse(f"`{end}` is bound in the loop more than once")
    outputs = _checked_skipped([s for s in skipped[:-1] if s is not ends[0]], start, end, names_bound([target]))
    reads = [n for n in ast.walk(loop) if isinstance(n, ast.Name) and n.id == outputs]
    if len(reads) != 1:
        raise Refuse(f"`{outputs}` is read in the loop other than by its `{outputs}.append(...)`")
    body = before + skipped
    _checked_after(fdef, loop, outputs, bound_in_loop - names_bound(before) - names_bound([target]) - {start},
                   names_bound([target]), body)
    body = copy.deepcopy(body)
    return ast.copy_location(ast.For(target=loop.target, iter=loop.iter, body=body, orelse=[]), loop)


def _checked_skipped(stmts: list, start: str, end: str, targets: set[str]) -> str:
    """The statements the skip leaves out, but the last (``start = end``): names bound once each, and one
    ``outputs.append(value)``, ``value`` computed from a slice ``x[start:end]``. Returns ``outputs``."""
    appends, bound, from_slice = [], set(), set()
    for stmt in stmts:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            if name in (start, end) or name in targets:
                raise Refuse(f"`{name}` is bound again after the skip")
            if name in bound:
                raise Refuse(f"`{name}` is bound twice after the skip")
            bound.add(name)
            if _slice_of(stmt.value, start, end) or _reads(stmt.value) & from_slice:
                from_slice.add(name)
        elif (isinstance(stmt, ast.Expr) and call_name(stmt.value) == "append"
              and isinstance(stmt.value.func, ast.Attribute) and isinstance(stmt.value.func.value, ast.Name)
              and len(stmt.value.args) == 1 and not stmt.value.keywords):
            value = stmt.value.args[0]
            if not (_slice_of(value, start, end) or _reads(value) & from_slice):
                raise Refuse(f"what it appends is not computed from the rows `x[{start}:{end}]`")
            appends.append(stmt.value.func.value.id)
        else:
            raise Refuse(f"after the skip it runs `{ast.unparse(stmt)}`, neither a binding of one name nor an "
                         f"`outputs.append(...)`")
    if len(appends) != 1:
        raise Refuse(f"it appends to {len(appends)} lists after the skip, not one")
    if appends[0] in bound:
        raise Refuse(f"`{appends[0]}` is bound in the loop")
    return appends[0]


def _checked_after(fdef, loop, outputs: str, local: set[str], targets: set[str], body: list) -> None:
    """``outputs`` is bound once, to ``[]``, before the loop, and read after it only by ``torch.cat(outputs)``
    along rows (or as the test of ``torch.cat(outputs) if len(outputs) else ...``, ``if outputs``); no name the
    skipped statements bind is read after the loop or before ``body`` (the loop's, the skip left out) binds it."""
    bound = assignments(fdef, outputs)
    if (len(bound) != 1 or not isinstance(bound[0], ast.Assign) or not isinstance(bound[0].value, ast.List)
            or bound[0].value.elts or bound[0].lineno > loop.lineno):
        raise Refuse(f"`{outputs}` is not bound once, to `[]`, before the loop")
    in_loop = {id(n) for n in ast.walk(loop)}
    allowed: set[int] = set()
    for node in ast.walk(fdef):
        if id(node) in in_loop:
            continue
        if _cat_rows(node, outputs):
            allowed.add(id(node.args[0]))
        if isinstance(node, ast.IfExp) and _cat_rows(node.body, outputs):
            test = node.test.args[0] if call_name(node.test) == "len" and len(node.test.args) == 1 else node.test
            if isinstance(test, ast.Name) and test.id == outputs:
                allowed.add(id(test))
    for node in ast.walk(fdef):
        if id(node) in in_loop or not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)):
            continue
        if node.id == outputs and id(node) not in allowed:
            raise Refuse(f"`{outputs}` is read after the loop other than by `torch.cat({outputs}, dim=0)`")
        if node.id in local:
            raise Refuse(f"`{node.id}`, bound after the skip, is read outside the loop")
    seen = set(targets)
    for stmt in body:  # a name bound after the skip and read before the body binds it is carried
        early = (_reads(stmt) & local) - seen
        if early:
            raise Refuse(f"`{sorted(early)[0]}` is read before the body binds it: a value carried between iterations")
        seen |= names_bound([stmt])


def _cat_rows(node, outputs: str) -> bool:
    """``torch.cat(outputs)``, ``torch.cat(outputs, 0)`` or ``torch.cat(outputs, dim=0)``."""
    if not (isinstance(node, ast.Call) and call_name(node) in ("cat", "concat", "concatenate") and node.args
            and isinstance(node.args[0], ast.Name) and node.args[0].id == outputs):
        return False
    dims = [*node.args[1:], *(k.value for k in node.keywords if k.arg in ("dim", "axis"))]
    extra = [k for k in node.keywords if k.arg not in ("dim", "axis")]
    return not extra and len(dims) <= 1 and all(isinstance(d, ast.Constant) and d.value == 0 for d in dims)
