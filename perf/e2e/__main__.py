"""``python -m perf.e2e``."""

from perf.e2e.cli import main

raise SystemExit(main())
