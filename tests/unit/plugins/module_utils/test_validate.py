# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The shared input rules (_validate): each accepts its domain and refuses the rest, naming the field."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings, strategies as st

from ansible_collections.gpufleet.vllm.plugins.module_utils import _validate as v


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), ("yes", True), ("no", False), ("y", True), ("n", False),
    ("TRUE", True), ("off", False), (1, True), (0, False), (" on ", True),
])
def test_boolean_words(value, expected):
    assert v.boolean(value, "flag") is expected


@pytest.mark.parametrize("value, kw, expected", [
    (7, {}, 7), (None, {}, None), (3.0, {}, 3), (2.9, {"floats": "truncate"}, 2), (-2.9, {"floats": "truncate"}, -2),
    (" 42 ", {"strings": True}, 42), (0, {"low": 0}, 0), ("x", {"quiet": True}, None), (1.0, {"floats": "refuse", "quiet": True}, None),
    (True, {"quiet": True}, None), (-1, {"low": 0, "quiet": True}, None),
])
def test_int_field_reads_a_records_integer(value, kw, expected):
    assert v.int_field(value, "doc.n", **kw) == expected


class _Mine(ValueError):
    pass


@pytest.mark.parametrize("value, kw, message", [
    (None, {"required": True}, "doc.n is missing"),
    (True, {}, "doc.n: expected an integer, got True"),
    (2.5, {}, "doc.n: expected an integer, got 2.5"),
    (math.inf, {"floats": "truncate"}, "doc.n: expected an integer, got inf"),
    (math.nan, {"floats": "truncate", "what": "a byte count"}, "doc.n: expected a byte count, got nan"),
    (3.0, {"floats": "refuse"}, "doc.n: expected an integer, got 3.0"),
    ("42", {}, "doc.n: expected an integer, got '42'"),
    ("-4", {"strings": True}, "doc.n: expected an integer, got '-4'"),
    ([1], {}, "doc.n: expected an integer, got [1]"),
    (0, {"low": 1}, "doc.n: expected at least 1, got 0"),
    ("0", {"low": 1, "strings": True}, "doc.n: expected at least 1, got 0"),
    ("x", {"message": "{field} must be an integer, got {value!r}"}, "doc.n must be an integer, got 'x'"),
])
def test_int_field_refuses_naming_the_field_with_the_callers_error(value, kw, message):
    with pytest.raises(_Mine) as info:
        v.int_field(value, "doc.n", error=_Mine, **kw)
    assert str(info.value) == message


@pytest.mark.parametrize("value", ["maybe", "", "2", 2, -1, None, [], {}, "yess", 0.5, "y\n x"])
def test_boolean_refuses_other_words(value):
    with pytest.raises(v.ValidationError, match=r"^flag: expected a boolean"):
        v.boolean(value, "flag")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf", "-inf", "1e400", True, None, "x", [], "",
                                   "9" * 100])
def test_number_refuses_non_finite_and_non_numbers(value):
    with pytest.raises(v.ValidationError, match=r"^headroom: "):
        v.number(value, "headroom", low=0)


def test_number_bounds():
    assert v.number("0.5", "u", low=0, high=1, low_open=True) == 0.5
    with pytest.raises(v.ValidationError, match=r"u: must be > 0 and <= 1, got 0"):
        v.number(0, "u", low=0, high=1, low_open=True)
    with pytest.raises(v.ValidationError, match=r"u: must be > 0 and <= 1, got 1.5"):
        v.number(1.5, "u", low=0, high=1, low_open=True)


@pytest.mark.parametrize("value", [0, -1, 65536, 70000, True, "80\n", 1.5, "abc", None, "8 0", "0x50", 10**30])
def test_port_refuses(value):
    with pytest.raises(v.ValidationError, match=r"^port: "):
        v.port(value)


@pytest.mark.parametrize("value, expected", [(1, 1), (65535, 65535), ("8000", 8000), (8000.0, 8000)])
def test_port_accepts(value, expected):
    assert v.port(value) == expected


@pytest.mark.parametrize("value", ["", ".", "..", "-x", ".x", "a/b", "a b", "a\n", "vllm\u00e9", "\u0430bc", "x" * 65, 3, None])
def test_instance_name_refuses(value):
    with pytest.raises(v.ValidationError, match=r"^instance name: "):
        v.instance_name(value)


@pytest.mark.parametrize("value", ["a", "vllm", "main-1", "a.b_c", "A9"])
def test_instance_name_accepts(value):
    assert v.instance_name(value) == value


def test_class_name_trailing_newline_is_refused():
    # re.match('^...$') lets one trailing newline through; fullmatch does not
    with pytest.raises(v.ValidationError, match="host_class"):
        v.class_name("h200\n")


@pytest.mark.parametrize("value", ["1A", "A-B", "A B", "", "A\n", "\u00c9T\u00c9", 5])
def test_env_name_refuses(value):
    with pytest.raises(v.ValidationError, match=r"^env name: "):
        v.env_name(value, "env name")


@pytest.mark.parametrize("value", ["relative", "/a/../b", "/a b", "/a\nb", "//a", "/a/./b", "", None, ["/a"]])
def test_abs_path_refuses(value):
    with pytest.raises(v.ValidationError, match=r"^home: "):
        v.abs_path(value, "home")


@pytest.mark.parametrize("name, secret", [
    ("api_key", True), ("--api-key", True), ("apikey", True), ("api-key=x", True), ("hf_token", True),
    ("ssl_keyfile_password", True), ("db_credentials", True), ("client_secret", True), ("API_KEY", True),
    ("max_num_batched_tokens", False), ("tokenizer", False), ("ssl_keyfile", False),
    ("return_tokens_as_token_ids", False), ("long_prefill_token_threshold", False), ("max_model_len", False),
])
def test_one_rule_for_secret_options(name, secret):
    assert v.is_secret_option(name) is secret


def test_systemd_word_quoting():
    assert v.systemd_word("plain/path-1.0", "w") == "plain/path-1.0"
    assert v.systemd_word("a b", "w") == '"a b"'
    assert v.systemd_word('q"\\', "w") == '"q\\"\\\\"'
    assert v.systemd_word("$HOME 50%", "w") == '"$$HOME 50%%"'
    assert v.systemd_word("$HOME 50%", "w", exec_line=False) == '"$HOME 50%%"'
    assert v.systemd_word("", "w") == '""'


@pytest.mark.parametrize("char", ["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\u2028"])
def test_control_characters_are_refused_everywhere(char):
    for call in (lambda: v.systemd_word(f"a{char}b", "f"), lambda: v.text(f"a{char}b", "f"),
                 lambda: v.systemd_value(f"a{char}b", "f"), lambda: v.systemd_environment("N", f"a{char}", "f"),
                 lambda: v.environment_file({"N": f"a{char}"}, "f")):
        with pytest.raises(v.ValidationError, match=r"^f"):
            call()


def test_environment_file_secret_errors_never_show_the_value():
    with pytest.raises(v.ValidationError) as err:
        v.environment_file({"HF_TOKEN": "hf_secret\nX=1"}, "secret_env")
    assert "hf_secret" not in str(err.value) and "HF_TOKEN" in str(err.value)


def test_systemd_value_refuses_a_trailing_backslash():
    with pytest.raises(v.ValidationError, match="backslash"):
        v.systemd_value("vllm\\", "vllm_service_user")


def _unquote_env_line(line: str) -> tuple[str, str]:
    """systemd's env-file rule for a double-quoted value: backslash + one of \\ " $ ` is that character."""
    match = re.fullmatch(r'([A-Za-z_][A-Za-z0-9_]*)="(.*)"', line)
    assert match, line
    return match.group(1), re.sub(r'\\([\\"`$])', r"\1", match.group(2))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True),
                       st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=30),
                       max_size=5))
def test_environment_file_round_trips(env):
    text = v.environment_file(env)
    assert v.check_environment_file(text) == text
    parsed = dict(_unquote_env_line(line) for line in text.splitlines())
    assert parsed == env


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_text_either_refuses_naming_the_field_or_returns_the_same_text(value):
    try:
        assert v.text(value, "f", allow_empty=True) == value
    except v.ValidationError as exc:
        assert str(exc).startswith("f: ")
