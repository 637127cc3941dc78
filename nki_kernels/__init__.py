"""nki-ardiff: NKI kernels for real-time autoregressive video diffusion on Trainium2."""
