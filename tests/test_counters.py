"""Instrumentation as context managers (dtensor_moe/kernels/counters.py): a block counts what ran inside it."""

import torch

from dtensor_moe.kernels import counters, policy


def test_blocks_count_what_runs_inside_them_and_nest():
    counters.add("sent_bytes", "k", 5)  # no block open: counted nowhere
    with counters.count("sent_bytes") as outer:
        counters.add("sent_bytes", "k", 2)
        with counters.count("sent_bytes") as inner:
            counters.add("sent_bytes", "k", 3)
            counters.add("host_syncs", "k")  # another kind
    counters.add("sent_bytes", "k", 7)  # after the blocks: counted nowhere
    assert outer == {"k": 5} and inner == {"k": 3}


def test_host_syncs_count_device_reads_only():
    with policy.count_host_syncs() as syncs:
        assert policy.host_list(torch.arange(3), "exact_loop") == [0, 1, 2]  # the CPU waits for nothing
        policy.host_synced("split_sizes", torch.device("cuda"))
    assert syncs == {"split_sizes": 1}
