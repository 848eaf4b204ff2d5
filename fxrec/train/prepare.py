"""TensorDict -> KJT conversion in the pipeline's host stage instead of the model's step.

A model that takes TensorDict input converts it to a KeyedJaggedTensor inside its forward
(``kjt_from_tensordict`` in fxrec's collections, or in user code). That is host work on the
critical path. The pipelines watch the first batch's forward to learn which of the batch's
TensorDicts the model converts and with which keys, then convert later batches with those
keys in their host stage (for :class:`~fxrec.train.TrainPipelineSparseDist`, the background
thread that already reads and copies the next batch) via
:func:`~fxrec.sparse.tensordict_interop.prepare_kjt`. The model still receives the same
TensorDict; its own conversion call finds the prepared KJT, so results are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tensordict import TensorDictBase

from fxrec.sparse.tensordict_interop import prepare_kjt, record_conversions

__all__ = ["TensorDictPrep"]


def _parts(batch: Any) -> list[Any]:
    """The sparse object of a batch, or each element of a tuple/list of them."""
    sparse = getattr(batch, "sparse", None)
    return list(sparse) if isinstance(sparse, (tuple, list)) else [sparse]


class TensorDictPrep:
    """Learns the model's conversions on one batch; repeats them ahead on later batches."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        # part index -> key lists the model converted it with; None until a batch is probed
        self.plan: dict[int, list[list[str]]] | None = None if enabled else {}

    @contextlib.contextmanager
    def probe(self, batch: Any) -> Iterator[None]:
        """Run the model's forward on ``batch`` inside this to learn the plan (once)."""
        if self.plan is not None:
            yield
            return
        parts = _parts(batch)
        if not any(isinstance(p, TensorDictBase) for p in parts):
            self.plan = {}
            yield
            return
        with record_conversions() as log:
            yield  # a forward that raises leaves the plan unset: the next batch probes
        plan: dict[int, list[list[str]]] = {}
        for td, keys in log:  # other threads' conversions are in the log too: match by id
            for i, p in enumerate(parts):
                if td is p and keys not in plan.setdefault(i, []):
                    plan[i].append(keys)
        self.plan = plan

    def apply(self, batch: Any) -> int:
        """Convert ``batch``'s TensorDicts as the model will, keeping the KJTs with them.

        Returns how many conversions were done. A conversion that fails is left to the model,
        which then raises in its own step.
        """
        plan = self.plan
        if not plan:
            return 0
        done = 0
        parts = _parts(batch)
        for i, key_lists in plan.items():
            td = parts[i] if i < len(parts) else None
            if not isinstance(td, TensorDictBase):
                continue
            for keys in key_lists:
                try:
                    prepare_kjt(td, keys)
                except Exception:  # the model reports it, as it would without this stage
                    continue
                done += 1
        return done
