"""`dtensor-moe` command line: train | plan | explain | export | import.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
only the chosen subcommand's module is imported, so `dtensor-moe plan` never pays for training.
"""

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

SUBCOMMANDS = {
    "train": ("dtensor_moe.cli.train", "train a small MoE language model on CPU ranks or GPUs"),
    "plan": ("dtensor_moe.cli.plan", "choose EP x EDP x ETP from memory and traffic"),
    "explain": ("dtensor_moe.cli.explain", "show which rank owns which slice of every weight"),
    "export": ("dtensor_moe.cli.export", "write a checkpoint's weights as safetensors"),
    "import": ("dtensor_moe.cli.export", "read safetensors weights back into a checkpoint"),
}


def _is_override(arg: str) -> bool:
    return not arg.startswith("-") and "=" in arg


def main(argv=None) -> int:
    """Runs `dtensor-moe` (the console script's entry point): `argv` (default sys.argv[1:]) names a subcommand
    and its arguments; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
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
