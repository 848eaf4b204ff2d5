"""Parameters of a grouped collection: one weight per group, per-table views for checkpoints.

``TableGroup.weight`` is THE parameter (what ``parameters()`` yields and an optimizer
updates). ``TableView.weight`` is a view of the table's rows in it: reading it always shows
the trained values, writing it (under ``no_grad``) writes the group weight, and the
collection's ``state_dict`` holds exactly these views under ``embedding_bags.<table>.weight``
with each table's own shape, as TorchRec's collection (and its fused TBE) do. Loading copies
each table into its rows, so checkpoints move both ways between fxrec, TorchRec and fxrec
collections grouped differently (another ``max_group_bytes``, another table order).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TableGroup", "TableView"]


class TableGroup(nn.Module):
    """Holds one group's weight ``[num_rows, dim]``; contributes nothing to ``state_dict``."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        pooling: str,
        tables: list[str],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.pooling = pooling
        self.tables = tables
        self.weight = nn.Parameter(torch.empty(num_rows, dim, device=device, dtype=dtype))

    def materialize(self, like: torch.Tensor) -> None:
        """A real weight on ``like``'s device and dtype, for a group still on the meta device.

        ``load_state_dict(..., assign=True)`` into a collection built on ``meta`` takes the
        checkpoint's tensors; a group's tables share one weight, so it is allocated here
        and each table is copied into its rows.
        """
        self.weight = nn.Parameter(
            torch.empty(self.weight.shape, dtype=like.dtype, device=like.device),
            requires_grad=self.weight.requires_grad,
        )

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return f"rows={rows}, dim={dim}, pooling={self.pooling!r}, tables={self.tables}"

    # The tables' views save and load the values; the group itself has no checkpoint keys.
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        return

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))


class TableView(nn.Module):
    """One table's rows ``[row_offset, row_offset + num_embeddings)`` of a group's weight."""

    def __init__(
        self, group: TableGroup, row_offset: int, num_embeddings: int, pooling: str
    ) -> None:
        super().__init__()
        # Not a registered submodule: the group belongs to the collection's ``groups``.
        self.__dict__["_group"] = group
        self.row_offset = row_offset
        self.num_embeddings = num_embeddings
        self.embedding_dim = int(group.weight.shape[1])
        self.mode = pooling

    @property
    def weight(self) -> torch.Tensor:
        """This table's rows: a differentiable view of the group weight (not a leaf)."""
        return self._group.weight.narrow(0, self.row_offset, self.num_embeddings)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, "
            f"rows {self.row_offset}..{self.row_offset + self.num_embeddings} of its group"
        )

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        w = self.weight
        destination[prefix + "weight"] = w if keep_vars else w.detach()

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        for hook in self._load_state_dict_pre_hooks.values():
            hook(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        key = prefix + "weight"
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k != key)
        if key not in state_dict:
            missing_keys.append(key)
            return
        src = state_dict[key]
        shape = (self.num_embeddings, self.embedding_dim)
        if not isinstance(src, torch.Tensor):
            error_msgs.append(f'While copying the parameter named "{key}", expected a tensor.')
            return
        if tuple(src.shape) != shape:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {tuple(src.shape)} from "
                f"checkpoint, the shape in current model is {torch.Size(shape)}."
            )
            return
        if local_metadata.get("assign_to_params_buffers", False) and self._group.weight.is_meta:
            self._group.materialize(src)
        with torch.no_grad():
            self.weight.copy_(src)
