"""Graph capture: symbolic tracing first, dynamo when tracing fails.

``torch.fx.symbolic_trace`` keeps modules as ``call_module`` nodes but fails on about half of
public CTR models (``len(x.shape)``, ``if x.dim() > 1``, iterating over ``torch.split``).
Dynamo captures nearly all of them; its graphs inline modules and pass parameters as graph
inputs. :func:`capture_dynamo` turns those inputs back into ``get_attr`` nodes on the
model's own parameters, so both capture paths give rules the same kind of graph: one whose
parameters belong to the model and can be laid out once (see :mod:`fxrec.graph.params`).

Dynamo's own machinery (guards, graph breaks, input and output plumbing) stays in charge:
``fxrec.optimize`` runs the model under ``torch.compile`` with fxrec's backend
(:mod:`fxrec.compile.backend`), which lifts the parameters and runs the rules on each graph.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import os
import sys
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxrec.graph import meta
from fxrec.graph.effects import has_hooks, mutates_input, written_target

logger = logging.getLogger(__name__)

__all__ = [
    "CaptureError",
    "FxrecTracer",
    "capture_lock",
    "capture_symbolic",
    "torchrec_kept_whole",
    "lift_params_to_attrs",
    "opaque_modules_note",
    "param_names",
    "prune_attrs",
]


# fx's tracer patches ``nn.Module.__call__`` and ``__getattr__`` for the whole process, and
# FxrecTracer patches ``torch.randn`` & co. and ``torch.utils.checkpoint``; each trace saves
# what it finds and puts it back at its end, so two traces at once would put back each
# other's patches, left installed for good. Every capture holds this lock, and so does
# ``fxrec.optimize``'s whole build of a graph (trace, rules, check, first compile), which
# runs the graphs and the model it captures.
capture_lock = threading.RLock()


def _free_in_child(lock: Any) -> bool:
    """Free ``lock`` if a thread that did not survive the fork holds it (True if one did).

    Freed in place: ``capture_lock`` is imported by name elsewhere."""
    if not (hasattr(lock, "_is_owned") and hasattr(lock, "_at_fork_reinit")):
        return False  # not an RLock (another torch's): left as it is
    if lock._is_owned():  # the forking thread's own: a fork from inside a build
        return False
    if lock.acquire(blocking=False):
        lock.release()
        return False
    lock._at_fork_reinit()
    return True


def _after_fork_in_child() -> None:
    """A process forked while another thread builds a graph (a DataLoader worker started
    during ``fxrec.optimize``) inherits ``capture_lock`` and dynamo's compile lock held by a
    thread that does not exist there, and fx's "tracing" flag set by its trace: the child's
    first build (a new input size) would wait forever, or dynamo would refuse to run."""
    if _free_in_child(capture_lock):
        torch.fx._symbolic_trace._is_fx_tracing_flag = False  # that trace died with its thread
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    compile_lock = getattr(convert_frame, "compile_lock", None)
    if compile_lock is not None:
        _free_in_child(compile_lock)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


class CaptureError(RuntimeError):
    """Raised when a capture method cannot produce a single graph for the model.

    ``assigned``: the buffers forward assigns (``self.n = self.n + 1``), by name.
    """

    assigned: tuple[str, ...] = ()


# TorchRec's dense modules and model arches: plain tensor code, traced through so that their
# layers fuse like the model's own. ``SparseArch`` is traced through too, with its collection
# a leaf (a sharded collection inside becomes visible to the overlap rule).
_TORCHREC_DENSE = (
    "torchrec.modules.activation",
    "torchrec.modules.crossnet",
    "torchrec.modules.deepfm",
    "torchrec.modules.mlp",
    "torchrec.models",
)


def torchrec_kept_whole(m: nn.Module) -> bool:
    """Is ``m`` one of TorchRec's modules the tracer keeps whole?

    Everything under ``torchrec`` but its dense modules (:data:`_TORCHREC_DENSE`): embedding
    collections, feature processors, managed collisions, pools and ``torchrec.distributed``
    read KJT internals or hold state a trace would freeze; a module not known to be dense
    stays whole, which is always correct. Outside ``torchrec.distributed``, a module holding
    one of fxrec's collections (a sharded one swapped in) is traced through, so that rules
    reach the collection (the overlap rule, its all-to-alls).
    """
    mod = type(m).__module__
    if not mod.startswith("torchrec."):
        return False
    if any(mod == d or mod.startswith(d + ".") for d in _TORCHREC_DENSE):
        return False
    if mod.startswith("torchrec.distributed."):
        return True
    return not any(getattr(sub, "_fxrec_leaf", False) for sub in m.modules())


def opaque_modules_note(gm: fx.GraphModule) -> str | None:
    """The report's note on TorchRec modules the graph calls whole that hold parameters.

    Rules see such a module as one call: its layers never fuse, and its embedding lookups are
    TorchRec's, not fxrec's grouped ones. None when the graph calls no such module.
    """
    kept: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in kept:
            continue
        m = gm.get_submodule(node.target)
        if torchrec_kept_whole(m) and next(m.parameters(), None) is not None:
            kept[node.target] = type(m).__name__
    if not kept:
        return None
    listed = ", ".join(f"{name} ({cls})" for name, cls in list(kept.items())[:4])
    more = ", ..." if len(kept) > 4 else ""
    return (
        f"kept whole (not traced into): {len(kept)} TorchRec module(s) holding parameters: "
        f"{listed}{more}; fxrec.nn.EmbeddingBagCollection takes TorchRec's configs and "
        "state_dict and runs grouped lookups"
    )


class FxrecTracer(fx.Tracer):
    """Symbolic tracer that keeps fxrec's and TorchRec's sparse modules as leaves.

    TorchRec's dense modules (``MLP``, ``CrossNet``, DLRM's arches) are traced through.

    Buffers are proxies (``get_attr`` nodes), as parameters are: a computation on buffers
    alone (``torch.tanh(self.scale)``) runs on every call, so a buffer loaded or changed
    after capture is read; a plain trace runs it once and keeps its result as a constant.

    It refuses what a symbolic trace would silently get wrong (dynamo gets each right):
    activation checkpointing (traced through, dropping the recomputation), grad-mode and
    autocast regions inside ``forward`` (``with torch.no_grad():``: a graph records no mode
    change), and random draws from constant arguments (``torch.randn(4, 8)`` runs once,
    at trace time, and its result would be a constant of the graph).
    """

    proxy_buffer_attributes = True

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        self._modes = _modes()
        self._thread = threading.get_ident()
        with capture_lock, _checkpoint_refused(), _constant_draws_refused():
            graph = super().trace(root, concrete_args)
        _refuse_written_constants(graph)
        return graph

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InPlaceProxy(node, self)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        if _modes() != getattr(self, "_modes", _modes()):
            raise CaptureError(
                "symbolic tracing skipped: forward switches grad mode or autocast inside "
                "(torch.no_grad, torch.autocast), which a trace would drop"
            )
        return super().create_node(*args, **kwargs)

    # fx patches ``nn.Module.__call__`` and ``__getattr__`` for the whole process while it
    # traces, and its patches defer to these two methods: a module called on another thread
    # meanwhile (a plain model serving requests) runs as written, rather than being recorded
    # in this graph or raising NameError (not a submodule of the traced model).
    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != getattr(self, "_thread", None):
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != getattr(self, "_thread", None):
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if getattr(m, "_fxrec_leaf", False):
            return True
        if torchrec_kept_whole(m):
            return True
        return super().is_leaf_module(m, qualname)


class _InPlaceProxy(fx.Proxy):
    """Records ``t += x`` as ``operator.iadd(t, x)``, which writes ``t`` in place as the model
    does (a plain proxy falls back to ``t = t + x``: views of ``t``, and a caller's tensor
    passed in as ``t``, would miss the write)."""


def _augmented(op: Any) -> Any:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _name in (
    "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand",
    "ior", "ixor", "ilshift", "irshift",
):  # fmt: skip
    setattr(_InPlaceProxy, f"__{_name}__", _augmented(getattr(operator, _name)))


@contextlib.contextmanager
def _checkpoint_refused() -> Iterator[None]:
    """``torch.utils.checkpoint.checkpoint`` raises while tracing (both of its variants), on
    the tracing thread only: other threads (a pipeline's, another model's) checkpoint as
    usual."""
    import torch.utils.checkpoint as ckpt

    cls = ckpt.CheckpointFunction
    own = cls.__dict__.get("apply")  # None: inherited from autograd.Function, as usual
    saved_fn = cls.apply
    saved_gen = ckpt._checkpoint_without_reentrant_generator
    tracing = threading.get_ident()

    def refusing(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == tracing:
                raise CaptureError("activation checkpointing (torch.utils.checkpoint) in forward")
            return fn(*args, **kwargs)

        return call

    cls.apply = refusing(saved_fn)  # type: ignore[method-assign]
    ckpt._checkpoint_without_reentrant_generator = refusing(saved_gen)  # type: ignore[assignment]
    try:
        yield
    finally:
        if own is None:
            del cls.apply  # the inherited classmethod again, not a bound copy of it
        else:
            cls.apply = own  # type: ignore[method-assign]
        ckpt._checkpoint_without_reentrant_generator = saved_gen


def _modes() -> tuple:
    """Grad mode, inference mode and autocast state: what a traced graph cannot record."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        *(
            torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
            for d in ("cpu", "cuda")
        ),
    )


_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm", "normal", "poisson", "bernoulli")


@contextlib.contextmanager
def _constant_draws_refused() -> Iterator[None]:
    """``torch.randn(4, 8)`` (no traced argument) raises while tracing: it would run once."""
    saved = {name: getattr(torch, name) for name in _RANDOM_FACTORIES}
    tracing = threading.get_ident()  # other threads (a pipeline's loader) draw as usual

    def guarded(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == tracing and not any(
                isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())
            ):
                raise CaptureError(
                    f"symbolic tracing skipped: forward draws random numbers from constant "
                    f"arguments (torch.{name}), which a trace would draw once"
                )
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(torch, name, guarded(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


def _refuse_written_constants(graph: fx.Graph) -> None:
    """A tensor made at trace time (``torch.zeros(4, 8)``) is one constant of the graph: the
    graph must not write it in place (every call would see the last call's writes), nor
    return it (the caller could)."""

    def constant(n: Any) -> bool:
        return isinstance(n, fx.Node) and n.op == "get_attr" and "_tensor_constant" in str(n.target)

    for node in graph.nodes:
        written = written_target(node) if mutates_input(node) else None
        returned = node.op == "output" and any(constant(a) for a in node.all_input_nodes)
        if constant(written) or returned:
            raise CaptureError(
                "symbolic tracing skipped: forward writes in place or returns a tensor it "
                "builds from constants (torch.zeros(4, 8)), which a trace would build once"
            )


def capture_symbolic(model: nn.Module) -> fx.GraphModule:
    """Trace ``model`` with :class:`FxrecTracer`; raises :class:`CaptureError` on failure."""
    params = inspect.signature(model.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        # The trace takes them as one dict placeholder, which calls cannot line up with.
        raise CaptureError("symbolic tracing skipped: forward takes **kwargs")
    hooked = _hooked_traced_through(model)
    if hooked is not None:
        raise CaptureError(
            f"symbolic tracing skipped: {hooked or 'the model'} has hooks, which tracing "
            "through it would drop"
        )
    tracer = FxrecTracer()
    with capture_lock:  # one capture at a time, its buffers put back before the next
        saved = _buffer_state(model)
        try:
            graph = tracer.trace(model)
            # Code generation fails too, e.g. on ``forward(x, y=None, *, z)``.
            gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        except CaptureError:
            raise
        except Exception as exc:  # tracing fails in many, unpredictable ways
            raise CaptureError(f"symbolic tracing failed: {type(exc).__name__}: {exc}") from exc
        finally:
            written = _restore_written(saved)
    if written:
        error = CaptureError(
            f"symbolic tracing skipped: forward assigns buffer {written[0]!r} (``self.n += 1``, "
            "``self.n = t``), which a graph does not record"
        )
        error.assigned = tuple(written)
        raise error
    return gm


def _buffer_state(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, int, torch.Tensor]]:
    """(module, name, buffer, its version, a copy) of every buffer of ``model``."""
    return [
        (m, f"{prefix}.{n}" if prefix else n, b, b._version, b.detach().clone())
        for prefix, m in model.named_modules()
        for n, b in m._buffers.items()
        if b is not None
    ]


def _restore_written(
    saved: list[tuple[nn.Module, str, torch.Tensor, int, torch.Tensor]],
) -> list[str]:
    """Put back every buffer a trace wrote or reassigned; their names.

    Buffers are proxies while tracing, so ``self.n.add_(1)`` is a node of the graph; but
    ``self.n += 1`` and ``self.n = t`` also assign the attribute (to a proxy), which the
    graph does not record, and a buffer reached around ``getattr`` (``self._buffers``) is
    a plain tensor that the trace would write once.
    """
    written = []
    for m, name, b, version, copy in saved:
        n = name.rpartition(".")[2]
        if m._buffers.get(n) is b and b._version == version:
            continue
        written.append(name)
        m._buffers[n] = b
        with torch.no_grad():
            b.copy_(copy)
    return written


def _hooked_traced_through(model: nn.Module) -> str | None:
    """The name of a module with hooks that tracing would inline (not a leaf), else None.

    Leaves stay ``call_module`` nodes, whose calls run their hooks (rules leave such calls
    alone); modules traced through lose them, so the model goes to dynamo, which keeps them.
    """
    tracer = FxrecTracer()
    for name, m in model.named_modules():
        if has_hooks(m) and (m is model or not tracer.is_leaf_module(m, name)):
            return name
    return None


def param_names(model: nn.Module) -> dict[int, str]:
    """Qualified name of every parameter and buffer of ``model``, by object id."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    for n, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), n)
    return names


def lift_params_to_attrs(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    model: nn.Module,
    assigned: Collection[str] = (),
) -> tuple[fx.GraphModule, list[int]]:
    """Replace graph inputs that are ``model``'s parameters/buffers by ``get_attr`` nodes.

    Buffers named in ``assigned`` (forward reassigns them) stay inputs: an attribute would
    hold the tensor the graph was compiled with, while each call reads the one the last
    call assigned. Returns the new graph module (whose attributes are the model's own
    tensors) and the positions of the inputs that remain real inputs.
    """
    names = param_names(model)
    graph = fx.Graph()  # a copy: dynamo still reads the graph it handed over
    graph.output(graph.graph_copy(gm.graph, {}))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise CaptureError("dynamo graph inputs do not line up with its example inputs")
    keep: list[int] = []
    root: dict[str, Any] = {}
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for i, (ph, val) in enumerate(zip(placeholders, example_inputs)):
        qual = names.get(id(val)) if isinstance(val, torch.Tensor) else None
        if qual is None or qual in assigned or not _reached_from_model(ph, val, model):
            keep.append(i)
            continue
        with graph.inserting_before(first):
            attr = graph.get_attr(qual)
        attr.meta.update(ph.meta)
        ph.replace_all_uses_with(attr)
        graph.erase_node(ph)
        root[qual] = val
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and node.target not in root:
            root[node.target] = meta.resolve_attr(gm, node.target)
    out = fx.GraphModule(root, graph, type(model).__name__)
    out.meta.update(gm.meta)  # Inductor reads dynamo's entries (parameter names, compile id)
    return out, keep


def prune_attrs(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` holding only the attributes its graph reads, tensors as buffers.

    After the rules ran, ``gm`` still holds the member parameters whose storage moved into a
    flat parameter. AOTAutograd lifts every parameter and buffer of the module it is given
    as an input, and cannot fakeify those views again (dynamo fakeified them before they
    moved); it must see only the leaves the graph reads. Tensors that are not parameters are
    registered as buffers, so in-place updates (running statistics) are written back.
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = fx.GraphModule(gm, graph, type(gm).__name__)
    out.meta.update(gm.meta)
    return out


def _reached_from_model(ph: fx.Node, val: torch.Tensor, model: nn.Module) -> bool:
    """Does dynamo read this input through ``model`` itself (``self.<path>``)?

    Dynamo passes modules' parameters as inputs so that one graph serves every instance of
    a module class: a graph compiled for a submodule's own frame (a graph break in a hook)
    runs again for its siblings. Only an input read from the model's own frame is always
    this very tensor, and can become a ``get_attr``; an input without a recorded source is
    taken by identity.
    """
    from fxrec.compile.direct import source_path

    grapharg = ph.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return True
    path = source_path(source, [_self_name(model)], cells=True)
    if path is None:
        return False
    obj: Any = model
    try:
        for kind, key in path[1]:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
    except (AttributeError, KeyError, IndexError, TypeError):
        return False
    return obj is val


def _self_name(model: nn.Module) -> str:
    """The name ``forward`` gives its module (``self``, by convention only)."""
    code = getattr(type(model).forward, "__code__", None)
    return code.co_varnames[0] if code is not None and code.co_argcount else "self"


def _resolve(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
