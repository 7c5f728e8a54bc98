"""The one place that decides which implementation runs: Triton, cuBLAS or plain torch ops.

Also counts host syncs: the only ones are split sizes that must reach the host (the expert-parallel
all-to-all) and the exact per-expert loop where no grouped-GEMM kernel takes the dtype.
"""

import functools
import json
import math
import os

import torch

from dtensor_moe.kernels import counters, wgrad

__all__ = [
    "count_host_syncs", "fp8_measured_faster", "fused_measured_faster", "gate_up_fused", "gemm_precision",
    "grouped_mm_supported", "host_list", "host_synced", "rounding_backend", "runs_triton", "weight_grad_accumulation",
    "wgrad_config",
]


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the CUDA build of torch ships it)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def runs_triton(t: torch.Tensor) -> bool:
    """The Triton kernels take CUDA tensors up to fp32 (they compute in fp32; fp64 stays on torch)."""
    return t.is_cuda and t.dtype != torch.float64 and triton_available()


def grouped_mm_supported(x_TD: torch.Tensor, w_shape) -> bool:
    """Whether torch._grouped_mm takes these operands; otherwise the exact per-expert loop runs."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    # The kernels (CUDA and CPU) need 16-byte aligned row strides for every operand layout used.
    if any(n * x_TD.element_size() % 16 for n in w_shape[-2:]):
        return False
    if x_TD.is_cuda:
        return x_TD.dtype == torch.bfloat16
    # The CPU kernel exists from torch 2.13 for these dtypes; float64 takes the exact loop.
    return x_TD.device.type == "cpu" and x_TD.dtype in (torch.float32, torch.bfloat16) and _cpu_grouped_mm_ok()


@functools.cache
def _cpu_grouped_mm_ok() -> bool:
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


# A cuBLAS call per expert accumulates into the gradient only when each call outlasts its launch
# (~10 us from Python, ~6 GFLOP on an H200); below that the launches, not the GEMMs, set the time.
MIN_MACS_PER_EXPERT_GEMM = 2**32
# cuBLAS runs an [O, I] weight gradient with O < I (w1/w3's [F, D] when F < D) with a slow tile when
# each expert reduces over few rows (~375 TFLOP/s at 512 rows, DeepSeek-like), fast at >= 2048 rows.
CUBLAS_WIDE_MIN_ROWS = 2048


def weight_grad_accumulation(x_ND: torch.Tensor, half_shape, grouped: bool, host_counts_known: bool,
                             precision: str = "bf16"):
    """How a backward adds weight gradients into existing ones, or None where autograd accumulates.

    Returns `method(out_shape) -> "per_expert" | "triton"`. One cuBLAS addmm_ per expert (needs the
    counts on the host) only where it measured fastest on 2xH200: per-expert GEMMs large enough to
    outlast their launches, in an orientation cuBLAS runs well; elsewhere on CUDA one Triton launch
    per weight (kernels/wgrad.py; tools/tune/wgrad_probe.py, RESULTS.md)."""
    E, F_, D = half_shape  # one of gate / up: [E, F, D]
    rows = x_ND.shape[0]
    if any(gemm_precision(precision, "wgrad_acc", x_ND, E, I, O) == "fp8" for I, O in ((D, F_), (F_, D))):
        return None  # the FP8 GEMM writes a fresh gradient, which autograd adds
    # The exact loop (no grouped kernel) reads the counts on the host anyway.
    per_expert = not grouped or (host_counts_known and rows * F_ * D >= MIN_MACS_PER_EXPERT_GEMM * max(E, 1))
    triton = grouped and runs_triton(x_ND)
    if not (per_expert or triton):
        return None
    long_rows = rows >= CUBLAS_WIDE_MIN_ROWS * max(E, 1)

    def method(out_shape) -> str:
        if per_expert and (not triton or long_rows or out_shape[-2] >= out_shape[-1]):
            return "per_expert"
        return "triton"

    return method


# The Triton weight-gradient kernel's tile config per measured (O, I, rows per expert): another than
# wgrad.DEFAULT_TILES only where tools/tune/wgrad_probe.py saw it >= 4% faster in every run (at least two) on
# one H200 (benchmarks/RESULTS.md; the spread between runs is about 4%).
WGRAD_CONFIGS = os.path.join(os.path.dirname(__file__), "wgrad_configs.json")


@functools.cache
def _wgrad_configs(path: str) -> tuple:
    with open(path) as f:
        return tuple(json.load(f)["configs"])


def wgrad_config(out_shape, rows: int) -> wgrad.TileConfig:
    """kernels/wgrad.py's config for out_shape [E, O, I] over `rows` routed rows: the table's at this
    (O, I) nearest in rows per expert on a log scale; for the experts' gate and up gradient [E, 2F, D] unmeasured,
    the one measured at [E, F, D] (the same tiles over twice the rows of output); wgrad.DEFAULT_TILES for an unmeasured
    (O, I) (DTENSOR_MOE_WGRAD_CONFIGS overrides the table's path)."""
    E, O, I = out_shape
    table = _wgrad_configs(os.environ.get("DTENSOR_MOE_WGRAD_CONFIGS", WGRAD_CONFIGS))
    candidates = ([r for r in table if (r["O"], r["I"]) == (O, I)]
                  or [r for r in table if (2 * r["O"], r["I"]) == (O, I)])
    if not candidates:
        return wgrad.DEFAULT_TILES
    return wgrad.TileConfig(*_nearest(candidates, rows / max(E, 1))["config"])


def _nearest(records: list[dict], rows_per_expert: float) -> dict:
    """The record measured at the rows per expert nearest `rows_per_expert` on a log scale."""
    rows = max(rows_per_expert, 1)
    return min(records, key=lambda r: abs(math.log2(r["rows_per_expert"] / rows)))


# Measured bf16 and FP8 rates of each expert GEMM (tools/tune/expert_gemms.py on one H200: CUDA-event
# medians, FP8 including the fused quantization of its activation operands; how and when is in the file).
FP8_RATES = os.path.join(os.path.dirname(__file__), "fp8_rates.json")


@functools.cache
def _fp8_rates(path: str) -> tuple:
    with open(path) as f:
        return tuple(json.load(f)["gemms"])


@functools.cache
def fp8_gemms_available(device: torch.device) -> bool:
    """torch._scaled_grouped_mm's rowwise FP8 kernels (sm90) and Triton for the quantization."""
    return (hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability(device) == (9, 0)
            and triton_available())


_RATES_AT_IMPORT = _fp8_rates(os.environ.get("DTENSOR_MOE_FP8_RATES", FP8_RATES))


def gemm_precision(precision: str, gemm: str, x: torch.Tensor, E: int, I: int, O: int) -> str:
    """"fp8" or "bf16" for one expert GEMM ("fwd", "dgrad", "wgrad", "wgrad_acc": into an existing
    gradient) of E experts, reduced dim I (wgrad: the weight's [O, I]), over x's rows.

    Off CUDA an "fp8" layer always runs the FP8 emulation (its numerics are what CPU tests check).
    On CUDA, FP8 only where it measured faster than bf16 at the same GEMM and (I, O), the nearest
    measured rows per expert (log scale): FP8 is never chosen where it was not seen to win."""
    if precision != "fp8":
        return "bf16"
    if not x.is_cuda:
        return "fp8"
    if x.dtype != torch.bfloat16 or I % 16 or O % 16 or not fp8_gemms_available(x.device):
        return "bf16"
    return "fp8" if fp8_measured_faster(gemm, I, O, x.shape[0] / max(E, 1)) else "bf16"


def gate_up_fused(precision: str, gemm: str, x: torch.Tensor, E: int, I: int, O: int) -> bool:
    """Whether the experts' gate and up run as one bf16 GEMM over w13's [E, 2F, D] rather than one per half (I, O:
    one half's, as gemm_precision takes them), each half in the precision gemm_precision picks for it. One GEMM
    unless the table measured the two halves faster in that precision (tools/tune/expert_gemms.py times both). On
    one H200 the fused input gradient ran faster than the two halves at every shape measured, the forward and the
    weight gradient even, and the DeepSeek-like layer went 50.12 -> 49.31 ms (benchmarks/RESULTS.md). Where the
    table has no fused row: one GEMM in bf16 and the halves where FP8 runs them. Off CUDA the halves wherever FP8
    runs (CPU tests check FP8's numerics), as in a compiled graph, which cannot read the table (a file)."""
    half = gemm_precision(precision, gemm, x, E, I, O)
    if not x.is_cuda or torch.compiler.is_compiling():
        return half != "fp8"
    return fused_measured_faster(gemm, I, O, x.shape[0] / max(E, 1), half)


def fused_measured_faster(gemm: str, I: int, O: int, rows_per_expert: float, half: str = "bf16") -> bool:
    """Whether the table's bf16 gate / up GEMM over 2F ran at most as long as two over F in `half` precision at this
    GEMM and half (I, O) (tools/tune/expert_gemms.py writes both); where either is unmeasured, True for bf16 halves
    and False for FP8 ones (which their own rows measured faster than bf16)."""
    fused = _measured(gemm, 2 * I, O, rows_per_expert) if gemm == "dgrad" else _measured(gemm, I, 2 * O,
                                                                                           rows_per_expert)
    halves = _measured(gemm, I, O, rows_per_expert)
    if fused is None or halves is None:
        return half == "bf16"
    return fused["bf16_ms"] <= 2 * halves[f"{half}_ms"]


def _rates() -> tuple:
    """The FP8 table's records. A compiled graph cannot open a file: it reads the table loaded at import."""
    if torch.compiler.is_compiling():
        return _RATES_AT_IMPORT
    return _fp8_rates(os.environ.get("DTENSOR_MOE_FP8_RATES", FP8_RATES))


def _measured(gemm: str, I: int, O: int, rows_per_expert: float) -> dict | None:
    """The table's record (DTENSOR_MOE_FP8_RATES overrides its path) of this GEMM and (I, O) at the measured rows
    per expert nearest on a log scale; None for an unmeasured (I, O). A compiled graph's row count may be
    data-dependent (the expert-parallel dispatch's): there the first measurement of this GEMM and (I, O)."""
    rates = [r for r in _rates() if r["gemm"] == gemm and r["I"] == I and r["O"] == O]
    if not rates or torch.compiler.is_compiling():
        return rates[0] if rates else None
    return _nearest(rates, rows_per_expert)


def fp8_measured_faster(gemm: str, I: int, O: int, rows_per_expert: float) -> bool:
    """Whether FP8 beat bf16 in the table at this GEMM and (I, O), at the measured rows per expert nearest on a log
    scale; False for an unmeasured (I, O)."""
    near = _measured(gemm, I, O, rows_per_expert)
    return near is not None and near["fp8_tflops"] > near["bf16_tflops"]


def rounding_backend(experts_TK: torch.Tensor) -> str | None:
    """The torch.compile backend for token rounding (token_rounding.round_tokens) called from an eager layer on
    CUDA, None to run its ops eagerly: eager on one H200 its ~100 small kernels took more host and device time
    than the whole-tile GEMMs saved, compiled the 1-GPU job gained from it (RESULTS.md, 2026-12-03). Off CUDA it
    runs eagerly (CPU tests, float64), inside a compiled graph as part of that graph."""
    if experts_TK.is_cuda and not torch.compiler.is_compiling() and triton_available():
        return "inductor"
    return None


def count_host_syncs():
    """A context manager counting the host's waits for the device inside its block, by why ("split_sizes": the
    dispatch's split sizes, "exact_loop": a per-expert loop's row counts, "capacity_check": the row cap): a
    `collections.Counter`."""
    return counters.count("host_syncs")


def host_synced(why: str, device: torch.device) -> None:
    """Counts one wait of the host for `device` under `why` (none on the CPU)."""
    if device.type != "cpu":
        counters.add("host_syncs", why)


def host_list(t: torch.Tensor, why: str) -> list:
    """t.tolist(), counted under `why` when it waits for the device."""
    host_synced(why, t.device)
    return t.tolist()
