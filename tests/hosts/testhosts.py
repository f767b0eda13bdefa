#!/usr/bin/env python
"""Real test hosts: Debian bookworm systemd-nspawn guests reached by Ansible over SSH.

Each host boots a real systemd (PID 1 in its own PID namespace) from one cached root
file system, with a writable overlay layer of its own, in its own network namespace
``gpf-<name>`` joined to the controller by a veth pair (guest ``10.213.<n>.2/24`` on
``host0``, controller side ``10.213.<n>.1/24`` on ``gpf-v<n>``). sshd in the guest
accepts the key ``<cache>/ssh/id_ed25519`` for root.

Every host also has a second interface, ``fabric0`` with ``10.214.0.<n>/24``, on one bridge
shared by all test hosts (the fabric: the bridge ``fab0`` in a network namespace of its own,
``gpffab``, made with the first host and removed with the last). The hosts reach each other
there and only there, as GPU hosts reach each other over a data network of their own (an
instance that spans hosts runs its ranks' traffic over it); the controller does not route
between the hosts' own links.

Per host, ``<cache>/hosts/<name>/`` holds ``host.json`` (the registry entry),
``console.log``, the overlay layers and ``fake-nvml/`` (bound to ``/etc/fake-nvml`` in
the guest). The fake NVML library ``<cache>/fake-nvml/libnvidia-ml.so.1`` is bound
read-only where a driver puts it.

The cache directory is ``$GPUFLEET_CACHE``, else ``<repository>/.cache``.
Runs as root. Usable as a command line tool (``testhosts.py --help``) and as a module::

    from testhosts import Harness
    h = Harness()
    h.up(["a", "b"])
    h.inventory("inv.yml", groups={"gpu": ["a", "b"]})
    h.exec("a", ["systemctl", "is-system-running"])
    h.down(all_hosts=True)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing as t
from pathlib import Path

try:
    import yaml
except ImportError:  # JSON is valid YAML: fall back to it without PyYAML
    yaml = None

REPO_ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
ROOTFS_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "iproute2",
    "procps",
    # Services that tests start on demand (load balancer, metrics and bake tests) and the venv
    # module the runtime role builds its virtual environments with.
    "haproxy",
    "prometheus",
    "prometheus-node-exporter",
    "python3-venv",
)
# Installed above but started only by the tests that need them.
ROOTFS_DISABLED_UNITS = ("haproxy.service", "prometheus.service", "prometheus-node-exporter.service")
# Bump when the guest configuration written by prepare() changes: the rootfs is rebuilt.
ROOTFS_CONFIG_VERSION = 3
NVML_GUEST_PATH = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
FAKE_NVML_GUEST_DIR = "/etc/fake-nvml"
NETNS_PREFIX = "gpf-"
VETH_PREFIX = "gpf-v"
SUBNET_PREFIX = "10.213"
GUEST_IFACE = "host0"
# The fabric between the test hosts (see the module's docstring): not under NETNS_PREFIX, which
# names the hosts' own namespaces. Its lock is machine-wide: every harness cache shares it.
FABRIC_NETNS = "gpffab"
FABRIC_BRIDGE = "fab0"
FABRIC_IFACE = "fabric0"
FABRIC_PREFIX = "10.214.0"
FABRIC_LOCK = Path("/run/gpffab.lock")
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,29}[a-z0-9]$|^[a-z]$")
GUEST_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}
SSH_OPTIONS = (
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "IdentitiesOnly=yes",
)
SSHD_CONFIG = """\
# Test host: root logs in with the harness key only.
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
"""


class HarnessError(Exception):
    """A test host operation failed; the message says which host and why."""


def log(msg: str) -> None:
    print(f"testhosts: {msg}", file=sys.stderr, flush=True)


def default_cache() -> Path:
    env = os.environ.get("GPUFLEET_CACHE")
    return Path(env).resolve() if env else REPO_ROOT / ".cache"


def atomic_write(path: Path, data: str, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def run(argv: t.Sequence[str], check: bool = True, **kwargs: t.Any) -> subprocess.CompletedProcess[str]:
    """Run a controller command; failures raise HarnessError with its output."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    try:
        proc = subprocess.run(list(argv), check=False, **kwargs)
    except FileNotFoundError as exc:
        raise HarnessError(f"command not found: {argv[0]} (run `make apt-deps`)") from exc
    if check and proc.returncode != 0:
        out = ((proc.stderr or "") + (proc.stdout or "")).strip()
        raise HarnessError(f"`{' '.join(argv)}` failed with exit {proc.returncode}: {out[-2000:]}")
    return proc


@contextlib.contextmanager
def signals_deferred() -> t.Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while cleaning up; they are delivered when the block ends."""
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def read_mountinfo() -> list[str]:
    """Mount points of this mount namespace, unescaped, in mount order."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            field = line.split()[4]
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field))
    return points


def proc_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_status(pid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
            for line in fh:
                key, _sep, value = line.partition(":")
                out[key] = value.strip()
    except OSError:
        pass
    return out


@dataclasses.dataclass
class HostInfo:
    """One test host as recorded in ``<cache>/hosts/<name>/host.json``."""

    name: str
    index: int
    address: str
    gateway: str
    port: int
    user: str
    identity_file: str
    netns: str
    veth: str
    nspawn_pid: int
    leader_pid: int
    root: str
    binds: list[str]
    binds_ro: list[str]
    fake_nvml_dir: str
    state: str
    started_at: float
    boot_seconds: float | None = None
    # the host's address on the fabric shared by the test hosts ("" in records from before it)
    fabric_address: str = ""

    @classmethod
    def load(cls, path: Path) -> HostInfo:
        data = json.loads(path.read_text(encoding="utf-8"))
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")


@dataclasses.dataclass(frozen=True)
class Leftover:
    """Something a test host left behind: a namespace, a link, a process or a mount."""

    kind: str
    owner: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.detail} (host {self.owner})"


class Harness:
    """Create, reach and destroy test hosts under one cache directory."""

    def __init__(self, cache: str | os.PathLike[str] | None = None) -> None:
        self.cache = Path(cache).resolve() if cache is not None else default_cache()
        self.rootfs = self.cache / "rootfs" / SUITE
        self.hosts_dir = self.cache / "hosts"
        self.ssh_key = self.cache / "ssh" / "id_ed25519"
        self.fake_nvml_lib = self.cache / "fake-nvml" / "libnvidia-ml.so.1"
        self._lock_fd: int | None = None
        # nspawn processes started by this object, polled so that exited ones are reaped.
        self._children: list[subprocess.Popen[bytes]] = []

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _require_root() -> None:
        if os.geteuid() != 0:
            raise HarnessError("test hosts need root (systemd-nspawn, network namespaces, mounts)")

    @staticmethod
    def _check_name(name: str) -> None:
        if not NAME_RE.match(name):
            raise HarnessError(
                f"invalid host name {name!r}: use 1-31 characters a-z, 0-9 and '-', starting with a letter"
            )

    def host_dir(self, name: str) -> Path:
        return self.hosts_dir / name

    @contextlib.contextmanager
    def _locked(self) -> t.Iterator[None]:
        if self._lock_fd is not None:  # re-entrant within one Harness
            yield
            return
        self.hosts_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.hosts_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._lock_fd = fd
            yield
        finally:
            self._lock_fd = None
            os.close(fd)

    def registry(self) -> dict[str, HostInfo]:
        """Every host with a ``host.json``, running or not."""
        out: dict[str, HostInfo] = {}
        if not self.hosts_dir.is_dir():
            return out
        for path in sorted(self.hosts_dir.glob("*/host.json")):
            try:
                info = HostInfo.load(path)
            except FileNotFoundError:
                # the host went down between the listing and the read (another stage's test tore it down: the
                # molecule, readme and integration stages run at once); records are written atomically, so a
                # record that is there reads whole
                continue
            except (OSError, ValueError, TypeError) as exc:
                raise HarnessError(f"unreadable host record {path}: {exc}") from exc
            out[info.name] = info
        return out

    def _nspawn_running(self, info: HostInfo) -> bool:
        argv = proc_cmdline(info.nspawn_pid)
        return (
            pid_alive(info.nspawn_pid)
            and bool(argv)
            and os.path.basename(argv[0]) == "systemd-nspawn"
            and f"--network-namespace-path=/run/netns/{info.netns}" in argv
        )

    def hosts(self) -> dict[str, HostInfo]:
        """The hosts that are up (registered and their nspawn process alive)."""
        return {n: i for n, i in self.registry().items() if i.state == "running" and self._nspawn_running(i)}

    def get(self, name: str) -> HostInfo:
        info = self.hosts().get(name)
        if info is None:
            raise HarnessError(f"test host {name!r} is not up (run `testhosts.py up {name}`)")
        return info

    # ------------------------------------------------------------------ prepare
    def _rootfs_spec(self) -> dict[str, t.Any]:
        return {
            "suite": SUITE,
            "packages": list(ROOTFS_PACKAGES),
            "config_version": ROOTFS_CONFIG_VERSION,
            "nvidia_ml_py": self._pynvml_requirement(),
        }

    @staticmethod
    def _pynvml_requirement() -> str:
        req = REPO_ROOT / "requirements-dev.txt"
        if req.is_file():
            for line in req.read_text(encoding="utf-8").splitlines():
                line = line.split("#", 1)[0].strip()
                if line.lower().startswith("nvidia-ml-py"):
                    return line
        return "nvidia-ml-py"

    @staticmethod
    def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
        """The Debian mirror for bookworm from the apt sources in ``apt_dir``, else deb.debian.org.

        ``$GPUFLEET_DEBIAN_MIRROR`` overrides it. Both one-line (``.list``) and deb822
        (``.sources``) formats are read; only URIs ending in ``/debian`` count.
        """
        override = os.environ.get("GPUFLEET_DEBIAN_MIRROR")
        if override:
            return override
        candidates: list[str] = []
        src = apt_dir / "sources.list"
        files = [src] if src.is_file() else []
        files += sorted((apt_dir / "sources.list.d").glob("*.list"))
        files += sorted((apt_dir / "sources.list.d").glob("*.sources"))
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except OSError:
                continue
            if path.suffix == ".sources":
                for stanza in re.split(r"\n\s*\n", text):
                    fields = dict(
                        (k.strip().lower(), v.strip())
                        for k, _sep, v in (ln.partition(":") for ln in stanza.splitlines() if not ln.startswith("#"))
                        if v
                    )
                    if SUITE in fields.get("suites", "").split():
                        candidates += fields.get("uris", "").split()
            else:
                for line in text.splitlines():
                    parts = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                    if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                        candidates.append(parts[1])
        for uri in candidates:
            if uri.rstrip("/").endswith("/debian"):
                return uri.rstrip("/")
        return DEFAULT_MIRROR

    def ensure_ssh_key(self) -> Path:
        if self.ssh_key.is_file() and self.ssh_key.with_suffix(".pub").is_file():
            return self.ssh_key
        self.ssh_key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.TemporaryDirectory(dir=self.ssh_key.parent) as tmp:
            key = Path(tmp) / "id_ed25519"
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpufleet-test-hosts", "-f", str(key)])
            os.chmod(key, 0o600)
            os.replace(key.with_suffix(".pub"), self.ssh_key.with_suffix(".pub"))
            os.replace(key, self.ssh_key)
        return self.ssh_key

    def _pynvml_wheel(self) -> Path:
        wheels = self.cache / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        found = sorted(wheels.glob("nvidia_ml_py-*.whl"))
        req = self._pynvml_requirement()
        if "==" in req:
            version = req.split("==", 1)[1].strip()
            found = [w for w in found if w.name.startswith(f"nvidia_ml_py-{version}-")]
        if found:
            return found[-1]
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", str(wheels), req])
        found = sorted(wheels.glob("nvidia_ml_py-*.whl"))
        if not found:
            raise HarnessError(f"pip download {req} produced no wheel in {wheels}")
        return found[-1]

    def _configure_rootfs(self, root: Path) -> None:
        ssh_dir = root / "etc" / "ssh" / "sshd_config.d"
        ssh_dir.mkdir(parents=True, exist_ok=True)
        (ssh_dir / "gpufleet.conf").write_text(SSHD_CONFIG, encoding="utf-8")
        wants = root / "etc/systemd/system/multi-user.target.wants/ssh.service"
        if not wants.is_symlink() and not wants.exists():
            wants.parent.mkdir(parents=True, exist_ok=True)
            wants.symlink_to("/lib/systemd/system/ssh.service")
        # Units with nothing to do in a container without a console login or a real clock.
        for unit in ("getty@tty1.service", "systemd-timesyncd.service", "apt-daily.timer",
                     "apt-daily-upgrade.timer", "e2scrub_reap.service"):
            link = root / "etc/systemd/system" / unit
            if not link.exists() and not link.is_symlink():
                link.symlink_to("/dev/null")
        # The links point into the guest (absolute targets): match names, never follow them.
        for wants in (root / "etc/systemd/system").glob("*.wants"):
            for link in wants.iterdir():
                if link.name in ROOTFS_DISABLED_UNITS or (
                        link.name.startswith("prometheus-node-exporter-") and link.name.endswith(".timer")):
                    link.unlink()
        # An empty machine-id: each boot gets its own transient id.
        (root / "etc/machine-id").write_text("", encoding="utf-8")
        pyver = os.readlink(root / "usr/bin/python3") if (root / "usr/bin/python3").is_symlink() else "python3"
        site = root / "usr/local/lib" / os.path.basename(pyver) / "dist-packages"
        site.mkdir(parents=True, exist_ok=True)
        wheel = self._pynvml_wheel()
        run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
             "--target", str(site), str(wheel)])
        check = run(["chroot", str(root), "/usr/bin/python3", "-c",
                     "import pynvml, sys; sys.stdout.write(pynvml.__file__)"], check=False)
        if check.returncode != 0 or "/usr/local/lib/" not in check.stdout:
            raise HarnessError(f"the guest python3 cannot import pynvml after install: {check.stderr.strip()}")

    def _install_authorized_key(self, root: Path) -> None:
        pub = self.ensure_ssh_key().with_suffix(".pub").read_text(encoding="utf-8")
        ssh = root / "root" / ".ssh"
        ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(ssh, 0o700)
        auth = ssh / "authorized_keys"
        if not auth.is_file() or auth.read_text(encoding="utf-8") != pub:
            atomic_write(auth, pub, mode=0o600)

    def prepare(self, force: bool = False) -> Path:
        """Build (once) the guest root file system and the SSH key; return the rootfs path."""
        self._require_root()
        with self._locked():
            self.ensure_ssh_key()
            stamp = self.rootfs / "etc" / "gpufleet-rootfs.json"
            spec = self._rootfs_spec()
            if self.rootfs.is_dir() and not force:
                try:
                    current = json.loads(stamp.read_text(encoding="utf-8")).get("spec")
                except (OSError, ValueError):
                    current = None
                if current == spec:
                    self._install_authorized_key(self.rootfs)
                    log(f"rootfs up to date: {self.rootfs}")
                    return self.rootfs
            up = [n for n, i in self.registry().items() if self._nspawn_running(i)]
            if up and self.rootfs.is_dir():
                raise HarnessError(f"cannot rebuild the rootfs while test hosts use it: {', '.join(up)}")
            parent = self.rootfs.parent
            parent.mkdir(parents=True, exist_ok=True)
            for stale in parent.glob(f".{SUITE}.*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{SUITE}.build-", dir=parent))
            started = time.monotonic()
            try:
                mirror = self.debian_mirror()
                log(f"debootstrap {SUITE} from {mirror} into {tmp}")
                proc = run(["debootstrap", "--variant=minbase", f"--include={','.join(ROOTFS_PACKAGES)}",
                            SUITE, str(tmp), mirror], check=False)
                if proc.returncode != 0:
                    tail = (proc.stdout + proc.stderr).strip()[-3000:]
                    raise HarnessError(f"debootstrap failed (exit {proc.returncode}): {tail}")
                self._configure_rootfs(tmp)
                self._install_authorized_key(tmp)
                seconds = round(time.monotonic() - started, 1)
                stamp_tmp = tmp / "etc" / "gpufleet-rootfs.json"
                atomic_write(stamp_tmp, json.dumps({"spec": spec, "mirror": mirror, "build_seconds": seconds,
                                                    "built_at": time.time()}, indent=2) + "\n")
                if self.rootfs.exists():
                    old = parent / f".{SUITE}.old-{os.getpid()}"
                    os.replace(self.rootfs, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.replace(tmp, self.rootfs)
                log(f"rootfs built in {seconds}s: {self.rootfs}")
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            return self.rootfs

    # ------------------------------------------------------------------ leftovers
    def _owner_of_path(self, path: str) -> str | None:
        prefix = str(self.hosts_dir) + "/"
        if path.startswith(prefix):
            return path[len(prefix):].split("/", 1)[0]
        return None

    def leftovers(self) -> list[Leftover]:
        """Everything test hosts hold: namespaces ``gpf-*``, links ``gpf-v*``, nspawn and guest processes,
        mounts under the cache directory."""
        found: list[Leftover] = []
        index_owner = {i.index: n for n, i in self.registry().items()}
        guests = self._guest_processes()
        netns_dir = Path("/run/netns")
        if netns_dir.is_dir():
            for ns in sorted(os.listdir(netns_dir)):
                if ns.startswith(NETNS_PREFIX):
                    found.append(Leftover("netns", ns[len(NETNS_PREFIX):], ns))
        for link in sorted(os.listdir("/sys/class/net")):
            if link.startswith(VETH_PREFIX) and link[len(VETH_PREFIX):].isdigit():
                owner = index_owner.get(int(link[len(VETH_PREFIX):]), "?")
                found.append(Leftover("link", owner, link))
        for pid in sorted(all_pids()):
            if pid == os.getpid():
                continue
            argv = proc_cmdline(pid)
            if argv and os.path.basename(argv[0]) == "systemd-nspawn":
                for arg in argv:
                    if arg.startswith(f"--network-namespace-path=/run/netns/{NETNS_PREFIX}"):
                        owner = arg.rsplit("/", 1)[1][len(NETNS_PREFIX):]
                        found.append(Leftover("process", owner, f"pid {pid} systemd-nspawn"))
                        break
                continue
            owner = guests.get(pid)
            if owner is not None:
                comm = read_status(pid).get("Name", "?")
                found.append(Leftover("process", owner, f"pid {pid} {comm}"))
        for point in read_mountinfo():
            owner = self._owner_of_path(point)
            if owner is not None:
                found.append(Leftover("mount", owner, point))
        ports = self._fabric_ports()
        for port in ports:
            owner = index_owner.get(int(port[1:]), "?") if port[1:].isdigit() else "?"
            found.append(Leftover("link", owner, f"{FABRIC_NETNS}/{port}"))
        if Path(f"/run/netns/{FABRIC_NETNS}").exists() and not ports:
            # no host's: `down --all` removes it (owner "?", never taken for a host name)
            found.append(Leftover("netns", "?", FABRIC_NETNS))
        return found

    # ------------------------------------------------------------------ fabric
    @staticmethod
    def _fabric_ports() -> list[str]:
        """The hosts' links on the fabric's bridge (empty when there is no fabric)."""
        if not Path(f"/run/netns/{FABRIC_NETNS}").exists():
            return []
        proc = run(["ip", "-n", FABRIC_NETNS, "-o", "link", "show", "master", FABRIC_BRIDGE], check=False)
        return [line.split(":")[1].strip().split("@")[0] for line in proc.stdout.splitlines() if ":" in line]

    @contextlib.contextmanager
    def _fabric_locked(self) -> t.Iterator[None]:
        fd = os.open(FABRIC_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _join_fabric(self, info: HostInfo) -> None:
        """Give the host its fabric link (the bridge made first when no host has one)."""
        port = f"f{info.index}"
        with self._fabric_locked():
            if not Path(f"/run/netns/{FABRIC_NETNS}").exists():
                run(["ip", "netns", "add", FABRIC_NETNS])
                run(["ip", "-n", FABRIC_NETNS, "link", "add", FABRIC_BRIDGE, "type", "bridge"])
                run(["ip", "-n", FABRIC_NETNS, "link", "set", FABRIC_BRIDGE, "up"])
            run(["ip", "-n", FABRIC_NETNS, "link", "add", port, "type", "veth", "peer", "name", FABRIC_IFACE,
                 "netns", info.netns])
            run(["ip", "-n", FABRIC_NETNS, "link", "set", port, "master", FABRIC_BRIDGE])
            run(["ip", "-n", FABRIC_NETNS, "link", "set", port, "up"])
        run(["ip", "-n", info.netns, "addr", "add", f"{info.fabric_address}/24", "dev", FABRIC_IFACE])
        run(["ip", "-n", info.netns, "link", "set", FABRIC_IFACE, "up"])

    def _leave_fabric(self, index: int | None) -> None:
        """Remove the host's fabric link, and the fabric once no host is on it. The link is removed
        here, not with the host's namespace: a namespace is destroyed after its last user is gone,
        asynchronously, and the bridge would still count the link."""
        with self._fabric_locked():
            if not Path(f"/run/netns/{FABRIC_NETNS}").exists():
                return
            if index is not None and f"f{index}" in self._fabric_ports():
                run(["ip", "-n", FABRIC_NETNS, "link", "del", f"f{index}"], check=False)
            if not self._fabric_ports():
                run(["ip", "netns", "del", FABRIC_NETNS], check=False)

    def check_clean(self, names: t.Sequence[str] = ()) -> None:
        """Raise HarnessError naming every leftover (only those of ``names`` when given)."""
        left = [x for x in self.leftovers() if not names or x.owner in names]
        if left:
            raise HarnessError("test host leftovers: " + "; ".join(str(x) for x in left))

    # ------------------------------------------------------------------ up
    def _free_index(self, taken: set[int]) -> int:
        fabric = set(self._fabric_ports())
        for n in range(1, 255):
            if n not in taken and not Path(f"/sys/class/net/{VETH_PREFIX}{n}").exists() and f"f{n}" not in fabric:
                return n
        raise HarnessError("no free test host address left in 10.213.1-254.0/24")

    @staticmethod
    def _parse_bind(spec: str, option: str) -> str:
        src, sep, dst = spec.partition(":")
        if not sep or not src or not dst.startswith("/"):
            raise HarnessError(f"{option} {spec!r}: expected HOST_PATH:GUEST_PATH (guest path absolute)")
        src = os.path.abspath(src)
        if not os.path.exists(src):
            raise HarnessError(f"{option} {spec!r}: {src} does not exist on the controller")
        return f"{os.path.realpath(src)}:{dst}"

    def up(
        self,
        names: t.Sequence[str],
        binds: t.Sequence[str] = (),
        binds_ro: t.Sequence[str] = (),
        timeout: float = 120.0,
    ) -> list[HostInfo]:
        """Boot the named hosts (those already up are kept as they are) and wait until SSH answers.

        ``binds``/``binds_ro`` are ``HOST_PATH:GUEST_PATH`` strings applied to every new host.
        Refuses to start when test host leftovers exist that no running host accounts for.
        On any failure the hosts this call started are torn down again.
        """
        self._require_root()
        if not names:
            raise HarnessError("up: name at least one host")
        for name in names:
            self._check_name(name)
        if len(set(names)) != len(names):
            raise HarnessError(f"up: duplicate host names in {list(names)}")
        binds = [self._parse_bind(b, "--bind") for b in binds]
        binds_ro = [self._parse_bind(b, "--bind-ro") for b in binds_ro]
        if not (self.rootfs / "etc" / "gpufleet-rootfs.json").is_file():
            raise HarnessError(f"no test host rootfs at {self.rootfs} (run `make rootfs`)")
        with self._locked():
            running = self.hosts()
            stray = [x for x in self.leftovers() if x.owner not in running]
            if stray:
                owners = sorted({x.owner for x in stray if x.owner != "?"})
                down = f"`tests/hosts/testhosts.py down {' '.join(owners)}`, or " if owners else ""
                raise HarnessError(
                    "refusing to start test hosts: leftovers of hosts not running under this harness: "
                    + "; ".join(str(x) for x in stray)
                    + " (hosts another checkout runs right now show up here too: wait for it to finish; otherwise clean "
                    + f"them with {down}`tests/hosts/testhosts.py down --all`, which also stops every other checkout's hosts)"
                )
            stale = [n for n, i in self.registry().items() if n not in running]
            for name in stale:  # a record without anything running: nothing to keep
                self._remove_record(name)
            new = [n for n in names if n not in running]
            for name in names:
                if name in running:
                    log(f"{name}: already up at {running[name].address}")
            self._install_authorized_key(self.rootfs)
            self._ensure_inotify_instances(len(running) + len(new))
            started: list[str] = []
            ok = False
            try:
                taken = {i.index for i in running.values()}
                for name in new:
                    index = self._free_index(taken)
                    taken.add(index)
                    started.append(name)  # first: a half-made host is torn down too
                    self._launch(name, index, binds, binds_ro)
                deadline = time.monotonic() + timeout
                for name in new:
                    self._wait_ready_or_restart(name, deadline)
                ok = True
            finally:
                if not ok:
                    with signals_deferred():
                        for name in reversed(started):
                            try:
                                self._down_one(name)
                            except HarnessError as exc:
                                log(f"{name}: cleanup after failed start: {exc}")
            current = self.hosts()
            return [current[n] for n in names]

    def _wait_ready_or_restart(self, name: str, deadline: float) -> None:
        """Wait for a new guest; when systemd-nspawn exits at once, start it once more on the same layer.

        Seen once while other harness processes booted guests of the same cache: nspawn exited
        within a second, printing nothing, and the guest never booted. The second start is logged
        with the first one's exit status; a second failure fails the start as before.
        """
        try:
            self._wait_ready(name, deadline)
            return
        except HarnessError as exc:
            if "systemd-nspawn exited during boot" not in str(exc):
                raise
            info = HostInfo.load(self.host_dir(name) / "host.json")
            status = next((c.returncode for c in self._children if c.pid == info.nspawn_pid), None)
            # What that start left (its guest's systemd and services, seen alive after such an
            # exit) holds the guest's root directory: the second nspawn would find it "busy".
            left = self._stop_processes(name)
            log(f"{name}: systemd-nspawn exited during boot (exit status {status}); stopped the {left} "
                "process(es) that start left, starting it once more")
        info.leader_pid = 0
        info.state = "starting"
        info.started_at = time.time()
        self._start_nspawn(info)
        self._wait_ready(name, deadline)

    def reboot(self, name: str, timeout: float = 120.0) -> HostInfo:
        """Reboot a running host as a machine reboots: its systemd shuts down (SIGTERM to
        systemd-nspawn), then boots again on the same writable layer, network and binds. What
        survives is what survives a reboot: the disk (units, /etc, /var), not /run or processes."""
        self._require_root()
        self._check_name(name)
        with self._locked():
            info = self.hosts().get(name)
            if info is None:
                raise HarnessError(f"reboot: {name} is not up")
            nspawn = self._nspawn_pids(name)
            for pid in nspawn:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while any(pid_alive(p) for p in nspawn):
                for child in self._children:
                    child.poll()
                if time.monotonic() > deadline:
                    raise HarnessError(f"reboot: {name}: systemd-nspawn did not stop within 30 s")
                time.sleep(0.1)
            info.leader_pid = 0
            info.state = "starting"
            info.started_at = time.time()
            self._start_nspawn(info)
            self._wait_ready(name, time.monotonic() + timeout)
            return self.hosts()[name]

    # Every guest's systemd and its services open inotify instances as root, which all
    # count against the host's per-user limit (128 by default): beyond about 20 guests,
    # systemd in the later ones cannot start and never reaches SSH.
    INOTIFY_LIMIT = Path("/proc/sys/fs/inotify/max_user_instances")
    INOTIFY_PER_HOST = 16

    def _ensure_inotify_instances(self, hosts: int) -> None:
        """Raise fs.inotify.max_user_instances (never lower it) so that ``hosts`` guests can boot."""
        want = 128 + self.INOTIFY_PER_HOST * hosts
        try:
            have = int(self.INOTIFY_LIMIT.read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            return
        if have >= want:
            return
        try:
            self.INOTIFY_LIMIT.write_text(f"{want}\n", encoding="ascii")
        except OSError as exc:
            log(f"fs.inotify.max_user_instances is {have}, {hosts} hosts need about {want}, cannot raise it: {exc}")
            return
        log(f"fs.inotify.max_user_instances raised from {have} to {want} for {hosts} hosts")

    def _launch(self, name: str, index: int, binds: list[str], binds_ro: list[str]) -> None:
        hdir = self.host_dir(name)
        hdir.mkdir(parents=True, exist_ok=True)
        for sub in ("upper", "work", "root"):
            shutil.rmtree(hdir / sub, ignore_errors=True)
            (hdir / sub).mkdir()
        fake_dir = hdir / "fake-nvml"
        fake_dir.mkdir(exist_ok=True)
        root = hdir / "root"
        for path in (self.rootfs, hdir):
            if any(c in str(path) for c in ",:"):
                raise HarnessError(f"path {path} contains ',' or ':' which overlayfs options cannot carry")
        netns = f"{NETNS_PREFIX}{name}"
        veth = f"{VETH_PREFIX}{index}"
        address = f"{SUBNET_PREFIX}.{index}.2"
        gateway = f"{SUBNET_PREFIX}.{index}.1"
        info = HostInfo(
            name=name, index=index, address=address, gateway=gateway, port=22, user="root",
            identity_file=str(self.ssh_key), netns=netns, veth=veth, nspawn_pid=0, leader_pid=0,
            root=str(root), binds=list(binds), binds_ro=list(binds_ro), fake_nvml_dir=str(fake_dir),
            state="starting", started_at=time.time(), fabric_address=f"{FABRIC_PREFIX}.{index}",
        )
        # Recorded before anything is created so that `down NAME` finds every piece.
        info.save(hdir / "host.json")
        run(["mount", "-t", "overlay", f"gpf-{name}", "-o",
             f"lowerdir={self.rootfs},upperdir={hdir / 'upper'},workdir={hdir / 'work'}", str(root)])
        hosts_file = root / "etc" / "hosts"
        hosts_file.write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n::1\tlocalhost ip6-localhost\n",
                              encoding="utf-8")
        (root / "etc" / "hostname").write_text(name + "\n", encoding="utf-8")
        run(["ip", "netns", "add", netns])
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", GUEST_IFACE, "netns", netns])
        run(["ip", "addr", "add", f"{gateway}/24", "dev", veth])
        run(["ip", "link", "set", veth, "up"])
        run(["ip", "-n", netns, "link", "set", "lo", "up"])
        run(["ip", "-n", netns, "addr", "add", f"{address}/24", "dev", GUEST_IFACE])
        run(["ip", "-n", netns, "link", "set", GUEST_IFACE, "up"])
        self._join_fabric(info)
        self._start_nspawn(info)

    def _nspawn_argv(self, info: HostInfo) -> list[str]:
        argv = [
            "systemd-nspawn", "--quiet", "-D", info.root, "-b", "-M", info.name,
            "--register=no", "--keep-unit", "--console=passive", "--link-journal=no",
            f"--network-namespace-path=/run/netns/{info.netns}",
            f"--bind={info.fake_nvml_dir}:{FAKE_NVML_GUEST_DIR}",
        ]
        if self.fake_nvml_lib.is_file():
            argv.append(f"--bind-ro={self.fake_nvml_lib}:{NVML_GUEST_PATH}")
        else:
            log(f"warning: {self.fake_nvml_lib} is not built (`make fake-nvml`); {info.name} has no NVML library")
        argv += [f"--bind={b}" for b in info.binds]
        argv += [f"--bind-ro={b}" for b in info.binds_ro]
        return argv

    def _start_nspawn(self, info: HostInfo) -> None:
        hdir = self.host_dir(info.name)
        argv = self._nspawn_argv(info)
        with open(hdir / "console.log", "ab") as console:
            console.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
            console.flush()
            # The guest outlives this process (CLI `up` returns while hosts run): own session, no wait.
            proc = subprocess.Popen(  # pylint: disable=consider-using-with
                argv, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
        info.nspawn_pid = proc.pid
        info.save(hdir / "host.json")
        self._children.append(proc)

    def _find_leader(self, nspawn_pid: int) -> int:
        for pid in all_pids():
            status = read_status(pid)
            if status.get("PPid") == str(nspawn_pid) and status.get("NSpid", "").split()[-1:] == ["1"]:
                return pid
        return 0

    def _console_tail(self, name: str, lines: int = 25) -> str:
        try:
            text = (self.host_dir(name) / "console.log").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no console log)"
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self, name: str, deadline: float) -> None:
        hdir = self.host_dir(name)
        info = HostInfo.load(hdir / "host.json")
        t0 = info.started_at
        state = ""
        phase = "systemd"
        while time.monotonic() < deadline:
            for child in self._children:
                child.poll()
            if not self._nspawn_running(info):
                # look once more before calling it an exit: one read of /proc under load is not enough
                time.sleep(0.5)
                for child in self._children:
                    child.poll()
            if not self._nspawn_running(info):
                raise HarnessError(f"{name}: systemd-nspawn exited during boot; console:\n{self._console_tail(name)}")
            if not info.leader_pid:
                info.leader_pid = self._find_leader(info.nspawn_pid)
                if info.leader_pid:
                    info.save(hdir / "host.json")
                else:
                    time.sleep(0.1)
                    continue
            if phase == "systemd":
                proc = self._nsenter(info, ["systemctl", "is-system-running"], timeout=10)
                state = proc.stdout.strip()
                if state in ("running", "degraded"):
                    if state == "degraded":
                        failed = self._nsenter(info, ["systemctl", "--failed", "--plain", "--no-legend"])
                        log(f"{name}: warning: systemd is degraded: {failed.stdout.strip()}")
                    phase = "ssh"
                else:
                    time.sleep(0.2)
                    continue
            proc = run(self.ssh_argv(info, ["true"], connect_timeout=2), check=False, timeout=15)
            if proc.returncode == 0:
                info.state = "running"
                info.boot_seconds = round(time.time() - t0, 2)
                info.save(hdir / "host.json")
                log(f"{name}: up at {info.address} (ssh after {info.boot_seconds}s)")
                return
            time.sleep(0.2)
        where = f"systemd state {state!r}" if phase == "systemd" else "sshd not accepting the key"
        raise HarnessError(f"{name}: not ready before the timeout ({where}); console:\n{self._console_tail(name)}")

    # ------------------------------------------------------------------ reach
    def ssh_argv(self, info: HostInfo, command: t.Sequence[str], connect_timeout: int = 10) -> list[str]:
        return ["ssh", "-i", info.identity_file, "-p", str(info.port), *SSH_OPTIONS, "-o", "BatchMode=yes",
                "-o", f"ConnectTimeout={connect_timeout}", f"{info.user}@{info.address}", *command]

    @staticmethod
    def _nsenter(info: HostInfo, argv: t.Sequence[str], **kwargs: t.Any) -> subprocess.CompletedProcess[str]:
        return run(["nsenter", "-t", str(info.leader_pid), "-a", "-r", "-w", "--", *argv], check=False,
                   env=GUEST_ENV, **kwargs)

    def exec(self, name: str, argv: t.Sequence[str], check: bool = False,
             **kwargs: t.Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the guest (all its namespaces, via nsenter); output captured as text."""
        info = self.get(name)
        proc = self._nsenter(info, argv, **kwargs)
        if check and proc.returncode != 0:
            raise HarnessError(f"{name}: `{' '.join(argv)}` exited {proc.returncode}: "
                               f"{(proc.stderr or proc.stdout or '').strip()[-2000:]}")
        return proc

    def ssh(self, name: str, command: t.Sequence[str], **kwargs: t.Any) -> subprocess.CompletedProcess[str]:
        """Run a command on the guest over SSH, as Ansible reaches it."""
        return run(self.ssh_argv(self.get(name), command), check=False, **kwargs)

    def inventory_data(self, groups: t.Mapping[str, t.Sequence[str]] | None = None,
                       hostvars: t.Mapping[str, t.Mapping[str, t.Any]] | None = None,
                       names: t.Sequence[str] | None = None) -> dict[str, t.Any]:
        """The inventory as a dict: every host that is up (or only ``names``, which must be up)."""
        up = self.hosts()
        if names is not None:
            missing = [n for n in names if n not in up]
            if missing:
                raise HarnessError(f"inventory: hosts not up: {', '.join(missing)}")
            up = {n: up[n] for n in names}
        if not up:
            raise HarnessError("inventory: no test host is up")
        hosts: dict[str, dict[str, t.Any]] = {}
        for name, info in sorted(up.items()):
            hosts[name] = {
                "ansible_host": info.address,
                "ansible_port": info.port,
                "ansible_user": info.user,
                "ansible_ssh_private_key_file": info.identity_file,
                "ansible_ssh_common_args": " ".join(SSH_OPTIONS),
                "ansible_python_interpreter": "/usr/bin/python3",
            }
            hosts[name].update((hostvars or {}).get(name, {}))
        for name in hostvars or {}:
            if name not in up:
                raise HarnessError(f"inventory: host vars given for {name!r}, which is not up")
        children: dict[str, t.Any] = {}
        for group, members in (groups or {}).items():
            missing = [m for m in members if m not in up]
            if missing:
                raise HarnessError(f"inventory: group {group!r} names hosts that are not up: {', '.join(missing)}")
            children[group] = {"hosts": {m: None for m in members}}
        data: dict[str, t.Any] = {"all": {"hosts": hosts}}
        if children:
            data["all"]["children"] = children
        return data

    def inventory(self, out: str | os.PathLike[str], groups: t.Mapping[str, t.Sequence[str]] | None = None,
                  hostvars: t.Mapping[str, t.Mapping[str, t.Any]] | None = None,
                  names: t.Sequence[str] | None = None) -> Path:
        """Write an Ansible YAML inventory of the hosts that are up (or only ``names``); return its path."""
        data = self.inventory_data(groups, hostvars, names)
        text = yaml.safe_dump(data, sort_keys=False) if yaml is not None else json.dumps(data, indent=2) + "\n"
        path = Path(out)
        atomic_write(path, text)
        return path

    def instance_config(self, names: t.Sequence[str]) -> list[dict[str, t.Any]]:
        """Molecule delegated-driver instance config entries for the named hosts (all must be up)."""
        return [
            {"instance": info.name, "address": info.address, "user": info.user, "port": info.port,
             "identity_file": info.identity_file}
            for info in (self.get(n) for n in names)
        ]

    def memory(self, name: str) -> dict[str, int]:
        """Memory the guest's processes hold: summed PSS and RSS in bytes, and the process count."""
        info = self.get(name)
        try:
            ns = os.readlink(f"/proc/{info.leader_pid}/ns/pid")
        except OSError as exc:
            raise HarnessError(f"{name}: guest PID 1 ({info.leader_pid}) is gone") from exc
        pss = rss = count = 0
        for pid in all_pids():
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") != ns:
                    continue
                with open(f"/proc/{pid}/smaps_rollup", encoding="utf-8") as fh:
                    for line in fh:
                        if line.startswith("Pss:"):
                            pss += int(line.split()[1]) * 1024
                        elif line.startswith("Rss:"):
                            rss += int(line.split()[1]) * 1024
                count += 1
            except OSError:
                continue
        return {"pss_bytes": pss, "rss_bytes": rss, "processes": count}

    # ------------------------------------------------------------------ down
    def down(self, names: t.Sequence[str] = (), all_hosts: bool = False) -> list[str]:
        """Stop hosts and remove their namespaces, links, processes and mounts. Idempotent.

        With ``all_hosts`` every registered host and every leftover owner is cleaned.
        Keeps ``console.log`` and ``fake-nvml/`` of each host. Returns the names handled.
        """
        self._require_root()
        with self._locked():
            if all_hosts:
                targets = set(self.registry()) | {x.owner for x in self.leftovers() if x.owner != "?"}
                targets |= set(names)
            else:
                if not names:
                    raise HarnessError("down: name hosts or use --all")
                targets = set(names)
            for name in targets:
                self._check_name(name)
            with signals_deferred():
                for name in sorted(targets):
                    self._down_one(name)
            if all_hosts:
                for x in self.leftovers():
                    if x.kind == "link" and "/" in x.detail:  # a fabric link whose host is gone
                        namespace, _sep, port = x.detail.partition("/")
                        run(["ip", "-n", namespace, "link", "del", port], check=False)
                    elif x.kind == "link":
                        run(["ip", "link", "del", x.detail], check=False)
                self._leave_fabric(None)
            return sorted(targets)

    def _guest_processes(self) -> dict[int, str]:
        """pid -> host name for every process whose root is a test host overlay of this cache.

        Guest processes live in another PID and mount namespace; their root mount is the
        overlay ``gpf-<name>`` whose upper layer lies under ``<cache>/hosts/<name>/``.
        """
        own_ns = os.readlink("/proc/self/ns/pid")
        out: dict[int, str] = {}
        for pid in all_pids():
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") == own_ns:
                    continue
                with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as fh:
                    for line in fh:
                        left, _sep, right = line.partition(" - ")
                        if left.split()[4] != "/":
                            continue
                        fstype, source, options = (right.split() + ["", "", ""])[:3]
                        if fstype == "overlay" and source.startswith(NETNS_PREFIX):
                            for opt in options.split(","):
                                if opt.startswith("upperdir="):
                                    owner = self._owner_of_path(opt[len("upperdir="):])
                                    if owner is not None:
                                        out[pid] = owner
                        break
            except (OSError, IndexError):
                continue
        return out

    def _guest_pids(self, name: str) -> list[int]:
        return [pid for pid, owner in self._guest_processes().items() if owner == name]

    def _nspawn_pids(self, name: str) -> list[int]:
        want = f"--network-namespace-path=/run/netns/{NETNS_PREFIX}{name}"
        return [p for p in all_pids()
                if (argv := proc_cmdline(p)) and os.path.basename(argv[0]) == "systemd-nspawn" and want in argv]

    def _stop_processes(self, name: str) -> int:
        """Stop the guest's systemd-nspawn (SIGTERM: its systemd shuts down) and every process
        left in the guest (SIGKILL), and wait until they are gone; returns how many were killed
        beside the nspawn processes stopped."""
        nspawn = self._nspawn_pids(name)
        for pid in nspawn:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(pid_alive(p) for p in nspawn):
            for child in self._children:
                child.poll()
            time.sleep(0.1)
        stopped = len(nspawn)
        for pid in nspawn + self._guest_pids(name):
            if pid_alive(pid):
                stopped += pid not in nspawn
                log(f"{name}: killing pid {pid} that did not stop on SIGTERM")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (self._guest_pids(name) or any(pid_alive(p) for p in nspawn)):
            for child in self._children:
                child.poll()
            time.sleep(0.1)
        self._children = [c for c in self._children if c.poll() is None]
        return stopped

    def _down_one(self, name: str) -> None:
        hdir = self.host_dir(name)
        record = hdir / "host.json"
        info: HostInfo | None = None
        if record.is_file():
            with contextlib.suppress(OSError, ValueError, TypeError):
                info = HostInfo.load(record)
        self._stop_processes(name)
        prefix = str(hdir) + "/"
        for point in reversed(read_mountinfo()):
            if point.startswith(prefix) or point == str(hdir):
                if run(["umount", point], check=False).returncode != 0:
                    run(["umount", "-l", point], check=False)
        # the fabric link first: its index stays taken (the veth) until both are gone
        netns = f"{NETNS_PREFIX}{name}"
        if info is None and Path(f"/run/netns/{netns}").exists():  # no record: the guest's end takes its peer along
            run(["ip", "-n", netns, "link", "del", FABRIC_IFACE], check=False)
        self._leave_fabric(info.index if info is not None else None)
        if info is not None and Path(f"/sys/class/net/{info.veth}").exists():
            run(["ip", "link", "del", info.veth], check=False)
        if Path(f"/run/netns/{netns}").exists():
            run(["ip", "netns", "del", netns])
        remaining = [x for x in self.leftovers() if x.owner == name]
        if remaining:
            raise HarnessError(f"{name}: could not clean up: " + "; ".join(str(x) for x in remaining))
        self._remove_record(name)

    def _remove_record(self, name: str) -> None:
        hdir = self.host_dir(name)
        for sub in ("upper", "work", "root"):
            shutil.rmtree(hdir / sub, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (hdir / "host.json").unlink()


# ---------------------------------------------------------------------- CLI
def _raise_exit(signum: int, _frame: t.Any) -> None:
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="testhosts.py", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--cache", help="cache directory (default: $GPUFLEET_CACHE, else <repo>/.cache)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the guest rootfs and the SSH key (cached)")
    p.add_argument("--force", action="store_true", help="rebuild the rootfs even if it is up to date")
    p = sub.add_parser("up", help="boot hosts and wait for SSH")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--bind", action="append", default=[], metavar="HOST:GUEST")
    p.add_argument("--bind-ro", action="append", default=[], metavar="HOST:GUEST")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for all hosts (default 120)")
    p = sub.add_parser("down", help="stop hosts and remove everything they hold")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--all", action="store_true", help="every registered host and every leftover")
    sub.add_parser("leftovers", help="list namespaces, links, processes and mounts of test hosts")
    p = sub.add_parser("check-clean", help="exit 1 naming any leftover (of the named hosts only, if named)")
    p.add_argument("names", nargs="*", metavar="NAME")
    sub.add_parser("list", help="hosts that are up, as JSON")
    p = sub.add_parser("stats", help="boot time and memory of hosts that are up, as JSON")
    p.add_argument("names", nargs="*", metavar="NAME")
    p = sub.add_parser("inventory", help="write an Ansible YAML inventory of the hosts that are up")
    p.add_argument("--out", required=True)
    p.add_argument("--group", nargs="+", action="append", default=[], metavar=("GROUP", "NAME"),
                   help="a group and its hosts; repeatable")
    p = sub.add_parser("instance-config", help="write molecule's instance config for hosts that are up")
    p.add_argument("--out", required=True)
    p.add_argument("names", nargs="+", metavar="NAME")
    p = sub.add_parser("exec", help="run a command in a guest via nsenter: exec NAME -- CMD...")
    p.add_argument("name")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    return parser


def main(argv: t.Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    h = Harness(args.cache)
    try:
        if args.cmd == "prepare":
            h.prepare(force=args.force)
        elif args.cmd == "up":
            for info in h.up(args.names, binds=args.bind, binds_ro=args.bind_ro, timeout=args.timeout):
                print(f"{info.name}\t{info.address}\t{info.boot_seconds}s")
        elif args.cmd == "down":
            if not args.names and not args.all:
                raise HarnessError("down: name hosts or use --all")
            done = h.down(args.names, all_hosts=args.all)
            log(f"down: {', '.join(done) if done else 'nothing to do'}")
        elif args.cmd == "leftovers":
            for item in h.leftovers():
                print(item)
        elif args.cmd == "check-clean":
            h.check_clean(args.names)
        elif args.cmd == "list":
            print(json.dumps({n: dataclasses.asdict(i) for n, i in h.hosts().items()}, indent=2))
        elif args.cmd == "stats":
            up = h.hosts()
            names = args.names or sorted(up)
            print(json.dumps({n: {"boot_seconds": h.get(n).boot_seconds, **h.memory(n)} for n in names}, indent=2))
        elif args.cmd == "inventory":
            groups = {g[0]: g[1:] for g in args.group}
            print(h.inventory(args.out, groups=groups))
        elif args.cmd == "instance-config":
            entries = h.instance_config(args.names)
            text = yaml.safe_dump(entries, sort_keys=False) if yaml is not None else json.dumps(entries) + "\n"
            atomic_write(Path(args.out), text, mode=0o600)
        elif args.cmd == "exec":
            cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not cmd:
                raise HarnessError("exec: give a command after `--`")
            info = h.get(args.name)
            return subprocess.call(["nsenter", "-t", str(info.leader_pid), "-a", "-r", "-w", "--", *cmd],
                                   env=GUEST_ENV)
    except (HarnessError, OSError) as exc:
        print(f"testhosts: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # SIGTERM/SIGHUP unwind like Ctrl-C, so a half-made host is torn down.
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGHUP, _raise_exit)
    sys.exit(main())
