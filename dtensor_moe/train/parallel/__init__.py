"""The main job's dense parallelism (TP styles, CP attention, pipeline) and `parallelize_transformer`, which chains them
with the library's expert parallelism over `dtensor_moe.train.model.MoETransformer`."""

# Nothing is re-exported here: the public modules, each imported by its own name.
__all__ = ["context_parallel", "parallelize_transformer", "pipeline", "tensor_parallel", "tp_styles"]
