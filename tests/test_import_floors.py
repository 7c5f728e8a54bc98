"""The package's layers, from the imports themselves: no import runs up a layer, no two files import each other.

A layer may import only the layers below it (every import counts, also those inside functions). The core (the
MoE layer, no parallelism) has floors of its own, bottom to top:

    base      validate, config, durable, corpus, grad_scale   checks, configs, files: no torch modules
    kernels   kernels/    registered ops, the experts' autograd, what checkpointing keeps and recomputes
    routing   routing/    router, routing tables, capacity, token rounding
    experts   experts     the experts module
    moe       moe, the package's __init__                     the layer
    replay    replay      routing replay (hooks MoE layers)
    parallel  parallel/   meshes, the placement plan, dispatch, ExpertParallel, parallelize_moe
    hf        hf/         Hugging Face MoE layers <-> ours
    tools     tools/      the folding search and its model presets (torch-free)
    train     train/      the main job: its model, dense parallelism, loop, checkpoints, exports
    titan     titan/, titan_data/  the torchtitan hook
    cli       cli/        the `dtensor-moe` commands
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dtensor_moe"
LAYERS = ("base", "kernels", "routing", "experts", "moe", "replay", "parallel", "hf", "tools", "train", "titan", "cli")
FOLDER_LAYER = {"kernels": "kernels", "routing": "routing", "experts": "experts", "moe": "moe", "replay": "replay",
                "parallel": "parallel", "hf": "hf", "tools": "tools", "train": "train", "titan": "titan",
                "titan_data": "titan", "cli": "cli"}
BASE = ("validate", "config", "durable", "corpus", "grad_scale")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    """The layer of `module` (a dotted name under dtensor_moe); the package's __init__ sits with the layer it
    hands on."""
    parts = module.split(".")
    if len(parts) == 1:
        return "moe"
    if parts[1] in BASE:
        return "base"
    assert parts[1] in FOLDER_LAYER, f"{module}: a file of no layer; give it one (BASE or FOLDER_LAYER above)"
    return FOLDER_LAYER[parts[1]]


def _imports(path: Path) -> set[str]:
    """The dtensor_moe modules a file imports (a `from pkg import name` counts as pkg.name where that is a module)."""
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == "dtensor_moe"}


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def test_no_import_runs_up_a_layer():
    up = sorted(f"{m} ({_layer(m)}) imports {i} ({_layer(i)})" for m, imps in _graph().items() for i in imps
                if LAYERS.index(_layer(i)) > LAYERS.index(_layer(m)))
    assert not up, "imports that run up a layer:\n  " + "\n  ".join(up)


def test_no_import_circles():
    graph = _graph()
    # A package's __init__ that only hands names on is imported by its own modules' imports: not a circle.
    edges = {m: {i for i in imps if not m.startswith(i + ".")} for m, imps in graph.items()}
    circles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for i in sorted(edges[m]):
            if state.get(i) == "open":
                circles.append(" -> ".join(stack[stack.index(i):] + [i]))
            elif i not in state:
                visit(i, stack + [i])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, "files that import each other:\n  " + "\n  ".join(circles)
