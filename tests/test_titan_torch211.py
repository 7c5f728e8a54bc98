"""tests/gpu/titan_torch211.py: its shims and its failure parser (no run: its CLI takes ~20 s of torchrun).

Its CLI was run on 2 CPU gloo ranks (EP2, 4 steps, from one seed checkpoint written under torch 2.13): torch 2.13.0+cpu
(no shim needed but set_timeout) and torch 2.11.0 with every shim logged losses 5.96939 5.91158 5.81545 5.72692 and
gradient norms 1.0983 1.1206 1.175 0.9625 alike; with bf16 parameters 5.96956 5.91182 5.81586 5.72707 (torch 2.11)
against 5.96956 5.91182 5.81587 5.72703 (torch 2.13). Under torch 2.11 without the FSDP fixes the run died of SIGSEGV
in the first backward (bf16, with only the lm_head one: "FSDP reduce-scatter expects uniform gradient dtype");
without any shim, at torchtitan's import of DataParallelMeshDims. Those are the samples below.
"""

import pytest

from tests.gpu import titan_torch211 as t211

IMPORT_FAILURE = """\
titan_torch211 shims: none needed
[rank0]:Traceback (most recent call last):
[rank0]:  File "/work/main/benchmarks/titan_torch211.py", line 464, in <module>
[rank0]:    rank_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
[rank0]:  File "/tmp/site/torchtitan/train.py", line 14, in <module>
[rank0]:    from torchtitan.trainer import Trainer
[rank0]:  File "/tmp/site/torchtitan/distributed/full_dtensor.py", line 23, in <module>
[rank0]:    from torch.distributed.fsdp import DataParallelMeshDims
[rank0]:ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp' (/x/fsdp/__init__.py)
E1204 16:33:55.715000 17958 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/run.py", line 994, in <module>
    main()
  File "/x/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 362, in wrapper
    return f(*args, **kwargs)
  File "/x/torch/distributed/launcher/api.py", line 317, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""

ATTRIBUTE_FAILURE = """\
Traceback (most recent call last):
  File "/tmp/site/torchtitan/models/common/token_dispatcher.py", line 259, in dispatch
    torch.compiler.is_compiling() or torch.compiler._is_non_strict_tracing()
                                     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
AttributeError: module 'torch.compiler' has no attribute '_is_non_strict_tracing'
"""

KEYWORD_FAILURE = """\
Traceback (most recent call last):
  File "/tmp/site/torchtitan/distributed/fsdp.py", line 171, in apply_fsdp_to_decoder
    fully_shard(
  File "/x/torch/distributed/fsdp/_fully_shard/_fully_shard.py", line 120, in wrapper
    return fn(*args, **kwargs)
TypeError: fully_shard() got an unexpected keyword argument 'dp_mesh_dims'
"""

SEGFAULT = """\
[titan] 2026-12-04 16:27:50,891 - root - INFO - Training starts at step 1
Fatal Python error: Segmentation fault

Thread 0x00007feea66ec6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait

Current thread 0x00007fef8a820b80 (most recent call first):
  File "/x/torch/autograd/graph.py", line 869 in _engine_run_backward
  File "/x/torch/_tensor.py", line 631 in backward
  File "/tmp/site/torchtitan/trainer.py", line 828 in _forward_backward_body
  File "/tmp/site/torchtitan/trainer.py", line 925 in train_step

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
E1204 16:27:51.085000 15510 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: -11) local_rank: 0
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 994, in <module>
    main()
  File "/x/torch/distributed/launcher/api.py", line 317, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  traceback : Signal 11 (SIGSEGV) received by PID 15515
"""


def test_blocker_names_the_missing_import_not_torchruns_error():
    found = t211.blocker(IMPORT_FAILURE, 1)
    assert found.startswith("missing torch API torch.distributed.fsdp.DataParallelMeshDims (ImportError"), found
    assert found.endswith("needed at torchtitan/distributed/full_dtensor.py:23 in <module>: "
                          "from torch.distributed.fsdp import DataParallelMeshDims"), found


@pytest.mark.parametrize("log, api, where", [
    (ATTRIBUTE_FAILURE, "torch.compiler._is_non_strict_tracing", "torchtitan/models/common/token_dispatcher.py:259"),
    (KEYWORD_FAILURE, "fully_shard(dp_mesh_dims=...)", "torchtitan/distributed/fsdp.py:171 in apply_fsdp_to_decoder"),
])
def test_blocker_names_missing_attributes_and_keywords(log, api, where):
    found = t211.blocker(log, 1)
    assert api in found and f"needed at {where}" in found, found


def test_blocker_reports_a_ranks_crash_with_torchtitans_frame():
    found = t211.blocker(SEGFAULT, 1)
    assert found == ("a rank crashed: Segmentation fault in /x/torch/autograd/graph.py:869 in _engine_run_backward, "
                     "called from torchtitan/trainer.py:828 in _forward_backward_body"), found


def test_blocker_none_for_a_finished_run():
    assert t211.blocker(ATTRIBUTE_FAILURE, 0) is None


def test_parse_steps_reads_ranks_first_lines():
    log = ("[titan] - INFO - \x1b[31mstep:  1  \x1b[32mloss:  5.96939  \x1b[38;2;180;60;0mgrad_norm:  1.0983  x\n"
           "[titan] - root - INFO - step:  1  loss:  5.96939  grad_norm:  1.0983\n"
           "[titan] - root - INFO - step:  2  loss:  5.91158  grad_norm:  1.1206\n")
    assert t211.parse_steps(log) == ([5.96939, 5.91158], [1.0983, 1.1206])


def test_install_adds_only_what_torch_lacks():
    import torch.compiler
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    had = {n: hasattr(m, a) for n, (m, a) in {
        "torch.distributed.fsdp.DataParallelMeshDims": (fsdp, "DataParallelMeshDims"),
        "torch.compiler._is_non_strict_tracing": (torch.compiler, "_is_non_strict_tracing"),
        "torch.distributed.set_timeout": (dist, "set_timeout")}.items()}
    added = t211.install()
    assert sorted(added) == sorted(n for n, present in had.items() if not present)
    assert t211.install() == []  # idempotent
    assert torch.compiler._is_non_strict_tracing() is False


def test_data_parallel_mesh_dims_matches_torch_2_13():
    dims = t211.DataParallelMeshDims(shard=("dp_shard", "cp"), replicate="dp_replicate")
    assert dims.shard_names == ("dp_shard", "cp") and dims.replicate_names == ("dp_replicate",)
    assert t211.DataParallelMeshDims(shard="efsdp").replicate_names == ()
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        t211.DataParallelMeshDims()


def test_fsdp_fixes_only_before_torch_2_13():
    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("patches torchtitan's loss and FSDP's param group on this torch")
    pytest.importorskip("torchtitan")
    assert t211.keep_lm_head_unsharded() is False and t211.uniform_grad_dtype() is False
