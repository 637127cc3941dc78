"""``rolling-forcing bench kernels|e2e``: the perf/ benchmarks' ``main(argv)``, arguments passed through."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import typer

from nki_ardiff.cli_checks import CliError
from nki_ardiff.cli_errors import reported_errors

bench_app = typer.Typer(
    help="Benchmarks (perf/): kernels on the emulator + cost model, end-to-end model.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def run_module_main(module: str, args: Sequence[str]) -> None:
    """Import ``module`` and call its ``main(list(args))``; a non-zero int result becomes the exit code."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise CliError(
                "bench", f"{module} is not available in this checkout ({exc}); see perf/ in the README"
            ) from None
        raise
    main_fn = getattr(mod, "main", None)
    if main_fn is None:
        raise CliError("bench", f"{module} has no main() entry point")
    result = main_fn(list(args))
    # a benchmark's main() returns its exit status (an int) or what it produced (rows: success)
    if isinstance(result, int) and not isinstance(result, bool) and result != 0:
        raise typer.Exit(code=result)


@bench_app.command("kernels", context_settings=_PASS_THROUGH)
def bench_kernels(ctx: typer.Context) -> None:
    """Kernel benchmarks (perf.bench_kernels); extra arguments are passed through."""
    with reported_errors("bench", ctx):
        run_module_main("perf.bench_kernels", ctx.args)


@bench_app.command("e2e", context_settings=_PASS_THROUGH)
def bench_e2e(ctx: typer.Context) -> None:
    """End-to-end model (perf.e2e); extra arguments are passed through."""
    with reported_errors("bench", ctx):
        run_module_main("perf.e2e", ctx.args)


__all__ = ["bench_app", "run_module_main"]
