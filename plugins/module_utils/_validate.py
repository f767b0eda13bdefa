# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The input rules every entry point applies, in one place.

Plain Python, no Ansible import. Each check returns the clean value or raises
:class:`ValidationError` (a ``ValueError``) whose message starts with the field and
says what is allowed: ``"port: must be an integer in 1..65535, got 70000"``.
The entry points (modules, action plugins, filters, the roles' validate tasks and the
programs on the hosts) call these functions at their edge and turn the error into their
own failure type, so the same value is refused the same way everywhere.

Also here, because they decide what a value may be:

* :func:`is_secret_option`: the one rule for ``vllm serve`` options that carry a secret;
* :func:`systemd_word`, :func:`systemd_exec_start`, :func:`systemd_environment` and
  :func:`environment_file`: quoting for systemd unit files and ``EnvironmentFile=``
  files, so that systemd reads exactly the words and values it was given.
"""

from __future__ import annotations

import math
import os
import re
import typing as t

__all__ = [
    "ValidationError",
    "abs_path",
    "account_name",
    "boolean",
    "check_environment_file",
    "class_name",
    "collect",
    "env_name",
    "environment_file",
    "instance_name",
    "int_field",
    "integer",
    "is_secret_option",
    "no_control",
    "number",
    "port",
    "systemd_environment",
    "systemd_exec_start",
    "systemd_unit_name",
    "systemd_value",
    "systemd_word",
    "text",
    "unique",
]


class ValidationError(ValueError):
    """A value outside its domain; the message names the field and the allowed values."""


# Ansible's own boolean words (ansible.module_utils.parsing.convert_bool), nothing else:
# a word outside both lists is an error, never a quiet false.
_TRUE = frozenset(("y", "yes", "on", "1", "true", "t", "1.0"))
_FALSE = frozenset(("n", "no", "off", "0", "false", "f", "0.0"))

# C0 controls, DEL, C1 controls and the Unicode line and paragraph separators: each can
# end a line for one parser or another (systemd, journald, YAML, a terminal).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Longest number text accepted: enough for any int64 or float literal, never a
# megabyte of digits that int() or Decimal would grind through.
_NUMBER_TEXT_MAX = 64

_INSTANCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_CLASS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# A systemd unit name (systemd.unit(5)): allowed characters, an optional template instance,
# one of the unit type suffixes.
_UNIT_RE = re.compile(r"[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]*)?"
                      r"\.(service|socket|target|device|mount|automount|swap|path|timer|slice|scope)")
# useradd's default NAME_REGEX (Debian), at most 32 characters.
_ACCOUNT_RE = re.compile(r"[a-z_][a-z0-9_-]{0,30}\$?")


def _kind(value: object) -> str:
    return type(value).__name__


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def no_control(value: str, field: str) -> str:
    """Refuse control characters (newline, carriage return, tab, NUL, ...) and unencodable text."""
    match = _CONTROL.search(value)
    if match:
        raise ValidationError(
            f"{field}: must not contain control characters (found {match.group()!r} at position {match.start()})"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{field}: is not valid Unicode text (a lone surrogate)") from None
    return value


def collect(problems: list[str], check: t.Callable[..., t.Any], *args: t.Any, **kwargs: t.Any) -> t.Any:
    """``check(*args, **kwargs)``, its message appended to ``problems`` instead of raised (then None): for a
    caller that names every problem of an input at once."""
    try:
        return check(*args, **kwargs)
    except ValidationError as exc:
        problems.append(str(exc))
        return None


def text(value: object, field: str, *, allow_empty: bool = False, max_len: int = 4096) -> str:
    """A string without control characters (numbers are taken as their text)."""
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list, tuple, set, bytes)):
        raise ValidationError(f"{field}: expected a string, got {_kind(value)} {_shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValidationError(f"{field}: expected a string, got {value!r}")
    value = str.__str__(str(value))
    if not value and not allow_empty:
        raise ValidationError(f"{field}: must not be empty")
    if len(value) > max_len:
        raise ValidationError(f"{field}: longer than {max_len} characters")
    return no_control(value, field)


def boolean(value: object, field: str) -> bool:
    """``true``/``false`` and Ansible's boolean words (``yes``, ``no``, ``y``, ``n``, ``1``, ``0``, ...)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, float) and value in (0.0, 1.0):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise ValidationError(f"{field}: expected a boolean (true/false, yes/no), got {_shown(value)}")


def _range_text(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(("> " if low_open else ">= ") + _num_text(low))
    if high is not None:
        parts.append(("< " if high_open else "<= ") + _num_text(high))
    return " and ".join(parts) if parts else "finite"


def _num_text(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else repr(n)


def number(value: object, field: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    """A finite number (int, float or its text) within the bounds; never a boolean, ``inf`` or ``nan``."""
    if isinstance(value, bool) or value is None:
        raise ValidationError(f"{field}: expected a number, got {_shown(value)}")
    if isinstance(value, str):
        word = value.strip(" ")
        if not word or len(word) > _NUMBER_TEXT_MAX or _CONTROL.search(word):
            raise ValidationError(f"{field}: expected a number, got {_shown(value)}")
        try:
            result = float(word)
        except ValueError:
            raise ValidationError(f"{field}: expected a number, got {_shown(value)}") from None
    elif isinstance(value, (int, float)):
        try:
            result = float(value)
        except OverflowError:
            raise ValidationError(f"{field}: {_shown(value)} is too large") from None
    else:
        raise ValidationError(f"{field}: expected a number, got {_kind(value)}")
    if not math.isfinite(result):
        raise ValidationError(f"{field}: must be a finite number, got {_shown(value)}")
    bad_low = low is not None and (result <= low if low_open else result < low)
    bad_high = high is not None and (result >= high if high_open else result > high)
    if bad_low or bad_high:
        raise ValidationError(f"{field}: must be {_range_text(low, high, low_open, high_open)}, got {_shown(value)}")
    return result


def integer(value: object, field: str, *, low: int | None = None, high: int | None = None) -> int:
    """A whole number (int, whole float or decimal digits) within ``low..high``."""
    if isinstance(value, bool) or value is None:
        raise ValidationError(f"{field}: expected an integer, got {_shown(value)}")
    result: int
    if isinstance(value, int):
        result = int(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValidationError(f"{field}: expected an integer, got {value!r}")
        result = int(value)
    elif isinstance(value, str):
        word = value.strip(" ")
        if not re.fullmatch(rf"[+-]?[0-9]{{1,{_NUMBER_TEXT_MAX}}}", word):
            raise ValidationError(f"{field}: expected an integer, got {_shown(value)}")
        result = int(word)
    else:
        raise ValidationError(f"{field}: expected an integer, got {_kind(value)}")
    if (low is not None and result < low) or (high is not None and result > high):
        span = f"{low}..{high}" if low is not None and high is not None else (f">= {low}" if low is not None else f"<= {high}")
        raise ValidationError(f"{field}: must be an integer in {span}, got {_shown(value)}")
    return result


def int_field(value: object, field: str, *, required: bool = False, low: int | None = None, strings: bool = False,
              floats: str = "whole", what: str = "an integer", error: type[Exception] = ValidationError,
              quiet: bool = False, message: str = "{field}: expected {what}, got {value!r}") -> int | None:
    """An integer field of a record (a plan file, a launch record, a report, a model's config): the one
    rule the readers of stored records share; :func:`integer` is the one for what a user gives.

    ``None`` stays None (``required``: ``"FIELD is missing"``); a bool is never an integer.
    ``floats``: ``"whole"`` reads 3.0 as 3 and refuses 2.5, ``"truncate"`` reads any finite float
    as ``int(value)``, ``"refuse"`` refuses them all. ``strings``: decimal digits (blanks around
    them allowed) read as their number. ``low``: the smallest value allowed
    (``"FIELD: expected at least LOW, got VALUE"``). Anything else is ``message``
    (``"FIELD: expected WHAT, got VALUE"``; its fields ``field``, ``what``, ``value``), raised as
    ``error`` (the caller's exception class), or with ``quiet`` read as absent (None).
    """
    if value is None:
        if required and not quiet:
            raise error(f"{field} is missing")
        return None
    result: int | None = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        result = value
    elif isinstance(value, float):
        if (floats == "truncate" and math.isfinite(value)) or (floats == "whole" and value.is_integer()):
            result = int(value)
    elif strings and isinstance(value, str) and value.strip().isdecimal():
        result = int(value.strip())
    if result is None:
        if quiet:
            return None
        raise error(message.format(field=field, what=what, value=value))
    if low is not None and result < low:
        if quiet:
            return None
        raise error(f"{field}: expected at least {low}, got {result}")
    return result


def port(value: object, field: str = "port") -> int:
    """A TCP port, 1..65535."""
    return integer(value, field, low=1, high=65535)


def _named(value: object, field: str, pattern: t.Pattern[str], what: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{field}: expected a name ({what}), got {_kind(value)} {_shown(value)}")
    if not pattern.fullmatch(value):
        raise ValidationError(f"{field}: {_shown(value)} is not a valid name: use {what}")
    return str.__str__(value)


def instance_name(value: object, field: str = "instance name") -> str:
    """An instance (unit ``vllm-NAME.service``) name: ASCII letters, digits, ``_ . -``, 1-64, not starting with ``.``/``-``."""
    return _named(value, field, _INSTANCE_RE, "1-64 ASCII letters, digits, '_', '.' or '-', starting with a letter or digit")


def class_name(value: object, field: str = "host_class") -> str:
    """A host class name (a directory of the profile store)."""
    return _named(value, field, _CLASS_RE, "1-128 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit")


def env_name(value: object, field: str = "environment variable name") -> str:
    """An environment variable name: ``[A-Za-z_][A-Za-z0-9_]*``."""
    return _named(value, field, _ENV_RE, "ASCII letters, digits and '_', not starting with a digit")


def systemd_unit_name(value: object, field: str) -> str:
    """A systemd unit name such as ``nvidia-persistenced.service``: systemd's characters, a type suffix, at most 255."""
    name = _named(value, field, _UNIT_RE, "a systemd unit name with its type, e.g. nvidia-persistenced.service")
    if len(name) > 255:
        raise ValidationError(f"{field}: a unit name has at most 255 characters, got {len(name)}")
    return name


def account_name(value: object, field: str) -> str:
    """A Unix user or group name (useradd's rule)."""
    return _named(value, field, _ACCOUNT_RE, "lower-case ASCII letters, digits, '_' and '-', starting with a letter or '_', at most 32")


def service_account_name(value: object, field: str) -> str:
    """:func:`account_name` of the unprivileged user vLLM runs as: never ``root``."""
    name = account_name(value, field)
    if name == "root":
        raise ValidationError(f"{field}: must not be root; vLLM runs as an unprivileged system user (for example vllm)")
    return name


def abs_path(value: object, field: str, *, spaces: bool = False) -> str:
    """An absolute, normalised path without control characters (and without whitespace unless ``spaces``)."""
    path = text(value, field)
    if not path.startswith("/"):
        raise ValidationError(f"{field}: must be an absolute path, got {_shown(path)}")
    if not spaces and re.search(r"\s", path):
        raise ValidationError(f"{field}: must not contain whitespace, got {_shown(path)}")
    if any(part == ".." for part in path.split("/")):
        raise ValidationError(f"{field}: must not contain '..', got {_shown(path)}")
    if "//" in path or (os.path.normpath(path) != path.rstrip("/") and path != "/"):
        raise ValidationError(f"{field}: must be a normalised path (no '//' or '/./'), got {_shown(path)}")
    return path


# Directories of the operating system and its package manager: a report or a profile store
# written there mixes the run's files with the system's (and a wrong variable can overwrite them).
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
               "/sys", "/usr", "/var/lib/dpkg", "/var/lib/rpm", "/var/lib/apt", "/var/cache/apt", "/var/log/journal")


def outside_system_dirs(value: object, field: str, *, allow: bool = False) -> str:
    """An absolute directory that is not one of the system's (:data:`SYSTEM_DIRS`) nor below one, unless ``allow``."""
    path = os.path.normpath(abs_path(value, field))
    if allow:
        return path
    for system in SYSTEM_DIRS:
        if path == system or (system != "/" and path.startswith(system + "/")):
            raise ValidationError(f"{field}: {value} is {'' if path == system else 'under '}the system directory {system}; "
                                  "choose a directory of its own (set gpufleet_allow_system_paths: true to allow it anyway)")
    return path


def unique(values: t.Iterable[t.Any], field: str) -> None:
    """Refuse duplicates, naming them."""
    seen: set[t.Any] = set()
    twice: list[str] = []
    for value in values:
        if value in seen and str(value) not in twice:
            twice.append(str(value))
        seen.add(value)
    if twice:
        raise ValidationError(f"{field}: {', '.join(twice)} appear(s) more than once")


# ----------------------------------------------------------------- secret options

# The last word of an option name that makes it a secret. Only the last word counts:
# max_num_batched_tokens, tokenizer or return_tokens_as_token_ids are not secrets.
_SECRET_LAST_WORDS = frozenset((
    "key", "keys", "apikey", "apikeys", "token", "secret", "secrets", "password", "passwd",
    "passphrase", "credential", "credentials", "auth",
))


def _option_words(name: str) -> list[str]:
    base = str(name).strip().lstrip("-").split("=", 1)[0].lower().replace("_", "-")
    return [w for w in base.split("-") if w]


def is_secret_option(name: object) -> bool:
    """``api_key``, ``--api-key``, ``apikey``, ``hf_token``, ``ssl_keyfile_password``: this option carries a secret.

    The one rule for what a secret option is: the canary's redaction, the serve-args
    check of the roles and the ``vllm_secret_options`` filter all use it.
    """
    words = _option_words(str(name))
    return bool(words) and words[-1] in _SECRET_LAST_WORDS


# --------------------------------------------------------------------- systemd

# Words systemd takes verbatim without quotes (no specifier, variable, quote, escape or space).
_BARE_WORD = re.compile(r"[A-Za-z0-9_./:=@+,-]+")


def systemd_word(value: object, field: str, *, exec_line: bool = True) -> str:
    """One word for an ``ExecStart=`` line (``exec_line``) or an ``Environment=`` assignment.

    systemd reads the result as exactly ``value``: ``%`` becomes ``%%`` (specifiers),
    ``$`` becomes ``$$`` on command lines (variable expansion), and anything but a plain
    word is put in double quotes with ``\\`` and ``"`` escaped. Control characters
    (a newline would start a new directive) are refused, naming ``field``.
    """
    word = text(value, field, allow_empty=True)
    word = word.replace("%", "%%")
    if _BARE_WORD.fullmatch(word):
        return word
    word = word.replace("\\", "\\\\").replace('"', '\\"')
    if exec_line:
        word = word.replace("$", "$$")
    return f'"{word}"'


def systemd_value(value: object, field: str) -> str:
    """A value for a unit line that is not a command line (``Description=``, ``User=``, a comment).

    Control characters are refused (a newline would start a new directive), and so is
    a trailing backslash (systemd would join the next line to this one); ``%`` becomes
    ``%%`` so that systemd does not expand it as a specifier.
    """
    line = text(value, field, allow_empty=True)
    if line.endswith("\\"):
        raise ValidationError(f"{field}: must not end with a backslash (systemd would join the next line)")
    return line.replace("%", "%%")


def systemd_exec_start(executable: object, words: t.Sequence[t.Any], field: str = "ExecStart") -> str:
    """The value of ``ExecStart=``: the executable, then each word quoted; options start a continuation line.

    A word may be given as ``(field, word)`` so that an error names where it came from.
    """
    exe = abs_path(executable, f"{field} executable")
    if not isinstance(words, (list, tuple)):
        raise ValidationError(f"{field}: expected a list of words, got {_kind(words)}")
    out = [systemd_word(exe, f"{field} executable")]
    for i, word in enumerate(words):
        where = f"{field}[{i}]"
        if isinstance(word, (list, tuple)) and len(word) == 2 and isinstance(word[0], str):
            where, word = word  # (the variable it came from, the word): errors name the variable
        if isinstance(word, (bool, dict, list, tuple)) or word is None:
            raise ValidationError(f"{where}: expected a string or a number, got {_kind(word)}")
        if isinstance(word, float):
            number(word, where)
        quoted = systemd_word(word, where)
        if isinstance(word, str) and word.startswith("--"):
            out.append(" \\\n    " + quoted)
        else:
            out.append(" " + quoted)
    return "".join(out)


def systemd_environment(name: object, value: object, field: str = "env") -> str:
    """The value of one ``Environment=`` line: ``NAME=value``, quoted as one assignment."""
    key = env_name(name, f"{field} name")
    return systemd_word(f"{key}={text(value, f'{field}.{key}', allow_empty=True)}", f"{field}.{key}", exec_line=False)


def environment_file(env: t.Mapping[t.Any, t.Any], field: str = "secret_env") -> str:
    """``EnvironmentFile=`` lines: ``NAME="value"`` with systemd's double-quote escapes (``\\ " $ ```).

    systemd's env-file parser takes a backslash before one of those four characters
    as the character itself inside double quotes, so the process sees ``value`` exactly.
    """
    if not isinstance(env, t.Mapping):
        raise ValidationError(f"{field}: expected a mapping NAME -> value, got {_kind(env)}")
    lines = []
    for name in sorted(env, key=str):
        key = env_name(name, f"{field} name")
        try:
            value = text(env[name], f"{field}.{key}", allow_empty=True)
        except ValidationError:
            raise ValidationError(f"{field}.{key}: must be a string without control characters (value not shown)") from None
        escaped = re.sub(r'([\\"`$])', r"\\\1", value)
        lines.append(f'{key}="{escaped}"\n')
    return "".join(lines)


_ENV_LINE = re.compile(r'([A-Za-z_][A-Za-z0-9_]{0,127})="((?:[^"\\`$\x00-\x1f\x7f]|\\["\\`$])*)"')


def check_environment_file(content: object, field: str = "env file") -> str:
    """Refuse an environment file that is not in the form :func:`environment_file` writes.

    The host-side check before the file is written: comments, blank lines and
    ``NAME="escaped value"`` lines only, so systemd cannot read a different set of
    variables than the one rendered. Messages name the line, never its value.
    """
    if not isinstance(content, str):
        raise ValidationError(f"{field}: expected text, got {_kind(content)}")
    for number_, line in enumerate(content.split("\n"), 1):
        if not line or line.startswith("#"):
            if _CONTROL.search(line):
                raise ValidationError(f"{field}: line {number_} has a control character")
            continue
        if not _ENV_LINE.fullmatch(line):
            name = line.split("=", 1)[0] if "=" in line and _ENV_RE.fullmatch(line.split("=", 1)[0]) else "?"
            raise ValidationError(f"{field}: line {number_} (variable {name}) is not NAME=\"value\" with \\ \" $ ` escaped")
    return content
