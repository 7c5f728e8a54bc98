"""What one MoE layer keeps for its backward, activation_memory "standard" vs "minimal", against the minimum.

    python benchmarks/activation_memory.py --out act.json                 # CPU: bytes kept (counted)
    python benchmarks/activation_memory.py --device cuda --out act.json   # GPU: also peak memory and time
    python benchmarks/activation_memory.py --peers --out act.json         # CPU, torchtitan's and transformers' too

Counted: every tensor autograd saves during the layer's forward (torch.autograd.graph.saved_tensors_hooks), each
storage once, leaving out the parameters, buffers and the caller's input. The minimum is the gate / up
pre-activation H [pairs, 2F] (and the shared experts' [tokens, 2F_shared]) plus the integer tables kept; under
EP the expert side adds the received rows, each token once. --peers counts the same for torchtitan 0.3.0's routed
experts (its GroupedExperts computes in bf16 whatever the input, so its bytes are bf16's: double them to compare;
given the routing, no router) and transformers' Qwen3-MoE sparse block (grouped_mm and eager experts, its router
included) on the same input. On CUDA each shape also runs forward + backward
(bf16) in both modes: median ms over --iters and the peak allocated above the start, side by side in one process.
"""

import argparse
import statistics
from dataclasses import dataclass, field

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path)
import torch
from torch.distributed.tensor import DTensor

from dtensor_moe import MoE, MoEConfig, MoERunOptions


@dataclass
class Kept:
    """Bytes a forward left for its backward."""

    total: int = 0
    index_bytes: int = 0  # integer tensors (routing tables, offsets)
    received_bytes: int = 0  # the minimal path's token rows (under EP: the received rows)
    pairs: int = 0  # the minimal path's (token, expert) pairs
    largest: list = field(default_factory=list)  # (bytes, dtype, shape) of the biggest, for reading


def _storage(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.untyped_storage().data_ptr()


def kept_bytes(moe: torch.nn.Module, x: torch.Tensor) -> Kept:
    """Run moe(x) and count what autograd keeps (see the module docstring). x must require no grad or be a leaf
    the caller keeps anyway."""
    skip = {_storage(t) for t in (*moe.parameters(), *moe.buffers())} | {_storage(x)}
    seen: dict[int, tuple] = {}

    def pack(t):
        if t.device.type != "meta" and (ptr := _storage(t)) not in skip:
            s = t.untyped_storage()
            seen[ptr] = (s.nbytes(), t.dtype, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe(x)
    out = Kept(total=sum(v[0] for v in seen.values()),
               index_bytes=sum(v[0] for v in seen.values() if not v[1].is_floating_point),
               largest=sorted(seen.values(), key=lambda v: -v[0])[:6])
    node = _find(y.grad_fn, "_PairSwiGLUBackward")
    if node is not None:
        x_RD, row_N = node.saved_tensors[0], node.saved_tensors[4]
        out.received_bytes, out.pairs = x_RD.untyped_storage().nbytes(), row_N.numel()
    return out


def _find(fn, name: str):
    stack, done = [fn], set()
    while stack:
        f = stack.pop()
        if f is None or f in done:
            continue
        done.add(f)
        if type(f).__name__ == name:
            return f
        stack.extend(g for g, _ in f.next_functions)
    return None


def minimum_bytes(cfg: MoEConfig, rows: int, dtype: torch.dtype, index_bytes: int, hidden: int | None = None,
                  per_token: bool = True) -> int:
    """H [pairs, 2F] (+ the shared experts' [tokens, 2F_shared]) + index_bytes; rows: tokens (per_token) or pairs."""
    elem = torch.empty(0, dtype=dtype).element_size()
    F_ = hidden or cfg.hidden_dim
    pairs = rows * cfg.top_k if per_token else rows
    shared = rows * 2 * cfg.hidden_dim * cfg.num_shared_experts if per_token else 0
    return (pairs * 2 * F_ + shared) * elem + index_bytes


# (name, D, F, E_local, K, tokens): CPU sizes of the table; GPU: one EP rank's experts at the rows EP gives
# them (benchmarks/moe_layer.py's proxies: DeepSeek-V3 EP8 = 32 of 256 experts, ...), tokens = 8192 a rank.
CPU_SHAPES = [("issue_a", 1024, 256, 32, 8, 4096), ("issue_b_shared_aux", 1024, 512, 16, 4, 4096),
              ("issue_c_aux_free", 768, 384, 64, 6, 4096)]
GPU_SHAPES = [("deepseek_ep8", 7168, 2048, 32, 8, 8192), ("qwen_ep8", 2048, 768, 16, 8, 8192),
              ("mixtral", 4096, 14336, 8, 2, 8192), ("e64_ep8", 2048, 1024, 8, 8, 8192)]


def _config(name: str, D: int, F_: int, E: int, K: int) -> MoEConfig:
    extra = {"issue_b_shared_aux": dict(num_shared_experts=1, load_balance="aux_loss"),
             "issue_c_aux_free": dict(load_balance="aux_free_bias")}.get(name, {})
    return MoEConfig(dim=D, hidden_dim=F_, num_experts=E, top_k=K, **extra)


def peer_kept(D: int, F_: int, E: int, K: int, x: torch.Tensor) -> dict[str, int]:
    """Bytes kept by torchtitan's routed experts and transformers' Qwen3-MoE block (grouped_mm, eager) on x."""
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    set_spmd_backend("partial_dtensor")
    T = x.shape[1]
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(1, T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).view(1, T, K)
    counts = torch.bincount(ids.flatten(), minlength=E)
    titan = RoutedExperts.Config(inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F_, num_experts=E),
                                 token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)).build()

    class Routed(torch.nn.Module):  # the routing as arguments, as torchtitan's MoE hands it over
        def __init__(self):
            super().__init__()
            self.experts = titan

        def forward(self, x):
            return self.experts(x, scores, ids, counts)

    out = {"torchtitan_bf16": kept_bytes(Routed(), x).total}
    for impl in ("grouped_mm", "eager"):
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F_, num_experts=E,
                                                      num_experts_per_tok=K, norm_topk_prob=True,
                                                      experts_implementation=impl))
        out[f"transformers_{impl}"] = kept_bytes(block, x).total
    return out


def _timed(moe: MoE, x: torch.Tensor, iters: int) -> tuple[float, int]:
    """(median ms of forward + backward, peak bytes allocated above the start) on CUDA."""
    times = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        moe(x).float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
        moe.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shapes", nargs="*", help="names to run (default: all of the device's)")
    ap.add_argument("--peers", action="store_true", help="CPU: torchtitan's and transformers' layers beside ours")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from dtensor_moe.train.metrics import write_json

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = [s for s in (GPU_SHAPES if dev.type == "cuda" else CPU_SHAPES) if not args.shapes or s[0] in args.shapes]
    rows = []
    mib = 2**20
    print(f"| shape | D F E K tokens | standard MiB | minimal MiB | minimum MiB | standard/min | minimal/min "
          f"|{' ms std | ms min | time ratio | peak std MiB | peak min MiB |' if dev.type == 'cuda' else ''}")
    print("|---|---|---|---|---|---|---|" + ("---|" * 5 if dev.type == "cuda" else ""))
    for name, D, F_, E, K, T in shapes:
        cfg = _config(name, D, F_, E, K)
        torch.manual_seed(0)
        with torch.device(dev):
            base = MoE(cfg)
        base.reset_parameters()
        x = torch.randn(1, T, D, device=dev, dtype=dtype)
        row = {"shape": name, "D": D, "F": F_, "E": E, "K": K, "tokens": T}
        for mode in ("standard", "minimal"):
            moe = MoE(cfg, MoERunOptions(activation_memory=mode)).to(dev, dtype)
            moe.load_state_dict(base.state_dict())
            kept = kept_bytes(moe, x)
            row[f"{mode}_kept_bytes"] = kept.total
            if mode == "minimal":
                row["minimum_bytes"] = minimum_bytes(cfg, T, dtype, kept.index_bytes)
            if dev.type == "cuda":
                row[f"{mode}_ms"], row[f"{mode}_peak_bytes"] = _timed(moe, x, args.iters)
            del moe
        for mode in ("standard", "minimal"):
            row[f"{mode}_over_minimum"] = row[f"{mode}_kept_bytes"] / row["minimum_bytes"]
        if args.peers:
            row.update({f"{k}_kept_bytes": v for k, v in peer_kept(D, F_, E, K, x).items()})
        line = (f"| {name} | {D} {F_} {E} {K} {T} | {row['standard_kept_bytes'] / mib:.0f} | "
                f"{row['minimal_kept_bytes'] / mib:.0f} | {row['minimum_bytes'] / mib:.0f} | "
                f"{row['standard_over_minimum']:.2f}x | {row['minimal_over_minimum']:.2f}x |")
        if dev.type == "cuda":
            row["time_ratio"] = row["minimal_ms"] / row["standard_ms"]
            line += (f" {row['standard_ms']:.2f} | {row['minimal_ms']:.2f} | {row['time_ratio']:.3f} | "
                     f"{row['standard_peak_bytes'] / mib:.0f} | {row['minimal_peak_bytes'] / mib:.0f} |")
        if args.peers:
            line += "".join(f" {k.removesuffix('_kept_bytes')} {row[k] / mib:.0f} |" for k in row if
                            k.startswith(("torchtitan", "transformers")))
        print(line, flush=True)
        rows.append(row)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "dtype": str(dtype), "routing": "the layer's own router (random weights, softmax top-k)"}
    write_json(args.out, {**meta, "rows": rows})


if __name__ == "__main__":
    main()
