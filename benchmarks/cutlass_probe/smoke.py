"""Exit 0 if grouped.so loads and its weight-gradient kernel adds a small grouped product correctly on this GPU."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe import load  # noqa: E402

lib = load(sys.argv[1])
E, O, I = 4, 256, 128
counts = torch.tensor([100, 0, 37, 300])
ends = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
g = torch.randn(int(counts.sum()), O, device="cuda", dtype=torch.bfloat16)
x = torch.randn(int(counts.sum()), I, device="cuda", dtype=torch.bfloat16)
out = torch.randn(E, O, I, device="cuda", dtype=torch.bfloat16)
want = out.float() + 0.5 * torch._grouped_mm(g.t(), x, offs=ends).float()
sms = torch.cuda.get_device_properties(0).multi_processor_count
rc = lib.grouped_gemm(0, g.data_ptr(), x.data_ptr(), out.data_ptr(), ends.data_ptr(), E, O, I, 0.5, 1.0, sms,
                      torch.cuda.current_stream().cuda_stream)
err = ((out.float() - want).norm() / want.norm()).item()
print("smoke rc", rc, "err", err)
sys.exit(0 if rc == 0 and err < 1e-2 else 1)
