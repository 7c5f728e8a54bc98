"""`dtensor-moe` command line: train | plan | explain | export | import.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
modules are imported lazily so `dtensor-moe plan` never pays for the training stack.
"""

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "train": ("dtensor_moe.train", "train a small MoE language model on CPU ranks or GPUs"),
    "plan": ("dtensor_moe.planner", "choose EP x EDP x ETP from memory and traffic"),
    "explain": ("dtensor_moe.explain", "show which rank owns which slice of every weight"),
    "export": ("dtensor_moe.export", "write a checkpoint's weights as safetensors"),
    "import": ("dtensor_moe.export", "read safetensors weights back into a checkpoint"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dtensor-moe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=True)
            continue
        getattr(mod, f"add_{name}_arguments", mod.add_arguments)(p)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        parser.error(f"subcommand {args.command!r} is not available in this build")
    mod = importlib.import_module(args._module)
    return getattr(mod, f"run_{args.command}", mod.run)(args) or 0


if __name__ == "__main__":
    sys.exit(main())
