"""Video quality of the streaming pipeline, read from decoded frames (docs/quality.md).

``detect``: shapes by colour from uint8 frames; ``metrics``: pure functions over detections (presence,
chunk-boundary continuity, drift, prompt-switch latency); ``streams``: the model adapter and stream
runner; ``compare``: decoded-video PSNR and metrics side by side; ``sheet``: PNG contact sheets.
"""
