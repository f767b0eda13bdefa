"""Unit tests of the test host harness's pure parts (no root, no guests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "hosts"))
import testhosts  # noqa: E402  pylint: disable=wrong-import-position,import-error


def _info(name: str, index: int, cache: Path) -> testhosts.HostInfo:
    return testhosts.HostInfo(
        name=name, index=index, address=f"10.213.{index}.2", gateway=f"10.213.{index}.1", port=22,
        user="root", identity_file=str(cache / "ssh" / "id_ed25519"), netns=f"gpf-{name}",
        veth=f"gpf-v{index}", nspawn_pid=0, leader_pid=0, root=str(cache / "hosts" / name / "root"),
        binds=[], binds_ro=[], fake_nvml_dir=str(cache / "hosts" / name / "fake-nvml"),
        state="running", started_at=0.0, boot_seconds=1.5,
    )


@pytest.mark.parametrize("name", ["a", "h1", "sim-h200-1", "it-harness-a", "x" * 31])
def test_valid_names(name: str) -> None:
    testhosts.Harness._check_name(name)  # pylint: disable=protected-access


@pytest.mark.parametrize("name", ["", "1a", "A", "a_b", "a-", "a.b", "x" * 32, "a/b"])
def test_invalid_names_name_the_host(name: str) -> None:
    with pytest.raises(testhosts.HarnessError, match="invalid host name"):
        testhosts.Harness._check_name(name)  # pylint: disable=protected-access


def test_mirror_from_deb822_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_DEBIAN_MIRROR", raising=False)
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\n# comment\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n", encoding="utf-8")
    (d / "other.list").write_text("deb https://packages.example/apt cloud-sdk-bookworm main\n", encoding="utf-8")
    assert testhosts.Harness.debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_from_one_line_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://ftp.example/debian bookworm main\n", encoding="utf-8")
    assert testhosts.Harness.debian_mirror(tmp_path) == "http://ftp.example/debian"


def test_mirror_falls_back_and_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list").write_text("deb http://archive.ubuntu.com/ubuntu jammy main\n", encoding="utf-8")
    assert testhosts.Harness.debian_mirror(tmp_path) == testhosts.DEFAULT_MIRROR
    monkeypatch.setenv("GPUFLEET_DEBIAN_MIRROR", "http://local/debian")
    assert testhosts.Harness.debian_mirror(tmp_path) == "http://local/debian"


def test_bind_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parse = testhosts.Harness._parse_bind  # pylint: disable=protected-access
    assert parse(f"{tmp_path}:/opt/x", "--bind") == f"{tmp_path}:/opt/x"
    monkeypatch.chdir(tmp_path.parent)
    assert parse(f"{tmp_path.name}:/opt/x", "--bind") == f"{tmp_path}:/opt/x"
    with pytest.raises(testhosts.HarnessError, match="--bind-ro 'nocolon'"):
        parse("nocolon", "--bind-ro")
    with pytest.raises(testhosts.HarnessError, match="guest path absolute"):
        parse(f"{tmp_path}:relative", "--bind")
    with pytest.raises(testhosts.HarnessError, match="does not exist on the controller"):
        parse(f"{tmp_path}/missing:/opt/x", "--bind")


def test_cache_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path))
    h = testhosts.Harness()
    assert h.cache == tmp_path.resolve()
    assert h.rootfs == tmp_path.resolve() / "rootfs" / "bookworm"
    assert h.ssh_key == tmp_path.resolve() / "ssh" / "id_ed25519"
    monkeypatch.delenv("GPUFLEET_CACHE")
    assert testhosts.Harness().cache == REPO / ".cache"


def test_host_record_round_trip_is_atomic(tmp_path: Path) -> None:
    info = _info("a", 3, tmp_path)
    path = tmp_path / "hosts" / "a" / "host.json"
    info.save(path)
    assert testhosts.HostInfo.load(path) == info
    assert [p.name for p in path.parent.iterdir()] == ["host.json"]  # no temporary file left
    assert json.loads(path.read_text(encoding="utf-8"))["address"] == "10.213.3.2"


def test_registry_reads_records_and_owners(tmp_path: Path) -> None:
    h = testhosts.Harness(tmp_path)
    for i, name in enumerate(["a", "b"], start=1):
        _info(name, i, tmp_path).save(h.host_dir(name) / "host.json")
    assert sorted(h.registry()) == ["a", "b"]
    assert h._owner_of_path(str(h.host_dir("b") / "root")) == "b"  # pylint: disable=protected-access
    assert h._owner_of_path("/elsewhere/hosts/b") is None  # pylint: disable=protected-access
    (h.host_dir("c")).mkdir()
    (h.host_dir("c") / "host.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(testhosts.HarnessError, match="unreadable host record"):
        h.registry()


def test_a_record_that_goes_away_while_the_registry_is_read_is_a_host_that_went_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The molecule, readme and integration stages run at once: a host another stage tears down between the listing
    of the records and the read of its own is left out, not an error (a CI run's readme stage failed on it)."""
    h = testhosts.Harness(tmp_path)
    for i, name in enumerate(["a", "b"], start=1):
        _info(name, i, tmp_path).save(h.host_dir(name) / "host.json")
    load = testhosts.HostInfo.load

    def vanishing(path: Path) -> testhosts.HostInfo:
        if path.parent.name == "a":
            path.unlink()
        return load(path)

    monkeypatch.setattr(testhosts.HostInfo, "load", staticmethod(vanishing))
    assert sorted(h.registry()) == ["b"]


def test_inventory_and_instance_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = testhosts.Harness(tmp_path)
    up = {"a": _info("a", 1, tmp_path), "b": _info("b", 2, tmp_path)}
    monkeypatch.setattr(h, "hosts", lambda: dict(up))
    data = h.inventory_data(groups={"gpu": ["a"]}, hostvars={"b": {"gpufleet_host_class": "l40s"}})
    hosts = data["all"]["hosts"]
    assert sorted(hosts) == ["a", "b"]
    assert hosts["a"]["ansible_host"] == "10.213.1.2"
    assert hosts["a"]["ansible_user"] == "root"
    assert hosts["a"]["ansible_python_interpreter"] == "/usr/bin/python3"
    assert "StrictHostKeyChecking=no" in hosts["a"]["ansible_ssh_common_args"]
    assert "UserKnownHostsFile=/dev/null" in hosts["a"]["ansible_ssh_common_args"]
    assert hosts["b"]["gpufleet_host_class"] == "l40s"
    assert data["all"]["children"] == {"gpu": {"hosts": {"a": None}}}
    assert sorted(h.inventory_data(names=["b"])["all"]["hosts"]) == ["b"]
    with pytest.raises(testhosts.HarnessError, match="not up: zz"):
        h.inventory_data(groups={"gpu": ["a", "zz"]})
    with pytest.raises(testhosts.HarnessError, match="hosts not up: zz"):
        h.inventory_data(names=["zz"])
    out = h.inventory(tmp_path / "inv.yml", groups={"gpu": ["a", "b"]})
    text = out.read_text(encoding="utf-8")
    assert "ansible_ssh_private_key_file" in text and "gpu" in text
    monkeypatch.setattr(h, "get", lambda n: up[n])
    assert h.instance_config(["b"]) == [{"instance": "b", "address": "10.213.2.2", "user": "root", "port": 22,
                                         "identity_file": str(tmp_path / "ssh" / "id_ed25519")}]


def test_inventory_needs_hosts_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = testhosts.Harness(tmp_path)
    monkeypatch.setattr(h, "hosts", dict)
    with pytest.raises(testhosts.HarnessError, match="no test host is up"):
        h.inventory_data()


def test_leftover_message_names_the_host() -> None:
    assert str(testhosts.Leftover("netns", "x", "gpf-x")) == "netns gpf-x (host x)"


def test_cli_errors_are_messages_not_tracebacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = testhosts.main(["--cache", str(tmp_path), "inventory", "--out", str(tmp_path / "i.yml")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("testhosts: error: ") and "Traceback" not in err


def test_inotify_limit_is_raised_for_many_hosts_and_never_lowered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = tmp_path / "max_user_instances"
    monkeypatch.setattr(testhosts.Harness, "INOTIFY_LIMIT", limit)
    h = testhosts.Harness(tmp_path)
    limit.write_text("128\n")
    h._ensure_inotify_instances(32)  # pylint: disable=protected-access
    assert int(limit.read_text()) == 128 + 16 * 32
    limit.write_text("100000\n")
    h._ensure_inotify_instances(32)  # pylint: disable=protected-access
    assert int(limit.read_text()) == 100000


def test_a_start_that_exits_during_boot_is_cleared_before_the_second_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the first systemd-nspawn left (its guest's processes, seen alive after such an exit) held
    the root directory, and the second start failed with "Directory tree ... is currently busy"."""
    h = testhosts.Harness(tmp_path)
    info = _info("sim-a", 3, tmp_path)
    (tmp_path / "hosts" / "sim-a").mkdir(parents=True)
    info.save(tmp_path / "hosts" / "sim-a" / "host.json")
    calls: list[str] = []
    waits = iter([testhosts.HarnessError("sim-a: systemd-nspawn exited during boot; console:\n"), None])

    def wait_ready(name: str, deadline: float) -> None:
        calls.append("wait")
        error = next(waits)
        if error is not None:
            raise error

    monkeypatch.setattr(h, "_wait_ready", wait_ready)
    monkeypatch.setattr(h, "_stop_processes", lambda name: calls.append(f"stop {name}") or 3)
    monkeypatch.setattr(h, "_start_nspawn", lambda i: calls.append(f"start {i.name}"))
    h._wait_ready_or_restart("sim-a", 0.0)  # pylint: disable=protected-access
    assert calls == ["wait", "stop sim-a", "start sim-a", "wait"]
