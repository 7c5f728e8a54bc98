"""Run outputs written by rank 0: metrics.jsonl (one line per step), summary.json, loss.png; the console summary."""

import json
import os
import resource
import sys

import torch


def local_state_bytes(module, optimizer) -> dict[str, int]:
    """Bytes of this rank's shards of parameters, gradients and optimizer state."""
    from torch.distributed.tensor import DTensor

    def nbytes(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(module.parameters())
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS of this rank's process


class RunWriter:
    def __init__(self, run_dir: str, total_steps: int, resumed_at: int = 0, label: str = "train"):
        """A resumed run keeps the rows of steps <= resumed_at from the earlier metrics.jsonl."""
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        path = os.path.join(run_dir, "metrics.jsonl")
        self.rows: list[dict] = []
        if resumed_at and os.path.exists(path):
            with open(path) as f:
                self.rows = [r for r in map(json.loads, f) if r["step"] <= resumed_at]
        self.metrics = open(path, "w")
        for row in self.rows:
            self.metrics.write(json.dumps(row) + "\n")
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=resumed_at, desc=label, unit="step", dynamic_ncols=True)

    def step(self, row: dict):
        self.rows.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        mem = row["peak_mem_per_rank_gib"]
        self.bar.set_postfix(
            loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", mem_gib=f"{min(mem):.2f}-{max(mem):.2f}"
        )
        self.bar.update(1)

    def finish(self, summary: dict):
        """summary.json first: a failing plot (no matplotlib, no display font, ...) never costs the results."""
        self.bar.close()
        self.metrics.close()
        write_json(os.path.join(self.run_dir, "summary.json"), summary)
        png = os.path.join(self.run_dir, "loss.png")
        try:
            plot_loss(self.rows, png)
        except Exception as e:  # noqa: BLE001 - the plot is a convenience; the numbers are in metrics.jsonl
            if os.path.exists(png):
                os.remove(png)  # an earlier run's plot would pass for this one's
            why = (
                "matplotlib is not installed (pip install matplotlib)"
                if isinstance(e, ImportError)
                else f"{type(e).__name__}: {e}"
            )
            print(f"loss.png not written: {why}; the losses are in metrics.jsonl", file=sys.stderr)


def write_json(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def plot_loss(rows: list[dict], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", "parity.json", "checkpoints", "reference_1proc")


def _si(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def summary_lines(summary: dict, run_dir: str, parity_line: str | None = None) -> list[str]:
    """What the run trained and how it went, for the console (from summary.json)."""
    m, t, mesh = summary["config"]["model"], summary["config"]["training"], summary["mesh"]
    shared = f" + {m['num_shared_experts']} shared" if m["num_shared_experts"] else ""
    fp8 = "".join(f", FP8 {what}" for key, what in (("expert_precision", "experts"), ("dispatch_precision", "dispatch"))
                  if m.get(key) == "fp8")
    lines = [
        f"trained  {_si(summary['model_params'])}-parameter MoE LM ({m['n_layers']} layers, dim {m['dim']}, "
        f"{m['num_experts']} experts top-{m['top_k']}{shared}), "
        f"{t['steps']} steps of {t['global_batch'] * t['seq_len']} "
        f"tokens, {t['dtype']}{fp8}",
    ]
    hsdp = f"HSDP{mesh['dp_replicate']} x " if mesh["dp_replicate"] > 1 else ""
    cp, tp = mesh.get("cp", 1), mesh.get("tp", 1)
    dense = f"FSDP{mesh['dp_shard'] * cp}" + (f" (CP{cp})" if cp > 1 else "") + (f" x TP{tp}" if tp > 1 else "")
    pp = f"PP{mesh['pp']} stages, each: " if mesh.get("pp", 1) > 1 else ""
    lines.append(
        f"mesh     {summary['world_size']} ranks on {summary['device']}: "
        f"{pp}experts {hsdp}EDP{mesh['edp']} x EP{mesh['ep']} x "
        f"ETP{mesh['etp']}, dense weights {hsdp}{dense}"
    )
    if summary["final_loss"] is not None:
        lines.append(f"loss     {summary['final_loss']:.4f} after step {t['steps']}")
        per_rank = summary["median_tokens_per_s_per_rank"]
        lines.append(f"speed    {summary['median_tokens_per_s']:,.0f} tokens/s median ({per_rank:,.0f} per rank)")
        peak = max(summary["peak_mem_per_rank_gib"])
        what = "peak RSS" if summary["device"] == "cpu" else "peak CUDA memory allocated"
        lines.append(f"memory   {peak:.2f} GiB {what} per rank (largest rank)")
    if parity_line:
        lines.append(f"parity   {parity_line}")
    files = [
        f + ("/" if os.path.isdir(os.path.join(run_dir, f)) else "")
        for f in RUN_FILES
        if os.path.exists(os.path.join(run_dir, f))
    ]
    lines.append(f"run dir  {run_dir}: {', '.join(files)}")
    return lines
