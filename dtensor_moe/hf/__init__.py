"""Hugging Face MoE weights in and out: Qwen3-MoE, Mixtral, DeepSeek-V3 and gpt-oss.

`from_hf_block(block)`: our `MoE` from a transformers sparse-MoE module. `load_hf_moe(moe, reader,
family, prefix, dims)`: one layer from a checkpoint, each rank reading only its own slices
(`SafetensorsReader`). `to_hf(state, family, prefix)`: our layer's tensors under their keys.
`moe_config_from_hf(config)`: a layer's `MoEConfig`. `parallelize_hf_model(model, dims)`: a transformers MoE
causal LM with our layers in place of its sparse blocks, parallelized; `save_hf(model, dir)` writes it back for
`from_pretrained`. Files: model.py (whole models), reader.py (lazy reads), layout.py (expert
layouts), families.py (key names, configs), convert.py (both directions, keys and shapes checked), block.py.
"""

from dtensor_moe.hf.block import from_hf_block
from dtensor_moe.hf.convert import layer_prefix, load_hf_moe, to_hf
from dtensor_moe.hf.families import FAMILIES, family, moe_config_from_hf
from dtensor_moe.hf.model import hf_state_dict, parallelize_hf_model, save_hf, swap_moe_blocks
from dtensor_moe.hf.reader import SafetensorsReader, StateDictReader

__all__ = ["FAMILIES", "SafetensorsReader", "StateDictReader", "family", "from_hf_block", "hf_state_dict",
           "layer_prefix", "load_hf_moe", "moe_config_from_hf", "parallelize_hf_model", "save_hf",
           "swap_moe_blocks", "to_hf"]
