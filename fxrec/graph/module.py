"""``fxrec.optimize``: a drop-in replacement module that runs the optimized graph.

The returned :class:`OptimizedModule` captures lazily, on the first call in each mode
(train/eval) and input signature, because both change the graph: symbolic tracing bakes in
``self.training``, and the cost model's choices depend on shapes (the best lowering of the
seed pattern differs between batch 32 and 2048). Captures are cached; parameters are laid
out by the first graph and shared by every graph built later, which reaches members it did not
fuse through the flat tensors (see :meth:`fxrec.graph.params.ParamStore.rebind`).

State stays the user's: ``state_dict()`` and ``load_state_dict`` are the original model's,
and fused parameters share storage with the original ones (see :mod:`fxrec.graph.params`).
Build the optimizer on ``optimized.parameters()`` after calling ``optimize``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import logging
import operator
import sys
import threading
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from fxrec.compiling import is_compiling, is_exporting
from fxrec.graph import meta
from fxrec.graph.capture import CaptureError, capture_lock, capture_symbolic
from fxrec.graph.effects import comm_kind, has_hooks
from fxrec.graph.optim_state import track
from fxrec.graph.optimize_graph import RuleSpec, optimize_graph, resolve_rules, strict_mode
from fxrec.graph.params import (
    FusedParameters,
    ParamStore,
    laid_out,
    note_graph_writes,
    note_written,
    seen_written,
)
from fxrec.graph.report import Report

logger = logging.getLogger(__name__)

__all__ = ["OptimizedModule", "optimize"]

MAX_CACHED_SIGNATURES = 8
# Signatures past the cache remember which shared runner serves them (the capture with
# symbolic sizes, a graph of their structure, the model run eagerly): nothing is built for
# them, and a serving loop over many batch sizes skips the build path on every call.
MAX_SPILLED_SIGNATURES = 1024

# How many parameters and submodules any module registered (``module.weight =
# nn.Parameter(...)``, ``model.act = nn.GELU()``, ``seq.append(m)``): a change tells an
# optimized module to look whether its model's parameters or submodules were replaced.
_registered = [0]
_registration_hooks: Any = None
# The modules of optimized models: only registrations on them count. A ModuleList sliced in
# forward (``self.towers[1:]``) registers into a new container on every call, which no
# optimized model holds.
_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class _OwnCalls(threading.local):
    """How deep this thread is in optimized modules' own calls (and ``optimize``'s build).

    A forward that assigns a module on itself (``self.head = nn.Identity()``) registers on
    every run; the runs fxrec makes (traces, checks, the model run eagerly) and the user's
    calls are the model's own behaviour, not an edit, and must not make the next call
    rebuild. Other threads' registrations still count."""

    depth = 0


_own_calls = _OwnCalls()


@contextlib.contextmanager
def _own_call() -> Iterator[None]:
    _own_calls.depth += 1
    try:
        yield
    finally:
        _own_calls.depth -= 1


def _count_registrations() -> int:
    global _registration_hooks
    if _registration_hooks is None:

        def count(module: nn.Module, name: str, value: Any) -> None:
            # Not while dynamo or export traces: a traced registration (that slice) must not
            # change Python state, which a checkpointed region refuses.
            # (is_compiling first: dynamo folds it and never reads, nor guards on, the rest)
            if not is_compiling() and not _own_calls.depth and module in _watched:
                _registered[0] += 1

        _registration_hooks = (
            nn.modules.module.register_module_parameter_registration_hook(count),
            nn.modules.module.register_module_module_registration_hook(count),
        )
    return _registered[0]


def _signature(x: Any) -> Any:
    """A hashable description of the inputs: dense shapes exactly, sparse inputs by keys and
    rows per key.

    Sparse values change length every batch; rules never depend on that length, so it stays
    out. Rows per key do not: rules bake sizes derived from them into graphs (the pieces of a
    KJT's lengths, one per key, split or stacked with fixed sizes), so a KJT's stride or
    per-key strides, a TensorDict's batch size (or each jagged entry's rows when it has none)
    and combined features' per-key strides key graphs too, read from host metadata.
    """
    if type(x) is tuple:  # the arguments (every call), and tuples inside them
        return ("tuple", *map(_signature, x))
    if type(x) is torch.Tensor:  # a plain tensor's sizes are ints: its Size as it is (fast)
        return ("T", x.shape, x.dtype, x.device, x.requires_grad)
    if type(x) is _NJT:  # a jagged nested tensor: its rows (its ids' count stays out)
        return ("NJT", (_ROWS, _host_int(x._offsets.shape[0] - 1)), x.dtype, x.device)
    if isinstance(x, torch.Tensor):  # a symbolic size (export, dynamo) keys as "s"
        shape = tuple(d if isinstance(d, int) else "s" for d in x.shape)
        return ("T", shape, x.dtype, x.device, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_signature(i) for i in x))
    if type(x) is dict:
        return ("D", *((k, _signature(v)) for k, v in x.items()))
    kind = _INPUT_KINDS.get(type(x))
    if kind is None:
        kind = _INPUT_KINDS[type(x)] = _input_kind(type(x))
    return kind(x)


# Rows per key of a sparse input: ``(_ROWS, rows)`` in a signature, kept by ``_structure``.
_ROWS: Any = type("_Rows", (), {"__repr__": lambda self: "rows"})()
_NJT = torch.nested._internal.nested_tensor.NestedTensor  # a jagged nested tensor's type
_JAGGED = frozenset({_NJT})
# How each input type past tensors, sequences and dicts is described (found once per type).
_INPUT_KINDS: dict[type, Any] = {}


def _input_kind(cls: type) -> Any:
    """The function describing inputs of type ``cls`` (sparse types by duck typing: fxrec's
    and TorchRec's KJT, JaggedTensor and KeyedTensor alike)."""
    td = sys.modules.get("tensordict")
    if td is not None and issubclass(cls, td.TensorDictBase):
        return _tensordict_signature
    combine = sys.modules.get("fxrec.sparse.combine")
    if combine is not None and issubclass(cls, combine.CombinedFeatures):
        return _combined_signature
    if issubclass(cls, Mapping):
        return _mapping_signature
    if all(callable(getattr(cls, a, None)) for a in ("keys", "stride_per_key", "stride")):
        return _kjt_signature
    if all(callable(getattr(cls, a, None)) for a in ("keys", "key_dim", "values")):
        return _keyed_tensor_signature
    if all(callable(getattr(cls, a, None)) for a in ("lengths_or_none", "offsets_or_none")):
        return _jagged_signature
    if dataclasses.is_dataclass(cls):  # a batch type (TorchRec's Batch): its fields
        names = tuple(f.name for f in dataclasses.fields(cls))
        return functools.partial(_fields_signature, names)
    if cls in pytree.SUPPORTED_NODES:  # a container registered with pytree: its children
        return functools.partial(_children_signature, pytree.SUPPORTED_NODES[cls].flatten_fn)
    if callable(getattr(cls, "keys", None)):
        return _keyed_signature
    if issubclass(cls, (int, float, str, bool, type(None))):
        return _value_signature
    if issubclass(cls, (nn.Module, types.FunctionType, types.MethodType, type)):
        return _type_signature  # (a callable passed in: no tensors of the batch's)
    return _object_signature


def _host_int(n: Any) -> Any:
    return n if type(n) is int else "s"  # symbolic (export): keys as "s", as tensor sizes do


def _kjt_signature(x: Any) -> Any:
    variable = getattr(x, "variable_stride_per_key", None)
    if callable(variable) and variable():
        rows: Any = tuple(map(_host_int, x.stride_per_key()))  # host ints, cached by the KJT
    else:
        rows = _host_int(x.stride())
    return (type(x).__name__, tuple(x.keys()), (_ROWS, rows))


def _tensordict_signature(x: Any) -> Any:
    store = getattr(x, "_tensordict", None)  # the plain dict behind a TensorDict
    batch = x.batch_size
    if len(batch):  # every entry has these leading rows (per-sample stacks: no entry read)
        rows = (_ROWS, tuple(map(_host_int, batch)))
        if type(store) is not dict:
            return (type(x).__name__, tuple(x.keys()), rows)
        # Dense entries past the batch dims (ids of a fixed length L per sample), as dense
        # inputs are: rules bake them. Jagged entries by their rows, already in ``rows``.
        if set(map(type, store.values())) <= _JAGGED:  # (the usual case, tested at C speed)
            return (type(x).__name__, tuple(store), rows)
        dense = [_entry_signature(v, len(batch)) for v in store.values() if type(v) is not _NJT]
        return (type(x).__name__, tuple(store), rows, *dense)
    if type(store) is not dict:
        store = dict(x.items())
    rows = []
    for v in store.values():  # jagged entries by their rows (the ids' count, ragged, stays out)
        if type(v) is not _NJT:  # weighted features, dense entries: each described on its own
            return (type(x).__name__, tuple(store), tuple(map(_signature, store.values())))
        rows.append(_host_int(v._offsets.shape[0] - 1))
    # one rows tuple, as a TensorDict with a batch size has: they differ by rows alone
    return (type(x).__name__, tuple(store), (_ROWS, tuple(rows)))


def _entry_signature(v: Any, batch_dims: int) -> Any:
    """A TensorDict entry other than a jagged one, its batch dims left out (its TensorDict's
    rows describe them)."""
    if type(v) is torch.Tensor:
        return ("T", v.shape[batch_dims:], v.dtype, v.device, v.requires_grad)
    return _signature(v)


def _combined_signature(x: Any) -> Any:
    return (type(x).__name__, x.keys, x.weights is None, (_ROWS, x.stride_per_key))


def _jagged_signature(x: Any) -> Any:
    lengths = x.lengths_or_none()
    rows = lengths.shape[0] if lengths is not None else max(x.offsets_or_none().shape[0] - 1, 0)
    return (type(x).__name__, (_ROWS, _host_int(rows)))


def _keyed_tensor_signature(x: Any) -> Any:
    return (type(x).__name__, tuple(x.keys()), _signature(x.values()))


def _mapping_signature(x: Any) -> Any:
    return (type(x).__name__, *((k, _signature(v)) for k, v in x.items()))


def _fields_signature(names: tuple[str, ...], x: Any) -> Any:
    return (type(x).__name__, *((n, _signature(getattr(x, n))) for n in names))


def _children_signature(flatten: Any, x: Any) -> Any:
    return (type(x).__name__, *map(_signature, flatten(x)[0]))


def _keyed_signature(x: Any) -> Any:
    try:
        return (type(x).__name__, tuple(x.keys()))
    except Exception:  # an object with an unusual keys(): type alone is enough
        return (type(x).__name__,)


def _value_signature(x: Any) -> Any:
    return ("V", x)


def _type_signature(x: Any) -> Any:
    return (type(x).__name__,)


def _object_signature(x: Any) -> Any:
    """Any other object by its attributes: a batch class of the user's (``batch.ids``, read
    by the trace) is described by the tensors it holds, as a dataclass is by its fields.
    Python scalars by their type: the trace reads them at run time, and a per-batch counter
    or name would otherwise make every batch a new signature."""
    attrs = getattr(x, "__dict__", None)
    if type(attrs) is not dict:  # (``__slots__``, or a proxy of some kind): its type alone
        return (type(x).__name__,)
    try:
        return (type(x).__name__, *((k, _attribute_signature(v)) for k, v in attrs.items()))
    except RecursionError:  # an object reachable from its own attributes
        return (type(x).__name__,)


def _attribute_signature(v: Any) -> Any:
    return type(v).__name__ if type(v) in _SCALARS else _signature(v)


_SCALARS = (int, float, str, bool, type(None))


@functools.lru_cache(maxsize=8 * MAX_CACHED_SIGNATURES)  # new signatures compare the cache's
def _structure(x: Any, rows: bool = True) -> Any:
    """``_signature`` without the batch: what a graph depends on beyond the cost model's
    choices.

    Rules bake no dense input's dim 0 (the batch) into a graph: they flatten and unflatten
    it as ``-1`` or read it at run time. Every other dim may be baked (a sequence's length
    unflattened back, a bag's number of ids, a piece's width), so a graph built for one
    signature runs any other that differs in dense inputs' dim 0 alone, only perhaps less
    well. Sparse inputs' rows per key are baked too, and stay (unless ``rows`` is false).
    """
    return _without_batch(x, rows)


def _batch_scale(key: Any) -> int:
    """The power of two of a signature's batch: its first dense input's dim 0 (0 without one)."""
    work = [key]
    while work:
        x = work.pop()
        if isinstance(x, tuple):
            if x and x[0] == "T" and isinstance(x[1], tuple):
                return x[1][0].bit_length() if x[1] and isinstance(x[1][0], int) else 0
            work.extend(reversed(x))
    return 0


def _without_batch(x: Any, rows: bool) -> Any:
    if isinstance(x, tuple):
        if x and x[0] == "T" and isinstance(x[1], tuple):  # (not a KJT's keys, "T" first)
            return ("T", len(x[1]), tuple(x[1][1:]), *x[2:])
        if x and x[0] is _ROWS:
            return x if rows else _ROWS
        return tuple(_without_batch(i, rows) for i in x)
    return x


# What an optimized module keeps for itself among public names set on it; others are the
# model's (see ``OptimizedModule.__setattr__``).
_OWN_NAMES = frozenset({"training", "model", "fxrec_fused", "fxrec_report"})
_MISSING = object()


def _same_value(old: Any, new: Any) -> bool:
    """Is ``new`` the value ``old`` was (the object, or an equal number or string)?"""
    if old is new:
        return True
    plain = (bool, int, float, str)
    return type(old) is type(new) and isinstance(new, plain) and old == new


class OptimizedModule(nn.Module):
    """Runs ``model`` through fxrec-optimized graphs; same signature, outputs and gradients."""

    def __init__(
        self,
        model: nn.Module,
        rules: RuleSpec = None,
        *,
        keep_params: bool = False,
        check: bool = True,
        backend: Any = "eager",
        guards: bool = False,
    ) -> None:
        super().__init__()
        from fxrec.compile.backend import inner_backend

        inner_backend(backend)  # an unknown name fails here, not at the first step
        self.model = model
        self._backend = backend
        self.fxrec_fused = FusedParameters()
        self._rules = resolve_rules(rules)
        self._keep_params = keep_params
        self._check = check
        self._guards = guards
        self._traced: dict[Any, fx.GraphModule | None] = {}
        self._runners: dict[Any, Any] = {}
        self._communicates: set[Any] = set()
        self._overflow: dict[Any, Any] = {}  # mode -> the capture past the signature cache
        self._spilled: dict[Any, Any] = {}  # signatures past the cache -> their shared runner
        # graphs built past the cache, by structure and batch scale (see _batch_scale)
        self._spilled_graphs: dict[Any, Any] = {}
        self._dynamo_backend: Any = None
        self._assigned: set[str] = set()  # buffers forward reassigns: dynamo reads them per call
        self._follow_modules(list(model.modules()))
        self._registrations_seen = _count_registrations()
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._slots_stamp: Any = None  # the registration count and flat parameters' number
        self._slots_flats = -1  # when ``_slots`` were listed (see ``_params_swapped``)
        self._hooks_seen = -1  # RemovableHandle.next_id when submodules were last looked at
        self._hooked_modules: list[tuple[int, nn.Module]] = []
        self._global_ids: tuple = ()  # the global module hooks' ids, when there are some
        self._hook_tables: list[dict] = []  # hook tables looked at, and their sizes then
        self._hook_sizes: list[int] = []
        self._params_swapped()  # the tensors calls expect, taken before any call swaps them
        self.fxrec_report = Report()
        self.train(model.training)
        self._register_load_state_dict_pre_hook(_keys_under_model, with_module=True)
        self.register_load_state_dict_post_hook(_missing_keys_as_saved)

    # -- running -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if is_exporting():
            if self.fxrec_fused.member_ids():
                raise RuntimeError(
                    "fxrec: torch.export.export cannot export an optimized module whose "
                    "parameters are laid out (it lists both the members and the flat "
                    "parameters); export it with fxrec.export(opt, args, dynamic_shapes=...), "
                    "which takes the same arguments as torch.export.export."
                )
            return self._run(args, kwargs)  # traced: no registration counts (see count())
        if is_compiling():
            return self._opaque_call(args, kwargs)
        if _fx_trace._is_fx_tracing_flag or _jit_tracing():  # two reads: ~0.1 us a call
            _refuse_tracers(args, kwargs)
        return self._call(args, kwargs)

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` calls this first (on every submodule of a scripted model)."""
        raise RuntimeError(
            "fxrec: torch.jit.script cannot script an optimized module: its graphs are "
            f"built per input signature and cached at call time. {_PORTABLE}"
        )

    @torch.compiler.disable
    def _opaque_call(self, args: tuple, kwargs: dict) -> Any:
        """A call under an outer ``torch.compile`` (``torch.compile(fxrec.optimize(m))``):
        one graph break, instead of dynamo tracing the per-call bookkeeping (which breaks
        its graph on every identity check) and inlining the model's forward on parameters
        fxrec laid out."""
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        own = _own_calls  # registrations made while this call runs are no edits
        own.depth += 1
        try:
            return self._run(args, kwargs)
        finally:
            own.depth -= 1

    def _run(self, args: tuple, kwargs: dict) -> Any:
        # read from ``_modules`` directly: ``self.fxrec_fused`` goes through two
        # ``__getattr__``s, about 1 us a read on every call
        fused = self._modules["fxrec_fused"]
        if self._params_swapped() or _transformed():
            # torch.func (functional_call, vmap, grad): the tensors given, run eagerly; no
            # graph is built or checked for them (a check cannot run under vmap).
            fused.sync_requires_grad()
            return _EagerRunner(self.model, fused, swapped=True)(*args, **kwargs)
        runner, args, kwargs = self._runner(args, kwargs)
        fused.sync_requires_grad()
        try:
            out = runner(*args, **kwargs)
        except Exception as exc:
            # dynamo reports bad inputs as its own errors: the model's own is clearer. Not
            # once the graphs communicate: running the model again would run its collectives
            # on this rank alone, which its peers never join.
            if isinstance(runner, _DynamoRunner) and not runner.communicates:
                _raise_if_model_fails(self.model, args, kwargs, cause=exc)
            raise
        if not fused.frozen:
            fused.freeze()  # the first call's layouts are the ones the optimizer holds
        return out

    def _runner(self, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        """What runs these arguments (built on first sight), and the arguments as bound."""
        if kwargs:
            args, kwargs = self._bind(args, kwargs)
        if _registered[0] != self._registrations_seen:
            with capture_lock:  # not while another thread builds a graph of the old model
                self._check_registrations()
        key = self._key(args, kwargs)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._spilled.get(key)
            if runner is None:
                # Members and flat tensors agree before a graph is built and checked (one of
                # them given new data since the last call: an EMA swapped in with `.data =`).
                self._modules["fxrec_fused"].sync_requires_grad()
                runner = self._build(key, args, kwargs)
        return runner, args, kwargs

    def _params_swapped(self) -> bool:
        """Are parameters given other tensors for this call only? ``torch.func.functional_call``
        writes them into the modules' ``_parameters`` (no registration), while graphs hold the
        tensors they were built with; the model run eagerly reads them (per-sample gradients,
        meta-learning). Rechecked on every call: about 50 ns a parameter."""
        flats = self._modules["fxrec_fused"]._parameters
        if self._slots_stamp != _registered[0] or self._slots_flats != len(flats):
            self._slots_stamp, self._slots_flats = _registered[0], len(flats)
            slots = [
                (m._parameters, n, p)
                for m in (*self.model.modules(), self.fxrec_fused)
                for n, p in m._parameters.items()
            ]
            self._slots = [list(column) for column in zip(*slots)] or [[], [], []]
        tables, names, params = self._slots
        return any(map(operator.is_not, map(dict.get, tables, names), params))

    def _check_registrations(self) -> None:
        """Something registered a parameter or a submodule: if it was the model's, rebuild."""
        self._check_params()
        self._check_modules()
        self._registrations_seen = _registered[0]

    def _check_params(self) -> None:
        """Graphs bake the model's parameter objects in: rebuild them after one was replaced
        (``model.fc.weight = nn.Parameter(w)``); a laid-out member replaced cannot be (its
        values live in the flat parameter the optimizer holds), so that raises. A member
        still in the model under another name (two towers swapped) is no replacement."""
        now = dict(self.model.named_parameters(remove_duplicate=False))
        changed = [n for n in {*now, *self._params} if now.get(n) is not self._params.get(n)]
        if not changed:
            return
        members = self.fxrec_fused.member_ids()
        present = set(map(id, now.values()))
        for name in sorted(changed):
            if id(self._params.get(name)) in members:
                self._check_replaced_member(name, moved=id(self._params[name]) in present)
        logger.info("fxrec: parameters %s were replaced; rebuilding graphs", changed[:3])
        self._forget_graphs()
        self._params = now

    def _check_replaced_member(self, name: str, moved: bool) -> None:
        """Raise for laid-out parameter ``name`` no longer at its name (replaced, or its
        module replaced or removed), saying what to do instead; ``moved``: still in the model
        under another name, which graphs rebuilt on the flat parameters follow, unless it was
        reparametrized."""
        owner_name, _, leaf = name.rpartition(".")
        try:
            owner = self.model.get_submodule(owner_name)
        except AttributeError:
            owner = None
        if owner is not None and (
            f"{leaf}_orig" in owner._parameters or hasattr(owner, "parametrizations")
        ):
            raise RuntimeError(
                f"fxrec: parameter {name!r} was reparametrized after fxrec.optimize (pruning, "
                "weight_norm, parametrize), but its values live in a flat parameter "
                "(fxrec_fused.*) that the optimizer holds. Apply it to the model first, then "
                "call fxrec.optimize."
            )
        if moved:
            return
        replaced = self._new_module_on(owner_name)
        if replaced is not None:
            module = f"module {replaced!r}" if replaced else "the model"
            raise RuntimeError(
                f"fxrec: {module}, which holds the laid-out parameter {name!r}, was "
                "replaced or removed after fxrec.optimize, but that parameter's values live in "
                "a flat parameter (fxrec_fused.*) that the optimizer holds. Load new values "
                "into the old module in place (`old.load_state_dict(new.state_dict())`), or "
                "optimize the changed model again (and build a new optimizer)."
            )
        raise RuntimeError(
            f"fxrec: parameter {name!r} was replaced after fxrec.optimize, but its values live "
            "in a flat parameter (fxrec_fused.*) that the optimizer holds. Copy new values "
            "into it in place (`with torch.no_grad(): param.copy_(new)`; load state dicts "
            "into the model without assign=True), or optimize the changed model again (and "
            "build a new optimizer)."
        )

    def _new_module_on(self, path: str) -> str | None:
        """The outermost module on ``path`` that is not one the model had when its graphs
        were built (replaced, or gone), or None."""
        known = set(map(id, self._submodules))
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            prefix = ".".join(parts[:i])
            try:
                module = self.model.get_submodule(prefix)
            except AttributeError:
                return prefix
            if id(module) not in known:
                return prefix
        return None

    def _check_modules(self) -> None:
        """Graphs call the submodules they were built with, and ``_mode`` reads the flags and
        hooks of those: after one was replaced or added (``model.act = nn.GELU()``,
        ``seq.append(m)``), follow the model's modules and rebuild."""
        now = list(self.model.modules())
        old = self._submodules
        if len(now) == len(old) and all(map(operator.is_, now, old)):
            return
        logger.info("fxrec: submodules of the model were replaced or added; rebuilding graphs")
        self._forget_graphs()
        self._follow_modules(now)
        self._hooks_seen = -1  # hooks looked for again, on the new modules
        self._hooked_modules, self._hook_tables, self._hook_sizes = [], [], []
        # (the parameter tables ``_params_swapped`` checks follow the registration count)

    def _follow_modules(self, modules: list[nn.Module]) -> None:
        """The submodules whose flags and hooks ``_mode`` reads on every call, and where it
        reads their flags: each module's ``__dict__`` (an item read costs half an attribute
        read), or the modules themselves where one keeps ``training`` elsewhere."""
        self._submodules = modules
        _watched.update(modules)
        dicts = [m.__dict__ for m in modules]
        if all("training" in d for d in dicts):
            self._flags_at, self._read_flag = dicts, _TRAINING_ITEM
        else:
            self._flags_at, self._read_flag = modules, _TRAINING

    def _forget_graphs(self) -> None:
        """Drop every graph: they hold the model's modules and tensors as they were."""
        self._runners.clear()
        self._overflow.clear()
        self._spilled.clear()
        self._spilled_graphs.clear()
        self._traced.clear()

    def _key(self, args: tuple, kwargs: dict) -> Any:
        return (
            self._mode(),
            _signature(args),
            _signature(kwargs) if kwargs else None,
            _autocast_state(),
            torch.is_grad_enabled(),
        )

    def _bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments as ``forward`` declares them: positional ones by position, defaults
        filled in; keyword-only ones (and ``**kwargs``) stay keywords."""
        sig = inspect.signature(self.model.forward)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            name = f"{type(self.model).__name__}.forward()"
            params = sig.parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                unknown = [k for k in kwargs if k not in params]
                if unknown:
                    raise TypeError(
                        f"{name} got an unexpected keyword argument {unknown[0]!r}"
                    ) from None
            raise TypeError(f"{name}: {exc}") from None
        bound.apply_defaults()
        return bound.args, bound.kwargs

    def _mode(self) -> Any:
        """``self.training``, or every submodule's flag and hooks when the flags differ (a
        BatchNorm put in eval mode alone) or a module has hooks: graphs bake the flags in, and
        the hooks decide how the model is captured, so each mix gets graphs of its own.

        Runs on every call: submodules are looked at for hooks only after a hook was
        registered (or a hook table of a hooked module changed size: one removed)."""
        t = self.training
        if (
            RemovableHandle.next_id != self._hooks_seen
            or list(map(len, self._hook_tables)) != self._hook_sizes
        ):
            self._find_hooks()
        flags = map(self._read_flag, self._flags_at)
        hooked = self._hooked_modules or self._global_ids
        if not hooked and (all(flags) if t is True else not any(flags)):
            return t
        return (
            tuple(map(self._read_flag, self._flags_at)),
            tuple(_hook_ids(i, m) for i, m in self._hooked_modules),
            self._global_ids,
        )

    def _find_hooks(self) -> None:
        self._hooks_seen = RemovableHandle.next_id
        self._hooked_modules = [(i, m) for i, m in enumerate(self._submodules) if has_hooks(m)]
        tables = _global_hooks()
        self._global_ids = tuple(tuple(t) for t in tables) if any(tables) else ()
        # Only tables holding hooks: an empty one grows by registering, which makes a handle
        # (``next_id``); a hook removed shrinks its table and makes none.
        self._hook_tables = [
            t for t in [getattr(m, a) for _, m in self._hooked_modules for a in _MODULE_HOOKS]
            + tables if t
        ]  # fmt: skip
        self._hook_sizes = list(map(len, self._hook_tables))

    def _owner(self) -> FusedParameters | None:
        return None if self._keep_params else self.fxrec_fused

    @torch.compiler.disable  # built and checked as eager code under an outer torch.compile
    def _build(self, key: Any, args: tuple, kwargs: dict, example: bool = False) -> Any:
        """The runner for ``key``; ``example``: built by ``optimize`` on its example inputs.

        Under ``capture_lock``: serving threads making their first calls at once would each
        trace (fx patches ``nn.Module.__call__`` process-wide, and overlapping traces leave
        their patches installed). The first builds; the others wait, then take its runner.
        Calls that find a runner (every later one) take no lock.
        """
        with capture_lock:
            runner = self._runners.get(key)
            if runner is None:
                runner = self._build_locked(key, args, kwargs, example)
                if key not in self._runners and not is_exporting():
                    if len(self._spilled) >= MAX_SPILLED_SIGNATURES:
                        del self._spilled[next(iter(self._spilled))]
                    self._spilled[key] = runner
            return runner

    def _build_locked(self, key: Any, args: tuple, kwargs: dict, example: bool) -> Any:
        mode = key[0]
        loose = [
            k
            for k in self._runners
            if k[0] == mode
            and _structure(k) == _structure(key)
            and not isinstance(self._runners[k], _DynamoRunner)  # its direct call is one shape's
        ]
        if any(_global_hooks()):
            # Global module hooks (register_module_forward_hook...) run on every module call:
            # a fused call would skip them. The model runs as written, through the flat
            # parameters, while there are some.
            note = "global module hooks: calls run the model eagerly while they are registered"
            if note not in self.fxrec_report.notes:
                self.fxrec_report.note(note)
            runner = _EagerRunner(self.model, self.fxrec_fused)
            if len(self._runners) < MAX_CACHED_SIGNATURES:
                self._runners[key] = runner
            return runner
        exporting = is_exporting()
        full = len(self._runners) >= MAX_CACHED_SIGNATURES
        forced = exporting or mode in self._communicates
        # The cost model's choices hold near the batch they were made for: a graph fused for
        # batch 13 runs batch 4096 slower than the model. Past the cache, a graph serves the
        # batches within its power of two; forced reuse takes the nearest.
        scale = _batch_scale(key)
        loose.sort(key=lambda k: abs(_batch_scale(k) - scale))
        if not forced:
            loose = [k for k in loose if _batch_scale(k) == scale]
        shared = self._runners[loose[0]] if loose else None
        if shared is None and (forced or full):  # one built past the cache, for other sizes
            shared = self._spilled_graph(key, nearest=forced)
        if shared is not None and (forced or full):
            # A graph of the same structure runs these inputs too. Reused when the cache is
            # full (once it gave the model's outputs on them), and always when the graph
            # communicates: building runs the graph, whose collectives would then run on
            # this rank only (other ranks' batch sizes differ). And while exporting: the
            # inputs are fake, with symbolic sizes no rule fuses.
            runner = shared
            if forced or self._serves(runner, args, kwargs):
                if len(self._runners) < MAX_CACHED_SIGNATURES:
                    self._runners[key] = runner
                return runner
            full = False  # a graph of its own, not eager
        if mode in self._communicates and any(k[0] == mode for k in self._runners):
            # Inputs of a new structure (a KJT's keys in another order) on a model whose
            # graphs communicate, maybe on this rank alone: building would run a new graph's
            # collectives here only. The model runs eagerly for them: the same collectives,
            # in the same order as the other ranks' graphs.
            self.fxrec_report.note(
                "inputs of a new structure (other keys, or other rows per key of a sparse input: "
                "a new batch size) on a model whose graphs communicate run the model eagerly "
                "(building a graph would run collectives on this rank alone)"
            )
            runner = _EagerRunner(self.model, self.fxrec_fused)
            if len(self._runners) < MAX_CACHED_SIGNATURES:
                self._runners[key] = runner
            return runner
        rows_free = _structure(key, False) if full else None
        if full and any(
            k[0] == mode
            and not isinstance(r, _DynamoRunner)  # (dynamo captures: the overflow capture)
            and _structure(k, False) == rows_free
            and _structure(k) != _structure(key)  # (the same: a batch of another scale)
            for k, r in self._runners.items()
        ):
            # New rows per key of a sparse input past the cache (a variable batch per key, new
            # on most batches): graphs bake rows in, so none of the cached ones runs them, and
            # a build (or a dynamo compile) per batch would cost more than it saves.
            note = (
                f"more than {MAX_CACHED_SIGNATURES} sets of rows per key of a sparse input: "
                "the others run the model eagerly, through the flat parameters"
            )
            if note not in self.fxrec_report.notes:
                logger.info("fxrec: %s", note)
                self.fxrec_report.note(note)
            return _EagerRunner(self.model, self.fxrec_fused)
        # A trace follows the grad mode and autocast regions it ran in: a `with no_grad()`
        # block, or a branch on `torch.is_grad_enabled()`, leaves nothing in a trace made
        # where it changes nothing. So each mix has its own trace, as it has its own graphs.
        modes = (mode, key[3], key[4])
        if modes not in self._traced:
            try:
                self._traced[modes] = capture_symbolic(self.model)
            except CaptureError as exc:
                logger.info("fxrec: %s; capturing with dynamo instead", exc)
                self.fxrec_report.notes.append(str(exc)[:200])
                self._assigned.update(exc.assigned)
                self._traced[modes] = None
        traced = self._traced[modes]
        runner = None
        if traced is not None:
            try:
                runner = self._optimize_traced(traced, mode, args, kwargs)
            except _TraceDoesNotRun as exc:
                note = f"symbolic trace unfit for these inputs ({exc}); dynamo captures them"
                logger.info("fxrec: %s", note)
                self.fxrec_report.note(note)
        if runner is None and len(self._runners) >= MAX_CACHED_SIGNATURES:
            return self._overflow_runner(mode)  # not cached by key: it serves them all
        if runner is None:
            runner = self._checked(self._dynamo_runner(), args, kwargs, example)
        if len(self._runners) >= MAX_CACHED_SIGNATURES:
            # Past the cache: kept with the signatures past it (``_build`` spills it), and
            # found by its structure for other batch sizes. Not in place of a cached one:
            # more structures than the cache holds, taking turns, would each be rebuilt.
            if len(self._spilled_graphs) >= MAX_SPILLED_SIGNATURES:
                del self._spilled_graphs[next(iter(self._spilled_graphs))]
            self._spilled_graphs[(_structure(key), _batch_scale(key))] = runner
            return runner
        self._runners[key] = runner
        return runner

    def _spilled_graph(self, key: Any, nearest: bool) -> Any:
        """A graph built past the cache for ``key``'s structure and batch scale; with
        ``nearest``, for the nearest scale built. None if there is none."""
        structure, scale = _structure(key), _batch_scale(key)
        found = self._spilled_graphs.get((structure, scale))
        if found is None and nearest:
            scales = [s for (st, s) in self._spilled_graphs if st == structure]
            if scales:
                found = self._spilled_graphs[(structure, min(scales, key=lambda s: abs(s - scale)))]
        return found

    def _serves(self, runner: Any, args: tuple, kwargs: dict) -> bool:
        """Does ``runner``, built for another batch size, give the model's outputs on these
        inputs? Rules bake no dense input's dim 0 (see ``_structure``), but a model may
        read another dim as its batch (a sequence-first ``(L, B)`` tensor, transposed):
        the graph built for one length would pool the wrong rows of another. So a graph
        serves a new batch size past the cache once it is checked on its first inputs, as
        each graph built is (with ``check=False``, or fake inputs, unchecked). The check's
        runs are fxrec's own: dispatch modes around the call (``count_kernels``, a tracer)
        do not see them."""
        from torch.utils._python_dispatch import _disable_current_modes

        if not self._check or _fake(args, kwargs) or isinstance(runner, (_EagerRunner, _Unfused)):
            return True  # (the model itself, or its trace: no size baked)
        with _hooks_silenced(self.model), _disable_current_modes():
            try:
                with _preserved_state(self.model, (args, kwargs)), torch.no_grad():
                    reference = self.model(*args, **kwargs)
                grad = torch.is_grad_enabled()  # a compiled graph compiles for this mode
                same = _same_outputs(self.model, runner, args, reference, grad, kwargs)
            except Exception as exc:  # a size it baked does not fit: build one for them
                logger.debug("fxrec: a graph of another batch size raised: %s", exc)
                same = False
        if not same:
            note = (
                "a graph built for another batch size disagrees with the model on new sizes "
                "past the cache (a dim other than the first is the batch?): they get graphs "
                "of their own"
            )
            if note not in self.fxrec_report.notes:
                logger.info("fxrec: %s", note)
                self.fxrec_report.note(note)
        return same

    def _overflow_runner(self, mode: Any) -> Any:
        """One dynamo capture with symbolic sizes for the signatures past the cache (more
        batch sizes than it holds): a capture per signature would recompile on every call
        once they take turns. Rules leave symbolic sizes alone, so those calls fuse less."""
        runner = self._overflow.get(mode)
        if runner is None:
            runner = self._overflow[mode] = self._dynamo_runner(dynamic=True)
            self.fxrec_report.note(
                f"more than {MAX_CACHED_SIGNATURES} input signatures: the others share one "
                "capture with symbolic sizes"
            )
        return runner

    def _checked(self, runner: _DynamoRunner, args: tuple, kwargs: dict, example: bool) -> Any:
        """``runner``, or the model run eagerly if its first call disagrees with the model.

        Dynamo compiles (and fxrec rewrites) on that first call, which this check makes, for
        every input signature as symbolic traces are checked. Not once the model's graphs
        communicate: a signature new on one rank (its batch size) would run the check's
        collectives on that rank alone. Nor in a user's call when the model has hooks: the
        check would run them on calls that are not the user's (dynamo compiles hooks into its
        graphs).

        ``optimize``'s example inputs are always compiled here (checked unless
        ``check=False``): the rules lay out parameters as they compile, and the user's
        optimizer is built on those layouts. A model with hooks is compiled, and checked, in
        a capture of its own with the hooks silenced; the first call compiles the model with
        them, reusing the layouts.
        """
        if self._dynamo_backend.communicates or _fake(args, kwargs):
            return runner
        hooked = _hooked(self._submodules)
        if not example and (hooked or not self._check):
            return runner
        probe = self._dynamo_runner() if hooked else runner
        grad = torch.is_grad_enabled()  # the mode training will call it in: one compile
        mark = self.fxrec_report.mark()  # this signature's graphs report from here on
        with _hooks_silenced(self.model) if hooked else contextlib.nullcontext():
            if not self._check:
                with _preserved_state(self.model, (args, kwargs)):
                    probe(*args, **kwargs)
                return runner
            with _preserved_state(self.model, (args, kwargs)), torch.no_grad():
                reference = self.model(*args, **kwargs)
            same = _same_outputs(self.model, probe, args, reference, grad, kwargs)
        if hooked:
            self.fxrec_report.note(
                "the model has hooks: checked in a capture of its own with them silenced; its "
                "first call compiles it with them"
            )
        if same:
            return runner
        if self._dynamo_backend.draws and self._backend != "eager":
            note = (
                f"not checked: the graphs draw random numbers, which {self._backend} draws "
                "differently from eager PyTorch"
            )
            self.fxrec_report.note(note)
            return runner
        logger.warning(
            "fxrec: optimized graphs disagree with the model on these inputs; running them eagerly"
        )
        undone = self.fxrec_report.undo(mark)
        note = "check failed: outputs differ on the first inputs of a signature; those run eagerly"
        self.fxrec_report.note(note)
        logger.info("fxrec: %d rewrites of that signature's graphs undone", undone)
        return _EagerRunner(self.model, self.fxrec_fused)

    def _dynamo_runner(self, dynamic: bool | None = None) -> Any:
        """A dynamo capture of the model for one input signature, with a cache of its own.

        Dynamo keeps its compiled graphs per code object and, past ``recompile_limit``
        (8) entries, silently runs the frame eagerly. Every instance of a model class shares
        ``forward``'s code object, so optimizing several instances, or one on many input
        signatures, would hit that limit; run eagerly, a model whose parameters fxrec laid
        out would then send its gradients to the members instead of the flat parameters.
        Each signature therefore compiles a private copy of ``forward``'s code object, and
        keeps the recompiles of the functions it calls apart from other captures'
        (``isolate_recompiles``, where torch has it): those dynamo compiles as frames of
        their own after a graph break (a helper of the model's, sparse plumbing) are shared
        by every signature and every model.
        """
        if self._dynamo_backend is None:
            from fxrec.compile.backend import compile_backend

            self._dynamo_backend = compile_backend(
                inner=self._backend,
                rules=self._rules,
                model=self.model,
                owner=self._owner(),
                report=self.fxrec_report,
                assigned=self._assigned,
            )
            self.fxrec_report.capture = "dynamo"
        fn = _own_code(self.model)
        # Sizes static at first; one that changes within a signature (the ids of a KJT, which
        # signatures key by feature names) makes dynamo's one recompile symbolic in it. Not
        # for code shared with other signatures (a module compiled with its hooks).
        if dynamic is None and fn is self.model:
            dynamic = False
        compiled = torch.compile(
            fn, backend=self._dynamo_backend, dynamic=dynamic, **_ISOLATED_RECOMPILES
        )
        code, params = _code_and_params(fn, self.model)
        return _DynamoRunner(
            compiled, self._dynamo_backend, code, params, self.fxrec_report,
            direct=not self._guards and code is not None and not dynamic,
            fallback=_EagerRunner(self.model, self.fxrec_fused),
            compiles=self._backend != "eager",
        )  # fmt: skip

    def _optimize_traced(
        self, traced: fx.GraphModule, mode: Any, call_args: tuple, kwargs: dict
    ) -> Any:
        args = call_args + tuple(kwargs.values())  # the trace's placeholders, in order
        graph = fx.Graph()
        graph.output(graph.graph_copy(traced.graph, {}))
        gm = fx.GraphModule(traced, graph, traced.__class__.__name__)
        if any(comm_kind(n) for n in gm.graph.nodes):
            self._communicates.add(mode)
        note_graph_writes(gm)  # parameters it writes: copied before the runs below
        with _preserved_state(self.model, args), _hooks_silenced(self.model):
            try:
                reference = _run_annotating(gm, args)
            except Exception as exc:
                _raise_if_model_fails(self.model, call_args, kwargs)
                raise _TraceDoesNotRun(f"{type(exc).__name__}: {exc}") from exc
        check = self._check and not _fake(args, {})  # fake inputs (export): no values
        if check:
            self._check_trace(call_args, kwargs, reference)
        report = Report(capture="symbolic_trace")
        mark = report.mark()
        optimize_graph(
            gm,
            self._rules,
            owner=self._owner(),
            report=report,
            device_type=_device_type(args),
            runs_eagerly=self._backend == "eager",
            for_inductor=self._backend == "inductor",
        )
        failed = ""
        with _hooks_silenced(self.model):
            try:
                same = not check or _same_outputs(self.model, gm, args, reference)
            except Exception as exc:  # a rewrite the inputs break: the model's graph runs them
                if strict_mode():
                    raise
                same, failed = False, f" (it raised {type(exc).__name__}: {exc})"
        if not same:
            logger.warning(
                "fxrec: optimized graph disagrees with the model on the example inputs%s; "
                "using the captured graph",
                failed,
            )
            undone = report.undo(mark)
            report.notes.append(
                f"check failed: outputs differ on the example inputs{failed}; graph left "
                f"unoptimized ({undone} rewrites undone)"
            )
            gm = fx.GraphModule(traced, _copy_graph(traced.graph), traced.__class__.__name__)
            ParamStore(gm, self._owner()).rebind()  # members laid out already: reach them
            gm.recompile()
        self.fxrec_report.capture = self.fxrec_report.capture or report.capture
        self.fxrec_report.merge(report)
        if self._backend != "eager":  # the optimized graph, compiled (parameters as inputs)
            return _FirstCallsLocked(torch.compile(gm, backend=self._backend, dynamic=None))
        if not report.firings and mode not in self._communicates:
            self.fxrec_report.note(
                "a signature no rule rewrote: its calls run the model as written"
            )
            return _Unfused(gm, self.model, self.fxrec_fused)
        return gm

    def _check_trace(self, args: tuple, kwargs: dict, reference: Any) -> None:
        """Raise :class:`_TraceDoesNotRun` unless the trace's outputs (``reference``) are the
        model's on these inputs.

        A proxy is not the tensor it stands for: ``isinstance(w, torch.Tensor)`` on an input
        is False while tracing, and the trace silently keeps the other branch. The rewritten
        graph is checked against the trace; this checks the trace against the model, so that
        such a model is captured by dynamo instead, which follows the branch and guards it.
        """
        with _hooks_silenced(self.model):
            grad = torch.is_grad_enabled()  # the mode the trace was made in
            same = _same_outputs(self.model, self.model, args, reference, grad, kwargs)
        if not same:
            raise _TraceDoesNotRun(
                "its outputs differ from the model's: the trace took a branch the model does "
                "not (isinstance of an input, a Python value of one)"
            )

    def __getattr__(self, name: str) -> Any:
        """The model's public attributes (``opt.head``, ``opt.get_embeddings()``), as
        ``torch.compile``'s wrapper gives them: code written for the model keeps working, and
        ``state_dict()``'s keys, which are the model's, resolve on this module too."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("_"):
                raise
            return getattr(model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Public names set the model's attribute (``opt.head = nn.Linear(64, 3)``), as
        they read it: set on this module, a new head would be trained by the optimizer but
        never called. Graphs follow: a module or parameter set is followed as one set on the
        model is; any other value (``opt.scale = 2.0``) rebuilds them, since they baked the
        old one in. This module's own state (``training``, ``model``, ``fxrec_*``, names
        starting with ``_``, its class's attributes) stays here."""
        if not self._forwards(name):
            super().__setattr__(name, value)
            return
        model = self._modules["model"]
        old = getattr(model, name, _MISSING)
        setattr(model, name, value)
        self.__dict__.get("_deleted_on_model", set()).discard(name)
        if not isinstance(value, (nn.Module, nn.Parameter)) and not _same_value(old, value):
            self._model_changed(f"{name} set")

    def __delattr__(self, name: str) -> None:
        """``del opt.head`` deletes the model's attribute (see ``__setattr__``)."""
        if not self._forwards(name):
            super().__delattr__(name)
            return
        delattr(self._modules["model"], name)  # PyTorch registers no deletion: look now
        # set again later (``opt.fc = nn.Linear(...)``): on the model, where forward reads it
        self.__dict__.setdefault("_deleted_on_model", set()).add(name)
        self._model_changed(f"{name} deleted")

    def _forwards(self, name: str) -> bool:
        """Is ``name`` set on the model rather than on this module? Only a name the model
        has (as reads of ``opt.<name>`` give it), or had until deleted through this module
        (``del opt.fc; opt.fc = ...`` replaces the model's): a new name (a note the user
        keeps on the optimized module) stays here and changes nothing the graphs compute."""
        if name.startswith("_") or name in _OWN_NAMES or hasattr(type(self), name):
            return False
        own = self.__dict__
        model = own.get("_modules", {}).get("model")
        if model is None:  # under construction
            return False
        if any(name in own[t] for t in ("_parameters", "_buffers", "_modules")) or name in own:
            return False
        return hasattr(model, name) or name in own.get("_deleted_on_model", ())

    def _model_changed(self, what: str) -> None:
        """A change through this module to the model that no registration reports: graphs
        are rebuilt, and the next call looks for replaced parameters and submodules."""
        logger.info(
            "fxrec: model attribute %s through the optimized module; rebuilding graphs", what
        )
        with capture_lock:  # not while another thread builds a graph of the old model
            self._forget_graphs()
            self._registrations_seen = -1
            self._slots_stamp = None

    # -- state: the user's model owns it -------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        self.fxrec_fused.sync_data()  # flat data replaced since the last call: members follow
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:  # type: ignore[override]
        if assign:
            raise ValueError(
                "fxrec: load_state_dict(assign=True) would detach laid-out parameters; load with assign=False"
            )
        return self.model.load_state_dict(_without_assign_flags(state_dict), strict=strict)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        """The parameters to optimize: fused ones replace their members (which gave them
        any data they got since the last call: ``member.data = t``)."""
        fused = self.fxrec_fused
        fused.sync_data()
        members = fused.member_ids()
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if id(p) not in members:
                yield name, p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """The buffers once each: fused ones (running statistics) replace their members, so
        a loop over ``buffers()`` (an EMA of them) updates each value once."""
        members = self.fxrec_fused.member_ids()
        for name, b in super().named_buffers(prefix, recurse, remove_duplicate):
            if id(b) not in members:
                yield name, b

    def requires_grad_(self, requires_grad: bool = True) -> OptimizedModule:
        """Every parameter, laid-out members included (``parameters()`` leaves them out)."""
        super().requires_grad_(requires_grad)
        self.model.requires_grad_(requires_grad)
        self.fxrec_fused.sync_requires_grad()
        return self

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """What ``DistributedDataParallel`` leaves alone: the laid-out members (read as
        ``model.*``), whose values and gradients live in the flat parameters it syncs.

        DDP finds parameters by walking every submodule, past ``named_parameters``; it would
        wait for gradients the members never get. Sharded collections' tables, which are
        each rank's own, are left alone too; names the model itself asks DDP to ignore (or
        set on this module) are kept.
        """
        members = self.fxrec_fused.member_ids()
        names = [
            f"model.{name}"
            for name, t in [
                *self.model.named_parameters(remove_duplicate=False),
                *self.model.named_buffers(remove_duplicate=False),
            ]
            if id(t) in members
        ]
        own = getattr(self.model, "_ddp_params_and_buffers_to_ignore", ())
        own = [*own, *_rank_local(self.model)]
        return [*names, *(f"model.{n}" for n in own), *self.__dict__.get("_ddp_ignored", ())]

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names: list[str]) -> None:
        self.__dict__["_ddp_ignored"] = list(names)

    def _apply(self, fn: Any, recurse: bool = True) -> OptimizedModule:  # type: ignore[override]
        self.fxrec_fused.check_conversion(fn)
        super()._apply(fn, recurse)
        self.fxrec_fused.relink()
        self._forget_graphs()  # graphs hold references to the old tensors
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        return self

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save(opt)``) without its graphs: they hold dynamo's and FX's
        process-local state, and are rebuilt on the first calls after loading."""
        self.fxrec_fused.sync_data()  # members and flat tensors pickled alike
        state = super().__getstate__()  # type: ignore[misc]
        state = dict(state)
        for name in ("_traced", "_runners", "_overflow", "_spilled", "_spilled_graphs"):
            state[name] = {}
        state["_communicates"] = set()
        state["_dynamo_backend"] = None
        state["_slots"], state["_slots_stamp"] = [], None
        state["_hooks_seen"], state["_hooked_modules"] = -1, []
        state["_hook_tables"], state["_hook_sizes"] = [], []
        for name in ("_flags_at", "_read_flag"):  # the modules' own dicts: set on loading
            state.pop(name, None)
        state["_global_ids"] = ()
        state["fxrec_report"] = self.fxrec_report.for_copy()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_spilled", {})  # (saved before it existed)
        self.__dict__.setdefault("_spilled_graphs", {})
        self.__dict__.setdefault("_hook_tables", [])
        self._hook_sizes = []  # (pairs of tables and sizes before)
        self._follow_modules(self._submodules)  # a loaded model's modules are new objects
        # Loaded in a fresh process, nothing has installed the registration hooks yet: a
        # submodule or parameter replaced after loading would go unseen. The first call looks.
        _count_registrations()
        self._registrations_seen = -1
        track(self)  # optimizers over the copy record its layouts too

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizedModule:
        """An independent copy: the model deep-copied, its parameters laid out as here.

        Graphs are rebuilt for the copy on its first calls (they hold this module's tensors,
        and dynamo's state cannot be copied).
        """
        self.fxrec_fused.sync_data()  # the copy's layouts are built from the members
        model = copy.deepcopy(self.model, memo)
        out = OptimizedModule(
            model,
            self._rules,
            keep_params=self._keep_params,
            check=self._check,
            backend=self._backend,
            guards=self._guards,
        )
        out.fxrec_fused = self.fxrec_fused.copy_layouts(memo)
        out.fxrec_report = self.fxrec_report.for_copy()
        out.train(self.training)
        memo[id(self)] = out
        track(out)
        return out


def _keys_under_model(
    module: OptimizedModule,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    *args: Any,
) -> None:
    """Loaded as another module's child, this module gets the model's keys (its
    ``state_dict`` gives them) at ``prefix``; PyTorch then loads its children, so they go
    under ``model.`` (every key: the model may have a child named ``model`` itself)."""
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError(
            "fxrec: load_state_dict(assign=True) would detach laid-out parameters; load with "
            "assign=False"
        )
    module.__dict__["_loading_prefix"] = prefix
    moved = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    for key, value in moved.items():  # popped first: a key may become another's old name
        state_dict[f"{prefix}model.{key[len(prefix) :]}"] = value


def _missing_keys_as_saved(module: OptimizedModule, incompatible: Any) -> None:
    """Missing and unexpected keys named as checkpoints name them, without ``model.``."""
    prefix = module.__dict__.pop("_loading_prefix", None)
    if prefix is None:
        return
    inner = f"{prefix}model."
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [prefix + k[len(inner) :] if k.startswith(inner) else k for k in keys]


_copies = itertools.count()


def _own_code(model: nn.Module) -> Any:
    """``model.forward`` bound to a private copy of its code object (see ``_dynamo_runner``)."""
    if _hooked([model]):
        return model  # hooks run in the module's __call__: compile the module, hooks included
    fwd = model.forward
    fn = getattr(fwd, "__func__", None)
    if not isinstance(fn, types.FunctionType) or getattr(fwd, "__self__", None) is not model:
        return model  # a forward we cannot copy (a C function, a callable object): as is
    # A name of its own too: dynamo keeps what it learnt about sizes (automatic dynamic) per
    # file, line and name, which would make another signature's first compile symbolic.
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_fxrec{next(_copies)}")
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return types.MethodType(copy, model)


def _code_and_params(fn: Any, model: nn.Module) -> tuple[Any, list[str]]:
    """The private code object dynamo caches ``fn`` under, and its parameter names.

    ``*name`` for a parameter taking the remaining positional arguments. (None, []) when
    calls cannot bypass dynamo: a module compiled with its hooks, or a forward taking
    ``**kwargs`` or keyword-only parameters, which a positional call does not fill.
    """
    if fn is model:
        return None, []
    sig = inspect.signature(fn)
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    kinds = [p.kind for p in sig.parameters.values()]
    if kinds and kinds[-1] is inspect.Parameter.VAR_POSITIONAL:
        kinds.pop()
    if any(k not in plain for k in kinds):
        return None, []
    params = sig.parameters.values()
    names = [f"*{p.name}" if p.kind is p.VAR_POSITIONAL else p.name for p in params]
    return fn.__func__.__code__, names


# Each capture's recompiles counted on their own (torch 2.13+; before, shared frames share
# dynamo's limit across captures).
_ISOLATED_RECOMPILES = (
    {"isolate_recompiles": True}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters
    else {}
)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")
_TRAINING_ITEM = operator.itemgetter("training")
_fx_trace = torch.fx._symbolic_trace  # its flag is set while any thread traces
_jit_tracing = torch._C._is_tracing
_PORTABLE = (
    "For a portable program, export it with fxrec.export(opt, args, dynamic_shapes=...) "
    "(torch.export's arguments); to trace or script the model as written, pass the plain "
    "model (opt.model, which holds the same values) instead."
)


def _refuse_tracers(args: tuple, kwargs: dict) -> None:
    """Raise, saying what to use, under ``torch.jit.trace`` (and TorchScript-based ONNX
    export) or a symbolic trace of the optimized module: they would record one cached graph
    of fxrec's (or fail on its bookkeeping) as if it were the model."""
    if _jit_tracing():
        raise RuntimeError(
            "fxrec: torch.jit.trace (and torch.onnx.export(..., dynamo=False), which runs it) "
            f"cannot trace an optimized module. {_PORTABLE}"
        )
    from torch.utils._pytree import tree_leaves

    if any(isinstance(a, fx.Proxy) for a in tree_leaves((args, kwargs))):
        raise RuntimeError(
            "fxrec: torch.fx.symbolic_trace cannot trace an optimized module: its graphs are "
            "built per input signature at call time. A train pipeline that traces the model "
            "to find its sparse modules (TorchRec's TrainPipelineSparseDist) cannot drive it: "
            "fxrec.train.TrainPipelineSparseDist and TrainPipelineBase take optimized models, "
            f"DistributedModelParallel-wrapped ones too. {_PORTABLE}"
        )


class _DynamoRunner:
    """One input signature's dynamo capture; its graph is called directly once that is safe.

    The first call goes through dynamo, which compiles; :meth:`DirectCall.build` then
    decides from what was compiled whether later calls may skip dynamo (see
    :mod:`fxrec.compile.direct`). A call in another grad mode than the first, one whose
    arguments dynamo's guards reject (strides, a KJT's per-key counts baked into the graph),
    and, for graphs compiled further (``backend="inductor"``), one after a parameter's
    ``requires_grad`` changed, go through dynamo, which guards on them and recompiles.
    Past dynamo's recompile limit, calls go to ``fallback`` (the model run eagerly through
    the laid-out parameters): dynamo would run the frame eagerly itself, on the members,
    whose gradients the optimizer never sees.
    """

    def __init__(
        self,
        compiled: Any,
        backend: Any,
        code: Any,
        params: list[str],
        report: Report,
        direct: bool,
        fallback: Any,
        compiles: bool = False,
    ) -> None:
        self.compiled = compiled
        self.fallback = fallback
        self.exhausted = False
        self.backend = backend
        self.code = code
        self.params = params
        from fxrec.compile.direct import positional_arity  # fxrec.compile imports this module

        self.fixed, self.star = positional_arity(params)  # the named ones must all be passed
        self.report = report
        self.try_direct = direct
        self.direct: Any = None
        self.unfused = False  # the first call's graphs fused nothing: see ``__call__``
        self.settled = direct  # ``unfused`` decided (a direct one decides on its first call)
        self.grad_mode = True
        self.routes_checked = False
        self.compiles = compiles
        self.param_list: list[nn.Parameter] = []
        self.grad_flags: list[bool] | None = None
        self.collectives: bool | None = None  # see ``communicates``
        # Dynamo compiles on a grad mode's first call (and fxrec's backend runs the rules and
        # the graphs it builds): never while another thread traces, as a build.
        self._dynamo = _FirstCallsLocked(self._dynamo_call)

    # Never traced into by an outer torch.compile (``torch.compile(fxrec.optimize(m))``):
    # dynamo would inline the model's own forward, on the parameters fxrec laid out, instead
    # of this capture's graphs. It calls the runner as an opaque function instead.
    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            self.unfused
            and torch.is_grad_enabled() is self.grad_mode
            and not self.fallback.owner.reads_through_flats()
        ):
            return self.fallback.model(*args, **kwargs)
        direct = self.direct
        if (
            direct is not None
            and not kwargs
            and torch.is_grad_enabled() is self.grad_mode
            and (self.grad_flags is None or self._same_grad_flags())
            and direct.accepts(args)
        ):
            return direct(*args)
        if not self.settled:  # a first call that is not a direct one's: decide ``unfused``
            with capture_lock:
                if not self.settled:
                    return self._settling(args, kwargs)
        if not self.try_direct or kwargs or not self._positional(len(args)):
            return self._through_dynamo(args, kwargs)  # defaults left out: dynamo fills them in
        with capture_lock:  # dynamo compiles now (see _through_dynamo)
            if not self.try_direct:  # another thread's first call came first
                return self(*args, **kwargs)
            return self._first_call(args)

    def _positional(self, n: int) -> bool:
        """Do ``n`` positional arguments fill every named parameter (none left to defaults)?"""
        return n >= self.fixed if self.star else n == self.fixed

    def _first_call(self, args: tuple) -> Any:
        """Compile through dynamo, then decide whether later calls may skip it."""
        self.try_direct = False
        graphs = self.backend.graphs
        first, fired = len(graphs), len(self.backend.report.firings)
        result = self._through_dynamo(args, {})
        new = graphs[first:]
        self._decide_unfused(fired)
        from fxrec.compile.direct import DirectCall

        self.direct, why = DirectCall.build(self.code, new, self.params, args, result)
        if self.compiles:  # AOTAutograd bakes in which parameters take gradients
            self.param_list = list(self.fallback.model.parameters())
            self.grad_flags = list(map(_REQUIRES_GRAD, self.param_list))
        for record in new:
            record.recording = False
            record.last_outputs = None
        if self.unfused:
            note = "a signature no rule rewrote: its calls run the model as written"
        elif self.direct is None:
            note = f"calls go through dynamo's guards: {why}"
        else:
            note = "one graph: calls after the first skip dynamo's guards"
        self.report.note(note)
        return result

    def _decide_unfused(self, fired: int) -> None:
        """Graphs no rule rewrote run what the model runs, at the cost of dynamo's guards and
        graph breaks and of reading every parameter through the graph module (tens of us a
        call, up to 3x a small model's): the model itself runs them (see ``__call__``). Not
        for graphs compiled further (Inductor), nor graphs that communicate. ``fired``: the
        backend's firings before this runner's first call."""
        self.settled = True
        self.unfused = (
            not self.compiles
            and not self.communicates
            and not self.exhausted
            and len(self.backend.report.firings) == fired
        )
        self.grad_mode = torch.is_grad_enabled()

    def _settling(self, args: tuple, kwargs: dict) -> Any:
        """The first call of a runner that calls through dynamo (symbolic sizes, guards kept,
        keyword arguments): compiles, then decides ``unfused`` as a direct one's does."""
        fired = len(self.backend.report.firings)
        result = self._through_dynamo(args, kwargs)
        self._decide_unfused(fired)
        if self.unfused:
            self.report.note("a signature no rule rewrote: its calls run the model as written")
        return result

    @property
    def communicates(self) -> bool:
        """Does a call run collectives: in its graphs, or around them (a module whose class
        sets ``fxrec_collectives``, as the sharded collection's does)?"""
        if self.backend.communicates:
            return True
        if self.collectives is None:
            modules = self.fallback.model.modules()
            self.collectives = any(getattr(m, "fxrec_collectives", False) for m in modules)
        return self.collectives

    def _same_grad_flags(self) -> bool:
        return list(map(_REQUIRES_GRAD, self.param_list)) == self.grad_flags

    def _through_dynamo(self, args: tuple, kwargs: dict) -> Any:
        """A call through dynamo; past its recompile limit, this call and later ones run
        ``fallback``. Not for graphs that communicate: the limit may be hit in a frame
        between two collectives (the sparse plumbing dynamo compiles per number of keys),
        and running the call again would send this rank's collectives twice. Dynamo runs
        such a frame eagerly itself; its own frame is cached per input signature."""
        if self.exhausted:
            return self.fallback(*args, **kwargs)
        return self._dynamo(args, kwargs)

    def _dynamo_call(self, args: tuple, kwargs: dict) -> Any:
        if self.exhausted:  # reached the limit in another thread
            return self.fallback(*args, **kwargs)
        fail = not self.communicates
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=fail):
                if not self.routes_checked and torch.is_grad_enabled():
                    return self._checking_routes(args, kwargs)
                return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            self.exhausted = True
            note = self._limit_note(_limit_code(exc))
        logger.warning("fxrec: %s", note)
        self.report.note(note)
        return self.fallback(*args, **kwargs)

    def _limit_note(self, code: types.CodeType | None) -> str:
        """What reached dynamo's recompile limit, for the report: the model's forward (a
        value it reads changes every call), or a function it calls, named."""
        eager = "those calls run the model eagerly"
        if code is None or code is self.code:
            return (
                "dynamo reached its recompile limit on one input signature (a Python value "
                f"the forward reads changes every call?); {eager}"
            )
        where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
        return (
            f"dynamo reached its recompile limit in {where}, a function the forward calls "
            f"that dynamo compiles as a frame of its own (after a graph break); {eager}"
        )

    def _checking_routes(self, args: tuple, kwargs: dict) -> Any:
        """The first call with autograd: does any gradient go to a laid-out member?

        Dynamo runs the code around a graph break (a hook it cannot compile, say) eagerly,
        on the members; their gradients would never reach the flat parameters the optimizer
        holds. If the call's autograd graph reaches a member, later calls run through the
        laid-out parameters (the model eagerly): slower, right. This call is run again that
        way, unless the model has forward hooks: they ran in it, and must run once per call,
        so its result stands (the members' gradients move into the flat ones, see
        ``fxrec.graph.params._grad_to_flat``). A module with backward hooks is never
        compiled: when it holds members, the call goes there at once.
        """
        self.routes_checked = True
        members = self.fallback.owner.member_ids()
        if not members:
            return self.compiled(*args, **kwargs)
        hooked = _backward_hooked_member(self.fallback.model, members)
        if hooked is not None:
            self.exhausted = True
            note = (
                f"dynamo runs module {hooked!r}, which has backward hooks, outside its graphs "
                "(a graph break) on parameters laid out in flat tensors; those calls run the "
                "model eagerly, through the flat parameters, so that their gradients reach them"
            )
            logger.warning("fxrec: %s", note)
            self.report.note(note)
            return self.fallback(*args, **kwargs)
        with _preserved_state(self.fallback.model, (args, kwargs)) as state:  # undone unless kept
            result = self.compiled(*args, **kwargs)
            stray = _reaches_leaves(result, members)
            stands = not stray or _forward_hooked(self.fallback.model)
            if stands:
                state.keep()
        if not stray:
            return result
        self.exhausted = True  # later calls run through the flat parameters
        note = (
            "dynamo runs part of the forward outside its graphs (a graph break: a hook it "
            "cannot compile?) on parameters laid out in flat tensors; those calls run the "
            "model eagerly, through the flat parameters, so that their gradients reach them"
        )
        logger.warning("fxrec: %s", note)
        self.report.note(note)
        return result if stands else self.fallback(*args, **kwargs)


def _limit_code(exc: BaseException) -> types.CodeType | None:
    """The code object whose compile reached dynamo's recompile limit, read from the frames
    of dynamo's compile that raised ``exc`` (None where they do not show it)."""
    code = None
    tb = exc.__traceback__
    while tb is not None:
        found = tb.tb_frame.f_locals.get("code")
        if isinstance(found, types.CodeType):
            code = found
        tb = tb.tb_next
    return code


def _rank_local(model: nn.Module) -> list[str]:
    """The sharded collections' tensors of ``model`` (none without torch.distributed)."""
    try:
        from fxrec.distributed.ddp import rank_local_names
    except ImportError:
        return []
    return rank_local_names(model)


def _backward_hooked_member(model: nn.Module, members: set[int]) -> str | None:
    """The name of a module with backward hooks (its own, or global ones: any module) that
    holds one of ``members`` (parameter ids), else None. Dynamo runs such a module's call
    outside its graphs, reading those members."""
    from torch.nn.modules import module as nn_module

    every = bool(nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)
    for name, m in model.named_modules():
        if (every or m._backward_hooks or m._backward_pre_hooks) and any(
            id(p) in members for p in m.parameters()
        ):
            return name
    return None


def _forward_hooked(model: nn.Module) -> bool:
    """Does a module of ``model`` have forward (pre-)hooks, which a call runs?"""
    return any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def _reaches_leaves(result: Any, leaves: set[int]) -> bool:
    """Does the autograd graph behind ``result``'s tensors accumulate into one of ``leaves``
    (tensor ids)?"""
    from torch.utils._pytree import tree_leaves

    todo = [t.grad_fn for t in tree_leaves(result) if isinstance(t, torch.Tensor) and t.grad_fn]
    seen: set[int] = set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if var is not None and id(var) in leaves:
            return True
        todo.extend(f for f, _ in fn.next_functions if f is not None)
    return False


def _hook_ids(index: int, m: nn.Module) -> tuple:
    return (
        index,
        tuple(m._forward_pre_hooks),
        tuple(m._forward_hooks),
        tuple(m._backward_pre_hooks),
        tuple(m._backward_hooks),
    )


def _transformed() -> bool:
    """Is a ``torch.func`` transform (vmap, grad, jacrev...) running? Its tensors are
    wrappers that graphs are not built for."""
    return torch._C._functorch.peek_interpreter_stack() is not None


_NO_AUTOCAST = (None, None)


def _autocast_state() -> tuple:
    """Which autocast regions are active, and their dtypes: graphs and direct calls built
    outside one must not serve calls inside it (and the reverse)."""
    if not torch._C._is_any_autocast_enabled():  # the common case: one call, not four
        return _NO_AUTOCAST
    return tuple(
        torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
        for d in ("cpu", "cuda")
    )


class _FirstCallsLocked:
    """``fn`` (something ``torch.compile`` compiles on the first call in each grad mode), that
    call holding ``capture_lock``, as a build does: never while another thread traces.
    Later calls take the lock only while some thread traces (see :func:`_steady_call`)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.grad_modes_run: set[bool] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        if grad in self.grad_modes_run:
            return _steady_call(self.fn, args, kwargs)
        with capture_lock:
            out = self.fn(*args, **kwargs)
        self.grad_modes_run.add(grad)
        return out


# what dynamo raises on entering a compiled function while fx's tracing flag is set
_NESTED_TRACE = "using FX to symbolically trace a dynamo-optimized function"


def _steady_call(fn: Any, args: tuple, kwargs: dict) -> Any:
    """A call of ``fn``, compiled already, that goes through dynamo.

    Dynamo refuses to enter a compiled function while fx's tracing flag is set, and that
    flag is the process's: another thread's symbolic trace (``fxrec.optimize`` of another
    model, a first call in a new mode) would make this call raise. While one traces, the
    call waits for the end of that build (``capture_lock``, which each build holds; the
    flag is one global read); a trace starting between the read and dynamo's own check
    makes dynamo refuse before it runs anything, and the call is made again the same way."""
    if not _fx_trace._is_fx_tracing_flag:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            if _NESTED_TRACE not in str(exc) or capture_lock._is_owned():  # type: ignore[attr-defined]
                raise
    with capture_lock:
        return fn(*args, **kwargs)


class _EagerRunner:
    """The model run as written, its laid-out parameters read through the flat tensors (so
    their gradients reach the parameters the optimizer holds). Without autograd there is no
    gradient to route: the members share the flat tensors' storage, and the model reads them
    (``views`` and ``functional_call`` cost more than a small model's call). Not for a call
    given other flat tensors (``swapped``: ``functional_call(opt, ...)``), which only the
    views read."""

    def __init__(self, model: nn.Module, owner: FusedParameters, swapped: bool = False) -> None:
        self.model = model
        self.owner = owner
        self.swapped = swapped

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.swapped and not self.owner.reads_through_flats():
            return self.model(*args, **kwargs)
        views = self.owner.views(self.model)
        if not views:
            return self.model(*args, **kwargs)
        # every name of a tied parameter is among the views: no search for ties per call
        return torch.func.functional_call(self.model, views, args, kwargs, tie_weights=False)


class _Unfused:
    """A signature whose trace no rule rewrote: the model runs it as written, which is what
    the trace runs, without the graph module's reads of every parameter (about 15% of a small
    model's call). Once parameters are laid out (another signature fused), the trace runs
    calls with autograd: it reads them through the flat tensors."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, owner: FusedParameters) -> None:
        self.gm = gm
        self.model = model
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.owner.reads_through_flats():
            return self.gm(*args, **kwargs)
        return self.model(*args, **kwargs)


class _TraceDoesNotRun(RuntimeError):
    """The symbolic trace fails on inputs the model itself runs (a branch on an argument
    that tracing took one way, e.g. ``if y is not None``)."""


def _raise_if_model_fails(
    model: nn.Module, args: tuple, kwargs: dict, cause: BaseException | None = None
) -> None:
    """Raise the model's own error for inputs it rejects, rather than a graph's."""
    try:
        with _preserved_state(model, (args, kwargs)), torch.no_grad():
            model(*args, **kwargs)
    except Exception as exc:
        raise exc from cause


def _copy_graph(g: fx.Graph) -> fx.Graph:
    out = fx.Graph()
    out.output(out.graph_copy(g, {}))
    return out


def _device_type(args: tuple) -> str:
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _MODULE_HOOKS)


def _global_hooks() -> list[dict]:
    """The hook tables ``nn.modules.module.register_module_*_hook`` fill (every module's)."""
    from torch.nn.modules import module as nn_module

    return [getattr(nn_module, name) for name in _GLOBAL_HOOKS]


def _hooked(modules: Iterable[nn.Module]) -> bool:
    """Does calling one of ``modules`` run a user's hook (its own or a global one)?"""
    return any(_global_hooks()) or any(has_hooks(m) for m in modules)


@contextlib.contextmanager
def _hooks_silenced(model: nn.Module) -> Iterator[None]:
    """The user's module hooks (forward and backward, the module's and global ones) do not
    run while fxrec runs the model or a traced graph to build, check or count it: those runs
    are fxrec's, not the user's steps, and a hook logging features or gradients would log
    batches never trained on. Graphs keep hooked calls as written."""
    saved = [(m, [getattr(m, a) for a in _MODULE_HOOKS]) for m in model.modules() if has_hooks(m)]
    tables = [(t, t.copy()) for t in _global_hooks() if t]
    for m, _ in saved:
        for a in _MODULE_HOOKS:
            setattr(m, a, OrderedDict())
    for t, _ in tables:
        t.clear()
    try:
        yield
    finally:
        for m, hooks in saved:
            for a, h in zip(_MODULE_HOOKS, hooks):
                setattr(m, a, h)
        for t, kept in tables:
            t.update(kept)


def _without_assign_flags(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict``, or a copy whose metadata drops ``assign_to_params_buffers``.

    ``load_state_dict(sd, assign=True)`` on any module marks ``sd``'s metadata in place, and
    a later ``load_state_dict(sd)`` reads that mark as ``assign=True``: it would replace the
    laid-out parameters instead of copying values into them."""
    metadata = getattr(state_dict, "_metadata", None)
    if not metadata or not any(m.get(_ASSIGN_FLAG) for m in metadata.values()):
        return state_dict
    out = OrderedDict(state_dict)
    out._metadata = type(metadata)(  # type: ignore[attr-defined]
        (k, {f: v for f, v in m.items() if f != _ASSIGN_FLAG}) for k, m in metadata.items()
    )
    return out


_ASSIGN_FLAG = "assign_to_params_buffers"


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None where it keeps none (inference and meta tensors)."""
    if t.is_inference() or t.device.type == "meta":
        return None
    try:
        return t._version
    except RuntimeError:  # a tensor subclass without one
        return None


def _flats_holding(t: torch.Tensor) -> list[torch.Tensor]:
    """The flat tensors holding ``t``'s values: the one it is laid out in, and so on out.

    A laid-out member shares storage with its flat tensor but not its version counter
    (``member.data = flat[i]``): graphs write through the flat one, the model through it."""
    from fxrec.graph.params import _LAID_OUT

    out: list[torch.Tensor] = []
    entry = _LAID_OUT.get(id(t))
    while entry is not None and entry[0]() is t:
        flat = entry[1]()
        if flat is None or any(f is flat for f in out):
            break
        out.append(flat)
        t, entry = flat, _LAID_OUT.get(id(flat))
    return out


_HOOKED_COPY_BYTES = 64 << 20


def _written_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters a forward of ``model`` may write in place, copied before each of fxrec's
    runs (copying every parameter would cost as much memory as the tables):
    ``Embedding``/``EmbeddingBag(max_norm=...)`` renormalize the rows they look up, a
    module's own forward hooks may change its parameters (up to 64 MiB of them in all: a
    logging hook on large tables' modules must not double their memory; the others are seen
    by their version, see ``_report_unsaved_writes``), and parameters seen written before."""
    out: dict[int, nn.Parameter] = {}
    budget = _HOOKED_COPY_BYTES
    for m in model.modules():
        renorms = isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
        hooked = m._forward_pre_hooks or m._forward_hooks
        for p in m.parameters(recurse=False) if renorms or hooked else ():
            size = p.numel() * p.element_size()
            if renorms or size <= budget:
                out[id(p)] = p
                budget -= 0 if renorms else size
    for p in model.parameters():
        if seen_written(p):
            out[id(p)] = p
    return [p for p in out.values() if _version(p) is not None]


def _saved_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s values to put back, outside autograd. Not ``t.detach()``: under
    ``inference_mode``, detaching a jagged nested tensor made outside it raises (its view
    would share the version counter, which inference mode has none of)."""
    with torch.no_grad():
        return t.clone()


class _preserved_state:
    """Capture runs the model; it must not change running statistics, buffers a forward
    reassigns (``self.steps = self.steps + 1``), inputs it changes in place, parameters it
    writes (``max_norm`` renormalization), or the RNG stream. An empty buffer the forward
    replaces with a filled one is set-up, which a plain first call would do too: kept."""

    def __init__(self, model: nn.Module, inputs: Any = ()) -> None:
        self.model = model
        self.inputs = inputs
        self.kept = False

    def __enter__(self) -> _preserved_state:
        from torch.utils._pytree import tree_leaves

        self.buffers = [
            (m._buffers, name, b, _saved_copy(b))
            for m in self.model.modules()
            for name, b in m._buffers.items()
            if b is not None
        ]
        # inputs restored only if a run changed them (their version counter moved)
        self.args = [
            (t, t._version, _saved_copy(t))
            for t in tree_leaves(self.inputs)
            if isinstance(t, torch.Tensor) and not t.is_inference()
        ]
        self._watch_params()
        self.rng = torch.random.fork_rng(devices=[])
        self.rng.__enter__()
        return self

    def _watch_params(self) -> None:
        """Copy the parameters known to be written; note every parameter's version (and
        its flat tensors'), to tell a write to one of the others."""
        self.params = [(p, _saved_copy(p)) for p in _written_params(self.model)]
        self.versions: dict[int, tuple[torch.Tensor, int]] = {}
        for p in self.model.parameters():
            for t in (p, *_flats_holding(p)):
                v = _version(t)
                if v is not None:
                    self.versions[id(t)] = (t, v)

    def keep(self) -> None:
        """Let what ran stand (statistics and the RNG stream as the run left them)."""
        self.kept = True

    def __exit__(self, *exc: Any) -> None:
        after = torch.get_rng_state()
        self.rng.__exit__(*exc)
        if self.kept:
            torch.set_rng_state(after)
            return
        with torch.no_grad():
            for buffers, name, b, saved in self.buffers:
                now = buffers.get(name)
                if now is not b and now is not None and b.numel() == 0 < now.numel():
                    # an empty placeholder the forward filled on its first call (TorchRec's
                    # KTRegroupAsDict builds its permutes so, and flags itself set up): set-up,
                    # not a step; keep it, consistent with the attributes set beside it
                    continue
                buffers[name] = b  # the object forward found, if it assigned another
                b.copy_(saved)
            for t, version, saved in self.args:
                if t._version != version:
                    t.copy_(saved)
            for p, saved in self.params:
                if not torch.equal(p, saved):
                    p.copy_(saved)
        self._report_unsaved_writes()

    def _report_unsaved_writes(self) -> None:
        """Warn of parameters the run wrote without a copy to put back; copy them next time."""
        covered = {id(p) for p, _ in self.params}
        covered.update(id(f) for p, _ in self.params for f in _flats_holding(p))
        moved = {i for i, (t, v) in self.versions.items() if i not in covered and _version(t) != v}
        if not moved:
            return
        names = []
        for name, p in self.model.named_parameters():
            if id(p) in moved or any(id(f) in moved for f in _flats_holding(p)):
                note_written(p)
                names.append(name)
        logger.warning(
            "fxrec: the model's forward wrote parameters in place (%s) while fxrec ran it to "
            "capture, check or count it, and fxrec kept no copy to put back: their values now "
            "differ from the model's before. fxrec copies them before its later runs; to undo "
            "this change, load a state dict saved before fxrec.optimize (or this call) with "
            "load_state_dict.",
            ", ".join(names),
        )


def _run_annotating(gm: fx.GraphModule, args: tuple) -> Any:
    class _A(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) or (
                isinstance(out, (tuple, list))
                and out
                and all(isinstance(o, torch.Tensor) for o in out)
            ):
                meta.set_info(n, out)
            return out

    with torch.no_grad():
        return _A(gm).run(*args)


def _fake(args: tuple, kwargs: dict) -> bool:
    """Are these inputs fake tensors (``torch.export`` tracing), which hold no values?"""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._pytree import tree_leaves

    return any(isinstance(t, torch.Tensor) and is_fake(t) for t in tree_leaves((args, kwargs)))


# A fused chain rounds in another order: a few units in the last place of a 16-bit float
# (bfloat16 keeps 8 bits, so 3 ulps near 1.0 are 0.023).
_CHECK_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _same_outputs(
    model: nn.Module,
    fn: Any,
    args: tuple,
    reference: Any,
    grad: bool = False,
    kwargs: dict | None = None,
) -> bool:
    """Does ``fn(*args, **kwargs)`` give ``reference`` (same structure, dtypes, values within
    tolerance)?

    ``grad``: run ``fn`` with autograd on. A compiled ``fn`` compiles on this call for the
    grad mode it runs in; checking in the mode training will use saves a second compile.
    """
    from torch.utils._pytree import tree_flatten

    with _preserved_state(model, (args, kwargs)), torch.set_grad_enabled(grad):
        got = fn(*args, **(kwargs or {}))
    a, _ = tree_flatten(reference)
    b, _ = tree_flatten(got)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.is_floating_point():
                tol = _CHECK_TOLERANCE.get(x.dtype, 1e-4)
                if not torch.allclose(x.float(), y.float(), rtol=tol, atol=tol, equal_nan=True):
                    return False
            elif not torch.equal(x, y):
                return False
    return True


def optimize(
    model: nn.Module,
    example_inputs: tuple | None = None,
    *,
    rules: RuleSpec = None,
    keep_params: bool | None = None,
    check: bool = True,
    backend: Any = "eager",
    guards: bool = False,
) -> OptimizedModule:
    """Make ``model`` faster by rewriting its graph; same outputs and gradients.

    Args:
        model: any ``nn.Module``. It is not modified, except that parameters of fused layers
            come to share storage with one flat parameter (values unchanged).
        example_inputs: if given, the graph for these inputs is captured and optimized now
            (and the report filled in); otherwise on the first call.
        rules: rule names, classes or instances to run (default: every registered rule but
            the opt-in ones; ``["default", "overlap_comm"]`` adds one to them).
        keep_params: keep the original parameter objects as the trained leaves (fused weights
            are then gathered in-graph each step). Use it only if you cannot build your
            optimizer after ``optimize``. By default False with ``example_inputs`` and True
            without: parameters are laid out when the first graph is built, which without
            example inputs is the first call, after the optimizer usually exists. Pass False
            there if the optimizer is built after the first call.
        check: compare each optimized graph with the model on the first inputs it is built
            for (the example inputs, then each new signature) and fall back to the captured
            graph, or the model run eagerly, where they differ.
        backend: what runs the optimized graphs: ``"eager"`` (PyTorch ops as rewritten),
            ``"inductor"`` (``torch.compile`` of fxrec's graphs, with fused parameters laid
            out once, which the ``torch.compile`` plug-ins cannot do since parameters reach
            them as graph inputs), or any ``torch.compile`` backend name or callable.
        guards: with dynamo capture, check dynamo's guards on every call. By default a
            model dynamo captures in one graph is called directly after the first call, its
            Python state (attributes ``forward`` reads, hooks) specialized as symbolic tracing
            does; shapes, dtypes, devices, input keys, train/eval and grad mode stay checked.

    Returns:
        an :class:`OptimizedModule`; its ``fxrec_report`` says what was done.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fxrec.optimize takes an nn.Module, got {type(model).__name__}; wrap a function "
            "in a module whose forward calls it."
        )
    model = _uncompiled(model)
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = _as_args(model, example_inputs)
    if keep_params is None:
        keep_params = example_inputs is None
    opt = OptimizedModule(
        model, rules, keep_params=keep_params, check=check, backend=backend, guards=guards
    )
    again = laid_out(list(model.parameters()))
    if again:
        note = (
            f"{again} parameters of this model are laid out already, by another "
            "fxrec.optimize of it: laying them out again leaves that optimized module correct "
            "but slower; keep one optimized module per model"
        )
        logger.warning("fxrec: %s", note)
        opt.fxrec_report.note(note)
    if example_inputs is not None:
        with _own_call():  # runs of the model that register (see _OwnCalls) are no edits
            runner = opt._build(opt._key(example_inputs, {}), example_inputs, {}, example=True)
            opt.fxrec_fused.freeze()  # the optimizer is built on these layouts
            opt.fxrec_report.kernels_before, opt.fxrec_report.kernels_after = _kernels(
                model, opt, runner, example_inputs
            )
    track(opt)  # optimizers over it record its layouts in their state (see optim_state)
    return opt


def _uncompiled(model: nn.Module) -> nn.Module:
    """The model ``torch.compile(model)`` wraps: its wrapper's ``forward(*args, **kwargs)``
    would hide the model from capture (parameters reach the graph as inputs, which rules
    cannot lay out), and fxrec runs its own graphs, so the compile would be dropped anyway."""
    from torch._dynamo.eval_frame import OptimizedModule as CompiledModule

    if not isinstance(model, CompiledModule):
        return model
    logger.warning(
        "fxrec: optimizing the model torch.compile wraps (%s), without that compile; for "
        'compiled graphs, use fxrec.optimize(model, example, backend="inductor") or '
        "torch.compile(fxrec.optimize(model, example))",
        type(model._orig_mod).__name__,
    )
    return model._orig_mod


def _as_args(model: nn.Module, example: Any) -> tuple:
    """``example_inputs`` that is not a tuple: the one argument of ``forward``. A list (or
    dict) that matches forward's parameters instead is refused: the tuple was meant."""
    try:
        params = [
            p
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # no signature to read: one argument it is
        return (example,)
    required = [p for p in params if p.default is p.empty]
    if len(required) > 1:
        names = ", ".join(p.name for p in params)
        batch = hasattr(example, "dense") and hasattr(example, "sparse")
        hint = " (a train Batch: (batch.dense, batch.sparse), as the pipelines call it)"
        raise TypeError(
            f"fxrec.optimize: example_inputs is a {type(example).__name__}, but "
            f"{type(model).__name__}.forward({names}) takes {len(required)} arguments; pass "
            f"them as a tuple (forward's positional arguments, in order){hint if batch else ''}."
        )
    return (example,)


def _updates_in_backward(model: nn.Module) -> bool:
    """Does a module of ``model`` update its own parameters in backward? fbgemm's
    table-batched lookups built with an optimizer, and TorchRec's sharded or fused modules
    (which expose ``fused_optimizer``), apply the step inside the backward kernel, where
    nothing can undo it."""
    for m in model.modules():
        if hasattr(type(m), "fused_optimizer"):  # a property or a method (TorchRec's)
            return True
        optim = m.__dict__.get("optimizer")
        if type(optim).__name__ == "EmbOptimType" and getattr(optim, "name", "NONE") != "NONE":
            return True
    return False


def _kernels(model: nn.Module, opt: OptimizedModule, runner: Any, args: tuple) -> tuple[Any, Any]:
    """(forward, backward) kernels of one training step of ``model`` and of ``opt`` (whose
    ``runner`` serves ``args``).

    Runs each once on the example inputs without leaving a trace: gradients, buffers and the
    RNG stream are restored, and the user's module hooks do not run. Counting is best effort
    (None when the model's outputs have no gradient to run backward from, or a step fails),
    and skipped when it would run the user's hooks (parameter gradient hooks, or module hooks
    compiled into a graph, which cannot run without them) or train the model (a module whose
    backward applies an optimizer step).
    """
    from torch.utils._pytree import tree_leaves

    from fxrec.graph.params import has_grad_hooks
    from fxrec.measure import count_kernels

    if any(has_grad_hooks(p) for p in model.parameters()):
        return None, None  # a counting step would run the user's gradient hooks
    if _updates_in_backward(model):
        return None, None  # a counting step would train it
    hooked = _hooked(model.modules())
    if hooked and not isinstance(runner, (fx.GraphModule, _EagerRunner)):
        return None, None  # compiled with the hooks in it, or compiled on its first run
    tensors = [*opt.parameters(), *model.parameters()]
    tensors += [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    saved = [(t, t.grad) for t in tensors]
    try:
        # fxrec's own counting steps: warnings they raise (e.g. from the user's hooks) stay quiet
        with (
            _preserved_state(model, args),
            warnings.catch_warnings(),
            _hooks_silenced(model),
        ):
            warnings.simplefilter("ignore")
            before = count_kernels(model, *args)
            for t in tensors:  # each step counted as after zero_grad(set_to_none=True)
                t.grad = None
            # the runner itself: silenced hooks would make ``opt`` build another for them
            after = count_kernels(runner if hooked else opt, *args)
        return (before.forward, before.backward), (after.forward, after.backward)
    except Exception as exc:  # a report detail must never make optimize fail
        logger.debug("fxrec: kernel counts for the report failed: %s", exc)
        return None, None
    finally:
        for t, g in saved:
            t.grad = g
