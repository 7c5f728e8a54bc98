"""Every patch the torchtitan hook makes to torchtitan 0.3.0 and torch, each with what it fixes and when it can go.

Two kinds, by reach:
- process-wide (`install()`, at import of the hook's trainer, idempotent): only the alias torch lacks; it adds a
  name and changes nothing that anything in the process already had. Import time, not the hook Trainer's
  `__init__`: torchtitan's own Trainer run under `--module dtensor_moe.titan` (the reference config
  `deepseek_v3_debugmodel_cpu_titan_ep`) needs it too and never builds ours.
- scoped to the hook's Trainer: applied to its class (`train_step_clipping_by_mesh`) or to the objects it owns
  (its pipeline schedule, model parts, checkpointer), never to torchtitan's module globals, so torchtitan's own
  Trainer in the same process (the test suite's references) runs as torchtitan wrote it.

Not here, being the hook's design rather than version skew: `ExpertMeshParallelDims.ep_enabled` (trainer.py:
torchtitan's switch for the expert-count sum over tp), the MoEs' `_sharding_config` cleared before torchtitan's
dense TP (parallelize_titan.py: how torchtitan 0.3.0's Module protocol leaves a module out of `Module.parallelize`) and
the `config.json` added to the last step's HF save (trainer.py: a file torchtitan does not write).
"""

import functools
import inspect
import types

import torch
import torch.distributed as dist
import torchtitan.distributed.utils as titan_dist_utils
from torchtitan.models.common.moe import MoE

from dtensor_moe.train.optim import clip_grad_norm_


def install() -> None:
    """The process-wide patches; calling it again changes nothing."""
    _alias_set_timeout()


def _alias_set_timeout() -> None:
    """torchtitan 0.3.0 calls `torch.distributed.set_timeout(timeout, group)` after the first step
    (`set_pg_timeouts`), an API that torch 2.13.0 has only under its private name `_set_pg_timeout` (same
    signature). Only where torch lacks it; remove when every torch the hook runs on has
    `torch.distributed.set_timeout`."""
    if hasattr(dist, "set_timeout"):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.set_timeout = _set_pg_timeout


def train_step_clipping_by_mesh(train_step):
    """torchtitan's `Trainer.train_step`, as its code stands, clipping with `_clip_grad_norm_by_mesh`.

    The copy shares torchtitan's code object (tracebacks name torchtitan's lines) and reads torchtitan.trainer's
    globals live, except `dist_utils`, which it sees with `clip_grad_norm_` replaced: the hook's Trainer class
    gets this copy once, and torchtitan's module and its own Trainer stay untouched. Refused at import where
    torchtitan's train_step no longer clips through `dist_utils.clip_grad_norm_` (a torchtitan other than
    0.3.0). Remove when torchtitan's clipping takes a norm per mesh (or a norm function): see
    `_clip_grad_norm_by_mesh`."""
    code = train_step.__code__
    module = inspect.getmodule(train_step)
    if not {"dist_utils", "clip_grad_norm_"} <= set(code.co_names) or \
            getattr(module, "dist_utils", None) is not titan_dist_utils:
        raise RuntimeError(f"{train_step.__qualname__} of {module.__name__} does not clip through "
                           "torchtitan.distributed.utils.clip_grad_norm_ as torchtitan 0.3.0's does: "
                           "dtensor_moe.titan needs torchtitan 0.3.0")
    dist_utils = _Overlay(titan_dist_utils, clip_grad_norm_=_clip_grad_norm_by_mesh)
    copy = types.FunctionType(code, _LiveGlobals(module, dist_utils=dist_utils), code.co_name,
                              train_step.__defaults__, train_step.__closure__)
    copy.__kwdefaults__ = train_step.__kwdefaults__
    return functools.update_wrapper(copy, train_step)


class _Overlay:
    """A module with some of its names replaced; every other name is the module's, read when asked."""

    def __init__(self, module: types.ModuleType, **names):
        self._module = module
        vars(self).update(names)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class _LiveGlobals(dict):
    """A function's globals: `names`, then the module's own, read at each lookup (not a copy), so a later
    change to one of the module's names (a test's patch) reaches the function too. CPython looks a global up
    through `__getitem__` (and so `__missing__`) where the globals are a dict subclass."""

    def __init__(self, module: types.ModuleType, **names):
        super().__init__(names, __builtins__=vars(module)["__builtins__"])
        self._module_dict = vars(module)

    def __missing__(self, name: str):
        return self._module_dict[name]


def _clip_grad_norm_by_mesh(parameters, max_norm, *, foreach, pp_mesh, ep_enabled):
    """torchtitan's clipping under EP takes one norm of the weights on meshes with an "ep" axis and
    one of the rest, but our parameters are DTensors on more meshes than two (under TP: the dense
    (fsdp, tp) weights and the MoEs' router and shared experts on the mesh of every rank with its own
    tokens), which one norm cannot stack. The main job's clipping norms each mesh on its own (the
    same global norm); same arguments as torchtitan's call in Trainer.train_step."""
    return clip_grad_norm_(parameters, max_norm, None if pp_mesh is None else pp_mesh.get_group())


def accept_premade_microbatches(schedule) -> None:
    """torchtitan 0.3.0 calls `schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)` with the
    microbatches already split; torch 2.13's `step(*args, target=, **kwargs)` takes the whole batch
    and forwards unknown keywords to the model (`forward() got an unexpected keyword argument
    'arg_mbs'`). torchtitan's microbatches are equal-size dataloader batches, so their
    concatenation along the batch dim is the whole local batch, which torch's step splits back into
    the same microbatches. This schedule's step only, and only where it lacks `arg_mbs`; remove when every
    torch the hook runs on has a `step` that takes `arg_mbs`."""
    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        return
    whole_batch_step = schedule.step

    # torch's `eval` calls `self.step(..., target=None, ...)`: torchtitan's validator reaches here too.
    def step(*, arg_mbs=None, kwarg_mbs=None, target_mbs=None, target=None, **step_kwargs):
        args = tuple(torch.cat(a) for a in zip(*arg_mbs)) if arg_mbs else ()
        model_kwargs = {k: torch.cat([kw[k] for kw in kwarg_mbs]) for k in kwarg_mbs[0]} if kwarg_mbs else {}
        target = torch.cat(target_mbs) if target_mbs else target
        return whole_batch_step(*args, target=target, **step_kwargs, **model_kwargs)

    schedule.step = step


def uncount_shape_inference(model_part) -> None:
    """torchtitan 0.3.0 builds its pipeline stages without static metadata, so torch runs each
    stage's model part once more before the first microbatch to infer shapes (the first stage on a
    copy of that microbatch, the others on uninitialized tensors). That forward would add to the MoEs'
    token counts, and so to the first expert-bias update: the counts are put back after it. One pair of
    hooks on this model part, gone after its first forward. Remove when torchtitan gives its stages static
    metadata (`PipelineStage(input_args=...)`): with no inference forward these hooks would drop the first
    microbatch's counts instead."""
    moes = [m for m in model_part.modules() if isinstance(m, MoE)]
    saved = []

    def before(module, args):
        saved.extend((moe, moe.tokens_per_expert_E.clone()) for moe in moes)

    def after(module, args, output):
        for moe, counts in saved:
            moe.tokens_per_expert_E.copy_(counts)
        pre.remove()
        post.remove()

    pre, post = model_part.register_forward_pre_hook(before), model_part.register_forward_hook(after)


def save_off_interval(checkpointer, step: int) -> None:
    """Saves `step` in full (model, optimizer, data loader) although `checkpoint.interval` would not.

    torchtitan 0.3.0's `CheckpointManager.save(step)` saves only where its `_should_save` says so (the
    interval, step 1, or the last step, which may be model-only) and has no way to force a full save: this
    checkpointer's `_should_save` says yes for this one call, the class's untouched. Remove when torchtitan's
    save can be forced."""
    checkpointer._should_save = lambda *_: True
    try:
        checkpointer.save(step)
    finally:
        del checkpointer._should_save
