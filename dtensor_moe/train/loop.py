"""The main job's training loop, run by every rank: build, parallelize, train, checkpoint, summarize.

`dtensor-moe train` (dtensor_moe/cli/train.py) starts the ranks; `python -m dtensor_moe.train.loop
CONFIG_JSON RUN_DIR` runs the 1-process parity reference.
"""

import json
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict
from datetime import timedelta

from dtensor_moe.train.config import Config
from dtensor_moe.train.supervision import LAUNCHED, ROW_CAP_RC, RankSupervision, write_stopped


def parallel_dims(cfg: Config, world: int):
    from dtensor_moe.parallel.mesh import MoEParallelDims

    p = cfg.parallel
    return MoEParallelDims(world, dp_replicate=p.dp_replicate, cp=p.cp, tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp)


def train_ranks(cfg: Config, run_dir: str, args=None, label: str = "train", moe_slices: tuple[int, int] | None = None
                ) -> None:
    """The training loop, run by every rank (environment set by torchrun). A stop signal ends it after the step
    every rank agrees on, saved; a non-finite loss or gradient norm before that step's update (supervision.py).
    `moe_slices` (dp, seq): the parity reference's MoE layers run the run's per-rank slices (train/reference.py)."""
    with RankSupervision(run_dir, int(os.environ.get("RANK", 0))) as supervision:
        _train(cfg, run_dir, args, label, supervision, moe_slices)


def _train(cfg: Config, run_dir: str, args, label: str, supervision: RankSupervision,
           moe_slices: tuple[int, int] | None = None) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dtensor_moe.parallel.dispatch import RowCapExceeded
    from dtensor_moe.parallel.placement import plan_moe
    from dtensor_moe.train.checkpoint import SaveError
    from dtensor_moe.train.data import data_fingerprint, load_data, rank_batches
    from dtensor_moe.train.loss import lm_loss
    from dtensor_moe.train.metrics import ExpertLoad, RunWriter, load_summary, local_state_bytes, peak_memory_bytes
    from dtensor_moe.train.model import build_model
    from dtensor_moe.train.optim import build_optimizer, build_scheduler, clip_grad_norm_
    from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer
    from dtensor_moe.train.parallel.pipeline import Pipeline, stage_view

    # The grad-norm all-reduce over the 3-axis expert mesh is one scalar per axis; not worth a warning per rank.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # Under TP the logits are the head's replicated DTensor output as a local view; only the loss reads them.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoETransformer\) returned a view tensor")
    # Inductor advises TF32 for every float32 matmul it compiles. A float32 job asked for float32, and in a bf16 job
    # the one float32 matmul is the router's gate, kept so on purpose (routing/router.py): TF32 would round the routing.
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication")
    p, t = cfg.parallel, cfg.training
    backend = p.resolved_backend
    if p.device == "cuda":
        # Under gloo several local ranks may share a GPU (the launcher refuses more ranks than GPUs under nccl).
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # device_id binds NCCL to this rank's GPU up front (else every barrier warns that it guesses); gloo takes none.
    # The launcher's heartbeat watchdog stops a stalled job at timeout_s with one line naming the rank; the
    # collectives' own timeout comes a minute later, so it never races the watchdog into a traceback per rank
    # (it alone acts under an outside torchrun). The rendezvous shares it: a busy machine's slow start is no stall.
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None,
                            timeout=timedelta(seconds=p.timeout_s + 60))
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = parallel_dims(cfg, world)

    torch.manual_seed(t.seed)  # same full weights on every rank before sharding
    model = build_model(cfg.model, cfg.moe_run).to(device)
    n_params = sum(p.numel() for p in model.parameters())  # counted before sharding: the whole model
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if t.dtype == "bf16" else None

    def parallelize(module):
        if cfg.model.hf_path:
            from dtensor_moe.hf.model import parallelize_hf_model

            parallelize_hf_model(module, dims, device_type=device.type, mp_policy=mp,
                                 activation_checkpoint=t.activation_checkpoint)
        else:
            parallelize_transformer(module, dims, device_type=device.type, mp_policy=mp, compile=t.compile,
                              activation_checkpoint=t.activation_checkpoint)

    pp_group = None
    if p.pp > 1:
        pp_mesh = dims.build_meshes(device.type).pp
        pp_group = pp_mesh.get_group()
        act_dtype = torch.bfloat16 if t.dtype == "bf16" else torch.get_default_dtype()
        pipe = Pipeline(model, pp_mesh, p.pp_schedule, p.num_microbatches,
                        t.global_batch // (dims.dp_replicate * dims.dp_shard), t.seq_len // dims.cp,
                        t.seq_len // (dims.cp * dims.tp), act_dtype, device, parallelize, t.loss_chunk_tokens)
        parts, forward_backward, rollout, loss_fn = pipe.parts, pipe.step, pipe.rollout, None
    else:
        parallelize(model)
        if moe_slices is not None:
            from dtensor_moe.train.reference import slice_moe_layers

            slice_moe_layers(model, *moe_slices)
        loss_fn = lm_loss(model, t.loss_chunk_tokens)
        parts, forward_backward = [model], _accumulating(model, p.num_microbatches, loss_fn)
        rollout = _rollout(model, p.num_microbatches)
    if t.routing_replay:
        forward_backward = _replaying(parts, rollout, forward_backward)
    del model  # with pp > 1 each stage holds a copy of its own layers
    # One module with the original parameter names over this rank's stages: optimizer and checkpoints.
    model = stage_view(parts)
    load = ExpertLoad(parts, dims, cfg.model, cfg.moe_run.expert_replicas, device)
    optimizer = build_optimizer(model, t.lr, t.weight_decay)
    scheduler = build_scheduler(optimizer, t.warmup_steps, t.steps, t.min_lr_ratio)
    train_tokens, held_tokens, data_info = load_data(cfg)
    batches, eval_batches = rank_batches(cfg, dims, rank, train_tokens, held_tokens, data_info.get("cache"))
    evaluate = None if eval_batches is None else _evaluator(parts, pipe if p.pp > 1 else None, loss_fn,
                                                            eval_batches, p.num_microbatches, dims, device)

    ckpt = _checkpointing(args, run_dir, t.steps, data_fingerprint(cfg, data_info.get("cache")))
    start = ckpt.resume(model, optimizer, scheduler)
    writer = RunWriter(run_dir, t.steps, resumed_at=start, label=label) if rank == 0 else None
    tokens_per_step = t.global_batch * t.seq_len
    state = None
    for step in range(start, t.steps):
        supervision.beat(step)
        t0 = time.perf_counter()
        inputs_BL, targets_BL = (b.to(device) for b in batches(step))
        try:
            ce, aux = forward_backward(inputs_BL, targets_BL)
        except RowCapExceeded as e:
            # Raised in one EP group's forward: the other ranks wait in a collective that will never complete. Our
            # launcher stops every rank on reading the note (waited for here, so torchrun has no failure to
            # report); under an outside torchrun this rank leaves and torchrun stops the rest.
            write_stopped(run_dir, "row cap", step + 1, what=str(e), last_checkpoint=ckpt.last())
            if LAUNCHED in os.environ:
                time.sleep(60)
            os._exit(ROW_CAP_RC)
        grad_norm = clip_grad_norm_(model.parameters(), t.max_norm, pp_group)
        # One small all-gather per step for loss, aux loss, each rank's peak memory (float64 holds byte counts
        # exactly), its stop vote and its stage's expert load (summed on the device: no host sync of its own).
        # Ranks' batches are equal-sized: the mean of means is the global mean.
        # Stages are outermost: the cross-entropy is the last stage's, the aux loss sums over stages.
        local = torch.cat([torch.tensor([ce, aux, peak_memory_bytes(device), supervision.flag], dtype=torch.float64,
                                        device=device), load.measure()])
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        per_rank = torch.stack(gathered).cpu()
        per_stage = per_rank.view(dims.pp, dims.stage_size, -1)
        # Every rank sees the same gathered losses and global norm, so all of them stop here or none.
        bad = _divergence(per_rank[:, :2], float(grad_norm))
        if bad:
            if rank == 0:
                write_stopped(run_dir, "diverged", step + 1, what=bad, last_checkpoint=ckpt.last())
            break
        optimizer.step()
        if step == t.steps - 1:
            state = local_state_bytes(model, optimizer)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        load.update_expert_bias()
        dt = time.perf_counter() - t0
        # The weights after this step's update, on the same held-out sequences each time.
        eval_loss = evaluate() if evaluate and _eval_due(step + 1, cfg) else None
        if writer:
            writer.step({
                "step": step + 1, "loss": per_stage[-1, :, 0].mean().item(),
                "aux_loss": per_stage[:, :, 1].mean(1).sum().item(),
                "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                "peak_mem_per_rank_gib": (per_rank[:, 2] / 2**30).tolist(),
                **load.row(per_stage[:, 0, 4:]),  # a stage's ranks hold the same sums
                **({} if eval_loss is None else {"eval_loss": eval_loss}),
            })
        stop = bool(per_rank[:, 3].max())  # some rank got a stop signal: every rank saves this step and stops
        try:
            saved = ckpt.maybe_save(step + 1, model, optimizer, scheduler, now=stop)
        except SaveError as e:  # raised alike on every rank: all of them stop here
            if rank == 0:
                write_stopped(run_dir, "save failed", step + 1, what=str(e), last_checkpoint=ckpt.last())
            break
        if stop:
            if rank == 0:
                write_stopped(run_dir, "signal", step + 1, signal=supervision.requested or "a stop signal",
                              checkpoint=str(saved))
            break
    states = [None] * world
    dist.all_gather_object(states, state)
    if writer:
        from dtensor_moe.tools.folding import predicted_state_bytes

        rows = writer.rows
        steady = [r["tokens_per_s"] for r in rows[3:]] or [r["tokens_per_s"] for r in rows]
        writer.finish(
            {
                "config": cfg.to_dict(),
                "model_params": n_params,
                "world_size": world,
                "mesh": {
                    **asdict(dims),
                    "edp": dims.edp,
                    "dense": dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), dims.dense_shape)),
                },
                "placement_plan": [asdict(wp) for wp in plan_moe(cfg.model.moe_config(), dims)],
                "final_loss": rows[-1]["loss"] if rows else None,
                "data": {**data_info, **({} if eval_batches is None else
                                         {"eval_tokens_per_eval": eval_batches.tokens_per_eval})},
                "eval": _eval_summary(rows),
                "median_tokens_per_s": statistics.median(steady) if steady else None,
                "median_tokens_per_s_per_rank": statistics.median(steady) / world if steady else None,
                "peak_mem_per_rank_gib": max((r["peak_mem_per_rank_gib"] for r in rows), key=max, default=None),
                "load": load_summary(rows),
                # Measured local bytes after the last step vs the folding search's prediction (dtensor-moe plan), which
                # models our own transformer (a Hugging Face model's attention is its family's).
                "state_bytes_per_rank": states,
                "predicted_state_bytes_per_rank": None if cfg.model.hf_path else [
                    predicted_state_bytes(cfg.model, dims, r, pp_schedule=p.pp_schedule) for r in range(world)
                ],
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            }
        )
    dist.barrier()  # no rank tears down gloo while a peer still talks to it
    dist.destroy_process_group()


def _eval_due(step: int, cfg: Config) -> bool:
    """After every data.eval_every-th step and the last one."""
    every = cfg.data.eval_every
    return step == cfg.training.steps or (every > 0 and step % every == 0)


def _eval_summary(rows: list[dict]) -> dict | None:
    """summary.json's `eval`: the last evaluation's loss and step, and the best one's."""
    evals = [(r["eval_loss"], r["step"]) for r in rows if "eval_loss" in r]
    if not evals:
        return None
    best = min(evals)
    return {"loss": evals[-1][0], "step": evals[-1][1], "best_loss": best[0], "best_step": best[1],
            "evaluations": len(evals)}


def _evaluator(parts, pipe, loss_fn, eval_batches, microbatches: int, dims, device):
    """A function of no argument: the mean cross-entropy over the held-out batches (every rank gets it), through the
    pipeline's schedule or `loss_fn` (train/loss.py's `lm_loss`) of the model's output. Eval forwards without
    gradients: the MoE layers count no load and the aux-free bias does not move. Ranks hold equal shares, so the
    mean of the ranks' means (the last stage's under PP) is the global mean."""
    import torch
    import torch.distributed as dist

    def evaluate() -> float:
        for part in parts:
            part.eval()
        total = 0.0
        with torch.no_grad():
            for inputs_BL, targets_BL in eval_batches:
                inputs_BL, targets_BL = inputs_BL.to(device), targets_BL.to(device)
                if pipe is not None:
                    total += pipe.evaluate(inputs_BL, targets_BL)
                    continue
                for x_BL, y_BL in zip(inputs_BL.tensor_split(microbatches), targets_BL.tensor_split(microbatches)):
                    total += float(loss_fn(parts[0](x_BL), y_BL)) / microbatches
        for part in parts:
            part.train()
        local = torch.tensor([total / eval_batches.batches], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        return torch.cat(gathered).cpu().view(dims.pp, dims.stage_size)[-1].mean().item()

    return evaluate


def _divergence(losses, grad_norm: float) -> str | None:
    """Why this step must not update the weights: a non-finite loss on some rank, or a gradient norm that is not
    finite or is exactly 0 (a diverged model whose saturated outputs pass no gradient trains no more)."""
    import math

    if not bool(losses.isfinite().all()):
        return f"non-finite loss ({', '.join(f'{v:g}' for v in losses.flatten().tolist() if not math.isfinite(v))})"
    if not math.isfinite(grad_norm) or grad_norm == 0:
        return f"gradient norm {grad_norm:g}"
    return None


def _accumulating(model, microbatches: int, loss_fn):
    """Forward and backward of every microbatch in turn (gradient accumulation), the objective of
    the pipeline schedules: mean over microbatches of (loss + the MoE layers' balance losses)."""

    import torch

    from dtensor_moe.moe import balance_loss

    def forward_backward(inputs_BL, targets_BL) -> tuple[float, float]:
        ce_sum = aux_sum = 0.0
        for x_BL, y_BL in zip(inputs_BL.tensor_split(microbatches), targets_BL.tensor_split(microbatches)):
            ce = loss_fn(model(x_BL), y_BL)
            aux = balance_loss(model)
            ((ce + aux) / microbatches).backward()
            ce_sum, aux_sum = ce_sum + ce.item(), aux_sum + float(torch.as_tensor(aux).detach())
        return ce_sum / microbatches, aux_sum / microbatches

    return forward_backward


def _rollout(model, microbatches: int):
    """The forwards `_accumulating` runs, without the loss: what routing replay records."""

    def rollout(inputs_BL, targets_BL) -> None:
        for x_BL in inputs_BL.tensor_split(microbatches):
            model(x_BL)

    return rollout


def _replaying(parts, rollout, forward_backward):
    """training.routing_replay: each step records its microbatches' routing in a no-grad eval forward of every part
    (this rank's pipeline stages), then runs `forward_backward` replaying it. Each part keeps its own recording:
    its layers' names are the whole model's, and a part holds only some of them."""
    from contextlib import ExitStack

    import torch

    from dtensor_moe.replay import record_routing, replay_routing

    def step(inputs_BL, targets_BL) -> tuple[float, float]:
        with ExitStack() as stack, torch.no_grad():
            for part in parts:
                part.eval()
            recorded = [stack.enter_context(record_routing(part)) for part in parts]
            rollout(inputs_BL, targets_BL)
        for part in parts:
            part.train()
        with ExitStack() as stack:
            for part, rec in zip(parts, recorded):
                stack.enter_context(replay_routing(part, rec))
            return forward_backward(inputs_BL, targets_BL)

    return step


class _Checkpointing:
    """--checkpoint-every / --resume: DCP checkpoints under RUN_DIR/checkpoints (see checkpoint.py)."""

    def __init__(self, root: str, every: int, keep_last: int, resume_from: str | None, total_steps: int,
                 data: dict | None = None):
        self.root, self.every, self.keep_last, self.total = root, every, keep_last, total_steps
        self.data = data  # data_fingerprint, saved with each checkpoint for --resume's check
        self.resume_from = root if resume_from == "latest" else resume_from

    def resume(self, model, optimizer, scheduler) -> int:
        if self.resume_from is None:
            return 0
        from dtensor_moe.train.checkpoint import load

        extra = load(self.resume_from, model, optimizer, fresh_optimizer_ok=True)  # `dtensor-moe import`: weights only
        step = int(extra["step"])
        if "lr_scheduler" in extra:
            scheduler.load_state_dict(extra["lr_scheduler"])
        else:  # the schedule continues where the step count says
            with warnings.catch_warnings():  # fast-forwarding before any optimizer step is the point here
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                for _ in range(step):
                    scheduler.step()
        return step

    def maybe_save(self, step: int, model, optimizer, scheduler, now: bool = False):
        """Saves at every `every` steps, the last step, and `now` (a stop signal); the saved path, or None."""
        if now or (self.every and (step % self.every == 0 or step == self.total)):
            from dtensor_moe.train.checkpoint import save

            extra = {"lr_scheduler": scheduler.state_dict(), **({"data": self.data} if self.data else {})}
            return save(self.root, step, model, optimizer, extra=extra, keep_last=self.keep_last)
        return None

    def last(self) -> str | None:
        from dtensor_moe.train.checkpoint import latest

        found = latest(self.root)
        return None if found is None else str(found)


def _checkpointing(args, run_dir: str, total_steps: int, data: dict | None = None) -> _Checkpointing:
    """Also without --checkpoint-every: a stop signal saves the step it ends on."""
    every, keep_last, resume = (0, 3, None) if args is None else (args.checkpoint_every, args.keep_last, args.resume)
    return _Checkpointing(os.path.join(run_dir, "checkpoints"), every, keep_last, resume, total_steps, data)


if __name__ == "__main__":  # the parity reference: python -m dtensor_moe.train.loop CONFIG_JSON RUN_DIR [DP SEQ]
    from dtensor_moe.train.config import SECTIONS, build_section

    raw = json.loads(sys.argv[1])
    ref = Config(**{name: build_section(name, raw[name]) for name in SECTIONS})
    slices = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 3 else None
    train_ranks(ref, sys.argv[2], label="1-process reference", moe_slices=slices)
