# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""_host_tools: the boot gate, its library and the exporter written in one call, only where they differ."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _host_tools
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._host_tools import (
    HostToolsError,
    apply,
    compile_dir,
    install,
    parse_dirs,
    parse_files,
    under,
)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture()
def tools(tmp_path):
    lib = tmp_path / "lib" / "pkg"
    files = parse_files([
        {"path": str(lib / "__init__.py"), "content": ""},
        {"path": str(lib / "_gate.py"), "content": "X = 1\n"},
        {"path": str(tmp_path / "bin" / "gate"), "content": "#!/bin/sh\nexit 0\n", "mode": "0755"},
    ])
    dirs = parse_dirs([{"path": str(lib)}, {"path": str(tmp_path / "textfile"), "mode": "0755"}])
    return tmp_path, files, dirs


def ids():
    return {"uid": os.getuid(), "gid": os.getgid()}


def test_a_first_install_writes_everything_and_a_second_nothing(tools):
    root, files, dirs = tools
    written = install(files, dirs, check=False, **ids())
    assert written == [str(root / "lib" / "pkg"), str(root / "textfile")] + [f.path for f in files]
    assert (root / "lib" / "pkg" / "_gate.py").read_text() == "X = 1\n"
    assert mode(root / "bin" / "gate") == 0o755 and mode(root / "lib" / "pkg" / "_gate.py") == 0o644
    assert install(files, dirs, check=False, **ids()) == []
    assert not [p for p in os.listdir(root / "lib" / "pkg") if p.startswith(".")], "no temporary file left"


def test_an_edited_or_removed_file_comes_back_and_only_it(tools):
    root, files, dirs = tools
    install(files, dirs, check=False, **ids())
    (root / "lib" / "pkg" / "_gate.py").write_text("X = 2  # edited by hand\n")
    (root / "bin" / "gate").unlink()
    os.chmod(root / "textfile", 0o777)
    assert install(files, dirs, check=True, **ids()) == [str(root / "textfile"), files[1].path, files[2].path]
    assert (root / "lib" / "pkg" / "_gate.py").read_text() == "X = 2  # edited by hand\n", "check mode writes nothing"
    assert install(files, dirs, check=False, **ids()) == [str(root / "textfile"), files[1].path, files[2].path]
    assert (root / "lib" / "pkg" / "_gate.py").read_text() == "X = 1\n" and (root / "bin" / "gate").exists()
    assert mode(root / "textfile") == 0o755


def test_check_mode_on_a_bare_host_names_everything_and_creates_nothing(tools):
    root, files, dirs = tools
    assert len(install(files, dirs, check=True, **ids())) == 5
    assert not (root / "lib").exists() and not (root / "bin").exists()


@pytest.mark.parametrize(("raw", "message"), [
    ([{"path": "relative/file", "content": ""}], r"files\[0\]\.path: must be an absolute path"),
    ([{"path": "/a/../b", "content": ""}], r"files\[0\]\.path: must not contain '\.\.'"),
    ([{"path": "/a", "content": "", "mode": "644x"}], r"files\[0\]\.mode: an octal file mode"),
    ([{"path": "/a", "content": "", "mode": "0999"}], r"files\[0\]\.mode: an octal file mode"),
    ([{"path": "/a", "content": None}], r"files\[0\]\.content: expected the file's text"),
    ([{"path": "/a", "content": ""}, {"path": "/a", "content": "x"}], r"files\[\]\.path: /a appear\(s\) more than once"),
])
def test_bad_files_are_refused_naming_the_field(raw, message):
    with pytest.raises(HostToolsError, match=message):
        parse_files(raw)


def test_a_file_where_a_directory_must_be_is_a_clear_error(tmp_path):
    (tmp_path / "lib").write_text("a file\n")
    with pytest.raises(HostToolsError, match=r"lib: exists and is not a directory"):
        install(parse_files([{"path": str(tmp_path / "lib" / "x.py"), "content": ""}]), [], check=False, **ids())
    with pytest.raises(HostToolsError, match=r"lib: exists and is not a directory"):
        install([], parse_dirs([{"path": str(tmp_path / "lib")}]), check=False, **ids())


def test_under():
    assert under(["/opt/lib/pkg/_a.py"], "/opt/lib/pkg") and under(["/opt/lib/pkg/_a.py"], "/opt/lib/pkg/")
    assert not under(["/opt/lib/pkg2/_a.py", "/opt/lib/pkg"], "/opt/lib/pkg")


# An interpreter that is not the one running the tests: compiling for it starts it.
OTHER_PYTHON = "/opt/other-python/bin/python3"


class Runner:
    """systemctl and the compiler as a log of argv; ``enabled`` units are enabled and active."""

    def __init__(self, enabled=()):
        self.calls: list[list[str]] = []
        self.enabled = set(enabled)

    def __call__(self, argv):
        self.calls.append(argv)
        if argv[1] in ("is-enabled", "is-active"):
            return (0 if argv[2] in self.enabled else 1), "", ""
        return 0, "", ""


def test_apply_compiles_and_starts_after_a_change_and_does_nothing_on_a_current_host(tools):
    root, _files, _dirs = tools
    lib = root / "lib" / "pkg"
    params = {"files": [{"path": str(lib / "_gate.py"), "content": "X = 1\n"}], "directories": [{"path": str(lib)}],
              "compile": [str(lib)], "python": OTHER_PYTHON, "units": ["tool.timer"]}
    run = Runner()
    first = apply(params, run, "systemctl", check=False)
    assert first == {"written": [str(lib), str(lib / "_gate.py")], "compiled": [str(lib)], "started": ["tool.timer"], "changed": True}
    assert [c for c in run.calls if c[1] not in ("is-enabled", "is-active")] == [
        [OTHER_PYTHON, "-m", "compileall", "-q", str(lib)], ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--no-reload", "tool.timer"], ["systemctl", "start", "tool.timer"]]
    (lib / "__pycache__").mkdir()
    (lib / "__pycache__" / "_gate.cpython-311.pyc").write_bytes(b"")
    run = Runner(enabled={"tool.timer"})
    assert apply(params, run, "systemctl", check=False) == {"written": [], "compiled": [], "started": [], "changed": False}
    assert [c[1] for c in run.calls] == ["is-enabled", "is-active"], "a current host: only the two questions"


def test_apply_in_check_mode_says_what_it_would_do_and_runs_nothing_that_changes(tools):
    root, _files, _dirs = tools
    params = {"files": [{"path": str(root / "bin" / "tool"), "content": "x"}], "compile": [], "units": ["tool.timer"]}
    run = Runner()
    assert apply(params, run, "systemctl", check=True)["started"] == ["tool.timer"]
    assert not (root / "bin").exists()
    assert {c[1] for c in run.calls} == {"is-enabled", "is-active"}


def test_apply_refuses_a_bad_unit_name_and_compile_without_python(tools):
    with pytest.raises(HostToolsError, match=r"units\[0\]"):
        apply({"files": [], "units": ["bad name"]}, Runner(), "systemctl", check=True)
    with pytest.raises(HostToolsError, match="python: required with compile"):
        apply({"files": [], "compile": ["/opt/lib"]}, Runner(), "systemctl", check=True)


def test_apply_names_the_command_that_failed_and_its_error(tools):
    root, _files, _dirs = tools
    lib = root / "lib" / "pkg"

    def failing(argv):
        return (1, "", "SyntaxError: bad\n") if "compileall" in argv else (1, "", "Unit tool.timer not found.\n")

    with pytest.raises(HostToolsError, match=rf"^compile {lib} with {OTHER_PYTHON}: SyntaxError: bad$"):
        apply({"files": [{"path": str(lib / "_gate.py"), "content": "X = (\n"}], "compile": [str(lib)],
               "python": OTHER_PYTHON}, failing, "systemctl", check=False)
    with pytest.raises(HostToolsError, match=r"^systemctl daemon-reload: Unit tool.timer not found.$"):
        apply({"files": [{"path": str(root / "bin" / "tool"), "content": "x"}], "units": ["tool.timer"]},
              failing, "systemctl", check=False)


def test_compile_dir_compiles_in_this_process_for_this_interpreter_and_names_what_failed(tools, capsys):
    root, _files, _dirs = tools
    lib = root / "lib" / "pkg"
    run = Runner()
    apply({"files": [{"path": str(lib / "_gate.py"), "content": "X = 1\n"}], "compile": [str(lib)],
           "python": sys.executable}, run, "systemctl", check=False)
    assert run.calls == [], "the same interpreter: no process started"
    assert [p.name.split(".")[0] for p in (lib / "__pycache__").iterdir()] == ["_gate"]
    (lib / "_bad.py").write_text("X = (\n", encoding="utf-8")
    with pytest.raises(HostToolsError, match=rf"^compile {lib} with .*: \*\*\* Error compiling .*_bad\.py"):
        compile_dir(run, sys.executable, str(lib))
    assert capsys.readouterr().out == "", "nothing printed on the module's stdout"


def test_compile_dir_takes_a_venv_link_to_this_interpreter_as_this_interpreter(tools, tmp_path, monkeypatch):
    root, _files, _dirs = tools
    lib = root / "lib" / "pkg"
    lib.mkdir(parents=True)
    (lib / "_gate.py").write_text("X = 1\n", encoding="utf-8")
    venv_python = tmp_path / "venv" / "bin" / "python3"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(sys.executable)
    run = Runner()
    compile_dir(run, str(venv_python), str(lib))
    assert run.calls == [] and [p.name.split(".")[0] for p in (lib / "__pycache__").iterdir()] == ["_gate"]

    # whatever compileall raises itself is the module's error naming the directory, as another interpreter's exit is
    def explode(*_args, **_kwargs):
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(_host_tools.compileall, "compile_dir", explode)
    with pytest.raises(HostToolsError, match=rf"^compile {lib} with .*: RecursionError: maximum recursion depth exceeded$"):
        compile_dir(run, str(venv_python), str(lib))
