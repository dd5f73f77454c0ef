"""Loops over the experts that received tokens, given to Dynamo as the same loop over every expert.

    before (transformers' experts_implementation="eager", dbrx, longcat_flash)     after
    mask = F.one_hot(top_k_index, num_classes=E).permute(2, 1, 0)   # [E, K, T]      the same
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()                          the same
    for row in hit:                                                                 for e in range(mask.shape[0]):
        e = row[0]
        pos, tok = torch.where(mask[e])                                                 pos, tok = ... mask[e] ...
        out.index_add_(0, tok, expert_e(x[tok]) * w[tok, pos, None])                    the same

Why: the trip count of ``for row in hit`` depends on the data, so Dynamo cannot unroll it and the graph breaks
there, leaving the experts outside any graph. An expert that received no tokens adds nothing (its ``where`` finds
no rows; ``index_add_`` of no rows changes nothing), so the loop over every expert computes the same ``out``, and
Dynamo unrolls it. ``rewrite(fn)`` proves that from the function's source (the conditions it checks, and how the
callbacks of ``capture.py`` swap the code only while Dynamo traces for moe: ``docs/detection.md``, Expert
loops) and returns the new code under ``if mask.dim() == len(dims) + 1:`` (``dims`` summed over), the original loop as
its ``else``, or the reason it cannot.

Loops over every expert that skip an expert with nothing to do (``if rows.numel() == 0: continue``, DeepSeek-V3's
``if counts[e] == 0: continue`` on a ``bincount``, ``if mask.any():`` around the body) lose the skip the same way,
where the skip provably leaves out only iterations that add at no row (``_drop_empty_skips``); so do loops that run
each expert on its slice of sorted rows at a running offset (DeepSeek's remote-code ``moe_infer``, a method other
than ``forward``: ``loop_offsets.py``).
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
import types
from typing import NamedTuple

import torch
from torch import nn

from .loop_ast import ROW, LoopBody, Refuse, assignments, call_name, changed_in_place, names_bound
from .loop_experts import hit_condition, is_one_hot_view, linked, nonzero_arg, strip_skips
from .loop_offsets import drop_offset_skip


def _rewriters():
    return ((_rewrite_loop, "looks like one over the experts that received tokens"),
            (_drop_empty_skips, "skips the experts that received no tokens"),
            (drop_offset_skip, "runs each expert on its rows at a running offset and skips the experts with none"))


COMPILING = "_moecompile_is_compiling"  # the global the new code reads: torch.compiler.is_compiling


class Rewrite(NamedTuple):
    code: types.CodeType | None  # the function's new code (the rewritten loop while a compiler traces), or None
    reason: str  # why not (empty when rewritten)
    where: str  # file:line of the loop (or of the function)
    source: str = ""  # the rewritten function, as Python source (for explain() and the tests)
    found: bool = False  # whether it holds a loop over nonzero() rows at all (rewritten or not)
    traced: types.CodeType | None = None  # the rewritten function alone: what a compiler traces (for the tests)


def rewrite(fn, forward: bool = True) -> Rewrite:
    """The code of ``fn`` with each loop over ``nonzero()`` rows rewritten as a loop over every expert, or why not.
    ``code`` is None when ``fn`` holds no such loop or one could not be proved (``reason`` says which). Where ``fn``
    is not a module's ``forward`` only the loops at a running offset are looked for (DeepSeek's ``moe_infer``): the
    other forms would also match, and report, loops of methods that run no expert (``generate``'s helpers)."""
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
    original_body = copy.deepcopy(fdef.body)
    loops = [n for n in ast.walk(fdef) if isinstance(n, ast.For)]
    reasons, done = [], 0
    for loop in loops:
        line = f"{code.co_filename}:{first + loop.lineno - 1}"
        replaced = None
        for rewrite_one, looks in _rewriters()[0 if forward else -1:]:
            try:
                replaced = rewrite_one(fdef, loop)
            except Refuse as why:
                reasons.append(f"the loop at {line} {looks}, but {why}")
                break
            if replaced is not None:
                break
        if replaced is None:
            continue
        _replace(fdef, loop, replaced)
        done += 1
        where = line
    if not done:
        return Rewrite(None, "; ".join(reasons) or "it holds no loop over nonzero() rows and no loop that skips "
                       "the experts that received no tokens", where, found=bool(reasons))
    ast.fix_missing_locations(tree)
    source = ast.unparse(fdef)
    traced_tree = copy.deepcopy(tree)
    traced = _compile(traced_tree, traced_tree.body[0], fn, first)
    compiling = ast.parse(f"{COMPILING}()", mode="eval").body
    fdef.body = [ast.copy_location(ast.If(test=compiling, body=fdef.body, orelse=original_body), fdef.body[0])]
    ast.fix_missing_locations(tree)
    new = _compile(tree, fdef, fn, first)
    if isinstance(new, str) or isinstance(traced, str):
        return Rewrite(None, new if isinstance(new, str) else traced, where, found=True)
    fn.__globals__.setdefault(COMPILING, torch.compiler.is_compiling)
    return Rewrite(new, "", where, source, found=True, traced=traced)


def _rewrite_loop(fdef, loop):
    """The ``if``/``else`` that replaces ``loop``, None when it is not a loop over ``nonzero()`` rows; raises
    ``Refuse`` with the reason when it is one that cannot be proved."""
    if not (isinstance(loop.iter, ast.Name) and isinstance(loop.target, ast.Name)):
        return None
    bound = assignments(fdef, loop.iter.id)
    cond = nonzero_arg(bound[0].value) if len(bound) == 1 and isinstance(bound[0], ast.Assign) else None
    if cond is None:
        return None
    if loop.orelse:
        raise Refuse("it has an `else:`")
    hit = hit_condition(cond)
    if hit is None:
        raise Refuse("the condition its nonzero() reads is not `mask.sum(dims) > 0` or `mask.any(dims)` with "
                      "constant dims")
    mask, dims, needs_nonnegative = hit
    sources = assignments(fdef, mask)
    if any(s.lineno >= bound[0].lineno for s in sources):
        raise Refuse(f"`{mask}` is bound again after the nonzero() the loop runs over")
    # a positive sum of a one_hot's row means a nonzero entry; of any other mask (negative entries) it need not,
    # so the new loop reads the mask with the rows of the experts the original skips set to 0 (``gated``)
    gated = needs_nonnegative and not (sources and all(isinstance(s, ast.Assign) and is_one_hot_view(s.value, mask)
                                                       for s in sources))
    n = len(dims) + 1
    if len(set(dims)) != len(dims) or set(dims) not in (set(range(-len(dims), 0)), set(range(1, n))):
        raise Refuse(f"the dims {dims} it reduces over are not every dimension but the first")
    changed = changed_in_place(fdef, {mask, loop.iter.id})
    if changed:
        raise Refuse(f"`{changed}` is changed in place")
    body = _checked_body(fdef, loop, LoopBody(loop.target.id, mask, _bound_outside(fdef, loop)))
    first = []
    if gated:
        hit_rows = f"({ast.unparse(cond)}).reshape(-1{', 1' * len(dims)})"
        first = [ast.parse(f"{GATED} = {mask}.where({hit_rows}, 0)").body[0]]
        body = [_Rename(mask, GATED).visit(stmt) for stmt in body]
    every = ast.For(
        target=ast.Name(ROW, ast.Store()),
        iter=ast.Call(ast.Name("range", ast.Load()), [ast.parse(f"{mask}.shape[0]", mode="eval").body], []),
        body=body, orelse=[],
    )
    guard = ast.parse(f"{mask}.dim() == {n}", mode="eval").body
    return ast.copy_location(ast.If(test=guard, body=[*first, ast.copy_location(every, loop)],
                                    orelse=[copy.deepcopy(loop)]), loop)


GATED = "_moecompile_mask"  # the loop's mask with the rows of the experts the original loop skips set to 0


class _Rename(ast.NodeTransformer):
    """Reads of one name made reads of another."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node):
        if node.id == self.old and isinstance(node.ctx, ast.Load):
            return ast.copy_location(ast.Name(self.new, ast.Load()), node)
        return node


def _bound_outside(fdef, loop) -> set[str]:
    """The names the function binds outside ``loop`` (its arguments included) and not in it. Raises ``Refuse``
    where a name bound in the loop is read after it (the last expert's value would differ)."""
    body_names = names_bound(loop.body) | names_bound([loop.target])
    loop_nodes = {id(n) for n in ast.walk(loop)}
    read_after = sorted({n.id for n in ast.walk(fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                         and n.id in body_names and id(n) not in loop_nodes})
    if read_after:
        raise Refuse(f"{', '.join('`%s`' % r for r in read_after)}, bound in the loop, is read outside it")
    args = fdef.args
    outside = {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
               and id(n) not in loop_nodes} | {
        a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg] if a is not None}
    return outside - body_names


def _checked_body(fdef, loop, checker: LoopBody) -> list:
    """The loop's body, checked and rewritten by ``checker``; it must add at the selected rows."""
    body = checker.block(copy.deepcopy(loop.body), top=True)
    if checker.effect is None:
        raise Refuse("its body has no `out.index_add_(0, rows, values)` or `out[rows] += values`")
    return body


def _drop_empty_skips(fdef, loop):
    """``loop`` without the skips of an expert with no rows, which Dynamo cannot branch on (``strip_skips``:
    ``if rows.numel() == 0: continue`` after ``_, rows = torch.where(...)``, ``if counts[e] == 0: continue`` on a
    ``bincount`` of the ids, ``if mask.any():`` around the body...); None when it has none; raises ``Refuse`` where
    the body is not provably unchanged by them: its one effect adds at the rows (or boolean mask) a skip tests
    (``out.index_add_(0, rows, values)``, ``out[rows] += values``), so an iteration the skip leaves out adds
    nothing, and every other statement binds local names (the checks of a loop over ``nonzero()`` rows), none read
    before it is bound (a value carried to the next iteration would change). A ``bincount`` only the skips read
    goes with them."""
    kept, order, skips = strip_skips(loop.body)
    if not skips:
        return None
    if loop.orelse:
        raise Refuse("it has an `else:`")
    target = loop.target
    if isinstance(target, ast.Tuple) and call_name(loop.iter) == "enumerate" and target.elts:
        target = target.elts[0]
    if not isinstance(target, ast.Name):
        raise Refuse("its variable is not one name (or `i, x` of an `enumerate`)")
    carried = _carried(order, loop.target)
    if carried:
        raise Refuse(f"`{carried}` is read before the body binds it: a value carried between iterations")
    checker = LoopBody(target.id, "", _bound_outside(fdef, loop), number=True)
    body = checker.block(copy.deepcopy(kept), top=True)
    if checker.effect is None:
        raise Refuse("its body has no `out.index_add_(0, rows, values)` or `out[rows] += values`")
    for stmt in linked(fdef, loop, target.id, checker, skips):
        _replace(fdef, stmt, ast.Pass())
    return ast.copy_location(ast.For(target=loop.target, iter=loop.iter, body=body, orelse=[]), loop)


def _carried(stmts, target) -> str | None:
    """A name the statements bind that one of them reads before any earlier statement bound it, or None."""
    bound, body_names = names_bound([target]), names_bound(stmts)
    for stmt in stmts:
        read = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        early = sorted((read & body_names) - bound)
        if early:
            return early[0]
        bound |= names_bound([stmt])
    return None


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


_CALLS = {"nonzero", "where", "any", "bincount", "tolist", "numpy"}  # what an expert loop's function calls


def _candidates(roots):
    """The functions (unwrapped) of the module classes reachable from ``roots`` whose code calls one of ``_CALLS``:
    ``forward``, and the other methods the classes define (DeepSeek's remote code runs its experts' loop in
    ``moe_infer``, which ``forward`` calls), each once."""
    classes, functions, out = set(), set(), []
    for root in roots:
        for module in root.modules():
            cls = type(module)
            if cls in classes:
                continue
            classes.add(cls)
            for owner in cls.__mro__:
                if owner in (nn.Module, object) or owner.__module__.startswith("torch."):
                    continue
                for attr, value in vars(owner).items():
                    try:
                        fn = inspect.unwrap(value) if isinstance(value, types.FunctionType) else None
                    except ValueError:  # a cycle of __wrapped__
                        continue
                    code = getattr(fn, "__code__", None)
                    if fn in functions or not isinstance(code, types.CodeType) or not _CALLS & set(code.co_names):
                        continue
                    functions.add(fn)
                    out.append((f"{owner.__module__}.{owner.__qualname__}.{attr}", fn))
    return out


def _roots(namespaces) -> list[nn.Module]:
    roots, ids = [], set()
    for ns in namespaces:
        for value in ns:
            if isinstance(value, nn.Module) and id(value) not in ids:
                ids.add(id(value))
                roots.append(value)
    return roots


def swap(namespaces) -> None:
    """Give every function reachable from the nn.Modules in ``namespaces`` (iterables of values: the locals,
    closure and globals of the frame Dynamo compiles) that holds a provable loop its new code, once and for good:
    the rewritten loop while a compiler traces (``torch.compiler.is_compiling()``), the loop as written otherwise.
    Kept, not put back after the compile: Dynamo guards the code of a function it reaches through a closure (a
    decorator's: ``torch.no_grad()``, transformers' experts wrapper), and code put back failed that guard at every
    later call, each call compiling again."""
    seen.clear()
    for name, fn in _candidates(_roots(namespaces)):
        current = fn.__code__
        if current not in _REWRITES:
            try:
                result = rewrite(fn, forward=name.endswith(".forward"))
            except Exception as exc:  # noqa: BLE001 - a loop we cannot read stays as written, and is reported
                result = Rewrite(None, f"moecompile could not read it ({exc!r})", name, found=True)
            _REWRITES[current] = result
            if result.code is not None:
                _REWRITES[result.code] = result  # the new code is not rewritten again
        result = seen[name] = _REWRITES[current]
        if result.code is not None and fn.__code__ is not result.code:
            fn.__globals__.setdefault(COMPILING, torch.compiler.is_compiling)  # (equal code: another module's)
            fn.__code__ = result.code
