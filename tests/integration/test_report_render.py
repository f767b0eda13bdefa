# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The run report end to end: the real playbook parts write it, headless Chromium renders it.

A localhost-only fleet (three hosts with a local connection) goes through the same
tasks files rollout.yml uses: batch progress at the start and end of each serial batch,
the report written from the rescue when a host fails (the failure stops every later
play), the report play otherwise. The class plan comes from the real kv_plan action.
Then report.html is rendered by Debian's chromium (installed by the fixture when
missing): the screenshot must show the chart's bars and the DOM must hold the figures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import pytest

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3

PLAYBOOK = """
- name: Run settings
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Keep the run settings as plays/validate.yml does
      ansible.builtin.set_fact:
        gpufleet_run:
          serial: [1, "50%"]
          report_dir: "{{ report_dir }}"
          classes: [h200]
          refused_class: fail
          class_pause: false
          class_pause_unattended: stop
          plan_file: ""
          plan: null
          started: "{{ now(utc=true).isoformat() }}"
          id: render-run
          profile_store: "{{ store }}"
        gpufleet_run_started_epoch: "{{ now().timestamp() | int }}"

- name: Plan the class
  hosts: gpu
  gather_facts: false
  tasks:
    - name: Plan with the real planner
      gpufleet.vllm.kv_plan:
        host_class: h200
        reference:
          ranks: [{rank: 0, free_bytes: 42GiB, kv_bytes: 30GiB}, {rank: 1, free_bytes: 42GiB, kv_bytes: 30GiB}]
          total_bytes: 141GiB
          bytes_per_block: 2097152
          kv_dtype_bytes: 2
        hosts:
          gpu-a/vllm: [{rank: 0, boot_free_bytes: 42GiB}, {rank: 1, boot_free_bytes: 41.5GiB}]
          gpu-b/vllm: [{rank: 0, boot_free_bytes: 40.75GiB}, {rank: 1, boot_free_bytes: 42GiB}]
          gpu-c/vllm: [{rank: 0, boot_free_bytes: 42GiB}, {rank: 1, boot_free_bytes: 42GiB}]
        guard_bytes: 0.5GiB
        # the protocol's exact formula: no gate margin, no rounding
        gate_margin_bytes: 0
        budget_granularity_bytes: 0
        max_model_len: 8192
        max_capacity_loss: 0.5
      register: plan
      run_once: true

    - name: Keep the class state and the canaries as plays/plan_classes.yml does
      ansible.builtin.set_fact:
        gpufleet_host_class: h200
        gpufleet_class_state:
          ok: true
          failed: false
          plan: "{{ plan }}"
          key_hash: 3f2a9c0d11e4b7a2
          manual_canary: pass
          reasons: "{{ plan.reasons }}"
        gpufleet_reference:
          profile:
            canary_result: {verdict: pass, kv_cache_tokens: 465632, preemptions: 0,
                            load: {completed: 16, failed: 0, ttft_p50: 0.041, ttft_p95: 0.087, e2e_p50: 0.61, e2e_p95: 0.93}}
        vllm_canary_result: {verdict: pass, kv_cache_tokens: 462848, preemptions: 0,
                             load: {completed: 16, failed: 0, ttft_p50: 0.043, ttft_p95: 0.091, e2e_p50: 0.62, e2e_p95: 0.95}}

    - name: Group the hosts
      ansible.builtin.add_host:
        name: "{{ item }}"
        groups: [gpufleet_rollout, gpufleet_class_h200]
      loop: "{{ ansible_play_hosts }}"
      run_once: true
      changed_when: false

    - name: Work out the batches of the class as plays/plan_classes.yml does
      ansible.builtin.set_fact:
        gpufleet_batch_plan: "{{ [['h200', ansible_play_hosts | sort]] | gpufleet.vllm.rollout_batches(hostvars['localhost']['gpufleet_run']['serial']) }}"
      delegate_to: localhost
      delegate_facts: true
      run_once: true

- name: Roll out in serial batches
  hosts: gpu
  gather_facts: false
  serial: "{{ hostvars['localhost']['gpufleet_run']['serial'] }}"
  max_fail_percentage: 0
  order: inventory
  vars_files:
    - REPO/playbooks/vars/common.yml
  vars:
    # as rollout.yml's serial play: the batch that runs
    gpufleet_hook_batch: "{{ hostvars['localhost']['gpufleet_batches'] | last }}"
  tasks:
    - name: Show the batch start
      ansible.builtin.import_tasks: REPO/playbooks/tasks/batch_start.yml

    - name: Deploy
      block:
        - name: Find what changes
          ansible.builtin.set_fact:
            vllm_service_pending: [{name: vllm}]
            vllm_service_touched: true

        - name: Start and check the new units
          ansible.builtin.fail:
            msg: "{{ item }}: boot check failed: ValueError: No available memory for the cache blocks."
          loop: [vllm-vllm.service]
          when: inventory_hostname == fail_host
      rescue:
        - name: Write the run report with this failure
          ansible.builtin.include_tasks: REPO/playbooks/tasks/report_tasks.yml

        - name: Fail this host so no later batch runs
          ansible.builtin.fail:
            msg: "{{ inventory_hostname }} failed; the previous units were restored and restarted"

    - name: Show the batch end
      ansible.builtin.import_tasks: REPO/playbooks/tasks/batch_end.yml

- name: Report the rollout
  ansible.builtin.import_playbook: REPO/playbooks/plays/report.yml
"""

INVENTORY = """
all:
  hosts:
    localhost: {ansible_connection: local}
  children:
    gpu:
      hosts: {gpu-a: {vllm_service_state_dir: STATE/gpu-a}, gpu-b: {vllm_service_state_dir: STATE/gpu-b},
              gpu-c: {vllm_service_state_dir: STATE/gpu-c}}
      vars: {ansible_connection: local}
"""


def run_playbook(tmp_path: Path, fail_host: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    reports = tmp_path / "reports"
    reports.mkdir()  # plays/validate.yml creates and write-tests it in a real run
    (tmp_path / "play.yml").write_text(PLAYBOOK.replace("REPO/", f"{REPO}/"), encoding="utf-8")
    (tmp_path / "hosts.yml").write_text(INVENTORY.replace("STATE/", f"{tmp_path}/state/"), encoding="utf-8")
    env = dict(os.environ)
    paths = [str(Path(p).resolve()) for p in env.get("ANSIBLE_COLLECTIONS_PATH", "").split(":") if p]
    env["ANSIBLE_COLLECTIONS_PATH"] = ":".join(paths or [str(REPO / ".cache" / "collections")])
    env["ANSIBLE_PYTHON_INTERPRETER"] = sys.executable
    env["ANSIBLE_NOCOLOR"] = "1"
    extra = json.dumps({"report_dir": str(reports), "fail_host": fail_host, "store": str(tmp_path / "store")})
    binary = shutil.which("ansible-playbook") or str(Path(sys.executable).parent / "ansible-playbook")
    proc = procgroup.run([binary, "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml"), "-e", extra],
                         env=env, timeout=600, cwd=tmp_path)
    return proc, reports


def run_dir(reports: Path) -> Path:
    runs = sorted(p for p in reports.iterdir() if p.is_dir())
    assert len(runs) == 1 and runs[0].name.startswith("rollout-"), runs
    return runs[0]


# ---------------------------------------------------------------- PNG reading (stdlib only)
def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit RGB/RGBA PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, width = 8, b"", 0
    height = bpp = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), f"unexpected PNG format depth {depth} color {color}"
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        ftype = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up = prev[i]
            corner = prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + left) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + up) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif ftype == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else (up if pb <= pc else corner)
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line) if bpp == 3 else bytes(b for i, b in enumerate(line) if i % 4 != 3))
        prev = line
    return width, height, rows


def color_share(rows: list[bytes], rgb: tuple[int, int, int], tol: int = 6) -> int:
    count = 0
    for row in rows:
        for i in range(0, len(row), 3):
            if all(abs(row[i + k] - rgb[k]) <= tol for k in range(3)):
                count += 1
    return count


# ---------------------------------------------------------------- Chromium
@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed with apt when missing (idempotent)."""
    return find_chromium()


def find_chromium() -> str:
    """Debian's chromium, installed with apt when missing (idempotent)."""
    path = shutil.which("chromium")
    if path is None:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
        if subprocess.run(cmd, env=env, capture_output=True, check=False).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, check=True, capture_output=True)
            subprocess.run(cmd, env=env, check=True, capture_output=True)
        path = shutil.which("chromium")
    assert path, "chromium is not installed and apt-get could not install it"
    return path


def chromium_run(binary: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,2000",
    ]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=180, check=False)


# ---------------------------------------------------------------- tests
def test_clean_rollout_report_from_the_report_play(tmp_path):
    proc, reports = run_playbook(tmp_path, fail_host="none")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    out = proc.stdout
    for index, host in ((1, "gpu-a"), (2, "gpu-b"), (3, "gpu-c")):
        assert f"batch {index} of 3 of class h200 (run batch {index} of 3): {host} (1 host(s));" in out, out[-5000:]
        assert f"batch {index} of 3 of class h200 done in " in out and f"{host} deployed vllm" in out
    run = run_dir(reports)
    report = json.loads((run / "report.json").read_text(encoding="utf-8"))
    assert report["schema_version"] == 2 and report["summary"]["ok"] is True and report["check_mode"] is False
    assert {h["host"]: (h["outcome"], h["batch"]) for h in report["hosts"]} == {
        "gpu-a": ("deployed", 1), "gpu-b": ("deployed", 2), "gpu-c": ("deployed", 3)}
    assert [b["outcome"] for b in report["batches"]] == ["ok", "ok", "ok"]
    cls = report["classes"][0]
    assert cls["plan"]["kv_cache_memory_bytes"] == int(28.25 * GIB)  # weakest gpu-b rank 0: 40.75 GiB boot free
    assert cls["weakest"]["host"] == "gpu-b/vllm" and cls["weakest"]["rank"] == 0
    assert cls["canaries"]["manual"]["kv_cache_tokens"] == 462848
    assert f"report: {run}/report.html" in out


def test_failed_host_report_and_chromium_rendering(tmp_path, chromium):
    proc, reports = run_playbook(tmp_path, fail_host="gpu-b")
    assert proc.returncode != 0, "a failed host must fail the run"
    # each batch held its hosts' leases; the report of the stopped batch gave gpu-b's back
    assert not list((tmp_path / "state").glob("*/.leases/host.json")), "no host lease is left behind"
    assert sorted(p.parent.name for p in (tmp_path / "state").glob("*/.leases")) == ["gpu-a", "gpu-b"], "gpu-c was never reached"
    run = run_dir(reports)
    report = json.loads((run / "report.json").read_text(encoding="utf-8"))
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {"gpu-a": "deployed", "gpu-b": "rolled_back", "gpu-c": "not_reached"}
    assert report["rolled_back"][0]["error"] == (
        "One or more items failed: vllm-vllm.service: boot check failed: ValueError: No available memory for the cache blocks.")
    assert [(b["index"], b["outcome"]) for b in report["batches"]] == [(1, "ok"), (2, "failed")]
    assert "failed hosts gpu-b" in proc.stdout

    html = run / "report.html"
    shot = Path(os.environ.get("GPUFLEET_REPORT_SCREENSHOT", tmp_path / "report.png"))
    res = chromium_run(chromium, tmp_path, f"--screenshot={shot}", html.as_uri())
    assert shot.exists(), res.stderr[-3000:]
    width, height, rows = png_pixels(shot)
    assert (width, height) == (1400, 2000)
    non_white = sum(1 for row in rows for i in range(0, len(row), 3) if row[i] + row[i + 1] + row[i + 2] < 720)
    assert non_white > 0.01 * width * height, f"screenshot looks blank: {non_white} non-white pixels"
    # the chart's bars: green (#2e7d32 at 75 % over white) for ranks above their floor
    assert color_share(rows, (98, 157, 101)) > 2000, "no green bar in the rendered chart"

    dom = chromium_run(chromium, tmp_path, "--dump-dom", html.as_uri())
    assert dom.returncode == 0, dom.stderr[-3000:]
    text = dom.stdout
    for needle in (
        "28.25GiB (30333206528 bytes)",
        "gpu-b/vllm rank 0 *",
        "free 40.75GiB, floor 40.75GiB",
        "No available memory for the cache blocks.",
        '<td>gpu-c</td><td>h200</td><td>-</td><td><span class="">not reached</span>',
        '<td>gpu-b</td><td>h200</td><td>2</td><td><span class="bad">rolled back</span>',
        "462848",
    ):
        assert needle in text, f"{needle!r} not in the rendered DOM"


# ---------------------------------------------------------------- plays/validate.yml: report directory and survey answers
VALIDATE_PLAY = """
- name: Check the inputs
  ansible.builtin.import_playbook: REPO/playbooks/plays/validate.yml

- name: Show the run settings
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Print them as JSON
      ansible.builtin.debug:
        msg: "RUN={{ gpufleet_run | to_json }}"
"""
VALIDATE_INVENTORY = """
all:
  hosts:
    localhost: {ansible_connection: local}
    gpu-a: {ansible_connection: local, gpufleet_host_class: h200, gpufleet_model: m, gpufleet_rollout_serial: [2, "20%"]}
"""


def run_validate(tmp_path: Path, extra: dict, inventory: str = VALIDATE_INVENTORY) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    (tmp_path / "validate.yml").write_text(VALIDATE_PLAY.replace("REPO/", f"{REPO}/"), encoding="utf-8")
    (tmp_path / "hosts.yml").write_text(inventory, encoding="utf-8")
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_PYTHON_INTERPRETER=sys.executable)
    paths = [str(Path(p).resolve()) for p in env.get("ANSIBLE_COLLECTIONS_PATH", "").split(":") if p]
    env["ANSIBLE_COLLECTIONS_PATH"] = ":".join(paths or [str(REPO / ".cache" / "collections")])
    binary = shutil.which("ansible-playbook") or str(Path(sys.executable).parent / "ansible-playbook")
    proc = procgroup.run([binary, "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "validate.yml"), "-e", json.dumps(extra)],
                         env=env, timeout=300, cwd=tmp_path)
    found = re.search(r'"msg": "RUN=(.*)"\n', proc.stdout)
    return proc, (json.loads(found.group(1).replace('\\"', '"')) if found else None)


def test_unwritable_report_dir_stops_the_run_up_front(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n", encoding="utf-8")
    proc, run = run_validate(tmp_path, {"gpufleet_profile_store": str(tmp_path / "store"), "gpufleet_report_dir": str(blocker / "reports")})
    assert proc.returncode != 0 and run is None
    assert f"gpufleet_report_dir {blocker / 'reports'} cannot be created or written on the controller" in proc.stdout, proc.stdout[-3000:]


def test_a_setting_built_from_a_host_variable_comes_from_the_first_target_host(tmp_path):
    # gpufleet_report_dir is a group variable of every host built from fleet_root, which only the GPU host has:
    # on localhost it is undefined, so it is not given there and the first target host's value is used
    fleet = tmp_path / "fleet"
    inventory = VALIDATE_INVENTORY.replace("gpufleet_model: m,", f"gpufleet_model: m, fleet_root: {fleet},") + (
        "  vars:\n    gpufleet_report_dir: \"{{ fleet_root }}/reports\"\n")
    proc, run = run_validate(tmp_path, {"gpufleet_profile_store": str(tmp_path / "store")}, inventory)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert run["report_dir"] == f"{fleet}/reports" and (fleet / "reports").is_dir()


def test_a_wrong_run_setting_stops_the_run_naming_it(tmp_path):
    proc, run = run_validate(tmp_path, {"gpufleet_profile_store": str(tmp_path / "store"), "gpufleet_split_policy": "maybe"})
    assert proc.returncode != 0 and run is None
    assert "value of gpufleet_split_policy must be one of: per_host, warn, fail, got: maybe" in proc.stdout, proc.stdout[-3000:]
    proc, run = run_validate(tmp_path, {"gpufleet_profile_store": str(tmp_path / "store"), "gpufleet_rollout_serial": "1,0"})
    assert proc.returncode != 0 and run is None
    assert "gpufleet_rollout_serial[1]: expected a positive int or a share 'N%' (0 < N <= 100), got 0" in proc.stdout, proc.stdout[-3000:]


def test_a_mistyped_variable_is_named_with_the_nearest_known_one(tmp_path):
    """A typo in the inventory (gpu-a's own) and in the extra vars: one warning names both, with the
    names they were meant to be, and the run goes on; with gpufleet_strict_variables it stops there."""
    inventory = VALIDATE_INVENTORY.replace("gpufleet_model: m,", "gpufleet_model: m, vllm_service_boot_timout: 1800,")
    extra = {"gpufleet_profile_store": str(tmp_path / "store"), "gpufleet_rollout_serail": [1, "50%"]}
    proc, run = run_validate(tmp_path, extra, inventory)
    assert proc.returncode == 0 and run is not None, proc.stdout[-3000:]
    assert ("gpu-a: 2 variable(s) that gpufleet.vllm does not read, so they change nothing: gpufleet_rollout_serail "
            "(did you mean gpufleet_rollout_serial?), vllm_service_boot_timout (did you mean vllm_service_boot_timeout?)") \
        in " ".join(proc.stdout.split()), proc.stdout[-3000:]
    proc, run = run_validate(tmp_path, dict(extra, gpufleet_strict_variables=True), inventory)
    assert proc.returncode != 0 and run is None
    assert "(gpufleet_strict_variables is true)" in proc.stdout, proc.stdout[-3000:]


def test_survey_answers_as_text(tmp_path):
    reports = tmp_path / "reports"
    proc, run = run_validate(tmp_path, {
        "gpufleet_profile_store": str(tmp_path / "store"), "gpufleet_report_dir": str(reports),
        "gpufleet_rollout_serial": "1,10%,50%", "gpufleet_classes": "h200", "gpufleet_force_profile": "true",
        "gpufleet_split_policy": "fail",
    })
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert run["serial"] == ["1", "10%", "50%"] and run["classes"] == ["h200"] and run["force_profile"] is True
    assert run["split_policy"] == "fail" and reports.is_dir() and not list(reports.iterdir())  # write test file removed
    # blank answers mean "not given": the defaults apply (an extra var hides the inventory value everywhere)
    proc, run = run_validate(tmp_path, {"gpufleet_profile_store": str(tmp_path / "store"), "gpufleet_rollout_serial": "",
                                        "gpufleet_classes": "", "gpufleet_report_dir": ""})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert run["serial"] == [1, "10%", "50%"] and run["classes"] == ["h200"] and run["report_dir"] == ""
    # no answer at all: the inventory's value
    proc, run = run_validate(tmp_path, {"gpufleet_profile_store": str(tmp_path / "store")})
    assert run["serial"] == [2, "20%"]
