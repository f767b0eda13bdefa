"""Testinfra checks over SSH: the unit converge templated is active and enabled on each guest."""

from __future__ import annotations

import typing as t

UNIT = "gpufleet-harness.service"


def test_pid1_is_systemd(host: t.Any) -> None:
    assert host.file("/proc/1/comm").content_string.strip() == "systemd"
    assert host.run("systemctl is-system-running").stdout.strip() in ("running", "degraded")


def test_unit_active_and_enabled(host: t.Any) -> None:
    service = host.service(UNIT)
    assert service.is_running
    assert service.is_enabled


def test_unit_file_templated_for_this_host(host: t.Any) -> None:
    unit = host.file(f"/etc/systemd/system/{UNIT}")
    assert unit.exists
    assert unit.mode == 0o644
    assert host.backend.get_hostname() in unit.content_string


def test_unit_logged_its_own_message(host: t.Any) -> None:
    name = host.backend.get_hostname()
    journal = host.run(f"journalctl -u {UNIT} --no-pager -o cat")
    assert journal.rc == 0
    assert f"hello from {name}" in journal.stdout


def test_guest_hostname_is_inventory_name(host: t.Any) -> None:
    assert host.run("hostname").stdout.strip() == host.backend.get_hostname()


def test_pynvml_importable_by_guest_python(host: t.Any) -> None:
    cmd = host.run("/usr/bin/python3 -c 'import pynvml; print(pynvml.__file__)'")
    assert cmd.rc == 0, cmd.stderr
    assert cmd.stdout.startswith("/usr/local/lib/python3")
