"""Run outputs written by rank 0: metrics.jsonl (one line per step), loss.png, summary.json."""

import json
import os
import resource

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
    def __init__(self, run_dir: str, total_steps: int, resumed_at: int = 0):
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

        self.bar = tqdm(total=total_steps, initial=resumed_at, desc="train", unit="step", dynamic_ncols=True)

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
        self.bar.close()
        self.metrics.close()
        plot_loss(self.rows, os.path.join(self.run_dir, "loss.png"))
        write_json(os.path.join(self.run_dir, "summary.json"), summary)


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
