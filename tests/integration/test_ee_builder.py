# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""ansible-builder with the execution environment of docs/awx.md and this collection's metadata.

ansible-builder is installed with pip into a virtual environment of its own (it is not a
dependency of the collection or of the dev environment). Two checks:

* ``ansible-builder create`` with the image definition docs/awx.md gives writes a build
  context whose Containerfile starts from the documented base image and installs this
  collection through ansible-galaxy;
* ``ansible-builder introspect`` on a collections tree holding this checkout reads the
  collection's ``meta/execution-environment.yml`` and reports the system packages of
  ``meta/ee-bindep.txt`` (what the image build installs for the collection).
"""

from __future__ import annotations

import os
import re
import subprocess
import venv
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def builder(tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("ansible-builder-venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    pip = subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "ansible-builder>=3,<4"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert pip.returncode == 0, f"pip install ansible-builder failed: {pip.stdout[-2000:]}{pip.stderr[-3000:]}"
    return env_dir / "bin" / "ansible-builder"


def documented_ee() -> dict:
    text = (REPO / "docs" / "awx.md").read_text(encoding="utf-8")
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    ees = [b for b in blocks if isinstance(b, dict) and b.get("version") == 3 and "dependencies" in b]
    assert len(ees) == 1, "docs/awx.md must show one execution-environment.yml (version 3)"
    return ees[0]


def test_create_writes_the_build_context(builder, tmp_path):
    ee = documented_ee()
    (tmp_path / "execution-environment.yml").write_text(yaml.safe_dump(ee), encoding="utf-8")
    ctx = tmp_path / "context"
    proc = subprocess.run(
        [str(builder), "create", "-f", "execution-environment.yml", "-c", str(ctx), "--output-filename", "Containerfile"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    containerfile = (ctx / "Containerfile").read_text(encoding="utf-8")
    base = ee["images"]["base_image"]["name"]
    assert re.search(rf"^ARG EE_BASE_IMAGE=\"?{re.escape(base)}\"?$", containerfile, re.M), containerfile[:2000]
    assert "ansible-galaxy" in containerfile and "requirements.yml" in containerfile
    assert "introspect" in containerfile  # the collection's own dependencies are read during the build
    galaxy = yaml.safe_load((ctx / "_build" / "requirements.yml").read_text(encoding="utf-8"))
    assert [c["name"] for c in galaxy["collections"]] == ["gpufleet.vllm"]
    refs = re.search(r'^ARG ANSIBLE_INSTALL_REFS="(.*)"$', containerfile, re.M)
    assert refs and refs.group(1).split() == [
        ee["dependencies"]["ansible_core"]["package_pip"], ee["dependencies"]["ansible_runner"]["package_pip"]]


def test_introspect_reads_the_collection_metadata(builder, tmp_path):
    tree = tmp_path / "collections" / "ansible_collections" / "gpufleet"
    tree.mkdir(parents=True)
    os.symlink(REPO, tree / "vllm")
    proc = subprocess.run(
        [str(builder), "introspect", str(tmp_path / "collections")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = yaml.safe_load(proc.stdout.split("---", 1)[1])
    bindep = [
        line.strip() for line in (REPO / "meta" / "ee-bindep.txt").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert bindep, "meta/ee-bindep.txt lists no package"
    system = [re.sub(r"\s*#.*$", "", s).strip() for s in data["system"]]
    assert sorted(system) == sorted(bindep), data
    assert all("from collection gpufleet.vllm" in s for s in data["system"])
    # Python needs: what meta/ee-requirements.txt lists, less what ansible-core already brings (PyYAML)
    assert all("gpufleet.vllm" in p for p in data.get("python") or []), data
