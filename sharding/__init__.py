"""Hybrid TP (heads) x SP (queries/tokens) sharding of attention across NeuronCores.

``sharding.plan`` is pure (no torch); ``sharding.attention`` and ``sharding.launch`` need
``torch.distributed`` and are imported explicitly by callers.
"""

from sharding.plan import (
    Alternative,
    AttentionShape,
    CommEstimate,
    CommModel,
    ShardingPlan,
    is_legal_group_size,
    plan,
    plan_table,
)

__all__ = [
    "Alternative",
    "AttentionShape",
    "CommEstimate",
    "CommModel",
    "ShardingPlan",
    "is_legal_group_size",
    "plan",
    "plan_table",
]
