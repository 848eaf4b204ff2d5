"""Direct calls: run a one-graph dynamo capture without going through dynamo on every call.

Once dynamo has captured a frame, each call still pays for its guards, and its generated
bytecode loads every parameter of the model (hundreds, in a ranking model) only for fxrec
to drop them, since fused graphs read laid-out parameters of their own. On a 100-feature
model that is 1.5-2 ms per step, a tenth of the whole optimized step on a CPU.

When a frame compiled to exactly one graph and dynamo's code around it only reads the
inputs, calls the graph and packs its outputs (no graph break, no side effect replayed),
:class:`DirectCall` does the same in a few lines: it reads the graph's inputs from the
call's arguments along the paths dynamo recorded (``L['sparse']['f000']``), calls the
graph, and rebuilds the output structure seen on the first call.

What stays checked on every call is what :class:`fxrec.optimize`'s cache key holds (input
structure, shapes, dtypes, devices, Python scalars, train/eval mode), grad mode, and dynamo's
own guards on the arguments (strides, a KJT's per-key counts that the graph baked in): a
call they reject goes through dynamo, which recompiles. The rest of dynamo's guards
(attributes of the model read by ``forward``, hooks) are specialized at the first call, as
symbolic tracing does; ``optimize(..., guards=True)`` keeps them.
"""

from __future__ import annotations

import dis
import logging
import types
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

logger = logging.getLogger(__name__)

__all__ = [
    "DirectCall",
    "GraphRecord",
    "input_paths",
    "plain_graph_call",
    "positional_arity",
    "unrebound_cells",
]

# Opcodes of the code dynamo generates around one graph call: loads, calls, building the
# output containers, local bookkeeping. Anything else (stores to attributes, globals,
# cells or items, jumps, imports, nested functions) means more than a graph call.
_PLAIN_OPS = frozenset(
    {
        "RESUME", "NOP", "CACHE", "EXTENDED_ARG", "MAKE_CELL", "COPY_FREE_VARS",
        "LOAD_GLOBAL", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_DEREF",
        "LOAD_CONST", "LOAD_ATTR", "LOAD_METHOD", "LOAD_SMALL_INT", "LOAD_FAST_BORROW",
        "LOAD_FAST_BORROW_LOAD_FAST_BORROW", "STORE_FAST", "STORE_FAST_STORE_FAST",
        "DELETE_FAST", "COPY", "SWAP", "POP_TOP", "PUSH_NULL", "PRECALL", "CALL", "CALL_KW",
        "KW_NAMES", "CALL_FUNCTION_EX", "BINARY_SUBSCR", "BUILD_TUPLE", "BUILD_LIST",
        "BUILD_MAP", "BUILD_CONST_KEY_MAP", "LIST_EXTEND", "LIST_APPEND", "DICT_UPDATE",
        "UNPACK_SEQUENCE", "RETURN_VALUE", "RETURN_CONST",
    }
)  # fmt: skip
_CALL_OPS = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION_EX"})
_DYNAMO_UTILS = "__import_torch_dot__dynamo_dot_utils"
_COMPILED_FN = "__compiled_fn"


def plain_graph_call(code: types.CodeType) -> bool:
    """Does dynamo's generated ``code`` only call one compiled graph and pack its outputs?

    Besides the graph, the only calls allowed are dynamo's own profiling markers
    (``record_pregraph_bytecode_enter/exit``). Unknown opcodes answer no.
    """
    calls = markers = graphs = 0
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op not in _PLAIN_OPS:
            return False
        if op in _CALL_OPS:
            calls += 1
        elif op == "LOAD_GLOBAL":
            name = str(ins.argval)
            if name.startswith(_COMPILED_FN):
                graphs += 1
            elif name != _DYNAMO_UTILS:
                return False
        elif op in ("LOAD_ATTR", "LOAD_METHOD") and str(ins.argval).startswith("record_pregraph"):
            markers += 1
    return graphs == 1 and calls == graphs + markers


@dataclass
class GraphRecord:
    """What the backend knows of one graph it compiled: how to call it and what it read."""

    fn: Callable[..., Any]  # the compiled graph, taking only the kept inputs
    sources: list[Any]  # dynamo's Source of each kept input (None where unknown)
    last_outputs: Any = None
    recording: bool = field(default=True, repr=False)  # until the first call is seen

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.recording:
            self.last_outputs = out
        return out


def graph_sources(gm: fx.GraphModule) -> list[Any]:
    """Dynamo's Source of each placeholder of ``gm`` (None where it recorded none)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            arg = node.meta.get("grapharg")
            out.append(getattr(arg, "source", None))
    return out


# Sources dynamo wraps around a module it inlines (``self.norms`` read as a module).
_MODULE_MARKERS = (
    "NNModuleSource",
    "UnspecializedNNModuleSource",
    "UnspecializedBuiltinNNModuleSource",
)


def source_path(
    source: Any, params: Sequence[str], cells: bool | Collection[str] = False
) -> tuple[int, list[tuple[str, Any]]] | None:
    """(argument position, [("item"|"attr", key), ...]) of a Source rooted at an argument.

    ``cells``: also an argument held in a cell (read by a comprehension or closure), whose
    contents the function body could rebind: any (True), or those named (arguments no code
    rebinds, see :func:`unrebound_cells`).
    """
    steps: list[tuple[str, Any]] = []
    while True:
        kind = type(source).__name__
        if kind == "LocalSource":
            name = source.local_name
            if getattr(source, "is_derefed_cell_contents", False) and not (
                cells is True or (cells and name in cells)
            ):
                return None
            if name not in params:
                return None
            return params.index(name), steps[::-1]
        if kind in ("DictGetItemSource", "GetItemSource", "ListGetItemSource"):
            if getattr(source, "index_is_slice", False):
                return None
            key = source.index
            if type(key) not in (str, int):
                return None
            steps.append(("item", key))
        elif kind in ("AttrSource", "UnspecializedParamBufferSource"):
            steps.append(("attr", source.member))
        elif kind not in _MODULE_MARKERS:  # markers wrap a module's source, reading nothing
            return None
        source = source.base


def positional_arity(params: Sequence[str]) -> tuple[int, bool]:
    """(how many named positional parameters, whether a last ``*name`` takes the rest) of a
    frame's parameter names as :func:`input_paths` takes them."""
    star = bool(params) and params[-1].startswith("*")
    return len(params) - star, star


def unrebound_cells(code: types.CodeType, params: Sequence[str]) -> frozenset[str]:
    """The arguments ``params`` of ``code`` held in cells (Python 3.11 makes one of an
    argument a comprehension or closure reads) that neither ``code`` nor a function nested
    in it rebinds or deletes: the cell holds the argument itself for the whole call."""
    names = {p.lstrip("*") for p in params}
    held = names.intersection(code.co_cellvars)
    todo = [code]
    while held and todo:
        c = todo.pop()
        for ins in dis.get_instructions(c):
            if ins.opname in ("STORE_DEREF", "DELETE_DEREF"):
                held.discard(ins.argval)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return frozenset(held)


def input_paths(
    sources: Sequence[Any], params: Sequence[str], cells: Collection[str] = ()
) -> Callable[..., tuple[Any, ...]] | None:
    """A function from the call's positional arguments to the graph's inputs, or None.

    ``params``: the frame's parameter names, ``*name`` for one taking the remaining
    positional arguments; ``cells``: arguments held in cells whose contents stay the
    argument (see :func:`unrebound_cells`). Generated as one expression per input
    (``a1['f000']``), the cheapest way Python has to read a hundred nested entries.
    """
    names = [p.lstrip("*") for p in params]
    exprs = []
    for source in sources:
        path = source_path(source, names, cells) if source is not None else None
        if path is None:
            return None
        pos, steps = path
        expr = f"a{pos}"
        for kind, key in steps:
            if kind == "attr":
                if not key.isidentifier():
                    return None
                expr += f".{key}"
            else:
                expr += f"[{key!r}]"
        exprs.append(expr)
    args = ", ".join(f"{'*' if p.startswith('*') else ''}a{i}" for i, p in enumerate(params))
    body = ", ".join(exprs)
    src = f"lambda {args}: ({body}{',' if len(exprs) == 1 else ''})"
    return eval(compile(src, "<fxrec direct inputs>", "eval"), {})


class DirectCall:
    """Calls one compiled graph the way dynamo's generated code would, minus the guards."""

    def __init__(
        self,
        record: GraphRecord,
        inputs: Callable[..., tuple[Any, ...]],
        leaves: list[tuple[bool, Any]],
        spec: Any,
        guards: Any,
        params: Sequence[str],
    ) -> None:
        self.record = record
        self.inputs = inputs
        self.leaves = leaves  # (is graph output, its index or the constant)
        self.spec = spec
        self.guards = guards  # dynamo's guards on the arguments (and global state)
        self.params = [p.lstrip("*") for p in params]
        fixed, star = positional_arity(params)
        self.fixed = fixed if star else None  # named parameters before ``*name``

    def accepts(self, args: tuple) -> bool:
        """Do dynamo's guards on the arguments pass? The graph may have baked in Python
        values read from them (a KJT's per-key counts), or their strides."""
        if self.fixed is None:  # every call: no method call for the usual forward
            return bool(self.guards.check(dict(zip(self.params, args))))
        return bool(self.guards.check(self.frame(args)))

    def frame(self, args: tuple) -> dict[str, Any]:
        """The frame's locals for positional arguments ``args``, as dynamo's guards read them."""
        n = self.fixed
        if n is None:
            return dict(zip(self.params, args))
        local = dict(zip(self.params, args[:n]))
        local[self.params[n]] = args[n:]
        return local

    def __call__(self, *args: Any) -> Any:
        outs = self.record.fn(*self.inputs(*args))
        flat = [outs[v] if is_out else v for is_out, v in self.leaves]
        return tree_unflatten(flat, self.spec)

    @classmethod
    def build(
        cls,
        code: types.CodeType,
        records: Sequence[GraphRecord],
        params: Sequence[str],
        args: tuple,
        result: Any,
    ) -> tuple[DirectCall | None, str]:
        """A direct call for ``code``'s one compiled graph, or (None, why not).

        ``records`` are the graphs compiled while running the first call on ``args``,
        ``result`` what it returned, ``records[0].last_outputs`` the graph's outputs;
        ``params`` as :func:`input_paths` takes them.
        """
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        if len({id(t) for t in tensors}) != len(tensors):
            # dynamo reads a tensor passed twice once; later calls may pass two
            return None, "the same tensor is passed as two inputs"
        if not records:
            return None, "no graph with laid-out parameters was compiled"
        if len(records) != 1:
            return None, f"{len(records)} graphs (graph breaks)"
        try:
            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

            entries = _debug_get_cache_entry_list(code)
        except Exception as exc:  # a private API: without it, keep dynamo in charge
            return None, f"cannot read dynamo's cache ({type(exc).__name__})"
        if len(entries) != 1:
            return None, f"{len(entries)} compiled versions of the frame"
        if not plain_graph_call(entries[0].code):
            return None, "dynamo's code around the graph does more than call it"
        guards = _argument_guards(entries[0], [p.lstrip("*") for p in params])
        if guards is None:
            return None, "cannot read dynamo's guards on the arguments"
        (record,) = records
        inputs = input_paths(record.sources, params, unrebound_cells(code, params))
        if inputs is None:
            return None, "a graph input is not read from the arguments"
        outs = record.last_outputs
        if not isinstance(outs, (tuple, list)):
            return None, "the graph's outputs were not recorded"
        where = {id(t): i for i, t in enumerate(outs) if isinstance(t, torch.Tensor)}
        flat, spec = tree_flatten(result)
        leaves: list[tuple[bool, Any]] = []
        for leaf in flat:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in where:
                    return None, "an output is not one of the graph's outputs"
                leaves.append((True, where[id(leaf)]))
            elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                leaves.append((False, leaf))
            else:
                return None, f"an output of type {type(leaf).__name__}"
        return cls(record, inputs, leaves, spec, guards, params), ""


def _argument_guards(entry: Any, params: Sequence[str]) -> Any:
    """The part of a cache entry's guards that reads the frame's arguments ``params`` (and
    the global state checked at the root: grad mode, autocast), without the model's own
    attributes; None if dynamo's guard tree cannot be read."""
    roots = [f"L[{p!r}]" for p in params]
    prefixes = tuple(r + c for r in roots for c in (".", "["))

    def keep(node: Any) -> bool:
        source = node.get_source()
        return source == "L" or source in roots or source.startswith(prefixes)

    try:  # private API (torch._dynamo.guards): without it, keep dynamo in charge
        return entry.guard_manager.root.clone_manager(keep)
    except Exception:
        return None
