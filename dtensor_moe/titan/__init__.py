"""torchtitan hook: `--module dtensor_moe.titan --config <fn>` trains torchtitan's MoE models with
dtensor_moe's EP x EDP x ETP. Needs torchtitan 0.3.0 (torch >= 2.13); see docs/titan.md.

Deliberately empty: `dtensor_moe.titan.cpu_train` must import nothing from torchtitan before it
switches torchtitan to the CPU.
"""
