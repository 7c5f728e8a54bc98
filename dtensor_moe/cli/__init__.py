"""`dtensor-moe` command line: train | plan | explain | export | import.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
only the chosen subcommand's module is imported, so `dtensor-moe plan` never pays for training.
"""

import argparse
import contextlib
import importlib
import signal
import sys
import threading

__all__ = ["main", "SUBCOMMANDS"]

SUBCOMMANDS = {
    "train": ("dtensor_moe.cli.train", "train a small MoE language model on CPU ranks or GPUs"),
    "plan": ("dtensor_moe.cli.plan", "rank the foldings (pp, dp, cp, tp; EDP, EP, ETP) by memory and traffic"),
    "explain": ("dtensor_moe.cli.explain", "show which rank owns which slice of every weight"),
    "export": ("dtensor_moe.cli.export", "write a checkpoint's weights as safetensors"),
    "import": ("dtensor_moe.cli.export", "read safetensors weights back into a checkpoint"),
}


def _is_override(arg: str) -> bool:
    return not arg.startswith("-") and "=" in arg


class Stopped(BaseException):
    """SIGTERM or SIGHUP outside the launcher's own handling (before launch: tokenizing, exporting): raised where the
    process is, so every writer's cleanup runs (no temporary file or folder is left), then one line and 128 + N."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


@contextlib.contextmanager
def _signals_unwind():
    """SIGTERM / SIGHUP raise Stopped for the command's duration (SIGINT raises KeyboardInterrupt already); the
    launcher installs its own handlers while ranks run and gives these back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv=None) -> int:
    """Runs `dtensor-moe` (the console script's entry point): `argv` (default sys.argv[1:]) names a subcommand
    and its arguments; returns the exit status (130 after Ctrl-C, 128 + N after signal N, nothing left behind)."""
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "dtensor-moe"
    try:
        with _signals_unwind():
            return _main(argv)
    except KeyboardInterrupt:
        print(f"dtensor-moe {command}: interrupted (Ctrl-C); its temporary files were removed", file=sys.stderr)
        return 128 + signal.SIGINT
    except Stopped as e:
        print(f"dtensor-moe {command}: stopped by {e}; its temporary files were removed", file=sys.stderr)
        return 128 + e.signum


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dtensor-moe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:  # only the chosen subcommand's module is imported
            mod = importlib.import_module(module)
            (getattr(mod, f"add_{name}_arguments", None) or mod.add_arguments)(p)
    args, extra = parser.parse_known_args(argv)
    # argparse takes only one run of positionals: `k=v` overrides after later options land here.
    if extra and isinstance(getattr(args, "overrides", None), list) and all(_is_override(e) for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    mod = importlib.import_module(SUBCOMMANDS[args.command][0])
    return (getattr(mod, f"run_{args.command}", None) or mod.run)(args) or 0
