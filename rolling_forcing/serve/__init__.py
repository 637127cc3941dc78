"""``rolling-forcing serve``: watch and steer live streams in the browser (FastAPI + uvicorn).

Modules (nothing is built at import; the model is built when the app starts):

* :mod:`rolling_forcing.serve.config`   -- frozen ``ServeConfig``
* :mod:`rolling_forcing.serve.playout`  -- playout buffer, playback clock, start threshold (pure maths)
* :mod:`rolling_forcing.serve.engine`   -- shared model, a session's ``LiveStream``, image encoding
* :mod:`rolling_forcing.serve.session`  -- a viewer's session, prompt rules, JSON report
* :mod:`rolling_forcing.serve.manager`  -- admission, the interleaving scheduler, reaper, metrics
* :mod:`rolling_forcing.serve.metrics`  -- Prometheus text format
* :mod:`rolling_forcing.serve.guard`    -- Host / Origin checks of a loopback server
* :mod:`rolling_forcing.serve.page`     -- the single static page
* :mod:`rolling_forcing.serve.app`      -- ``create_app`` (needs the ``serve`` extra: fastapi)
* :mod:`rolling_forcing.serve.command`  -- the ``serve`` subcommand (uvicorn)
* :mod:`rolling_forcing.serve.bench`    -- batched vs interleaved streams on CPU (measured)

See docs/serve.md.
"""
