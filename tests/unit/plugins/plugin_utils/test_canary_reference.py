# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The reference of a canary gang: every member's ranks, each naming its host, from the results the members'
vllm_canary runs return (the one-host reference: tests/unit/roles/test_vllm_canary_reference.py)."""
from __future__ import annotations

import pytest

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._canary_reference import ReferenceError, reference_from_canary

GIB = 1 << 30


def gpu(index: int, free_gib: int) -> dict:
    return {"index": index, "free_bytes": free_gib * GIB, "total_bytes": 80 * GIB, "name": "NVIDIA H100 80GB HBM3"}


def rank(number: int, in_use_gib: int) -> dict:
    return {"rank": number, "current_kv_bytes": in_use_gib * GIB, "suggested_kv_bytes_fit": None, "initial_free_bytes": 79 * GIB}


# TP=2 x PP=2 over two hosts of two GPUs: the leader runs ranks 0-1 on its GPUs 2, 3; the follower ranks 2-3 on 0, 1
LEADER_RUN = {"ranks": [rank(0, 40), rank(1, 40)], "num_blocks": 1000, "block_size": 16, "kv_cache_tokens": 16000,
              "verdict": "pass", "max_model_len": 4096}
FOLLOWER = {"host": "h2", "result": {"ranks": [rank(2, 41), rank(3, 39)], "health": "joined", "held": "stop_file"},
            "preboot_gpus": [gpu(0, 78), gpu(1, 77)], "gpus": [0, 1]}


def test_a_gang_reference_holds_every_members_ranks_each_with_its_host_and_gpu():
    ref = reference_from_canary(LEADER_RUN, [gpu(2, 79), gpu(3, 76)], [2, 3], canary={"host": "h1"}, members=[FOLLOWER])
    assert ref["members"] == ["h1", "h2"]
    assert [(r["rank"], r["host"], r["free_bytes"] // GIB, r["kv_bytes_in_use"] // GIB) for r in ref["ranks"]] == [
        (0, "h1", 79, 40), (1, "h1", 76, 40), (2, "h2", 78, 41), (3, "h2", 77, 39)]
    assert sorted(ref["vllm_free_bytes"]) == [0, 1, 2, 3]
    # the engine's figures are the leader's canary's: it measured the gang's engine
    assert (ref["num_blocks"], ref["kv_cache_tokens"], ref["total_bytes"]) == (1000, 16000, 80 * GIB)


def test_a_member_whose_log_numbers_its_ranks_within_the_member_gets_the_instances_numbers():
    """The CPU build's data-parallel follower logs its worker as rank 0 (``Worker``): its ranks follow the leader's."""
    follower = {**FOLLOWER, "result": {"ranks": [rank(0, 41), rank(1, 39)], "health": "joined", "held": "stop_file"}}
    ref = reference_from_canary(LEADER_RUN, [gpu(2, 79), gpu(3, 76)], [2, 3], canary={"host": "h1"}, members=[follower])
    assert [(r["rank"], r["host"], r["free_bytes"] // GIB) for r in ref["ranks"]] == [(0, "h1", 79), (1, "h1", 76), (2, "h2", 78), (3, "h2", 77)]
    assert sorted(ref["vllm_free_bytes"]) == [0, 1, 2, 3]


def test_a_one_host_reference_is_unchanged():
    ref = reference_from_canary(LEADER_RUN, [gpu(2, 79), gpu(3, 76)], [2, 3], canary={"host": "h1"})
    assert "members" not in ref and all("host" not in r for r in ref["ranks"])
    assert [r["free_bytes"] // GIB for r in ref["ranks"]] == [79, 76]


@pytest.mark.parametrize("members, canary, message", [
    ([FOLLOWER], {}, "canary.facts.host: a canary gang's reference names the host of each rank"),
    ([{**FOLLOWER, "host": "h1"}], {"host": "h1"}, "members[0].host: expected a host of the gang other than h1, got 'h1'"),
    ([{**FOLLOWER, "result": {"ranks": []}}], {"host": "h1"}, "members[0] (h2): canary result: ranks missing"),
    ([{**FOLLOWER, "preboot_gpus": []}], {"host": "h1"}, "members[0] (h2): pre-boot probe: no GPUs"),
    ([{**FOLLOWER, "gpus": [0]}], {"host": "h1"}, "members[0] (h2): canary rank 3 has no GPU in the instance's gpus [0]"),
    ([{**FOLLOWER, "preboot_gpus": [gpu(0, 78)]}], {"host": "h1"}, "members[0] (h2): canary rank 3: GPU 1 is not in the pre-boot probe"),
    ([{**FOLLOWER, "result": {"ranks": [rank(1, 40)]}, "gpus": [0]}], {"host": "h1"},
     "members[0] (h2): rank(s) 1 also reported by another member"),
])
def test_a_gang_member_that_cannot_make_a_reference_is_named(members, canary, message):
    with pytest.raises(ReferenceError) as err:
        reference_from_canary(LEADER_RUN, [gpu(2, 79), gpu(3, 76)], [2, 3], canary=canary, members=members)
    assert message in str(err.value), str(err.value)


def test_the_reference_keeps_the_serve_args_of_its_geometry_without_a_secret_option():
    # the store's records are readable by whoever reads the store: a key given in serve_args stays out of them
    ref = reference_from_canary(LEADER_RUN, [gpu(2, 79), gpu(3, 76)], [2, 3], config={"model_type": "llama"},
                                serve_args={"tensor_parallel_size": 2, "api_key": "k-secret", "hf_token": "hf-secret"})
    assert ref["geometry"]["serve_args"] == {"tensor_parallel_size": 2}
    assert "secret" not in repr(ref)
