"""Parameters of fused layers, laid out once.

A fused layer needs its members' weights side by side (concatenated or stacked along dim 0).
Gathering them inside the graph every step (``torch.cat`` of N weights) is what makes
PyTorch's own batch fusions slower than eager on real multi-task models. fxrec instead
allocates ONE parameter holding the members' values and re-points each member parameter's
storage at its slice (``member.data = flat[i]``). So:

* a step reads the fused weight directly: no gather in forward, no scatter in backward;
* the user's original ``nn.Parameter`` objects still exist, share storage with the fused
  one, and so always show the trained values: ``state_dict()`` keys, shapes and values stay
  the original ones, and ``load_state_dict`` writes through into the fused parameter;
* the optimizer must be built on the optimized module's ``parameters()`` (which yields the
  fused parameter, not the members) *after* ``fxrec.optimize``.

Users who cannot rebuild their optimizer pass ``keep_params=True``: members stay the
trained leaves and the fused weight is gathered in-graph (slower, but nothing moves). Graphs
whose parameters are graph inputs (``torch.compile`` backends) always gather in-graph.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["FusedParameters", "ParamStore"]

OWNER_ATTR = "fxrec_fused"


@dataclass
class _Member:
    tensor: torch.Tensor  # the user's Parameter or buffer object
    index: int  # position along dim 0 of the flat tensor (stacked layout)
    offset: int  # start row in the flat tensor (concatenated layout)


class FusedParameters(nn.Module):
    """Owns the flat parameters and buffers of fused layers and keeps members as views."""

    def __init__(self) -> None:
        super().__init__()
        self._members: dict[str, tuple[str, list[_Member]]] = {}
        self._by_ids: dict[tuple[str, tuple[int, ...]], str] = {}

    def member_ids(self) -> set[int]:
        return {id(m.tensor) for _, ms in self._members.values() for m in ms}

    def locate(self) -> dict[int, tuple[str, str, _Member]]:
        """For every member tensor id: (flat name, layout, member record)."""
        return {
            id(m.tensor): (name, how, m) for name, (how, ms) in self._members.items() for m in ms
        }

    def grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """Each of ``model``'s parameter gradients by name, read through the flat layouts.

        A fused member's gradient lives in its flat parameter's ``.grad`` (the leaf the
        optimizer holds); this returns the member's slice of it, as a view, so per-parameter
        code (clipping, logging, tests) keeps the original names and shapes.
        """
        where = self.locate()
        out: dict[str, torch.Tensor | None] = {}
        for name, p in model.named_parameters():
            loc = where.get(id(p))
            if loc is None:
                out[name] = p.grad
                continue
            flat, how, m = loc
            g = getattr(self, flat).grad
            if g is None:
                out[name] = None
            else:
                out[name] = g[m.index] if how == "stack" else g.narrow(0, m.offset, p.shape[0])
        return out

    def lookup(self, how: str, tensors: Sequence[torch.Tensor]) -> str | None:
        return self._by_ids.get((how, tuple(id(t) for t in tensors)))

    def add(self, how: str, tensors: Sequence[torch.Tensor]) -> str:
        """Lay ``tensors`` out in one new flat tensor (``how`` is "stack" or "cat")."""
        existing = self.lookup(how, tensors)
        if existing is not None:
            return existing
        name = f"{how}{len(self._members)}"
        with torch.no_grad():
            data = torch.stack(list(tensors)) if how == "stack" else torch.cat(list(tensors))
        is_param = all(isinstance(t, nn.Parameter) for t in tensors)
        if is_param:
            self.register_parameter(
                name, nn.Parameter(data, requires_grad=tensors[0].requires_grad)
            )
        else:
            self.register_buffer(name, data)
        members, offset = [], 0
        for i, t in enumerate(tensors):
            members.append(_Member(t, i, offset))
            offset += t.shape[0] if t.dim() else 1
        self._members[name] = (how, members)
        self._by_ids[(how, tuple(id(t) for t in tensors))] = name
        self.relink(name)
        return name

    def relink(self, name: str | None = None) -> None:
        """Point every member's storage at its slice of the flat tensor again."""
        names = [name] if name is not None else list(self._members)
        for n in names:
            how, members = self._members[n]
            flat = getattr(self, n)
            for m in members:
                if how == "stack":
                    view = flat.data[m.index]
                else:
                    view = flat.data.narrow(0, m.offset, m.tensor.shape[0])
                m.tensor.data = view

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self.relink()
        return out


class ParamStore:
    """Gives rules a node that yields N parameters laid out side by side."""

    def __init__(self, gm: fx.GraphModule, owner: FusedParameters | None) -> None:
        self.gm = gm
        self.owner = owner
        # Attribute path -> tensor. Attributes are added while rules run, never reassigned.
        self._tensors: dict[str, torch.Tensor] = {}

    def _owned_tensor(self, node: fx.Node) -> torch.Tensor | None:
        if node.op != "get_attr":
            return None
        return self.target_tensor(node.target)

    def can_lay_out(self, ts: Sequence[torch.Tensor | None]) -> bool:
        """Can these model tensors (None: not one) become views of one new flat tensor?"""
        if self.owner is None or any(t is None for t in ts):
            return False
        if len({id(t) for t in ts}) != len(ts):
            return False  # a parameter shared between members: refuse the layout
        grads = {t.requires_grad for t in ts}
        kinds = {isinstance(t, nn.Parameter) for t in ts}
        taken = self.owner.member_ids()
        fresh = all(id(t) not in taken for t in ts)
        return len(grads) == 1 and len(kinds) == 1 and fresh

    def combined(self, nodes: Sequence[fx.Node], how: str) -> fx.Node:
        """A node holding ``torch.stack(nodes)`` (how="stack") or ``torch.cat(nodes)`` ("cat").

        Laid out once when possible (a ``get_attr`` of a flat tensor); otherwise, or when the
        same members were laid out before, gathered in the graph. Insert point: the caller's
        current ``graph.inserting_*`` context.
        """
        node = self.laid_out_node([self._owned_tensor(n) for n in nodes], how)
        if node is not None:
            return node
        fn = torch.stack if how == "stack" else torch.cat  # gathered in-graph
        node = self.gm.graph.call_function(fn, (list(nodes), 0))  # dim given: shape arithmetic
        from fxrec.graph.meta import infer

        infer(self.gm, node)
        return node

    def target_tensor(self, target: str) -> torch.Tensor | None:
        """The model tensor at ``target`` (a qualified attribute name), else None."""
        t = self._tensors.get(target)
        if t is not None:
            return t
        obj: object = self.gm
        for part in target.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        if not isinstance(obj, torch.Tensor):
            return None
        self._tensors[target] = obj
        return obj

    def is_laid_out(self, ts: Sequence[torch.Tensor | None], how: str) -> bool:
        """Are these exact tensors already one flat tensor laid out ``how``?"""
        if self.owner is None or any(t is None for t in ts):
            return False
        return self.owner.lookup(how, ts) is not None  # type: ignore[arg-type]

    def laid_out_node(self, ts: Sequence[torch.Tensor | None], how: str) -> fx.Node | None:
        """A ``get_attr`` of one flat tensor holding ``ts`` laid out ``how``, or None.

        Reuses an existing layout of exactly these tensors, or creates one when they can be
        laid out (model parameters this graph owns, not shared with another layout).
        """
        if self.owner is None or any(t is None for t in ts):
            return None
        name = self.owner.lookup(how, ts)  # type: ignore[arg-type]
        if name is None and self.can_lay_out(ts):  # type: ignore[arg-type]
            name = self.owner.add(how, ts)  # type: ignore[arg-type]
        if name is None:
            return None
        if not hasattr(self.gm, OWNER_ATTR):
            self.gm.add_submodule(OWNER_ATTR, self.owner)
        node = self.gm.graph.get_attr(f"{OWNER_ATTR}.{name}")
        from fxrec.graph.meta import set_info

        set_info(node, getattr(self.owner, name))
        return node

    def rebind(self) -> int:
        """Route every remaining read of a laid-out member through its flat tensor.

        Once a parameter lives in a flat tensor, gradients must reach the flat tensor (the
        one the optimizer holds) from *every* graph, including graphs where that member was
        not fused (another input shape, eval mode). Returns the number of reads rerouted.
        """
        if self.owner is None:
            return 0
        where = self.owner.locate()
        graph = self.gm.graph
        n = 0
        for node in list(graph.nodes):
            t = self._owned_tensor(node)
            if t is None or id(t) not in where or node.target.startswith(OWNER_ATTR + "."):
                continue
            name, how, m = where[id(t)]
            if not hasattr(self.gm, OWNER_ATTR):
                self.gm.add_submodule(OWNER_ATTR, self.owner)
            with graph.inserting_after(node):
                flat = graph.get_attr(f"{OWNER_ATTR}.{name}")
            with graph.inserting_after(flat):
                if how == "stack":
                    view = graph.call_function(operator.getitem, (flat, m.index))
                else:
                    view = graph.call_method("narrow", (flat, 0, m.offset, m.tensor.shape[0]))
            view.meta.update(node.meta)
            node.replace_all_uses_with(view)
            graph.erase_node(node)
            n += 1
        return n
