"""Metaclass that records construction from FX proxies as one graph node."""

from __future__ import annotations

from typing import Any

from torch.fx import _symbolic_trace
from torch.fx.node import map_aggregate
from torch.fx.proxy import Proxy

__all__ = ["SparseMeta"]


class SparseMeta(_symbolic_trace.ProxyableClassMeta):
    """``ProxyableClassMeta`` that reads the tracing flag directly.

    Same behaviour (constructing a sparse type from proxies under ``symbolic_trace`` becomes a
    ``call_function`` node, so models that build KJTs in ``forward`` stay traceable), without
    torch's ``is_fx_tracing()`` deprecation warning on every process's first construction.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if _symbolic_trace._is_fx_tracing_flag:
            found: list[Proxy] = []
            map_aggregate(args, lambda a: found.append(a) if isinstance(a, Proxy) else None)
            map_aggregate(kwargs, lambda a: found.append(a) if isinstance(a, Proxy) else None)
            if found:
                return found[0].tracer.create_proxy("call_function", cls, args, kwargs)
        return super(_symbolic_trace.ProxyableClassMeta, cls).__call__(*args, **kwargs)
