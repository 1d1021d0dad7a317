"""The `reshard` command line: parse arguments, call the library, render. No logic here."""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer

from reshard.errors import ReshardError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Move distributed-training checkpoints between parallel layouts without changing what the run means.")

_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    _state["debug"] = debug or bool(os.environ.get("RESHARD_DEBUG"))


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="item", disable=not sys.stderr.isatty(), leave=False)


@app.command()
def inspect(
    ckpt: Path = typer.Argument(..., help="DCP checkpoint directory."),
    json_out: bool = typer.Option(False, "--json", help="Print the stable JSON shape (see README)."),
    deep: bool = typer.Option(False, "--deep", help="Also load every item and report the ones that fail."),
    from_spec: Optional[str] = typer.Option(None, "--from", help="Override the writer topology, e.g. dp_shard=4,tp=2."),
    trust_pickle: bool = typer.Option(False, "--trust-pickle", help="Allow object items to unpickle arbitrary classes (only for sources you trust)."),
) -> None:
    """Is a checkpoint complete, what does it hold, and which topology wrote it.

    Exit 0: complete and consistent; 1: readable but inconsistent; 2: incomplete, unsafe or unreadable.
    """
    from reshard.inspection import inspect_checkpoint
    from reshard.report import render_inspect, to_json

    bar = None
    if deep:
        from reshard.index import CheckpointIndex

        bar = _progress(CheckpointIndex.open(ckpt).item_count(), "deep check")
    result = inspect_checkpoint(ckpt, deep=deep, from_spec=from_spec, trust_pickle=trust_pickle, progress=bar)
    if bar is not None:
        bar.close()
    typer.echo(to_json(result.report) if json_out else render_inspect(result.report))
    raise typer.Exit(result.exit_code)


@app.command()
def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", help="Where the demo writes its checkpoints."),
    steps: int = typer.Option(6, "--steps", help="Optimizer steps the reference trainer runs."),
) -> None:
    """Train the reference model on 4 CPU ranks (FSDP2, gloo), save a DCP checkpoint, inspect it."""
    from reshard.demo import run_demo

    raise typer.Exit(run_demo(out, steps=steps))


def main(argv: list[str] | None = None) -> None:
    """Entry point: typer handles usage errors (exit 2); our errors become one paragraph."""
    try:
        app(args=argv, prog_name="reshard")
    except ReshardError as exc:
        if _state["debug"]:
            traceback.print_exc()
        typer.echo(f"error: {exc.render()}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one paragraph, exit 2
        if _state["debug"]:
            traceback.print_exc()
        typer.echo(f"error: unexpected {type(exc).__name__}: {exc}. Re-run with --debug for a traceback "
                   "and report it.", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
