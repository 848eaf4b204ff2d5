"""Sharded embeddings on ``torch.distributed`` (gloo on CPU, NCCL on GPU, via torchrun).

``shard(ebc)`` places an embedding collection's tables on ranks (``row_wise=[...]`` splits
the named tables by rows over every rank instead); ids and pooled embeddings
travel by all-to-all, each written as a request and a wait so that the overlap pass
(``rules=[..., "overlap_comm"]``) can run independent compute while they are in flight.
"""

from __future__ import annotations

from fxrec.distributed.clip import clip_grad_norm_
from fxrec.distributed.comm import CommError, CommStats, MissingBatch, init_distributed, stats
from fxrec.distributed.ddp import ignore_sharded_in_ddp, rank_local_names
from fxrec.distributed.plan import ShardingPlan, TableSpec, greedy_plan
from fxrec.distributed.sharded_ebc import ShardedEmbeddingBagCollection, shard, table_specs

__all__ = [
    "CommError",
    "MissingBatch",
    "CommStats",
    "ShardedEmbeddingBagCollection",
    "ShardingPlan",
    "TableSpec",
    "clip_grad_norm_",
    "greedy_plan",
    "ignore_sharded_in_ddp",
    "init_distributed",
    "rank_local_names",
    "shard",
    "stats",
    "table_specs",
]
