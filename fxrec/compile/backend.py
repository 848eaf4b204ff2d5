"""``fxrec.compile_backend``: fxrec's rules on every graph dynamo hands a backend.

Dynamo keeps what it is good at (guards, graph breaks, input/output plumbing); fxrec
rewrites each graph it is handed, then passes it to an inner backend: ``"eager"`` runs the
rewritten graph as is, ``"inductor"`` compiles it, any other registered backend name
(``"aot_eager"``...) or callable gets it next.

What this guarantees:

* No guards and no recompiles of fxrec's own: the rules run after dynamo has traced and
  guarded the frame, on the graph it hands over, and return a graph with the same inputs
  and outputs. A graph break gives two graphs; each is optimized on its own.
* Symbolic sizes (``dynamic=True``, or dynamo's automatic dynamic shapes after a second
  batch size): rules decide on static sizes, so with the inner backends ``"eager"``,
  ``"aot_eager"`` and ``"inductor"`` such a graph runs as a copy optimized (and compiled) per
  concrete signature, built on its first call (second where that compiles), for the first
  :data:`~fxrec.compile.specialize.MAX_SIGNATURES` signatures (:mod:`fxrec.compile.specialize`);
  past that, and with other inner backends, rules skip symbolic candidates instead of baking
  a size in.
* Parameters arrive as graph inputs (placeholders) when dynamo inlines modules: fused
  weights are then gathered in the graph. ``fxrec.optimize`` passes ``model`` and ``owner``
  so they become ``get_attr`` nodes laid out once instead; the inner backend is then handed
  a module holding only the tensors its graph reads (the flat parameters and unfused
  originals), since AOTAutograd lifts every parameter of that module as an input.
* Nodes a rule creates get dynamo's ``example_value`` (fake tensors in dynamo's own fake
  mode), so inner backends that read it (Inductor's pre-grad passes) see a normal graph.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate

from fxrec.compile.checkpoint import eager_forward, note_unfused
from fxrec.compile.direct import GraphRecord, graph_sources
from fxrec.compile.specialize import SizeSymbols, Specialized, drop_example_values
from fxrec.graph.capture import lift_params_to_attrs, prune_attrs
from fxrec.graph.effects import comm_kind, is_random
from fxrec.graph.optimize_graph import RuleSpec, optimize_graph, resolve_rules
from fxrec.graph.params import FusedParameters
from fxrec.graph.report import Report

logger = logging.getLogger(__name__)

__all__ = ["Backend", "compile_backend", "fill_example_values", "inner_backend"]

Backend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


def inner_backend(inner: str | Backend) -> Backend:
    """The backend callable ``inner`` names; a clear ``ValueError`` for an unknown name."""
    if callable(inner):
        return inner
    if not isinstance(inner, str):
        raise ValueError(f"inner backend must be a backend name or a callable, not {inner!r}")
    if inner == "eager":
        return lambda gm, ex: eager_forward(gm)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    try:
        return lookup_backend(inner)
    except Exception as exc:  # dynamo raises its own InvalidBackend
        known = ", ".join(["eager", "inductor", *list_backends(exclude_tags=())])
        raise ValueError(
            f"unknown inner backend {inner!r}; use a callable or one of: {known}"
        ) from exc


def _with_compile_options(
    inner: str | Backend, inner_fn: Backend, mode: str | None, options: dict[str, Any] | None
) -> Backend:
    """``inner_fn`` taking ``torch.compile``'s ``mode=``/``options=``, which ``torch.compile``
    hands its backend (this one) as keyword arguments, as ``torch.compile`` would give them.

    ``"inductor"`` gets them as Inductor's config, through the wrapper ``torch.compile`` builds
    for ``backend="inductor"`` (same modes, same checks of option names). ``"eager"`` ignores
    them with a warning, as dynamo's own ``eager`` backend does; other registered backends and
    callables that accept them get them as keyword arguments; any other callable cannot.
    """
    given = {k: v for k, v in (("mode", mode), ("options", options)) if v}
    if not given:
        return inner_fn
    if inner == "inductor":
        from torch import _TorchCompileInductorWrapper

        return _TorchCompileInductorWrapper(mode, options, None)
    if inner == "eager":
        logger.warning("fxrec.compile_backend: inner backend 'eager' ignores %s", given)
        return inner_fn
    if isinstance(inner, str) or _takes_keywords(inner_fn, given):
        return functools.partial(inner_fn, **given)
    shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
    raise TypeError(
        f"fxrec.compile_backend: torch.compile passed {shown} to the inner backend "
        f"{getattr(inner_fn, '__name__', inner_fn)!r}, which takes no such argument. Drop "
        "mode=/options= from torch.compile, use compile_backend('inductor') (which applies "
        "them), or give the inner backend the keyword arguments (**kwargs)."
    )


def _takes_keywords(fn: Callable[..., Any], given: dict[str, Any]) -> bool:
    """Can ``fn`` be called with the keyword arguments ``given``?"""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call say
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return set(given) <= names


def _fake_mode(gm: fx.GraphModule) -> Any:
    for node in gm.graph.nodes:
        v = node.meta.get("example_value", node.meta.get("val"))
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def fill_example_values(gm: fx.GraphModule) -> int:
    """Give nodes that rules created an ``example_value`` in the graph's own fake mode.

    Runs only the nodes lacking one, on their inputs' fake values; symbolic sizes carry
    through. A node whose value cannot be computed keeps none (nothing downstream needs
    it to be correct). Returns how many nodes got one.
    """
    mode = _fake_mode(gm)
    if mode is None:
        return 0
    filled = 0

    def value(x: Any) -> Any:
        if isinstance(x, fx.Node):
            v = x.meta.get("example_value", x.meta.get("val"))
            if v is None:
                raise LookupError(x.name)
            return v
        return x

    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or "example_value" in node.meta:
            continue
        try:
            args = map_aggregate(node.args, value)
            kwargs = map_aggregate(node.kwargs, value)
            with mode:
                if node.op == "call_function":
                    out = node.target(*args, **kwargs)
                else:
                    self_, *rest = args
                    out = getattr(self_, node.target)(*rest, **kwargs)
        except Exception as exc:  # e.g. an input that itself has no value: leave it
            logger.debug("no example_value for %s: %s", node.name, exc)
            continue
        node.meta["example_value"] = out
        filled += 1
    return filled


def _members_through_flat(
    fn: Callable[..., Any], inputs: Sequence[Any], owner: FusedParameters | None
) -> Callable[..., Any]:
    """``fn``, called with laid-out member parameters replaced by views of their flat tensor.

    Parameters stay graph inputs in graphs dynamo compiles for a submodule's own frame (a
    graph break in a hook), which it reuses for every sibling module; their gradients must
    still reach the flat parameters the optimizer holds.
    """
    positions = [j for j, t in enumerate(inputs) if isinstance(t, nn.Parameter)]
    if owner is None or not positions:
        return fn

    def call(*args: Any) -> Any:
        args_list = list(args)
        for j in positions:
            view = owner.view_of(args_list[j])
            if view is not None:
                args_list[j] = view
        return fn(*args_list)

    return call


def _without_new_attrs(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``, or a copy when rules gave it tensors of its own (fused lookups' constant table
    offsets): AOTAutograd looks each of the module's tensors up among the sources dynamo
    recorded for the module it captured, and would not find those. The copy is a plain
    graph module, whose tensors AOTAutograd takes as they are."""
    known = getattr(gm, "_param_name_to_source", None)
    if known is None:
        return gm
    ours = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target not in known]
    if not any(isinstance(getattr(gm, str(t), None), torch.Tensor) for t in ours):
        return gm
    return prune_attrs(gm)


# Inner backends that can compile a specialized copy on a call's real inputs (AOTAutograd
# runs inside them, so gradients flow through each copy); an arbitrary callable may expect
# dynamo's fake inputs and compile context.
_SPECIALIZING = ("eager", "aot_eager", "inductor")


def _size_symbols(gm: fx.GraphModule, inner: str | Backend) -> SizeSymbols | None:
    """The symbols to specialize ``gm`` on, or None to run it with symbolic sizes.

    Not for graphs with collectives: ranks with different batch sizes would optimize
    different copies, whose collectives might not match.
    """
    if not (isinstance(inner, str) and inner in _SPECIALIZING):
        return None
    if any(comm_kind(n) for n in gm.graph.nodes):
        return None
    return SizeSymbols.of(gm)


def _fired(report: Report) -> Counter[tuple[str, int]]:
    """What a graph's rewrite did: each rule that fired, with the size of each set."""
    return Counter((f.rule, len(f.nodes)) for f in report.firings)


def compile_backend(
    inner: str | Backend = "inductor",
    *,
    rules: RuleSpec = None,
    model: nn.Module | None = None,
    owner: FusedParameters | None = None,
    report: Report | None = None,
    assigned: Collection[str] = (),
) -> Backend:
    """A ``torch.compile`` backend running fxrec's rules before ``inner``.

    Usage: ``torch.compile(model, backend=fxrec.compile_backend())``, or
    ``compile_backend("aot_eager")`` to check a rewrite without Inductor's C++ build.
    ``rules`` picks rules by name, class or instance (default: every registered rule).
    ``torch.compile``'s ``mode=``/``options=`` reach ``inner`` as ``torch.compile`` would pass
    them to it (Inductor's config for ``"inductor"``; ``"eager"`` ignores them, with a warning).
    ``fxrec.optimize`` passes ``model`` and ``owner`` so that parameters become ``get_attr``
    nodes and are laid out once, except the buffers named in ``assigned``, which forward
    reassigns (each call reads the tensor the last one assigned). The backend's ``report`` attribute accumulates what each
    graph got (one graph per graph break, per recompile), its ``graphs`` attribute a
    :class:`~fxrec.compile.direct.GraphRecord` of each graph whose parameters were lifted,
    its ``communicates`` attribute whether any graph holds a collective, its ``draws`` whether
    any draws random numbers.
    """
    default_inner = inner_backend(inner)
    eager = isinstance(inner, str) and inner == "eager"
    inner_is_inductor = isinstance(inner, str) and inner == "inductor"
    rule_list = resolve_rules(rules)
    rep = report if report is not None else Report(capture="dynamo")
    graphs: list[GraphRecord] = []

    def backend(
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        inner_fn = _with_compile_options(inner, default_inner, mode, options)
        keep: list[int] | None = None
        if any(is_random(n) for n in gm.graph.nodes):
            backend.draws = True  # type: ignore[attr-defined]
        if model is not None and owner is not None:
            sources = graph_sources(gm)
            gm, keep = lift_params_to_attrs(gm, example_inputs, model, assigned)
        device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
        symbols = _size_symbols(gm, inner) if keep is None else None
        captured = copy.deepcopy(gm.graph) if symbols is not None else None  # before rules

        def optimize(g: fx.GraphModule, into: Report, specialized_later: bool = False) -> None:
            optimize_graph(
                g,
                rule_list,
                owner=owner,
                report=into,
                device_type=device,
                runs_eagerly=eager,
                for_inductor=inner_is_inductor,
                specialized_later=specialized_later,
            )

        symbolic = Report(capture="dynamo")  # what the graph with symbolic sizes got
        optimize(gm, symbolic, specialized_later=symbols is not None)
        rep.merge(symbolic)
        note_unfused(gm, rep)
        fill_example_values(gm)
        if any(comm_kind(n) for n in gm.graph.nodes):
            backend.communicates = True  # type: ignore[attr-defined]
        if keep is None and symbols is not None and captured is not None:

            def build(copy_gm: fx.GraphModule, args: list[Any]) -> Callable[..., Any]:
                mine = Report(capture="dynamo")
                optimize(copy_gm, mine)
                if not eager and _fired(mine) == _fired(symbolic):
                    # static sizes fused nothing more (Inductor's cost model on a CPU
                    # refuses most sets): the compiled symbolic graph serves these sizes too
                    rep.note(
                        "dynamic shapes: copies for concrete sizes that fuse nothing more than "
                        "the graph with symbolic sizes are not compiled; it runs them"
                    )
                    return fallback
                rep.merge(mine)
                return inner_fn(drop_example_values(copy_gm), args)

            when = "first call" if eager else "second call (the first compiles nothing)"
            rep.note(
                "dynamic shapes: graphs with symbolic sizes run as a copy optimized for each "
                f"concrete signature (batch size), built on its {when}"
            )
            fallback = inner_fn(_without_new_attrs(gm), list(example_inputs))
            return Specialized(
                captured, gm, symbols, build, fallback, rep, build_on=1 + (not eager)
            )
        if keep is None:
            return inner_fn(_without_new_attrs(gm), list(example_inputs))
        kept_inputs = [example_inputs[i] for i in keep]
        record = GraphRecord(
            _members_through_flat(inner_fn(prune_attrs(gm), kept_inputs), kept_inputs, owner),
            [sources[i] for i in keep],  # placeholders and example inputs line up
        )
        graphs.append(record)
        return lambda *args: record(*[args[i] for i in keep])

    backend.report = rep  # type: ignore[attr-defined]
    backend.graphs = graphs  # type: ignore[attr-defined]
    backend.communicates = False  # type: ignore[attr-defined]
    backend.draws = False  # type: ignore[attr-defined]
    return backend
