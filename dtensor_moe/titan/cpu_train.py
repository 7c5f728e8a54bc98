"""`torchrun --nproc-per-node N -m dtensor_moe.titan.cpu_train --module ... --config ...`

torchtitan's `torchtitan.train` entry point on CPU gloo ranks: same arguments, no GPU needed.
"""

from dtensor_moe.titan.cpu import use_cpu

if __name__ == "__main__":
    use_cpu()
    from torchtitan.train import main

    main()
