"""Rolling Forcing on a Wan2.1-style causal DiT.

Modules (import what you need; nothing happens at import time):

* :mod:`rolling_forcing.config`   -- frozen ``ModelConfig`` / ``PipelineConfig``, presets, derived sizes
* :mod:`rolling_forcing.schedule` -- pure window / level / slot / position / key-segment maths
* :mod:`rolling_forcing.cache`    -- the rolling KV cache (sink slot + ring) and the text k/v cache
* :mod:`rolling_forcing.model`    -- ``CausalWanModel`` (Wan2.1 key names; RoPE/attention through
  ``nki_kernels.ops``)
* :mod:`rolling_forcing.pipeline` -- ``RollingForcingPipeline.stream`` yielding final ``Chunk`` s
* :mod:`rolling_forcing.driver`   -- the one stream driver (unsharded and sharded) and its pure helpers
* :mod:`rolling_forcing.passes`   -- the unsharded stream's forwards (attention closures over the cache)
* :mod:`rolling_forcing.merged`   -- the merged, static-shape forward (cache update + denoise in one)
"""
