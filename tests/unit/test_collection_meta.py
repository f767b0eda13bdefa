"""Checks on the collection as a whole: build artifact, metadata, changelog, EE, docs."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    """Path of a console script from requirements-dev.txt (next to this Python, else on PATH)."""
    candidate = BIN / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    assert found, f"{name} is not installed: run 'make venv' (it is pinned in requirements-dev.txt)"
    return found


def _run(argv: list[str], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.setdefault("ANSIBLE_NOCOLOR", "1")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False, **kwargs)


def _load_yaml(path: Path) -> object:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


# ---------------------------------------------------------------- build artifact


@pytest.fixture(scope="module")
def built_tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # the release artifact as `make build` makes it (DIST: where it goes)
    result = _run(["make", "--no-print-directory", "build", f"DIST={out}"], cwd=REPO_ROOT)
    assert result.returncode == 0, f"make build failed:\n{result.stdout}\n{result.stderr}"
    tarballs = list(out.glob("gpufleet-vllm-*.tar.gz"))
    assert len(tarballs) == 1, f"expected one tarball in {out}, found {tarballs}"
    return tarballs[0]


@pytest.fixture(scope="module")
def tarball_members(built_tarball: Path) -> list[str]:
    with tarfile.open(built_tarball) as tar:
        return [m.name.rstrip("/") for m in tar.getmembers()]


@pytest.fixture(scope="module")
def tarball_files(built_tarball: Path) -> list[str]:
    with tarfile.open(built_tarball) as tar:
        return [m.name for m in tar.getmembers() if m.isfile()]


@pytest.mark.parametrize("directory", ["plugins", "roles", "playbooks"])
def test_build_contains_content_directory(tarball_files: list[str], directory: str) -> None:
    # A directory alone is not content: at least one file below it must ship.
    assert any(f.startswith(directory + "/") for f in tarball_files), f"built collection has no files under {directory}/"


def test_build_contains_metadata(tarball_files: list[str]) -> None:
    for required in ("meta/runtime.yml", "MANIFEST.json", "FILES.json", "README.md", "meta/execution-environment.yml"):
        assert required in tarball_files, f"built collection lacks {required}"


# Directories (anywhere in the tree) and files that must never ship.
FORBIDDEN_PARTS = {
    ".cache", ".git", ".ansible", ".pytest_cache", ".hypothesis", "__pycache__", ".venv", "venv", "molecule",
}
FORBIDDEN_PREFIXES = ("sim/", "bench/", "tests/output/", "tests/output")


def test_build_excludes_development_trees(tarball_members: list[str]) -> None:
    bad = []
    for member in tarball_members:
        parts = member.split("/")
        if member.startswith(FORBIDDEN_PREFIXES) or member in ("sim", "bench"):
            bad.append(member)
        elif FORBIDDEN_PARTS.intersection(parts):
            bad.append(member)
        elif member.endswith((".pyc", ".tar.gz")) or parts[-1] == "pyvenv.cfg":
            bad.append(member)
    assert not bad, "built collection ships development files:\n" + "\n".join(sorted(bad)[:40])


def test_the_docs_install_the_version_galaxy_yml_builds() -> None:
    """README's install commands and the AWX execution environment name the version `make build` produces."""
    version = str(_load_yaml(REPO_ROOT / "galaxy.yml")["version"])
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"gpufleet-vllm-([0-9][0-9.]*[0-9])\.tar\.gz", readme)) | set(re.findall(r"gpufleet\.vllm:==([0-9.]+[0-9])", readme))
    assert named == {version}, f"README installs {sorted(named)}, galaxy.yml builds {version}"
    awx = (REPO_ROOT / "docs" / "awx.md").read_text(encoding="utf-8")
    assert f'version: ">={version}"' in awx and f"gpufleet-ee:{version}" in awx, "docs/awx.md's execution environment names another version"
    porting = (REPO_ROOT / "docs" / "porting.md").read_text(encoding="utf-8")
    assert re.search(rf"^## From [0-9.]+ to {re.escape(version)}$", porting, re.MULTILINE), f"docs/porting.md has no section for {version}"
    assert "not released yet" not in porting.split("\n## ", 2)[1], "the porting guide's newest section says it is not released"


def test_build_manifest_matches_galaxy_yml(built_tarball: Path) -> None:
    galaxy = _load_yaml(REPO_ROOT / "galaxy.yml")
    assert isinstance(galaxy, dict)
    with tarfile.open(built_tarball) as tar:
        handle = tar.extractfile("MANIFEST.json")
        assert handle is not None
        manifest = json.load(handle)
    info = manifest["collection_info"]
    assert (info["namespace"], info["name"], info["version"]) == (galaxy["namespace"], galaxy["name"], galaxy["version"])
    assert built_tarball.name == f"{galaxy['namespace']}-{galaxy['name']}-{galaxy['version']}.tar.gz"


def test_built_artifact_installs_and_its_content_is_found(built_tarball: Path, tmp_path: Path) -> None:
    """The artifact installs with ansible-galaxy into an empty collections path; ansible-doc finds a
    module there, and the playbooks run by their collection names (syntax check) from there only."""
    # only the installed copy: neither the checkout's collections path nor its PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS")}
    env.update(ANSIBLE_COLLECTIONS_PATH=str(tmp_path), ANSIBLE_NOCOLOR="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    install = subprocess.run(
        [_tool("ansible-galaxy"), "collection", "install", "--offline", "-p", str(tmp_path), str(built_tarball)], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    galaxy = _load_yaml(REPO_ROOT / "galaxy.yml")
    assert isinstance(galaxy, dict)
    assert f"gpufleet.vllm:{galaxy['version']} was installed successfully" in install.stdout, install.stdout
    doc = subprocess.run([_tool("ansible-doc"), "--json", "-t", "module", "gpufleet.vllm.gpu_memory_info"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    found = json.loads(doc.stdout)["gpufleet.vllm.gpu_memory_info"]["doc"]
    assert found["filename"].startswith(str(tmp_path / "ansible_collections" / "gpufleet" / "vllm")), found["filename"]
    assert found["version_added"] or found["short_description"]
    for playbook in ("gpufleet.vllm.rollout", "gpufleet.vllm.plan", "gpufleet.vllm.rollback"):
        check = subprocess.run([_tool("ansible-playbook"), "-i", "localhost,", "--syntax-check", playbook], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120, check=False)
        assert check.returncode == 0, f"{playbook}: {check.stdout}{check.stderr}"


# ---------------------------------------------------------------- runtime metadata and plugins


def _runtime() -> dict[str, object]:
    runtime = _load_yaml(REPO_ROOT / "meta" / "runtime.yml")
    assert isinstance(runtime, dict), "meta/runtime.yml must be a mapping"
    return runtime


def test_runtime_requires_ansible_matches_tested_core() -> None:
    runtime = _runtime()
    requires = runtime.get("requires_ansible")
    assert isinstance(requires, str) and re.fullmatch(r">=\s*2\.\d+(\.\d+)?(,\s*<\s*2\.\d+(\.\d+)?)?", requires), requires
    pinned = re.search(r"^ansible-core==(\d+)\.(\d+)", (REPO_ROOT / "requirements-dev.txt").read_text(), re.M)
    assert pinned, "requirements-dev.txt must pin ansible-core"
    minimum = tuple(int(x) for x in re.findall(r"\d+", requires.split(",")[0])[:2])
    # The claim is what the stages test: the one pinned ansible-core release series.
    assert minimum == (int(pinned.group(1)), int(pinned.group(2))), (
        f"requires_ansible {requires!r} claims other releases than the tested ansible-core {pinned.group(0)}")


def test_every_plugin_file_names_its_licence() -> None:
    licence = "LICENSES/GPL-3.0-or-later.txt"
    assert (REPO_ROOT / licence).is_file(), f"{licence} is cited by the plugin files and must exist"
    # an empty __init__.py (a module_utils subpackage) holds nothing to license, and ansible-test
    # sanity's empty-init test requires it empty
    files = sorted(p for p in (REPO_ROOT / "plugins").rglob("*") if p.suffix in (".py", ".yml", ".yaml")
                   and not (p.name == "__init__.py" and p.stat().st_size == 0))
    assert files
    missing = [str(p.relative_to(REPO_ROOT)) for p in files
               if "SPDX-License-Identifier: GPL-3.0-or-later" not in p.read_text(encoding="utf-8")]
    assert not missing, f"no SPDX-License-Identifier line: {missing}"


def test_action_group_members_have_modules() -> None:
    groups = _runtime().get("action_groups")
    assert isinstance(groups, dict) and "vllm" in groups, "meta/runtime.yml must declare the action group 'vllm'"
    members = groups["vllm"]
    assert isinstance(members, list) and members
    missing = [m for m in members if not (REPO_ROOT / "plugins" / "modules" / f"{m}.py").is_file()]
    assert not missing, f"action group 'vllm' lists modules without plugins/modules/<name>.py: {missing}"


def test_every_action_plugin_has_a_documentation_stub() -> None:
    actions = sorted(p.stem for p in (REPO_ROOT / "plugins" / "action").glob("*.py") if p.stem != "__init__")
    missing = [a for a in actions if not (REPO_ROOT / "plugins" / "modules" / f"{a}.py").is_file()]
    assert not missing, f"action plugins without a documentation stub in plugins/modules/: {missing}"


def test_no_sanity_ignore_files() -> None:
    ignores = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests").glob("sanity/ignore-*.txt"))
    assert not ignores, f"sanity ignore files are not allowed: {ignores}"


# ---------------------------------------------------------------- documentation of modules

_DOC_LOADER = textwrap.dedent(
    """
    import json, sys
    from ansible.plugins.loader import fragment_loader, init_plugin_loader
    init_plugin_loader([sys.argv[1]])
    from ansible.utils.plugin_docs import get_docstring
    out = {}
    for path in sys.argv[2:]:
        try:
            doc, _plainexamples, returndocs, _metadata = get_docstring(
                path, fragment_loader, collection_name="gpufleet.vllm", is_module=True)
            out[path] = {"doc": json.loads(json.dumps(doc, default=str)), "returns": sorted(returndocs or {})}
        except Exception as exc:  # report every module, not the first failure
            out[path] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def module_docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    tree = tmp_path_factory.mktemp("collections")
    (tree / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(REPO_ROOT, tree / "ansible_collections" / "gpufleet" / "vllm")
    modules = sorted(str(p) for p in (REPO_ROOT / "plugins" / "modules").glob("*.py") if p.name != "__init__.py")
    if not modules:
        return {}
    result = _run([sys.executable, "-c", _DOC_LOADER, str(tree), *modules], cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return {Path(k).stem: v for k, v in json.loads(result.stdout).items()}


def test_module_docs_load_with_fragments(module_docs: dict[str, dict[str, object]]) -> None:
    errors = {name: entry["error"] for name, entry in module_docs.items() if "error" in entry}
    assert not errors, f"module documentation does not load: {errors}"


def test_modules_declare_check_and_diff_mode(module_docs: dict[str, dict[str, object]]) -> None:
    problems = []
    for name, entry in module_docs.items():
        doc = entry.get("doc")
        if not isinstance(doc, dict):
            continue  # reported by test_module_docs_load_with_fragments
        attributes = doc.get("attributes") or {}
        for attribute in ("check_mode", "diff_mode"):
            spec = attributes.get(attribute)
            if not isinstance(spec, dict) or spec.get("support") not in ("full", "partial", "none", "N/A"):
                problems.append(f"{name}: attributes.{attribute}.support missing")
    assert not problems, "\n".join(problems)


def test_info_modules_set_no_facts_and_facts_modules_do(module_docs: dict[str, dict[str, object]]) -> None:
    """The community convention: a ``*_info`` module returns results only, a ``*_facts`` module sets facts."""
    problems = []
    for name, entry in sorted(module_docs.items()):
        doc = entry.get("doc")
        if not isinstance(doc, dict) or not name.endswith(("_info", "_facts")):
            continue
        facts = (doc.get("attributes") or {}).get("facts") or {}
        documented = "ansible_facts" in (entry.get("returns") or [])
        if name.endswith("_info") and (documented or facts.get("support") not in (None, "none")):
            problems.append(f"{name}: an info module returns no ansible_facts (move them to a _facts module)")
        if name.endswith("_facts") and not (documented and facts.get("support") == "full"):
            problems.append(f"{name}: a facts module documents RETURN ansible_facts and attributes.facts.support full")
    assert "gpu_memory_facts" in module_docs and "gpu_memory_info" in module_docs
    assert not problems, "\n".join(problems)


def test_action_group_membership_documented(module_docs: dict[str, dict[str, object]]) -> None:
    members = set(_runtime()["action_groups"]["vllm"])  # type: ignore[index]
    problems = []
    for name in sorted(members & set(module_docs)):
        doc = module_docs[name].get("doc")
        if not isinstance(doc, dict):
            continue
        group = (doc.get("attributes") or {}).get("action_group") or {}
        if "gpufleet.vllm.vllm" not in (group.get("membership") or []):
            problems.append(f"{name}: add gpufleet.vllm.attributes.actiongroup_vllm to extends_documentation_fragment")
    assert not problems, "\n".join(problems)


def test_attributes_fragment_merges(tmp_path: Path) -> None:
    """Every fragment of gpufleet.vllm.attributes is valid YAML that ansible-core can merge."""
    fragments = ["", ".info_module", ".platform_linux", ".actiongroup_vllm", ".facts", ".facts_module", ".action_plugin"]
    script = textwrap.dedent(
        """
        import json, sys
        from ansible.plugins.loader import fragment_loader, init_plugin_loader
        init_plugin_loader([sys.argv[1]])
        from ansible.utils.plugin_docs import add_fragments
        out = {}
        for name in sys.argv[2:]:
            doc = {"module": "x", "short_description": "x", "description": ["x"], "options": {},
                   "extends_documentation_fragment": ["gpufleet.vllm.attributes" + name]}
            add_fragments(doc, "/x.py", fragment_loader=fragment_loader)
            out[name] = json.loads(json.dumps(doc.get("attributes", {}), default=str))
        print(json.dumps(out))
        """
    )
    (tmp_path / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(REPO_ROOT, tmp_path / "ansible_collections" / "gpufleet" / "vllm")
    result = _run([sys.executable, "-c", script, str(tmp_path), *fragments], cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    merged = json.loads(result.stdout)
    assert set(merged[""]) == {"check_mode", "diff_mode", "idempotent", "platform"}
    assert merged[".info_module"]["check_mode"]["support"] == "full"
    assert merged[".info_module"]["diff_mode"]["support"] == "N/A"
    assert merged[".platform_linux"]["platform"] == {"support": "full", "platforms": "linux"}
    group = merged[".actiongroup_vllm"]["action_group"]
    assert group["support"] == "full"
    # The documented group must be the one meta/runtime.yml declares.
    assert "gpufleet.vllm.vllm" in group["membership"] and "vllm" in _runtime()["action_groups"]  # type: ignore[operator]
    assert merged[".facts_module"]["facts"]["support"] == "full"
    assert merged[".facts_module"]["idempotent"]["support"] == "full"
    assert merged[".action_plugin"]["action"]["support"] == "full"


# ---------------------------------------------------------------- changelog


def test_changelog_fragments_lint() -> None:
    result = _run([_tool("antsibull-changelog"), "lint"], cwd=REPO_ROOT)
    assert result.returncode == 0, f"antsibull-changelog lint:\n{result.stdout}{result.stderr}"
    assert result.stdout.strip() == "", result.stdout


def test_changelog_yaml_lint() -> None:
    result = _run(
        [_tool("antsibull-changelog"), "lint-changelog-yaml", "--strict", "changelogs/changelog.yaml"], cwd=REPO_ROOT
    )
    assert result.returncode == 0, f"antsibull-changelog lint-changelog-yaml:\n{result.stdout}{result.stderr}"


def test_changelog_lint_detects_bad_fragment(tmp_path: Path) -> None:
    """The lint above really reads this collection's fragments (a bad one makes it fail)."""
    shutil.copy(REPO_ROOT / "galaxy.yml", tmp_path / "galaxy.yml")
    shutil.copytree(REPO_ROOT / "changelogs", tmp_path / "changelogs")
    (tmp_path / "changelogs" / "fragments" / "bad.yml").write_text("no_such_section:\n  - text\n", encoding="utf-8")
    result = _run([_tool("antsibull-changelog"), "lint"], cwd=tmp_path)
    assert "bad.yml" in result.stdout + result.stderr


# ---------------------------------------------------------------- execution environment

EE_DIR = REPO_ROOT / "meta"


def test_execution_environment_schema_v3() -> None:
    from ansible_builder.ee_schema import validate_schema

    definition = _load_yaml(EE_DIR / "execution-environment.yml")
    assert isinstance(definition, dict) and definition.get("version") == 3
    validate_schema(dict(definition))
    deps = definition["dependencies"]
    assert deps == {"python": "meta/ee-requirements.txt", "system": "meta/ee-bindep.txt"}
    for rel in deps.values():
        assert (REPO_ROOT / rel).is_file(), f"{rel} referenced by meta/execution-environment.yml does not exist"


def _requirement_lines(path: Path) -> list[str]:
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def test_ee_requirements_are_pep508() -> None:
    from packaging.requirements import Requirement

    for line in _requirement_lines(EE_DIR / "ee-requirements.txt"):
        Requirement(line)


_OWN_MODULE_UTILS = "ansible_collections.gpufleet.vllm.plugins.module_utils."


def _imports(path: Path) -> tuple[set[str], set[Path]]:
    """(top-level third-party-or-stdlib names, own module_utils files) imported by a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module_utils = REPO_ROOT / "plugins" / "module_utils"
    names: set[str] = set()
    own: set[Path] = set()

    def own_files(base: Path, dotted: str, aliases: list[ast.alias]) -> None:
        # a module (_gate._boot_gate) or a package whose names are modules (_gate, or none: module_utils)
        target = base.joinpath(*dotted.split(".")) if dotted else base
        if target.is_dir():
            own.update(target / f"{a.name}.py" for a in aliases)
        else:
            own.add(target.parent / f"{target.name}.py")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(_OWN_MODULE_UTILS):
                    own_files(module_utils, alias.name[len(_OWN_MODULE_UTILS):], [])
                else:
                    names.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = path.parent
                base = base.parents[node.level - 2] if node.level > 1 else base
                own_files(base, module, node.names)
            elif module.startswith(_OWN_MODULE_UTILS):
                own_files(module_utils, module[len(_OWN_MODULE_UTILS):], node.names)
            elif module == _OWN_MODULE_UTILS.rstrip("."):
                own_files(module_utils, "", node.names)
            elif module:
                names.add(module.split(".")[0])
    return names, own


def test_ee_requirements_cover_controller_imports() -> None:
    """Third-party imports of controller-side code are declared in meta/ee-requirements.txt.

    Controller-side code: action, filter and lookup plugins, plugin_utils and every module_utils file
    they import (transitively). Target-side dependencies (pynvml, ...) do not belong there.
    """
    from packaging.requirements import Requirement

    declared = {Requirement(line).name.lower() for line in _requirement_lines(EE_DIR / "ee-requirements.txt")}
    distribution = {"yaml": "pyyaml"}
    ignored = {"ansible", "ansible_collections", "__future__"}
    plugins = REPO_ROOT / "plugins"
    queue = [p for sub in ("action", "filter", "lookup", "plugin_utils") for p in sorted((plugins / sub).glob("*.py"))]
    seen: set[Path] = set()
    undeclared = set()
    while queue:
        path = queue.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        names, own = _imports(path)
        queue.extend(own)
        for top in names - ignored:
            if top in sys.stdlib_module_names:
                continue
            if distribution.get(top, top).lower().replace("_", "-") not in declared:
                undeclared.add(f"{path.relative_to(REPO_ROOT)}: {top}")
    assert not undeclared, "add these to meta/ee-requirements.txt:\n" + "\n".join(sorted(undeclared))


def test_ee_bindep_parses_per_platform() -> None:
    from bindep.depends import Depends

    depends = Depends((EE_DIR / "ee-bindep.txt").read_text(encoding="utf-8"))
    dpkg = {rule[0] for rule in depends.active_rules(["platform:dpkg", "platform:debian"])}
    rpm = {rule[0] for rule in depends.active_rules(["platform:rpm", "platform:redhat"])}
    assert "openssh-client" in dpkg and "openssh-clients" not in dpkg
    assert "openssh-clients" in rpm and "openssh-client" not in rpm


def test_ee_introspect_reads_built_collection(built_tarball: Path, tmp_path: Path) -> None:
    """ansible-builder finds the system dependencies in the installed artifact."""
    # --force: the collection may already be installed in a configured collections path.
    install = _run(
        [_tool("ansible-galaxy"), "collection", "install", "--offline", "--force", "-p", str(tmp_path), str(built_tarball)],
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    result = _run([_tool("ansible-builder"), "introspect", str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    data = yaml.safe_load(result.stdout.split("\n", 1)[1])
    system = " ".join(data.get("system") or [])
    assert "openssh-client [platform:dpkg]" in system and "from collection gpufleet.vllm" in system


# ---------------------------------------------------------------- lint scope


def test_lint_excluded_trees_hold_no_ansible_content(monkeypatch: pytest.MonkeyPatch) -> None:
    """.ansible-lint excludes sim/ and bench/; that is only right while they hold no Ansible content."""
    from ansiblelint.file_utils import Lintable

    monkeypatch.chdir(REPO_ROOT)
    config = _load_yaml(REPO_ROOT / ".ansible-lint")
    assert isinstance(config, dict) and config.get("profile") == "production"
    assert not config.get("skip_list"), ".ansible-lint must not skip rules"
    excluded = [p.rstrip("/") for p in config.get("exclude_paths", [])]
    ansible_kinds = {"playbook", "tasks", "handlers", "role", "meta", "requirements", "vars", "galaxy", "rulebook"}
    offenders = []
    for top in ("sim", "bench"):
        if top not in excluded:
            continue
        for path in sorted((REPO_ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in (".yml", ".yaml"):
                kind = Lintable(str(path.relative_to(REPO_ROOT))).kind
                if kind in ansible_kinds:
                    offenders.append(f"{path.relative_to(REPO_ROOT)} ({kind})")
    assert not offenders, "Ansible content in a tree excluded from lint (remove it from exclude_paths):\n" + "\n".join(
        offenders
    )


def _newest_version_added() -> str | None:
    """The newest ``version_added`` in the modules' and filters' documentation (None when none has one)."""
    found = []
    for path in [*(REPO_ROOT / "plugins" / "modules").glob("*.py"), *(REPO_ROOT / "plugins" / "filter").glob("*.yml")]:
        found += re.findall(r"^\s*version_added:\s*['\"]?([0-9][0-9.]*)['\"]?\s*$", path.read_text(encoding="utf-8"), re.MULTILINE)
    return max(found, key=Version) if found else None


def test_changelog_release_lists_every_module(tmp_path: Path) -> None:
    """A release of the current tree (in a copy) renders notes naming every module.

    galaxy.yml's version is a release of changelogs/changelog.yaml (it moves at a release). What
    came after it is released here as the next version, the newest ``version_added`` of the
    modules and filters, or folded into galaxy.yml's version (``--update-existing``) when none
    is newer.

    antsibull-changelog finds new plugins through ansible-doc, so this also proves that
    every module's documentation loads from an installed-style collection tree.
    """
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO_ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")
    dest = tmp_path / "ansible_collections" / "gpufleet" / "vllm"
    for rel in filter(None, listed):
        source = REPO_ROOT / rel
        if source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    galaxy = _load_yaml(REPO_ROOT / "galaxy.yml")
    assert isinstance(galaxy, dict)
    changelog = _load_yaml(REPO_ROOT / "changelogs" / "changelog.yaml")
    assert isinstance(changelog, dict) and str(galaxy["version"]) in changelog["releases"], "galaxy.yml's version is not released"
    upcoming = _newest_version_added()
    if upcoming is not None and Version(upcoming) > Version(str(galaxy["version"])):
        release = ["--version", upcoming]
    else:
        release = ["--version", str(galaxy["version"]), "--update-existing"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ANSIBLE_COLLECTIONS_PATH")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        [_tool("antsibull-changelog"), "release", *release, "--reload-plugins"],
        cwd=dest, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    notes = (dest / "CHANGELOG.rst").read_text(encoding="utf-8")
    modules = sorted(p.stem for p in (REPO_ROOT / "plugins" / "modules").glob("*.py") if p.stem != "__init__")
    assert modules, "no modules in plugins/modules"
    missing = [m for m in modules if f"gpufleet.vllm.{m} - " not in notes]
    assert not missing, f"release notes do not list these modules (broken documentation?): {missing}"


def test_no_file_hard_codes_the_checkout_location() -> None:
    """Files must work from any checkout: none may contain this checkout's absolute path."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO_ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")
    needle = str(REPO_ROOT).encode()
    offenders = []
    for rel in filter(None, listed):
        path = REPO_ROOT / rel
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
            offenders.append(rel)
    assert not offenders, f"files containing {REPO_ROOT}: {offenders}"
