"""On one GPU: pad_to_capacity's static path and the FP8 payload's packing on CUDA (the CPU suite covers
every mesh; this checks what CPU cannot: device syncs and Triton/inductor paths).

- the padded layer (capacity_factor 1, an overloaded expert) against the unpadded dropping layer on the
  same weights, bf16 and fp32: output and every gradient;
- its forward and backward under torch.cuda.set_sync_debug_mode("error"): any host sync raises (the
  unpadded layer's split-size read is shown to raise, so the check can fail);
- the padded layer compiled (inductor, fullgraph) against eager;
- kernels/fp8.py's pack_rows / unpack_rows round trip on CUDA against quantize_rows, a zero row included.

    python tests/gpu/gpu_pad_check.py [--out results.json]
"""

import argparse
import json

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path)
import torch

from dtensor_moe import MoE, MoEConfig, MoERunOptions
from dtensor_moe.kernels import fp8


def _layer(pad: bool, dtype, seed=0):
    cfg = MoEConfig(dim=256, hidden_dim=512, num_experts=8, top_k=2)
    torch.manual_seed(seed)
    moe = MoE(cfg, MoERunOptions(capacity_factor=1.0, pad_to_capacity=pad)).to("cuda", dtype)
    with torch.no_grad():
        moe.router.gate.weight[3] += 0.5  # an overloaded expert: pairs are dropped
    return moe


def _step(moe, x):
    x = x.detach().requires_grad_()
    y = moe(x)
    y.float().square().mean().backward()
    return (
        y.detach(),
        x.grad,
        {n.removeprefix("_orig_mod."): p.grad for n, p in moe.named_parameters() if p.grad is not None},
    )


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        x = torch.randn(4, 512, 256, device="cuda", dtype=dtype)
        ref, pad = _step(_layer(False, dtype), x), _step(_layer(True, dtype), x)
        errs = {"out": _rel(pad[0], ref[0]), "x.grad": _rel(pad[1], ref[1]),
                **{n: _rel(pad[2][n], ref[2][n]) for n in ref[2]}}
        res[f"padded_vs_unpadded_{dtype}"] = errs
        assert sorted(pad[2]) == sorted(ref[2]) and max(errs.values()) < tol, errs
    x = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16)
    padded = _layer(True, torch.bfloat16)
    _step(padded, x)  # warm-up: Triton compiles, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(padded, x)
        res["padded_syncs"] = "none (set_sync_debug_mode error: passed)"
        try:
            _step(_layer(False, torch.bfloat16), x)
            res["unpadded_syncs"] = "none"
        except RuntimeError as e:
            res["unpadded_syncs"] = f"raised: {str(e).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert res["unpadded_syncs"].startswith("raised"), res  # the check can fail
    compiled = torch.compile(_layer(True, torch.bfloat16), fullgraph=True)
    eager, comp = _step(_layer(True, torch.bfloat16), x), _step(compiled, x)
    res["compiled_vs_eager"] = errs = {"out": _rel(comp[0], eager[0]), "x.grad": _rel(comp[1], eager[1]),
                                       **{n: _rel(comp[2][n], eager[2][n]) for n in eager[2]}}
    assert max(errs.values()) < 3e-2, errs
    rows = torch.randn(33, 7168, device="cuda", dtype=torch.bfloat16)
    rows[5] = 0
    q, s = fp8.quantize_rows(rows)
    back = fp8.unpack_rows(fp8.pack_rows(rows), torch.bfloat16)
    want = (q.float() * s[:, None]).to(torch.bfloat16)
    res["pack_roundtrip_max_abs_diff"] = (back.float() - want.float()).abs().max().item()
    res["pack_zero_row_max"] = back[5].abs().max().item()
    assert res["pack_roundtrip_max_abs_diff"] == 0 and res["pack_zero_row_max"] == 0, res
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
