# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Option parsing of the simulated engine matches vLLM's ``vllm serve``."""

from __future__ import annotations

import argparse

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import render_serve_args

# vLLM's human_readable_int: lowercase suffixes decimal, uppercase binary,
# decimals only with decimal suffixes, anything else must be a plain int.
ACCEPT = [
    ("0", 0),
    ("100000000", 100_000_000),
    (" 42 ", 42),
    ("1k", 1000),
    ("1K", 1024),
    ("25.6k", 25_600),
    ("30g", 30_000_000_000),
    ("30G", 30 * 2**30),
    ("2m", 2_000_000),
    ("2M", 2 * 2**20),
    ("1t", 10**12),
    ("1T", 2**40),
    ("1.5g", 1_500_000_000),
    ("-5", -5),             # int() accepts it; vLLM does too
]
REJECT = ["30GiB", "1.5G", "30 G", "30GB", "1e9", "0x10", "", "G", "2.5K", "12.0"]


@pytest.mark.parametrize(("text", "value"), ACCEPT)
def test_human_readable_int_accepts(engine, text: str, value: int) -> None:
    assert engine.human_readable_int(text) == value


@pytest.mark.parametrize("text", REJECT)
def test_human_readable_int_rejects(engine, text: str) -> None:
    with pytest.raises((ValueError, argparse.ArgumentTypeError)):
        engine.human_readable_int(text)


def test_binary_decimal_error_names_the_fix(engine) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"Did you mean to use 1\.5g instead"):
        engine.human_readable_int("1.5G")


def test_serve_parses_collection_options(engine) -> None:
    args = engine.parse_args([
        "serve", "/srv/models/m", "--host", "127.0.0.1", "--port", "8001",
        "--kv-cache-memory-bytes", "30333009920", "--gpu-memory-utilization", "0.87",
        "--max-model-len", "32k", "--max-num-seqs", "64", "--max-num-batched-tokens", "8K",
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1", "--dtype", "bfloat16",
        "--kv-cache-dtype", "fp8", "--block-size", "32", "--enforce-eager", "--served-model-name", "llama",
        "--seed", "7", "--disable-log-requests",
    ])
    assert args.model_tag == "/srv/models/m"
    assert args.kv_cache_memory_bytes == 30333009920
    assert args.gpu_memory_utilization == 0.87
    assert args.max_model_len == 32000
    assert args.max_num_batched_tokens == 8192
    assert (args.tensor_parallel_size, args.block_size, args.kv_cache_dtype) == (2, 32, "fp8")
    assert args.enforce_eager is True
    assert args.served_model_name == ["llama"]


def test_logged_spelling_works_by_prefix(engine) -> None:
    # vLLM's own suggestion prints `--kv-cache-memory=N`: argparse prefix matching accepts it.
    args = engine.parse_args(["serve", "m", "--kv-cache-memory=1234567"])
    assert args.kv_cache_memory_bytes == 1234567


def test_underscore_spelling_like_flexible_argument_parser(engine) -> None:
    args = engine.parse_args(["serve", "m", "--max_model_len", "4096", "--kv_cache_memory_bytes=2G"])
    assert (args.max_model_len, args.kv_cache_memory_bytes) == (4096, 2 * 2**30)


@pytest.mark.parametrize("argv", [
    ["serve", "m", "--kv-cache-memory-bytes", "30GiB"],
    ["serve", "m", "--kv-cache-memory-bytes", "1.5G"],
    ["serve", "m", "--no-such-option", "1"],
    ["serve", "m", "--dtype", "int3"],
    ["serve", "m", "--max-num", "3"],          # ambiguous prefix
])
def test_bad_options_exit_2_with_argparse_error(engine, argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        engine.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_version(engine, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        engine.parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == engine.VERSION


def test_every_option_the_collection_renders_is_accepted(engine) -> None:
    serve_args = {
        "max_model_len": 32768, "max_num_seqs": 64, "max_num_batched_tokens": 8192,
        "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "dtype": "bfloat16",
        "kv_cache_dtype": "fp8", "block_size": 16, "enforce_eager": True, "served_model_name": "llama",
        "seed": 0,
    }
    argv = ["serve", "/srv/models/m", *render_serve_args(serve_args)]
    args = engine.parse_args(argv)
    assert args.max_model_len == 32768
    assert args.enforce_eager is True
    assert (args.kv_cache_dtype, args.served_model_name) == ("fp8", ["llama"])


def test_a_hugging_face_model_id_is_read_from_the_hub_cache_as_vllm_reads_it_offline(engine, tmp_path, monkeypatch):
    """``vllm serve ORG/NAME --revision R`` with HF_HOME set: the snapshot of that revision in the hub
    cache (huggingface_hub's layout), else the one refs/main names; a directory is read as it is."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = tmp_path / "hf" / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct"
    assert engine.model_config_path("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f") == str(repo / "snapshots" / "0e9e39f" / "config.json")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n", encoding="ascii")
    assert engine.model_config_path("meta-llama/Llama-3.1-8B-Instruct", None) == str(repo / "snapshots" / "abc123" / "config.json")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert engine.model_config_path("org/m", "r1") == str(tmp_path / "cache" / "models--org--m" / "snapshots" / "r1" / "config.json")
    assert engine.model_config_path(str(tmp_path), None) == str(tmp_path / "config.json")
    assert engine.model_config_path("/srv/models/m", None) == "/srv/models/m/config.json"
