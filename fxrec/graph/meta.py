"""What the optimizer knows about each value: shape, dtype, device.

Rules decide on metadata alone, never on values. It comes from whatever the IR already
carries (dynamo's ``example_value``, ``val``, ShapeProp's ``tensor_meta``) or from one run of
the graph on the example inputs (:func:`annotate`). New nodes a rule creates get theirs from
:func:`infer`, which runs the op on fake tensors. A node with no metadata is simply not a
candidate for any rule: the rule reports why and moves on.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

logger = logging.getLogger(__name__)

__all__ = [
    "TensorInfo",
    "info",
    "set_info",
    "annotate",
    "infer",
    "stamp_program_order",
    "program_order",
    "resolve_attr",
]

_KEY = "fxrec_info"


@dataclass(frozen=True)
class TensorInfo:
    """Static description of a tensor value; hashable so it can be part of a bucket key."""

    shape: tuple[Any, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorInfo:
        shape = tuple(s if isinstance(s, int) else _sym(s) for s in t.shape)
        return cls(shape, t.dtype, t.device, bool(t.requires_grad))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def static(self) -> bool:
        """True when every dimension is a plain int (no symbolic sizes)."""
        return all(isinstance(s, int) for s in self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s if isinstance(s, int) else 1
        return n


def _sym(s: Any) -> Any:
    """A symbolic size as a hashable token (its expression), or its hint when it has one."""
    try:
        node = s.node
    except AttributeError:
        return str(s)
    const = node.maybe_as_int() if hasattr(node, "maybe_as_int") else None
    return const if const is not None else str(node.expr)  # a specialized size is an int


def _from_meta(node: fx.Node) -> Any:
    for key in ("val", "example_value"):
        v = node.meta.get(key)
        if v is not None:
            return map_aggregate(
                v, lambda x: TensorInfo.of(x) if isinstance(x, torch.Tensor) else x
            )
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return TensorInfo(tuple(tm.shape), tm.dtype, torch.device("cpu"), bool(tm.requires_grad))
    return None


def info(node: Any) -> Any:
    """The node's :class:`TensorInfo` (or a tuple/list of them for multi-output ops), or None."""
    if not isinstance(node, fx.Node):
        return None
    cached = node.meta.get(_KEY)
    if cached is None:
        cached = _from_meta(node)
        if cached is not None:
            node.meta[_KEY] = cached
    return cached


def set_info(node: fx.Node, value: Any) -> None:
    """Record metadata for a node (tensors are converted to :class:`TensorInfo`)."""
    if type(value) is TensorInfo:  # the common case, and what map_aggregate would return
        node.meta[_KEY] = value
        return
    node.meta[_KEY] = map_aggregate(
        value, lambda x: TensorInfo.of(x) if isinstance(x, torch.Tensor) else x
    )


class _Annotator(fx.Interpreter):
    """Runs the graph once on real example inputs and records each node's TensorInfo."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor) or (
            isinstance(result, (tuple, list))
            and result
            and all(isinstance(r, torch.Tensor) for r in result)
        ):
            set_info(n, result)
        return result


def annotate(gm: fx.GraphModule, *example_inputs: Any) -> None:
    """Fill in metadata by running ``gm`` once without autograd on the example inputs.

    Randomness is isolated (fork_rng) so annotating does not shift the user's RNG stream.
    """
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        _Annotator(gm).run(*example_inputs)


def _fake_arg(mode: Any, x: Any) -> Any:
    if isinstance(x, fx.Node):
        ti = info(x)
        if isinstance(ti, TensorInfo) and ti.static:
            with mode:
                t = torch.empty(ti.shape, dtype=ti.dtype, device=ti.device)
            return t.requires_grad_(ti.requires_grad) if ti.dtype.is_floating_point else t
        raise LookupError(f"no static metadata for {x.name}")
    return x


_FAKE_MODES: weakref.WeakKeyDictionary[fx.Graph, Any] = weakref.WeakKeyDictionary()


def _fake_mode(graph: fx.Graph) -> Any:
    """One fake mode per graph: creating one costs more than most inferences."""
    mode = _FAKE_MODES.get(graph)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = _FAKE_MODES[graph] = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def infer(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Compute metadata for ``node`` from its inputs' metadata on fake tensors.

    Returns False (leaving the node without metadata) when an input lacks it or the op
    cannot run on fake tensors; rules treat such nodes as opaque.
    """
    shaped = _glue_info(node)
    if shaped is not None:
        node.meta[_KEY] = shaped
        return True
    mode = _fake_mode(node.graph)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled = fake_log.disabled
    fake_log.disabled = True  # a failed inference is expected, not an error
    try:
        args = map_aggregate(node.args, lambda x: _fake_arg(mode, x))
        kwargs = map_aggregate(node.kwargs, lambda x: _fake_arg(mode, x))
        with mode:
            if node.op == "call_function":
                out = node.target(*args, **kwargs)
            elif node.op == "call_method":
                self_, *rest = args
                out = getattr(self_, node.target)(*rest, **kwargs)
            elif node.op == "call_module":
                out = gm.get_submodule(node.target)(*args, **kwargs)
            elif node.op == "get_attr":
                out = resolve_attr(gm, node.target)
            else:
                return False
    except Exception as exc:  # any failure leaves the node opaque, by design
        logger.debug("cannot infer metadata for %s: %s", node.name, exc)
        return False
    finally:
        fake_log.disabled = was_disabled
    set_info(node, out)
    return True


# -- glue ops: metadata by shape arithmetic -----------------------------------------------------
# The split that hands a fused result back to its N members, and the cat or stack that gathers
# N inputs, have N inputs or outputs. On fake tensors each costs tens of microseconds per
# member (a fused set has thousands of members on large graphs), while their metadata is plain
# shape arithmetic. Only the exact forms rules build are handled here, with the checks the op
# itself makes; anything else goes through fake tensors.


def _static_info(x: Any) -> TensorInfo | None:
    ti = info(x) if isinstance(x, fx.Node) else None
    return ti if isinstance(ti, TensorInfo) and ti.static else None


def _requires_grad(infos: Sequence[TensorInfo]) -> bool:
    """What autograd (grad mode on) gives the result of a differentiable op on ``infos``."""
    return any(i.requires_grad and i.dtype.is_floating_point for i in infos)


_ACTIVATIONS = {torch.tanh, torch.sigmoid, torch.relu}  # the pointwise rule's fused forms


def _glue_info(node: fx.Node) -> Any:
    """Metadata of a ``torch.split/unbind/cat/stack`` node in a plain form, else None.

    Also the few shape-only ops every fused set adds (an elementwise activation, the
    normalisation before the members' affine, ``addcmul``, ``flatten``/``unflatten``): fake
    tensors cost up to a millisecond each, a large part of a small graph's pass time.
    Only in grad mode: without it, views and copies differ in ``requires_grad``.
    """
    if node.kwargs or not node.args or not torch.is_grad_enabled():
        return None
    if node.op == "call_method":
        if node.target == "flatten":
            return _flatten_info(node.args)
        if node.target == "unflatten":
            return _unflatten_info(node.args)
        return None
    if node.op != "call_function":
        return None
    if node.target in _ACTIVATIONS:
        return _activation_info(node.args)
    if node.target is torch.nn.functional.layer_norm:
        return _layer_norm_info(node.args)
    if node.target is torch.addcmul:
        return _addcmul_info(node.args)
    if node.target is torch.split:
        return _split_info(node.args)
    if node.target is torch.unbind:
        return _unbind_info(node.args)
    if node.target is torch.cat or node.target is torch.stack:
        return _join_info(node.args, node.target is torch.stack)
    return None


def _with_shape(ti: TensorInfo, shape: tuple[Any, ...]) -> TensorInfo:
    """The result of a differentiable op on ``ti`` alone, of the given shape."""
    return TensorInfo(shape, ti.dtype, ti.device, _requires_grad([ti]))


def _at_dim(x: Any, dim: Any) -> tuple[TensorInfo, int] | None:
    """``x``'s static info and ``dim`` made non-negative, if ``dim`` is one of its dims."""
    ti = _static_info(x)
    if ti is None or ti.ndim == 0 or type(dim) is not int or not -ti.ndim <= dim < ti.ndim:
        return None
    return ti, dim % ti.ndim


def _activation_info(args: tuple) -> TensorInfo | None:
    """``tanh/sigmoid/relu(x)`` of a float ``x``: ``x``'s shape."""
    ti = _static_info(args[0]) if len(args) == 1 else None
    if ti is None or not ti.dtype.is_floating_point:
        return None
    return _with_shape(ti, ti.shape)


def _layer_norm_info(args: tuple) -> TensorInfo | None:
    """``layer_norm(x, shape, None, None, eps)`` (no affine) of a float ``x``."""
    if len(args) != 5 or args[2] is not None or args[3] is not None:
        return None  # affine parameters: their dtype and shape would need checking too
    x, ns = args[0], args[1]
    ti = _static_info(x)
    if ti is None or not ti.dtype.is_floating_point or not isinstance(ns, (list, tuple)):
        return None
    if not ns or tuple(ti.shape[-len(ns) :]) != tuple(ns):
        return None
    return _with_shape(ti, ti.shape)


def _addcmul_info(args: tuple) -> TensorInfo | None:
    """``torch.addcmul(a, b, c)`` of one float dtype and device, shapes broadcast."""
    if len(args) != 3:
        return None
    infos = [_static_info(x) for x in args]
    first = infos[0]
    if first is None or not first.dtype.is_floating_point:
        return None
    if any(i is None or i.dtype != first.dtype or i.device != first.device for i in infos):
        return None
    try:
        shape = tuple(torch.broadcast_shapes(*(i.shape for i in infos)))  # type: ignore[union-attr]
    except RuntimeError:
        return None
    return TensorInfo(shape, first.dtype, first.device, _requires_grad(infos))  # type: ignore[arg-type]


def _flatten_info(args: tuple) -> TensorInfo | None:
    """``x.flatten(start, end)`` with both dims given."""
    if len(args) != 3:
        return None
    x, start, end = args
    first, last = _at_dim(x, start), _at_dim(x, end)
    if first is None or last is None or first[1] > last[1]:
        return None
    ti, a, b = first[0], first[1], last[1]
    return _with_shape(ti, (*ti.shape[:a], math.prod(ti.shape[a : b + 1]), *ti.shape[b + 1 :]))


def _int_sizes(sizes: Any, lowest: int) -> bool:
    """A non-empty list or tuple of plain ints, none below ``lowest``."""
    return (
        isinstance(sizes, (list, tuple))
        and bool(sizes)
        and all(type(n) is int and n >= lowest for n in sizes)
    )


def _unflatten_info(args: tuple) -> TensorInfo | None:
    """``x.unflatten(dim, sizes)`` with at most one ``-1`` among the sizes."""
    if len(args) != 3:
        return None
    x, dim, sizes = args
    at = _at_dim(x, dim)
    if at is None or not _int_sizes(sizes, -1) or list(sizes).count(-1) > 1:
        return None
    ti, d = at
    known, total = math.prod(n for n in sizes if n != -1), ti.shape[d]
    if -1 in sizes:
        if known == 0 or total % known:
            return None
        sizes = [total // known if n == -1 else n for n in sizes]
    elif known != total:
        return None
    return _with_shape(ti, (*ti.shape[:d], *sizes, *ti.shape[d + 1 :]))


def _split_info(args: tuple) -> tuple[TensorInfo, ...] | None:
    """``torch.split(x, [sizes], dim)`` with sizes that tile ``x`` along ``dim``."""
    if len(args) != 3:
        return None
    x, sizes, dim = args
    at = _at_dim(x, dim)
    if at is None or not _int_sizes(sizes, 0):
        return None
    ti, d = at
    if sum(sizes) != ti.shape[d]:
        return None
    head, tail = ti.shape[:d], ti.shape[d + 1 :]
    return tuple(_with_shape(ti, (*head, n, *tail)) for n in sizes)


def _unbind_info(args: tuple) -> tuple[TensorInfo, ...] | None:
    """``torch.unbind(x, dim)`` into at least one piece."""
    if len(args) != 2:
        return None
    at = _at_dim(*args)
    if at is None or at[0].shape[at[1]] == 0:
        return None
    ti, d = at
    return (_with_shape(ti, ti.shape[:d] + ti.shape[d + 1 :]),) * ti.shape[d]


def _join_info(args: tuple, stack: bool) -> TensorInfo | None:
    """``torch.cat([xs], dim)`` / ``torch.stack([xs], dim)`` of one dtype and device."""
    if len(args) != 2:
        return None
    xs, dim = args
    if not isinstance(xs, (list, tuple)) or not xs or type(dim) is not int:
        return None
    infos = [_static_info(x) for x in xs]
    first = infos[0]
    if first is None or any(
        i is None or i.dtype != first.dtype or i.device != first.device for i in infos
    ):
        return None
    nd = first.ndim
    rg = _requires_grad(infos)  # type: ignore[arg-type]
    if stack:
        if not -(nd + 1) <= dim <= nd or any(i.shape != first.shape for i in infos):  # type: ignore[union-attr]
            return None
        d = dim % (nd + 1)
        shape = (*first.shape[:d], len(infos), *first.shape[d:])
        return TensorInfo(shape, first.dtype, first.device, rg)
    if nd == 0 or not -nd <= dim < nd:
        return None
    d = dim % nd
    rest = first.shape[:d] + first.shape[d + 1 :]
    if any(i.ndim != nd or i.shape[:d] + i.shape[d + 1 :] != rest for i in infos):  # type: ignore[union-attr]
        return None
    total = sum(i.shape[d] for i in infos)  # type: ignore[union-attr]
    return TensorInfo(
        (*first.shape[:d], total, *first.shape[d + 1 :]), first.dtype, first.device, rg
    )


def resolve_attr(root: Any, target: str) -> Any:
    """What the qualified attribute name ``target`` (``"a.b.weight"``) names on ``root``;
    AttributeError if nothing does."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_SEQ = "fxrec_seq"


def stamp_program_order(graph: fx.Graph) -> None:
    """Remember each node's position in the captured program.

    Rewrites move nodes (a fused node goes before its last member, a toposort follows), so
    the graph's order stops being the order the model was written in. Rules that are free to
    choose the order of stacked members use this one: the model's own consumers (a ``cat``
    of every feature, in feature order) then read the fused result's pieces in order.
    """
    for i, n in enumerate(graph.nodes):
        n.meta.setdefault(_SEQ, i)


def program_order(node: fx.Node) -> int:
    """The node's position in the captured program (nodes made by rules sort last)."""
    return node.meta.get(_SEQ, 1 << 62)
