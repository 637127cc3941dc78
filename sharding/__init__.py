"""Hybrid TP (heads) x SP (queries/tokens) sharding of attention across NeuronCores.

Submodules (imported explicitly; nothing is imported here, so ``python -m sharding.plan`` works and the
package import has no side effects):

* ``sharding.plan``: pure planner (no torch): ``plan``, ``plan_table``, ``ShardingPlan``, ``CommModel``.
* ``sharding.attention``: sharded attention on ``torch.distributed``: ``build_groups``,
  ``sharded_attention``, ``local_heads``, ``local_tokens``, ``token_splits``.
* ``sharding.launch``: spawn gloo ranks on CPU: ``launch``, ``LaunchError``.
"""
