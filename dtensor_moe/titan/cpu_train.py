"""`torchrun --nproc-per-node N -m dtensor_moe.titan.cpu_train --module ... --config ...`

torchtitan's `torchtitan.train` entry point on CPU gloo ranks: same arguments, no GPU needed.
"""

import importlib.util
import sys

from dtensor_moe.titan.cpu import use_cpu

if __name__ == "__main__":
    if importlib.util.find_spec("torchtitan") is None:  # one line per rank, not an ImportError traceback each
        print("dtensor_moe.titan.cpu_train needs torchtitan 0.3.0, which is not installed; install the extra: "
              "pip install 'dtensor-moe[titan]' (or pip install torchtitan==0.3.0)", file=sys.stderr)
        sys.exit(2)
    use_cpu()
    from torchtitan.train import main

    main()
