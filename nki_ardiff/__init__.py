"""The face of nki-ardiff: the ``rolling-forcing`` command line (``nki_ardiff.cli``, entry point
``nki_ardiff.entry:main``, ``python -m nki_ardiff``) over the streaming pipeline (:mod:`rolling_forcing`),
its sharded stream (:mod:`sharding`), the live server (:mod:`rolling_forcing.serve`) and the benchmarks
(:mod:`perf`). Imports run one way: this package imports those, none of them imports it."""
