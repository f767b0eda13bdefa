"""Tests of the CI tooling in tests/tools/ and the stage parts of the Makefile."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_STAGE = REPO_ROOT / "tests" / "tools" / "run-stage.sh"
SANITY = REPO_ROOT / "tests" / "tools" / "ansible-test-sanity.sh"

# Final lines as the pinned tools print them (ansible-lint and molecule from their sources,
# pytest in both -q and verbose forms, sanity from ansible-test-sanity.sh).
TOOL_OUTPUTS = {
    "units": (
        "....F.\n=========================== short test summary info ============================\n"
        "FAILED tests/unit/test_x.py::test_y - assert 1 == 2\n1 failed, 41 passed, 2 skipped in 3.52s\n",
        "1 failed, 41 passed, 2 skipped in 3.52s",
    ),
    "integration": (
        "collected 7 items\n\ntests/integration/test_a.py .......\n"
        "============================== 7 passed in 95.10s (0:01:35) ==============================\n",
        "7 passed in 95.10s (0:01:35)",
    ),
    "harness": (
        "tests/integration/test_harness.py ............\n12 passed in 40.10s\n",
        "12 passed in 40.10s",
    ),
    "sanity": (
        'Running sanity test "action-plugin-docs"\nRunning sanity test "yamllint"\n'
        "Sanity summary: 24 sanity tests run, 0 failed, 0 skipped (ansible-test exit 0)\n",
        "24 sanity tests run, 0 failed, 0 skipped (ansible-test exit 0)",
    ),
    "lint": (
        "WARNING  Listing 2 violation(s) that are fatal\n"
        "Failed: 2 failure(s), 0 warning(s) in 37 files processed of 65 encountered. "
        "Profile 'production' was required, but 'min' profile passed.\n"
        "==== ruff check plugins/\nplugins/x.py:1:1: F401 `os` imported but unused\nFound 3 errors.\n"
        "[*] 1 fixable with `--fix`.\n"
        "==== mypy --strict plugins/\n"
        "ansible_collections/gpufleet/vllm/plugins/x.py:3: error: Missing type arguments for generic type \"dict\"  [type-arg]\n"
        "Found 2 errors in 1 file (checked 47 source files)\n",
        "Failed: 2 failure(s), 0 warning(s) in 37 files processed of 65 encountered.; ruff: Found 3 errors.; "
        "mypy: Found 2 errors in 1 file (checked 47 source files)",
    ),
    "molecule": (
        "INFO     default ➜ destroy: Executed: Successful\n"
        "INFO     Molecule executed 3 scenarios (3 successful)\n",
        "Molecule executed 3 scenarios (3 successful)",
    ),
}


def _run_stage(tmp_path: Path, stage: str, output: str, rc: int) -> subprocess.CompletedProcess[str]:
    out_file = tmp_path / f"{stage}.out"
    out_file.write_text(output, encoding="utf-8")
    env = dict(os.environ, GPUFLEET_CACHE=str(tmp_path / "cache"))
    command = f"cat {shlex.quote(str(out_file))}; exit {rc}"
    return subprocess.run(
        [str(RUN_STAGE), stage, "bash", "-c", command],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


def _stage_lines(tmp_path: Path) -> list[str]:
    return (tmp_path / "cache" / "stages.txt").read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize("stage", sorted(TOOL_OUTPUTS))
def test_run_stage_records_the_tools_counts(tmp_path: Path, stage: str) -> None:
    output, expected = TOOL_OUTPUTS[stage]
    result = _run_stage(tmp_path, stage, output, 0)
    assert result.returncode == 0, result.stderr
    assert output in result.stdout  # the tool's output is shown as it runs
    (line,) = _stage_lines(tmp_path)
    assert line.split()[:2] == [stage, "ok"]
    assert line.endswith(expected), line
    assert (tmp_path / "cache" / f"stage-{stage}.log").read_text(encoding="utf-8") == output


def test_run_stage_fails_a_stage_that_leaves_a_process_running(tmp_path: Path) -> None:
    """A process the stage started and did not end (here in a session of its own, as a playbook run
    with start_new_session would be) is listed, ended and fails the stage, even though the stage's
    own command passed; a process outside the stage is left alone."""
    outside = subprocess.Popen(["sleep", "120"])  # pylint: disable=consider-using-with
    marker = tmp_path / "stray.pid"
    env = dict(os.environ, GPUFLEET_CACHE=str(tmp_path / "cache"))
    command = f"setsid sleep 300 >/dev/null 2>&1 & echo $! > {shlex.quote(str(marker))}; echo '1 passed in 0.01s'"
    try:
        result = subprocess.run([str(RUN_STAGE), "units", "bash", "-c", command], cwd=REPO_ROOT, env=env,
                                capture_output=True, text=True, timeout=120, check=False)
        stray = int(marker.read_text(encoding="utf-8"))
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"pid {stray} " in result.stderr and "sleep 300" in result.stderr, result.stderr
        assert "FAILED stage units: it left processes running" in result.stderr
        (line,) = _stage_lines(tmp_path)
        assert line.split()[:2] == ["units", "FAILED"] and line.endswith("1 passed in 0.01s; left processes running"), line
        assert not Path(f"/proc/{stray}").exists(), "the stray process was ended"
        assert outside.poll() is None, "a process of no stage is not touched"
    finally:
        outside.kill()
        outside.wait()


def test_leftovers_tells_an_ssh_connection_cache_from_a_stray() -> None:
    sys.path.insert(0, str(REPO_ROOT / "tests" / "tools"))
    import leftovers  # pylint: disable=import-outside-toplevel,import-error

    assert leftovers.Proc(1, 1, "ssh: /root/.ansible/cp/3f2a1b [mux]").connection_cache
    assert not leftovers.Proc(1, 1, "ssh -C -o ControlMaster=auto root@10.0.0.2 /bin/sh").connection_cache
    assert not leftovers.Proc(1, 1, "/usr/bin/python3 /usr/bin/ansible-playbook rollout.yml").connection_cache


def test_run_stage_lint_summary_of_a_clean_run(tmp_path: Path) -> None:
    """The lint line names each tool's own result: ansible-lint's counts, ruff's and mypy's final lines."""
    output = (
        "Passed: 0 failure(s), 0 warning(s) in 40 files processed of 52 encountered. "
        "Last profile that met the validation criteria was 'production'.\n"
        "==== ruff check plugins/\nAll checks passed!\n"
        "==== mypy --strict plugins/\nSuccess: no issues found in 47 source files\n"
    )
    result = _run_stage(tmp_path, "lint", output, 0)
    assert result.returncode == 0, result.stderr
    (line,) = _stage_lines(tmp_path)
    assert line.split()[:2] == ["lint", "ok"]
    assert line.endswith(
        "Passed: 0 failure(s), 0 warning(s) in 40 files processed of 52 encountered. Last profile that met the validation "
        "criteria was 'production'.; ruff: All checks passed!; mypy: Success: no issues found in 47 source files"
    ), line


@pytest.mark.parametrize("mypy_rc", [0, 1])
def test_lint_sh_runs_mypy_strict_from_the_collections_root(tmp_path: Path, mypy_rc: int) -> None:
    """lint.sh runs ansible-lint, ruff, then mypy with mypy.ini where the collection imports as
    ansible_collections.gpufleet.vllm (ANSIBLE_COLLECTIONS_PATH); a mypy finding fails the stage."""
    bin_dir, calls, root = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "collections"
    bin_dir.mkdir()
    root.mkdir()
    for tool, rc in (("ansible-lint", 0), ("ruff", 0), ("mypy", mypy_rc)):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $PWD $*" >> {shlex.quote(str(calls))}\nexit {rc}\n', encoding="utf-8")
        stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", ANSIBLE_COLLECTIONS_PATH=str(root))
    result = subprocess.run(
        [str(REPO_ROOT / "tests" / "tools" / "lint.sh")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == mypy_rc, result.stdout + result.stderr
    assert "==== mypy --strict plugins/" in result.stdout
    assert calls.read_text(encoding="utf-8").splitlines() == [
        f"ansible-lint {REPO_ROOT} --profile production",
        f"ruff {REPO_ROOT} check plugins/",
        f"mypy {root} --config-file {REPO_ROOT}/mypy.ini -p ansible_collections.gpufleet.vllm.plugins",
    ]


def test_run_stage_propagates_failure(tmp_path: Path) -> None:
    output, expected = TOOL_OUTPUTS["units"]
    result = _run_stage(tmp_path, "units", output, 3)
    assert result.returncode == 3
    (line,) = _stage_lines(tmp_path)
    assert line.split()[:2] == ["units", "FAILED"] and line.endswith(expected)


def test_run_stage_without_summary_says_so(tmp_path: Path) -> None:
    result = _run_stage(tmp_path, "lint", "Traceback (most recent call last):\n  boom\n", 1)
    assert result.returncode == 1
    (line,) = _stage_lines(tmp_path)
    assert "no lint summary line found" in line


def test_run_stage_rerun_replaces_its_line(tmp_path: Path) -> None:
    _run_stage(tmp_path, "units", "1 failed, 1 passed in 0.10s\n", 1)
    _run_stage(tmp_path, "lint", TOOL_OUTPUTS["lint"][0], 0)
    _run_stage(tmp_path, "units", "2 passed in 0.10s\n", 0)
    lines = _stage_lines(tmp_path)
    assert [line.split()[0] for line in lines] == ["lint", "units"]
    assert lines[1].split()[1] == "ok" and lines[1].endswith("2 passed in 0.10s")


def test_stage_report_marks_stages_that_never_ran(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "stages.txt").write_text(
        "units        ok         4s  12 passed in 1.00s\nlint         FAILED     9s  Failed: 1 failure(s)\n",
        encoding="utf-8",
    )
    result = subprocess.run(
        ["make", "-s", "--no-print-directory", "stage-report", f"CACHE={cache}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[0] == "==== make test: stage summary ===="
    body = {line.split()[0]: line for line in lines[1:]}
    assert list(body) == ["units", "sanity", "lint", "harness", "readme", "molecule", "integration", "bench"]
    assert body["units"].endswith("12 passed in 1.00s")
    assert "FAILED" in body["lint"]
    for stage in ("sanity", "harness", "readme", "molecule", "integration", "bench"):
        assert "NOT RUN" in body[stage]


def test_get_pip_stand_in_installs_pip_with_machine_config(tmp_path: Path) -> None:
    """The offline get-pip stand-in bootstraps the pip version ansible-test asks for.

    It runs as ansible-test runs it (GET_PIP set, through a runpy wrapper, inside a venv
    without pip) and must keep the machine's pip configuration (indexes, find-links).
    """
    home = tmp_path / "home"
    home.mkdir()
    # A scratch HOME for ~/.ansible; the user's pip configuration stays where pip finds it.
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=os.environ.get("XDG_CONFIG_HOME", str(Path.home() / ".config")))
    wrote = subprocess.run(
        [str(SANITY), "--write-get-pip"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert wrote.returncode == 0, wrote.stderr
    get_pip = Path(wrote.stdout.strip())
    assert get_pip.parent == home / ".ansible" / "test" / "cache"
    version = get_pip.stem.removeprefix("get_pip_").replace("_", ".")
    assert version.count(".") >= 1, get_pip

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # The same wrapper ansible-test uses (quiet_pip.py): run GET_PIP as __main__.
    wrapper = tmp_path / "quiet_pip.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        "directory, filename = os.path.split(os.environ['GET_PIP'])\n"
        "sys.path.insert(0, directory)\n"
        "runpy.run_module(os.path.splitext(filename)[0], run_name='__main__', alter_sys=True)\n",
        encoding="utf-8",
    )
    boot = subprocess.run(
        [str(python), str(wrapper), "--disable-pip-version-check", f"pip=={version}", "--no-setuptools", "--no-wheel"],
        env=dict(env, GET_PIP=str(get_pip), PIP_BREAK_SYSTEM_PACKAGES="1"),
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert boot.returncode == 0, boot.stdout[-3000:] + boot.stderr[-3000:]
    shown = subprocess.run(
        [str(python), "-m", "pip", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.stdout.startswith(f"pip {version} "), shown.stdout


def test_sanity_script_refuses_ignore_files(tmp_path: Path) -> None:
    """A tests/sanity/ignore-*.txt in the tree stops the sanity stage before ansible-test runs."""
    ignore = REPO_ROOT / "tests" / "sanity" / "ignore-2.19.txt"
    if ignore.exists():
        pytest.fail(f"{ignore.relative_to(REPO_ROOT)} exists: sanity ignore files are not allowed")
    clone = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(clone)], check=True, timeout=60)
    (clone / "tests" / "tools").mkdir(parents=True)
    (clone / "tests" / "tools" / "ansible-test-sanity.sh").write_bytes(SANITY.read_bytes())
    (clone / "tests" / "tools" / "ansible-test-sanity.sh").chmod(0o755)
    (clone / "tests" / "sanity").mkdir()
    (clone / "tests" / "sanity" / "ignore-2.19.txt").write_text("plugins/modules/x.py validate-modules:foo\n")
    env = dict(os.environ, GPUFLEET_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        [str(clone / "tests" / "tools" / "ansible-test-sanity.sh")],
        cwd=clone, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2
    assert "sanity ignore files are not allowed" in result.stderr and "ignore-2.19.txt" in result.stderr
    assert not (tmp_path / "cache" / "ansible-test").exists()
