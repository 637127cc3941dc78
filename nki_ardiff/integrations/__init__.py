"""Ways into the project's kernels from models that live elsewhere (``docs/integrate.md``).

* :mod:`nki_ardiff.integrations.diffusers`: an attention processor for diffusers' ``WanTransformer3DModel``
  (self-attention through ``ops.rope3d_tables`` + ``ops.attention``, cross-attention through
  ``ops.attention``), installed with :func:`~nki_ardiff.integrations.diffusers.install_nki_attention`.
* :mod:`nki_ardiff.integrations.diffusers_stream`: a diffusers-format Wan checkpoint (a
  ``WanTransformer3DModel`` or its ``save_pretrained`` directory) streamed by the project's driver
  (:class:`rolling_forcing.pipeline.RollingForcingPipeline`, every method, ring cache, merged forward).

Neither module imports diffusers at import time; the functions that need it import it when called.
"""
