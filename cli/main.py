"""Entry point of the ``kvbridge`` command.

Exit codes, for every command: 0 ok, 1 validation or verification failure (a bad or corrupted
file, a failed check, a write that could not be done), 2 usage (a bad option or argument),
130 interrupted (Ctrl-C), 143 / 129 terminated by SIGTERM / SIGHUP (cleaned up like Ctrl-C).
Every error is one line on stderr (``--debug`` adds the traceback).
Command modules are imported only when their command runs, so ``kvbridge --help`` needs
neither torch nor numba.
"""

from __future__ import annotations

import importlib
import signal
import sys

import click

from kvbridge._version import __version__
from kvbridge.errors import KVBridgeError

#: Command name -> (module under this package defining ``command``, one-line help for the listing).
COMMANDS = {
    "layouts": ("layouts_cmd", "List the KV layouts: bytes per token, pages, fields, dialects."),
    "inspect": ("inspect_cmd", "Show what a dump holds: layouts, tokens, checksums, NaN, scales."),
    "convert": ("convert_cmd", "Convert a dump to another layout (streamed, atomic, loss report)."),
    "verify": ("verify_cmd", "Run the conformance fixtures; pass/fail per layout and dialect."),
    "demo": ("demo_cmd", "Synthetic DeepSeek-V4 request: TensorRT-LLM FP8 -> MODEL1 -> back."),
    "migrate": ("migrate_cmd", "Plan, run or check a DeepSeek-V4 request migration."),
    "accuracy": ("accuracy_cmd", "Accuracy study: per-tensor FP8 against per-tile MODEL1."),
    "bench": ("bench_cmd", "Throughput of transcode/encode/decode against a memory copy."),
    "serve-sglang-prefill": ("adapter_sglang_cmd", "Be the prefill server of an SGLang decode (PD over NIXL)."),
    "sglang-decode": ("adapter_sglang_decode_cmd", "Be the decode server of an SGLang prefill (PD over NIXL)."),
    "vllm-config": ("adapter_vllm_cmd", "Print vLLM's --kv-transfer-config for the kvbridge connector."),
    "pd-proxy": ("pd_proxy_cmd", "Drive an SGLang and a vLLM server as one request's prefill and decode."),
}

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, docker, systemd) or SIGHUP (a closed terminal), raised where the command
    is, so it cleans up (temp files, connections, agents) exactly as after Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, frame) -> None:
    raise Terminated(signum)


class Failure(click.ClickException):
    """A one-line failure with exit code 1 (validation or verification)."""

    exit_code = EXIT_FAILURE


def _usage_line(exc: click.UsageError) -> str:
    """A usage error as one line: click's message, then where to look for help."""
    where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
    return f"Error: {' '.join(exc.format_message().split())}{where}"


class KVBridgeGroup(click.Group):
    """Lazy subcommands, library errors as one readable line, and the exit-code scheme above."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, short_help = COMMANDS[name]
        command = importlib.import_module(f".{module}", __package__).command
        command.short_help = command.short_help or short_help
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command listing of ``--help``, from ``COMMANDS`` (imports no command module)."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_line) for name, (_, help_line) in COMMANDS.items()])

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, KeyboardInterrupt):
            raise
        except (KVBridgeError, OSError, MemoryError) as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise Failure(" ".join(str(exc).split()) or type(exc).__name__) from None
        except Exception as exc:  # an unexpected bug: still one line unless --debug
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise Failure(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)") from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run the command; errors print one line and exit with the scheme's code."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _terminate)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            click.echo(_usage_line(exc), err=True)
            sys.exit(EXIT_USAGE)
        except click.ClickException as exc:
            click.echo(f"Error: {' '.join(exc.format_message().split())}", err=True)
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt) as exc:
            cause = exc if isinstance(exc, Terminated) else exc.__cause__  # click wraps it in Abort
            if isinstance(cause, Terminated):
                click.echo(f"Error: terminated ({cause})", err=True)
                sys.exit(128 + cause.signum)
            click.echo("Error: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


@click.group(cls=KVBridgeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvbridge")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Move DeepSeek-V4 KV caches between TensorRT-LLM, FlashMLA, SGLang and vLLM layouts.

    Exit codes: 0 ok, 1 validation or verification failure, 2 usage error, 130 interrupted.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main() -> None:
    cli.main(prog_name="kvbridge")


if __name__ == "__main__":
    main()
