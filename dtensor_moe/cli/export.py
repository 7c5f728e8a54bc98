"""`dtensor-moe export` / `dtensor-moe import`: a checkpoint's weights as safetensors and back
(dtensor_moe.train.export), or its MoE layers under a Hugging Face family's keys with `--hf`
(dtensor_moe.train.hf_checkpoint, docs/hf.md). Bad input is one line on stderr and rc 2."""

import importlib.util
import sys
from pathlib import Path

from dtensor_moe.train.checkpoint import MANIFEST, MODEL_CONFIG, TRAIN_STATE

# train.export's names, spelled here: that module needs safetensors, which is checked before it is imported.
WEIGHTS, CONFIG = "model.safetensors", "config.json"
# What each optional package is for, and how to install it.
EXTRAS = {"safetensors": "pip install safetensors (or pip install 'dtensor_moe[train]')",
          "torchtitan": "pip install 'dtensor_moe[titan]' (torchtitan 0.3.0, torch >= 2.13)"}


def require(module: str, what: str) -> None:
    """A ValueError naming `what` needs `module` and how to install it, where it is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs {module}, which is not installed: {EXTRAS[module]}")


def add_export_arguments(parser):
    parser.add_argument("ckpt", help="checkpoint directory, or a run's checkpoint root (its latest is used); with --hf "
                                     "also a directory written by `export` or `import --hf`")
    parser.add_argument("out", nargs="?", help=f"output directory for {WEIGHTS} and {CONFIG} (not with --hf)")
    parser.add_argument("--hf", metavar="OUT_DIR", help="write the MoE layers under a Hugging Face family's keys "
                                                       "into OUT_DIR instead (docs/hf.md)")
    parser.add_argument("--model-type", help="with --hf: qwen3_moe | mixtral | deepseek_v3 | gpt_oss (recorded by "
                                             "`import --hf`, needed for the main job's weights)")
    parser.add_argument("--force", action="store_true", help=f"replace an existing {WEIGHTS} / {CONFIG} in the output "
                                                             "directory (refused without it)")
    parser.add_argument("--titan-config", metavar="NAME", help="with --hf: CKPT is a torchtitan checkpoint written "
                                                             "through `--module dtensor_moe.titan --config NAME` "
                                                             "(docs/titan.md)")


def _torchtitan_checkpoint(path: Path) -> bool:
    """A DCP checkpoint none of our savers wrote (they add a manifest, a model config and a train state):
    torchtitan's `checkpoint/step-N`. Ours with only its manifest lost is ours: the loader names the opt-in."""
    ours = (MANIFEST, MODEL_CONFIG, TRAIN_STATE)
    return (path / ".metadata").is_file() and not any((path / name).exists() for name in ours)


def _one_line_errors(command: str, fn) -> int:
    try:
        return fn()
    except ValueError as e:
        print(f"dtensor-moe {command}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _export(args) -> Path:
    require("safetensors", "dtensor-moe export")
    from dtensor_moe.train.export import export_checkpoint
    from dtensor_moe.train.hf_checkpoint import export_hf

    if args.titan_config is not None:
        if args.hf is None or args.out is not None or args.model_type is not None:
            raise ValueError("--titan-config goes with --hf alone: export CKPT --hf OUT_DIR --titan-config NAME")
        require("torchtitan", "export --titan-config (a torchtitan checkpoint)")
        from dtensor_moe.titan.hf_export import export_checkpoint_hf

        return export_checkpoint_hf(args.ckpt, args.hf, args.titan_config, args.force)
    if _torchtitan_checkpoint(Path(args.ckpt)):
        raise ValueError(f"{args.ckpt} is a torchtitan checkpoint (DCP, no {MANIFEST}); export it with "
                         f"`dtensor-moe export {args.ckpt} --hf OUT_DIR --titan-config NAME`, NAME the --config it "
                         "was trained with (docs/titan.md)")
    if args.hf is not None:
        if args.out is not None:
            raise ValueError(f"export --hf writes to its OUT_DIR ({args.hf}); drop the second positional ({args.out})")
        return export_hf(args.ckpt, args.hf, args.model_type, args.force)
    if args.out is None:
        raise ValueError(f"export CKPT needs an output: OUT (a directory for {WEIGHTS} and {CONFIG}) or --hf OUT_DIR")
    if args.model_type is not None:
        raise ValueError("--model-type goes with --hf; export CKPT OUT does not take it")
    return export_checkpoint(args.ckpt, args.out, args.force)


def run_export(args) -> int:
    return _one_line_errors("export", lambda: print(_export(args)) or 0)


def add_import_arguments(parser):
    parser.add_argument("safetensors", nargs="?", help=f"{WEIGHTS} written by `dtensor-moe export`, or its directory "
                                                      "(with --hf: the output directory)")
    parser.add_argument(
        "out_ckpt", nargs="?", help="checkpoint root to write step_<step>/ into (resume from it with --resume)"
    )
    parser.add_argument("--hf", metavar="HF_DIR", help="import the MoE layers of a Hugging Face checkpoint directory "
                                                      "instead, into the one positional OUT directory (docs/hf.md)")
    parser.add_argument("--step", type=int, default=0, help="step number to record in the checkpoint (default 0)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing step_<step>/ (its optimizer state, if any, is deleted)")


def _import(args) -> Path:
    require("safetensors", "dtensor-moe import")
    from dtensor_moe.train.export import import_weights
    from dtensor_moe.train.hf_checkpoint import import_hf

    if args.hf is not None:
        if args.safetensors is None or args.out_ckpt is not None or args.step:
            raise ValueError("import --hf HF_DIR takes exactly one positional, the output directory, and no --step")
        return import_hf(args.hf, args.safetensors, args.force)
    if args.out_ckpt is None:
        raise ValueError("import takes SAFETENSORS OUT_CKPT (or --hf HF_DIR OUT)")
    return import_weights(args.safetensors, args.out_ckpt, args.step, args.force)


def run_import(args) -> int:
    return _one_line_errors("import", lambda: print(_import(args)) or 0)
