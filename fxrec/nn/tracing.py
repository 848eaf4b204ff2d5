"""Keeping a module (or a function) as ONE node under any ``torch.fx`` tracer.

``torch.fx.symbolic_trace`` traces into every module that is not from ``torch.nn``; the
collection's forward reads host-side metadata of its input (keys, per-key id counts) that a
proxy cannot give, so it must stay a leaf. fxrec's own tracer asks ``_fxrec_leaf``; for any
other tracer the module's ``__call__`` records the node itself (:func:`leaf_call`). The graph
then keeps the module (and so its ``state_dict`` keys), and graph rules see one node they
can reason about.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.fx import _symbolic_trace
from torch.fx.node import map_aggregate
from torch.fx.proxy import Proxy

__all__ = ["is_symbolic_tracing", "leaf_call", "leaf_function_call"]


def is_symbolic_tracing() -> bool:
    """The module flag, read directly (``is_fx_tracing()`` logs a warning per call)."""
    return bool(getattr(_symbolic_trace, "_is_fx_tracing_flag", False))


def _first_proxy(args: Any, kwargs: Any) -> Proxy | None:
    found: list[Proxy] = []
    map_aggregate(args, lambda a: found.append(a) if isinstance(a, Proxy) else None)
    map_aggregate(kwargs, lambda a: found.append(a) if isinstance(a, Proxy) else None)
    return found[0] if found else None


def leaf_function_call(fn: Callable[..., Any], args: Any, kwargs: Any) -> Proxy | None:
    """``fn(*args, **kwargs)`` as one ``call_function`` node, or None if no proxy is given."""
    proxy = _first_proxy(args, kwargs)
    if proxy is None:
        return None
    return proxy.tracer.create_proxy("call_function", fn, args, kwargs)


def leaf_call(module: nn.Module, args: Any, kwargs: Any) -> Proxy | None:
    """``module(*args, **kwargs)`` as one ``call_module`` node, or None if no proxy is given."""
    proxy = _first_proxy(args, kwargs)
    if proxy is None:
        return None
    tracer = proxy.tracer
    path = tracer.path_of_module(module)

    def as_node(*a: Any, **k: Any) -> Proxy:
        return tracer.create_proxy("call_module", path, a, k)

    # Through ``call_module`` so the tracer keeps its bookkeeping (module stack, node meta);
    # a tracer that would trace into the module gets the single node from ``as_node``.
    return tracer.call_module(module, as_node, args, kwargs)
