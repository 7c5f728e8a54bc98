"""The main job's dense parallelism (TP plan, CP attention, pipeline) and `parallelize_model`, which chains them
with the library's expert parallelism over `dtensor_moe.train.model.MoETransformer`."""
