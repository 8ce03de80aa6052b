"""How an attention module routes its keys, values and mask, read from its ``forward`` source.

alisa's attention function sees the query, the key and value the cache returned, and
transformers' mask; it attends over the cache's kept slots with its own mask. That is exact
only when the module hands the attention function exactly those: one call per layer, with the
key and value ``cache.update`` returned and the ``attention_mask`` the module was given.
:func:`routing_reason` checks it on the syntax tree of the module's ``forward`` (no forward is
run), so a model that computes attention inline, derives values from the cache's (DiffLlama),
or builds its own mask (Doge) is refused when the cache is built.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from torch import nn

# The keyword under which a modeling file hands its attention module the cache (Llama-style,
# older files, and GPT-NeoX / GPTBigCode / CTRL).
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")
INTERFACE = "ALL_ATTENTION_FUNCTIONS"
INLINE_ATTENTION = (
    "its modeling code computes attention inline instead of through transformers' attention "
    "interface (ALL_ATTENTION_FUNCTIONS), so the kept tokens could not be the ones attended"
)


@dataclass(frozen=True, kw_only=True)
class Routing:
    """What an attention module's ``forward`` does with the cache and the attention function.

    Attributes
    ----------
    cache_kwarg
        The parameter that receives the cache (one of :data:`CACHE_KWARGS`), or None.
    updated
        The names ``cache.update`` binds (key, value), or None when it is not called.
    calls
        Each call of the attention function: the source of its key, value and mask arguments.
    rebound
        Names ``cache.update`` binds that are assigned again after it (JetMoE tiles its keys
        per expert there): the attention function would not see what the cache returned.
    """

    cache_kwarg: str | None
    updated: tuple[str, ...] | None
    calls: tuple[tuple[str, str, str], ...]
    rebound: tuple[str, ...] = ()


def routing(module_class: type[nn.Module]) -> Routing:
    """Read :class:`Routing` from ``module_class.forward``'s source."""
    function = _forward_tree(module_class)
    parameters = [argument.arg for argument in function.args.args + function.args.kwonlyargs]
    cache_kwarg = next((name for name in CACHE_KWARGS if name in parameters), None)
    interfaces = _interface_names(function)
    caches = _aliases(function, cache_kwarg) if cache_kwarg else set()
    updated, calls, line = None, [], None
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and _is_cache_update(node.value, caches):
            target = node.targets[0]
            if isinstance(target, ast.Tuple):
                updated = tuple(ast.unparse(element) for element in target.elts)
                line = node.lineno
        if isinstance(node, ast.Call) and _calls_interface(node, interfaces):
            calls.append(_attention_arguments(node))
    rebound = _assigned_after(function, updated or (), line) if line is not None else ()
    return Routing(cache_kwarg=cache_kwarg, updated=updated, calls=tuple(calls), rebound=rebound)


def _assigned_after(
    function: ast.FunctionDef, names: tuple[str, ...], line: int
) -> tuple[str, ...]:
    """Which of ``names`` an assignment after source line ``line`` binds again."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Assign | ast.AugAssign) and node.lineno > line:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                found += [ast.unparse(e) for e in elements if ast.unparse(e) in names]
    return tuple(dict.fromkeys(found))


def routing_reason(module_class: type[nn.Module]) -> str | None:
    """Why the attention of ``module_class`` could not run exactly on the ALISA cache, or None.

    Parameters
    ----------
    module_class
        The class of a self-attention module of the model (one module per layer).
    """
    name = module_class.__name__
    try:
        found = routing(module_class)
    except (OSError, TypeError) as error:  # no source file: nothing to read the routing from
        return f"{name}.forward has no readable source ({error}), so its routing is unknown"
    if found.cache_kwarg is None:
        return (
            f"{name}.forward takes no cache argument ({' / '.join(CACHE_KWARGS)}), so the "
            "attention function could not reach the cache"
        )
    if not found.calls:
        return INLINE_ATTENTION
    if len(found.calls) > 1:
        return (
            f"{name} calls the attention function {len(found.calls)} times per layer, and "
            "alisa's attention keeps one set of tokens per layer and step"
        )
    if found.updated is None:
        return (
            f"{name}.forward never stores its keys and values with the cache's update(), so "
            "the cache could not hold the tokens attended"
        )
    key, value, mask = found.calls[0]
    if found.rebound:
        return (
            f"{name} changes {' / '.join(found.rebound)} after the cache returns them (JetMoE "
            "tiles its keys per expert), and alisa's attention reads its own kept slots, which "
            "would pair query heads with the wrong keys"
        )
    if (key, value) != found.updated[:2]:
        return (
            f"{name} attends to {key} / {value} instead of the keys and values the cache "
            f"returns ({' / '.join(found.updated[:2])}), and alisa's attention reads its own "
            "kept slots"
        )
    if mask not in ("attention_mask", "None"):
        return (
            f"{name} builds its own attention mask ({mask}) instead of transformers' "
            "attention_mask, which alisa's attention replaces by the kept slots' positions"
        )
    return None


def _forward_tree(module_class: type[nn.Module]) -> ast.FunctionDef:
    source = textwrap.dedent(inspect.getsource(module_class.forward))
    return ast.parse(source).body[0]


def _interface_names(function: ast.FunctionDef) -> set[str]:
    """Names bound to a function taken from transformers' attention interface."""
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if INTERFACE in ast.unparse(node.value):
                names.update(ast.unparse(target) for target in targets)
    return names


def _calls_interface(call: ast.Call, interfaces: set[str]) -> bool:
    """A call of a name bound to an attention-interface function, or of a lookup made inline
    (``ALL_ATTENTION_FUNCTIONS[name](...)``); not the lookup itself."""
    if ast.unparse(call.func) in interfaces:
        return True
    return isinstance(call.func, ast.Call | ast.Subscript) and INTERFACE in ast.unparse(call.func)


def _aliases(function: ast.FunctionDef, cache_kwarg: str) -> set[str]:
    """``cache_kwarg`` and the names bound to it or to a part of it (GPT-2's
    ``curr_past_key_values = past_key_values.self_attention_cache``), to a fixed point."""
    names = {cache_kwarg}
    assignments = [node for node in ast.walk(function) if isinstance(node, ast.Assign)]
    while True:
        bound = {
            target.id
            for node in assignments
            if _root_name(node.value) in names
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        if bound <= names:
            return names
        names |= bound


def _root_name(expression: ast.expr) -> str | None:
    """The name an attribute chain starts from (``a`` of ``a.b.c``), else None."""
    while isinstance(expression, ast.Attribute):
        expression = expression.value
    return expression.id if isinstance(expression, ast.Name) else None


def _is_cache_update(value: ast.expr, caches: set[str]) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "update"
        and _root_name(value.func.value) in caches
    )


def _attention_arguments(call: ast.Call) -> tuple[str, str, str]:
    """(key, value, mask) of an attention-function call ``f(module, query, key, value, mask)``,
    positional or by keyword."""
    names = ("module", "query", "key", "value", "attention_mask")
    given = dict(zip(names, call.args, strict=False))
    given |= {keyword.arg: keyword.value for keyword in call.keywords if keyword.arg in names}
    return tuple(
        ast.unparse(given[name]) if name in given else "None"
        for name in ("key", "value", "attention_mask")
    )
