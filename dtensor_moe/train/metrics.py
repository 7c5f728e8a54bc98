"""Run outputs written by rank 0: metrics.jsonl (one line per step), summary.json, loss.png, load.png; the console
summary; the per-step expert load every rank measures for them (`ExpertLoad`)."""

import json
import os
import resource
import statistics
import sys
from dataclasses import replace

import torch

from dtensor_moe.config import MoEConfig
from dtensor_moe.train.config import ModelConfig


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


def expert_ep_ranks(config: MoEConfig, dims) -> list[int]:
    """The EP rank that owns each expert: the placement plan's EP split of the expert weights (its later ETP and
    EDP splits cut inside an EP rank's experts)."""
    from dtensor_moe.parallel.placement import owned_box, plan_moe, rank_coords

    w2 = next(wp for wp in plan_moe(config, dims) if wp.name == "experts.w2")
    ep = w2.step_on("ep")
    by_ep = replace(w2, steps=(ep,))
    owner = [0] * config.num_experts
    for rank in range(dims.stage_size):
        for e in range(config.num_experts)[owned_box(by_ep, dims, rank)[ep.dim]]:
            owner[e] = rank_coords(dims, rank)["ep"]
    return owner


def imbalance(rows: torch.Tensor) -> torch.Tensor:
    """max / mean over the last dim: how much longer the hottest expert (or EP rank) works than an even split."""
    return rows.amax(-1) / rows.mean(-1)


def worst_layer(imbalance_by_layer: torch.Tensor) -> torch.Tensor:
    """Index of the step's straggler layer in [layers, 2] (expert, EP-rank imbalance): the largest EP-rank imbalance,
    ties (every layer under EP1) to the larger expert imbalance (what more EP ranks would turn into rank imbalance),
    then to the lower index. A total order: on a subset holding the overall worst layer it picks that layer too.
    Tensor ops only (no host sync on a device)."""
    by_experts = torch.argsort(imbalance_by_layer[:, 0], descending=True, stable=True)
    first_max = torch.argmax(imbalance_by_layer.index_select(0, by_experts)[:, 1])  # the first of equal maxima
    return by_experts.index_select(0, first_max.view(1)).squeeze(0)


class ExpertLoad:
    """Each step's rows per expert and per EP rank of every MoE layer, over the global batch.

    The MoE layers count their training forwards' rows per expert on each rank (`MoE.tokens_per_expert`: eval
    forwards and activation checkpointing's recomputation do not count); these are the router's choices, before any
    capacity dropping. `measure` sums them over the ranks that see different tokens (the layers' `stats.sum`: one
    all-reduce of all of this rank's layers, on the device) and returns what rank 0 needs as a piece of the step's
    metrics all-gather, so the load adds no host sync: each layer's expert and EP-rank imbalance (at its layer id;
    0 for layers of other pipeline stages) and this rank's worst layer with its rows per expert. `row` reads it on
    rank 0: per layer the two imbalances, and the worst layer's values and rows (its vectors only, so a row stays
    O(layers + experts)). The aux-free bias update reads the same sums (`update_expert_bias`)."""

    def __init__(self, parts, dims, config: ModelConfig, expert_replicas: int, device: torch.device):
        self.moes = {i: moe for part in parts for i, moe in part.moe_layers().items()}
        self.n_layers, self.ep = config.n_layers, dims.ep
        # With replicas the rows an EP rank computes are no longer its owned experts' rows: the dispatchers count
        # them (each rank of an EP x ETP group holds its group's; the all-reduce sums groups, hence the divisor).
        self.replicas = expert_replicas > 0 and dims.ep > 1
        self.group_size = dims.ep * dims.etp
        owner_E = torch.tensor(expert_ep_ranks(config.moe_config(), dims))
        self.owner_E, self.owner_on_device_E = owner_E, owner_E.to(device)
        self.ids = torch.tensor(list(self.moes), device=device)
        self.global_counts = None  # [this rank's layers, E]: the last measured step's

    def _per_ep_rank(self, counts: torch.Tensor, owner_E: torch.Tensor) -> torch.Tensor:
        return counts.new_zeros(*counts.shape[:-1], self.ep).index_add_(-1, owner_E, counts)

    def measure(self) -> torch.Tensor:
        """This step's load (a collective over the ranks with different tokens): float64 [2 * layers + 1 + E]."""
        moes = list(self.moes.values())
        counts = torch.stack([m.tokens_per_expert for m in moes])
        E = counts.shape[1]
        if self.replicas:
            computed = [m.experts.expert_parallel.load.take() or [0] * self.ep for m in moes]
            counts = torch.cat([counts.double(), torch.tensor(computed, dtype=torch.float64, device=counts.device)
                                / self.group_size], 1)
        # Every layer's stats sum over the same ranks: one all-reduce for all of them.
        summed = moes[0].stats.sum(counts)
        self.global_counts = summed[:, :E]
        counts = self.global_counts.double()
        mine = torch.stack([imbalance(counts), imbalance(self._per_ep_rank(counts, self.owner_on_device_E))], dim=1)
        # Other stages' layers stay 0, below any layer's imbalance (>= 1), so the worst is one of this rank's.
        by_layer = counts.new_zeros(self.n_layers, 2).index_copy_(0, self.ids, mine)
        worst = worst_layer(by_layer)
        rows_E = counts.new_zeros(self.n_layers, counts.shape[1]).index_copy_(0, self.ids, counts).index_select(
            0, worst.view(1))
        out = [by_layer.flatten(), worst.view(1).double(), rows_E.flatten()]
        if self.replicas:
            out.append(counts.new_zeros(self.n_layers).index_copy_(0, self.ids, imbalance(summed[:, E:].double())))
        return torch.cat(out)

    def row(self, loads: torch.Tensor) -> dict:
        """metrics.jsonl's load fields from `measure`'s pieces of one rank per pipeline stage ([stages, its width])."""
        n = self.n_layers
        by_layer = loads[:, : 2 * n].view(-1, n, 2).sum(0)  # each layer from the stage that holds it
        worst = int(worst_layer(by_layer))
        holder = int((loads[:, 2 * n] == worst).nonzero()[0])  # the stage whose own worst layer it is
        width = loads.shape[1] - (n if self.replicas else 0)
        rows_E = loads[holder, 2 * n + 1 : width]
        replicas = {}
        if self.replicas:  # rows each EP rank computed, its replica slots' included
            computed = loads[:, width:].sum(0)
            replicas = {"replica_ep_imbalance": [round(x, 4) for x in computed.tolist()],
                        "worst_replica_ep_imbalance": round(float(computed.max()), 4)}
        return {
            "expert_imbalance": [round(x, 4) for x in by_layer[:, 0].tolist()],
            "ep_imbalance": [round(x, 4) for x in by_layer[:, 1].tolist()],
            "worst_layer": worst,
            "worst_expert_imbalance": round(float(by_layer[worst, 0]), 4),
            "worst_ep_imbalance": round(float(by_layer[worst, 1]), 4),
            "worst_rows_per_expert": rows_E.long().tolist(),
            "worst_rows_per_ep_rank": self._per_ep_rank(rows_E, self.owner_E).long().tolist(),
            **replicas,
        }

    @torch.no_grad()
    def update_expert_bias(self):
        """Each layer's aux-free bias step (and count reset) from the counts `measure` summed: no second all-reduce."""
        for moe, counts_E in zip(self.moes.values(), self.global_counts):
            moe.update_expert_bias(counts_E)


def load_summary(rows: list[dict]) -> dict:
    """The worst layer's imbalances over the steps (summary.json's `load`, the console's load line); rows an earlier
    version wrote before a resume have none."""
    rows = [r for r in rows if "worst_ep_imbalance" in r]
    out = {"steps": len(rows)}
    for key in ("worst_expert_imbalance", "worst_ep_imbalance", "worst_replica_ep_imbalance"):
        values = [r[key] for r in rows if key in r]
        if values or key != "worst_replica_ep_imbalance":  # that one only in runs with replicas
            out[key] = {"mean": statistics.fmean(values), "max": max(values)} if values else None
    return out


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
        # The last evaluation's loss stays on the progress bar until the next one.
        self.eval_loss = next((r["eval_loss"] for r in reversed(self.rows) if "eval_loss" in r), None)
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=resumed_at, desc=label, unit="step", dynamic_ncols=True)

    def step(self, row: dict):
        self.rows.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        mem = row["peak_mem_per_rank_gib"]
        if "eval_loss" in row:
            self.eval_loss = row["eval_loss"]
        held = {} if self.eval_loss is None else {"eval": f"{self.eval_loss:.4f}"}
        self.bar.set_postfix(
            loss=f"{row['loss']:.4f}", **held, tok_s=f"{row['tokens_per_s']:.0f}",
            mem_gib=f"{min(mem):.2f}-{max(mem):.2f}",
        )
        self.bar.update(1)

    def finish(self, summary: dict):
        """summary.json first: a failing plot (no matplotlib, no display font, ...) never costs the results."""
        self.bar.close()
        self.metrics.close()
        write_json(os.path.join(self.run_dir, "summary.json"), summary)
        for name, plot, what in (("loss.png", plot_loss, "losses"), ("load.png", plot_load, "loads")):
            png = os.path.join(self.run_dir, name)
            try:
                plot(self.rows, png)
            except Exception as e:  # noqa: BLE001 - the plot is a convenience; the numbers are in metrics.jsonl
                if os.path.exists(png):
                    os.remove(png)  # an earlier run's plot would pass for this one's
                why = (
                    "matplotlib is not installed (pip install matplotlib)"
                    if isinstance(e, ImportError)
                    else f"{type(e).__name__}: {e}"
                )
                print(f"{name} not written: {why}; the {what} are in metrics.jsonl", file=sys.stderr)


def _with_replicas(computed: dict | None) -> str:
    return "" if computed is None else f", computed with replicas {computed['mean']:.2f} ({computed['max']:.2f})"


def write_json(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def plot_loss(rows: list[dict], path: str):
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="training")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    _save(fig, path)


def plot_load(rows: list[dict], path: str):
    """Each layer's expert and EP-rank imbalance (max/mean rows) over the steps, deeper layers lighter."""
    plt = _pyplot()
    rows = [r for r in rows if "expert_imbalance" in r]
    steps = [r["step"] for r in rows]
    n_layers = len(rows[0]["expert_imbalance"]) if rows else 0  # a run that diverged in its first step: empty axes
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, what in zip(axes, ("expert_imbalance", "ep_imbalance"), ("experts", "EP ranks")):
        for layer in range(n_layers):
            ax.plot(steps, [r[key][layer] for r in rows], color=plt.cm.viridis(0.85 * layer / max(n_layers - 1, 1)),
                    label=f"layer {layer}")
        ax.set_title(f"max/mean rows over {what}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("imbalance (1 = even)")
    if n_layers <= 8:  # more lines than that read by their shade
        axes[1].legend(fontsize="small")
    _save(fig, path)


RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", "load.png", "parity.json", "checkpoints",
             "reference_1proc")


def _si(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def summary_lines(summary: dict, run_dir: str, parity_line: str | None = None) -> list[str]:
    """What the run trained and how it went, for the console (from summary.json)."""
    m, t, mesh = summary["config"]["model"], summary["config"]["training"], summary["mesh"]
    run = summary["config"]["moe_run"]
    shared = f" + {m['num_shared_experts']} shared" if m["num_shared_experts"] else ""
    fp8 = "".join(f", FP8 {what}" for key, what in (("expert_precision", "experts"), ("dispatch_precision", "dispatch"))
                  if run[key] == "fp8")
    what = "MoE LM"
    if m.get("hf_path"):
        what = f"Hugging Face {json.loads(m['hf_config'])['model_type']} from {m['hf_path']}"
    lines = [
        f"trained  {_si(summary['model_params'])}-parameter {what} ({m['n_layers']} layers, dim {m['dim']}, "
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
    data = summary.get("data") or {}
    if data.get("source") == "files":
        held = f", {_si(data['eval_tokens'])} held out" if data["eval_tokens"] else ""
        files = f"{data['files']} file{'s' if data['files'] != 1 else ''}"
        lines.append(f"data     {files}, {data['documents']:,} documents: {_si(data['train_tokens'])} "
                     f"training tokens{held}; tokenizer {data['tokenizer']}")
    if summary["final_loss"] is not None:
        lines.append(f"loss     {summary['final_loss']:.4f} after step {t['steps']}")
        ev = summary.get("eval")
        if ev:
            best = f" (best {ev['best_loss']:.4f} at step {ev['best_step']})" if ev["best_step"] != ev["step"] else ""
            lines.append(f"eval     {ev['loss']:.4f} held-out loss after step {ev['step']} on "
                         f"{_si(data.get('eval_tokens_per_eval', 0))} tokens{best}")
        per_rank = summary["median_tokens_per_s_per_rank"]
        lines.append(f"speed    {summary['median_tokens_per_s']:,.0f} tokens/s median ({per_rank:,.0f} per rank)")
        peak = max(summary["peak_mem_per_rank_gib"])
        what = "peak RSS" if summary["device"] == "cpu" else "peak CUDA memory allocated"
        lines.append(f"memory   {peak:.2f} GiB {what} per rank (largest rank)")
        load = summary["load"]
        experts, ranks = load["worst_expert_imbalance"], load["worst_ep_imbalance"]
        if experts is not None:  # None: every step's row predates load metrics (an older run, resumed)
            lines.append(f"load     worst layer's max/mean rows, mean (max) over {load['steps']} steps: per expert "
                         f"{experts['mean']:.2f} ({experts['max']:.2f}), "
                         f"per EP rank {ranks['mean']:.2f} ({ranks['max']:.2f})"
                         + _with_replicas(load.get("worst_replica_ep_imbalance")))
    if parity_line:
        lines.append(f"parity   {parity_line}")
    files = [
        f + ("/" if os.path.isdir(os.path.join(run_dir, f)) else "")
        for f in RUN_FILES
        if os.path.exists(os.path.join(run_dir, f))
    ]
    lines.append(f"run dir  {run_dir}: {', '.join(files)}")
    return lines
