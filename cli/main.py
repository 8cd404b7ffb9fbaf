"""Entry point of the ``kvbridge`` command. Exit codes: 0 ok, 1 validation/verification failure, 2 usage."""

from __future__ import annotations

import importlib
import sys

import click

from kvbridge import __version__
from kvbridge.errors import KVBridgeError

#: Modules under ``cli`` that each define ``command`` (a click command or group).
COMMAND_MODULES = ("layouts_cmd", "inspect_cmd", "convert_cmd", "verify_cmd", "demo_cmd", "migrate_cmd",
                   "accuracy_cmd", "bench_cmd")


class Failure(click.ClickException):
    """A one-line failure with exit code 1 (validation or verification)."""

    exit_code = 1


class KVBridgeGroup(click.Group):
    """Turns library errors into one readable line (full traceback with ``--debug``)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (KVBridgeError, OSError) as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise Failure(str(exc)) from None
        except Exception as exc:  # an unexpected bug: still one line unless --debug
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise Failure(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)") from None


@click.group(cls=KVBridgeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvbridge")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Move DeepSeek-V4 KV caches between TensorRT-LLM, FlashMLA, SGLang and vLLM layouts."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


for _name in COMMAND_MODULES:
    cli.add_command(importlib.import_module(f"cli.{_name}").command)


def main() -> None:
    cli.main(prog_name="kvbridge", standalone_mode=True)


if __name__ == "__main__":
    sys.exit(main())
