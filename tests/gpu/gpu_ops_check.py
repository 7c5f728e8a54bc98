"""On the GPU: every registered op's CUDA implementation through torch.library.opcheck (schema,
fake, autograd registration, compile), and the Triton paths against the torch ones.

    python tests/gpu/gpu_ops_check.py
"""

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path)
import torch

from dtensor_moe.kernels import gather_sum as G
from dtensor_moe.kernels import grouped_mm as M
from dtensor_moe.kernels import policy
from dtensor_moe.kernels import swiglu as S
from dtensor_moe.kernels import wgrad as W
from dtensor_moe.routing.tables import gather_rows


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        y = torch.randn(6, 64, device=dev, dtype=dtype, requires_grad=True)
        w = torch.rand(6, device=dev, dtype=dtype, requires_grad=True)
        idx = torch.tensor([[0, 3], [1, -1], [2, 4], [-1, -1], [5, -1]], device=dev)
        tok = torch.tensor([0, 1, 2, 0, 2, 4], device=dev)
        torch.library.opcheck(G.gather_sum, (y, idx, tok, w))
        assert policy.runs_triton(y)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(G.triton_forward(y.detach(), idx, w.detach()),
                                   G.torch_forward(y.detach(), idx, w.detach()), rtol=tol, atol=tol)
        a = torch.randn(3, 4096, device=dev, dtype=dtype, requires_grad=True)
        b = torch.randn(3, 4096, device=dev, dtype=dtype, requires_grad=True)
        torch.library.opcheck(S.swiglu, (a, b))
        x = torch.randn(70, 64, device=dev, dtype=dtype)
        wt = torch.randn(3, 64, 32, device=dev, dtype=dtype)
        offs = torch.tensor([20, 20, 70], device=dev, dtype=torch.int32)
        torch.library.opcheck(M.grouped_mm, (x, wt, offs))
        out = torch.zeros(3, 32, 64, device=dev, dtype=dtype)
        g = torch.randn(70, 32, device=dev, dtype=dtype)
        torch.library.opcheck(M.add_weight_grad_, (out, g, x, offs, 0.5, None, "triton"))
        xr = torch.randn(4, 8, device=dev, dtype=dtype, requires_grad=True)
        torch.library.opcheck(gather_rows, (xr, torch.tensor([0, 0, 2, 3, 1], device=dev),
                                            torch.tensor([[0, 1], [4, -1], [2, -1], [3, -1]], device=dev)))
        print(f"opcheck on cuda {dtype}: ok", flush=True)
    # kernels/wgrad's epilogues (read-add-write, atomic, TMA reduce-add), grids (a program per tile, persistent) and
    # operand loads (pointers, TMA) at ragged counts, an empty expert, partial tiles and rows TMA cannot take (130
    # bf16: not 16-byte aligned).
    for counts, O, I in (([5, 0, 70, 16], 40, 24), ([33], 17, 130), ([3, 40, 200], 136, 264)):
        g = torch.randn(sum(counts), O, device=dev, dtype=torch.bfloat16)
        x = torch.randn(sum(counts), I, device=dev, dtype=torch.bfloat16)
        out0 = torch.randn(len(counts), O, I, device=dev, dtype=torch.bfloat16)
        want = out0.float() + 0.5 * torch.stack([a.t().float() @ b.float() for a, b in zip(g.split(counts),
                                                                                                x.split(counts))])
        ends = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        for config in (W.DEFAULT_TILES, W.TileConfig(128, 128, 32, 4, 4, True),
                       W.TileConfig(128, 128, 32, 4, 4, True, True), W.TileConfig(64, 128, 32, 4, 3, True, True, 1),
                       W.TileConfig(128, 64, 32, 4, 3, False, False, 2),
                       W.TileConfig(128, 128, 32, 4, 4, True, True, 0, True),
                       W.TileConfig(64, 128, 32, 4, 3, False, False, 1, True)):
            out = out0.clone()
            W.accumulate(out, g, x, ends, 0.5, config)
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=0.5)
    print("wgrad accumulate configs on cuda: ok", flush=True)


if __name__ == "__main__":
    main()
