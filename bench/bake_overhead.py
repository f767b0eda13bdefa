# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark: what a batch's bake adds beyond its configured seconds.

Serves N engines' ``/metrics`` in vLLM's exposition format over HTTP on this machine (each read
finds more finished requests, with histograms of time to first token, time per output token and
end-to-end latency), then runs ``ansible-playbook`` on localhost: one task ``gpufleet.vllm.rollout_bake``
with ``--seconds`` over the first half of the engines as the batch and the other half as the
baseline, timed from the task before it to the task after it. The overhead is that time less the
bake's seconds: two reads of every engine, the analysis and the task around them. Goal (the
rollout's per-batch budget): under 1 s. Prints JSON.

With ``--sources scrape,prometheus`` each size is also baked from a real Prometheus server (the
``prometheus`` binary of Debian's package, on loopback, scraping every engine each second):
``prometheus_url`` set, the two readings are instant queries of its HTTP API and the margins query.

Usage: python bench/bake_overhead.py [--engines 8,64] [--seconds 2] [--runs 3] [--sources scrape,prometheus]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import typing as t
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

GOAL_S = 1.0
LABELS = 'engine="0",model_name="bench"'
HISTOGRAMS = {"vllm:time_to_first_token_seconds": 0.08, "vllm:inter_token_latency_seconds": 0.02,
              "vllm:e2e_request_latency_seconds": 0.9}
BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Engine(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        self.reads = 0
        super().__init__(("127.0.0.1", 0), Handler)

    def exposition(self) -> str:
        self.reads += 1
        n = 50.0 * self.reads
        out = ["# TYPE vllm:request_success_total counter"]
        out += [f'vllm:request_success_total{{{LABELS},finished_reason="{r}"}} {n if r == "stop" else 0.0}' for r in ("stop", "length", "abort")]
        out += ["# TYPE vllm:num_preemptions_total counter", f"vllm:num_preemptions_total{{{LABELS}}} 0.0",
                "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{LABELS}}} 0.3"]
        for name, value in HISTOGRAMS.items():
            out.append(f"# TYPE {name} histogram")
            out += [f'{name}_bucket{{{LABELS},le="{le}"}} {n if value <= le else 0.0}' for le in BOUNDS]
            out += [f'{name}_bucket{{{LABELS},le="+Inf"}} {n}', f"{name}_count{{{LABELS}}} {n}", f"{name}_sum{{{LABELS}}} {n * value}"]
        return "\n".join(out) + "\n"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (the http.server API)
        assert isinstance(self.server, Engine)
        body = self.server.exposition().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def playbook(targets: list[dict[str, str]], seconds: int, out: Path, prometheus_url: str | None = None) -> list[dict]:
    half = len(targets) // 2
    bake: dict[str, t.Any] = {"seconds": seconds, "canary": targets[:half], "baseline": targets[half:]}
    if prometheus_url:
        bake["prometheus_url"] = prometheus_url
    return [{"name": "Bake", "hosts": "localhost", "connection": "local", "gather_facts": False, "tasks": [
        {"name": "Start", "ansible.builtin.set_fact": {"bench_t0": "{{ now().timestamp() }}"}},
        {"name": "Bake the batch", "register": "bake", "gpufleet.vllm.rollout_bake": bake},
        {"name": "End", "ansible.builtin.set_fact": {"bench_t1": "{{ now().timestamp() }}"}},
        {"name": "Keep", "ansible.builtin.copy": {
            "dest": str(out), "mode": "0644",
            "content": "{{ {'seconds': bench_t1 | float - bench_t0 | float, 'verdict': bake.analysis.verdict} | to_json }}"}},
    ]}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def prometheus(addresses: list[str], workdir: Path) -> t.Iterator[str]:
    """A Prometheus server on loopback scraping ``addresses`` every second, once it has scraped each; its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (Debian's prometheus package; tests/tools/apt-deps.sh installs it)")
    work = Path(tempfile.mkdtemp(prefix="prometheus-", dir=workdir))
    targets = ", ".join(f"'{a}'" for a in addresses)
    (work / "prometheus.yml").write_text("global: {scrape_interval: 1s}\n"
                                         f"scrape_configs:\n  - job_name: vllm\n    static_configs:\n      - targets: [{targets}]\n",
                                         encoding="utf-8")
    url = f"http://127.0.0.1:{_free_port()}"
    with (work / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                                 f"--web.listen-address={url.split('//', 1)[1]}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline, up = time.monotonic() + 120, 0
            while time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    with urllib.request.urlopen(f"{url}/api/v1/query?query=up%3D%3D1", timeout=5) as resp:
                        up = len(json.loads(resp.read())["data"]["result"])
                    if up == len(addresses):
                        break
                time.sleep(0.25)
            else:
                raise RuntimeError(f"Prometheus did not scrape the {len(addresses)} engines ({up} up): "
                                   + (work / "prometheus.log").read_text(errors="replace")[-2000:])
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            shutil.rmtree(work, ignore_errors=True)


def one_run(count: int, seconds: int, workdir: Path, source: str = "scrape") -> dict:
    engines = [Engine() for _unused in range(count)]
    for engine in engines:
        threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        addresses = [f"127.0.0.1:{e.server_address[1]}" for e in engines]
        targets = [{"host": f"bench-{i // 2}", "instance": f"e{i % 2}", "url": f"http://{address}/metrics"}
                   for i, address in enumerate(addresses)]
        with prometheus(addresses, workdir) if source == "prometheus" else contextlib.nullcontext() as url:
            out = workdir / "result.json"
            book = workdir / "bake.yml"
            book.write_text(json.dumps(playbook(targets, seconds, out, url)), encoding="utf-8")
            argv = ["ansible-playbook", "-i", "localhost,", "-e", f"ansible_python_interpreter={sys.executable}", str(book)]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 300, check=False)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-1000:])
        result = json.loads(out.read_text(encoding="utf-8"))
        # read straight from the engines: twice each; through Prometheus the engines see only its scrapes
        if source == "scrape" and not all(e.reads == 2 for e in engines):
            raise RuntimeError("an engine was not read exactly twice")
        return result
    finally:
        for engine in engines:
            engine.shutdown()
            engine.server_close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="8,64")
    parser.add_argument("--seconds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sources", default="scrape", help="scrape (each engine's /metrics), prometheus, or both")
    args = parser.parse_args()
    sizes = [int(s) for s in args.engines.split(",") if s.strip()]
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    if not sources or set(sources) - {"scrape", "prometheus"}:
        parser.error(f"--sources: scrape, prometheus or both, got {args.sources!r}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-bake-") as tmp:
        for count, source in ((c, s) for c in sizes for s in sources):
            walls, verdicts = [], set()
            for _run in range(args.runs):
                got = one_run(count, args.seconds, Path(tmp), source)
                walls.append(got["seconds"])
                verdicts.add(got["verdict"])
            overhead = [w - args.seconds for w in walls]
            rows.append({"engines": count, "source": source, "bake_seconds": args.seconds, "runs": args.runs,
                         "median_task_seconds": round(statistics.median(walls), 3),
                         "median_overhead_s": round(statistics.median(overhead), 3), "max_overhead_s": round(max(overhead), 3),
                         "ratio_to_bake": round(statistics.median(walls) / args.seconds, 3),
                         "verdicts": sorted(verdicts), "within_goal": max(overhead) < GOAL_S})
    print(json.dumps({"goal_overhead_s": GOAL_S, "sizes": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
