"""The quota file (tinkerflow.common.quotas): the documented example reads as documented, every problem is refused
naming the file, the line and what could not be read, and no file however hostile gets anything else out of it."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinkerflow.common.quotas import MAX_FILE_BYTES, QUOTAS, Limits, QuotaFileError, load, parse
from tinkerflow.common.tenancy import key_id

EXAMPLE = """\
[default]                            # every key not named below
training_tokens_per_day = 50_000_000
sampling_tokens_per_day = 200_000_000
sampling_tokens_per_minute = 2_000_000
concurrent_runs = 16
stored_gb = 100

[keys."tml-alice"]                   # an accepted API key ...
training_tokens_per_day = 500_000_000

[keys."3f9a0c1d2e4b5a6c"]            # ... or its key id
concurrent_runs = "unlimited"
stored_gb = 0.5
"""
DEFAULT = Limits(50_000_000, 200_000_000, 2_000_000, 16, 100)


def test_the_documented_example_reads_as_documented():
    file = parse(EXAMPLE, "q.toml")
    assert file.limits() == DEFAULT
    alice = key_id(b"server-key", "tml-alice")
    by_id = file.by_key_id(lambda key: key_id(b"server-key", key), accepted=("tml-alice", "tml-bob"))
    assert by_id == {
        alice: Limits(500_000_000, 200_000_000, 2_000_000, 16, 100),  # the rest from [default]
        "3f9a0c1d2e4b5a6c": Limits(50_000_000, 200_000_000, 2_000_000, None, 0.5),  # "unlimited" lifts the default's
    }
    assert file.lines == {"tml-alice": 8, "3f9a0c1d2e4b5a6c": 11}


def test_an_empty_file_limits_nothing():
    assert parse("# no quotas yet\n", "q.toml").limits() == Limits()


@pytest.mark.parametrize(
    "text, line, what",
    [
        ("[default]\nconcurrent_runs = -3\n", 2, "default.concurrent_runs: expected a whole number .* got -3"),
        ("[default]\n\nconcurrent_runs = 1.5\n", 3, "default.concurrent_runs: .*whole number.* got 1.5"),
        ("[default]\nstored_gb = nan\n", 2, "default.stored_gb: expected a number .* got nan"),
        ("[default]\nstored_gb = inf\n", 2, "got inf"),
        ("[default]\ntraining_tokens_per_day = true\n", 2, "got true"),
        ("[default]\ntraining_tokens_per_day = 'lots'\n", 2, 'got the string "lots"'),
        ("[default]\ntraining_tokens_per_day = [1]\n", 2, "got an array"),
        ("[default]\ntraining_tokens_per_day = 1979-05-27\n", 2, "got date"),
        ("[default]\ntraining_tokens_per_day = 9_223_372_036_854_775_808\n", 2, "2\\*\\*63-1"),
        ("[default]\ntokens_per_day = 5\n", 2, "default.tokens_per_day: not a quota; the quotas are training_"),
        ("\n[defaults]\nconcurrent_runs = 1\n", 2, "defaults: not a quota file section"),
        ("default = 3\n", 1, "default: must be a table of limits"),
        ('[keys]\n"tml-alice" = 3\n', 2, 'keys."tml-alic…": must be a table of limits'),
        ("keys = [1, 2]\n", 1, "keys: must hold one table per key"),
        ('[keys."tml-alice-secret"]\nconcurrent_runs = -1\n', 2, 'keys."tml-alic…".concurrent_runs'),
        ("[default]\nconcurrent_runs = \n", 2, "not valid TOML"),
        ("[default\n", 1, "not valid TOML"),
        ("[default]\nstored_gb = 1\nstored_gb = 2\n", 3, "not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_the_line_and_what(text, line, what):
    with pytest.raises(QuotaFileError) as e:
        parse(text, "/etc/q.toml")
    assert str(e.value).startswith(f"quota file /etc/q.toml, line {line}: "), str(e.value)
    assert re.search(what, str(e.value)), str(e.value)
    assert e.value.line == line


def test_a_secret_key_never_shows_whole_in_a_message():
    with pytest.raises(QuotaFileError) as e:
        parse('[keys."tml-0123456789abcdef"]\nconcurrent_runs = -1\n', "q.toml")
    assert "0123456789abcdef" not in str(e.value)


def test_section_names_resolve_to_accepted_keys_or_key_ids():
    file = parse('[keys."tml-car"]\nconcurrent_runs = 1\n', "q.toml")
    with pytest.raises(QuotaFileError, match=r'line 1: \[keys."tml-car"\] names neither an API key'):
        file.by_key_id(lambda key: "x" * 16, accepted=("tml-alice",))
    same = parse('[keys."tml-alice"]\n[keys."0123456789abcdef"]\n', "q.toml")
    with pytest.raises(QuotaFileError, match=r'line 2: \[keys."0123456789abcdef"\] names the same key as'):
        same.by_key_id(lambda key: "0123456789abcdef", accepted=("tml-alice",))


def test_load_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(QuotaFileError, match=r"quota file .*missing.toml: cannot read it"):
        load(str(tmp_path / "missing.toml"))
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"[default]\n# caf\xe9\n")
    with pytest.raises(QuotaFileError, match=r"line 2: not UTF-8 text"):
        load(str(latin))
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(QuotaFileError, match="more than a quota file's"):
        load(str(big))
    good = tmp_path / "good.toml"
    good.write_text(EXAMPLE)
    assert load(str(good)).limits() == DEFAULT


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300) | st.lists(st.sampled_from(list(EXAMPLE.splitlines())), max_size=12).map("\n".join))
def test_a_hostile_file_is_read_or_refused_with_file_and_line_never_anything_else(text):
    try:
        file = parse(text, "h.toml")
    except QuotaFileError as e:
        assert str(e).startswith("quota file h.toml")
        assert e.line is None or 1 <= e.line <= text.count("\n") + 1
        return
    for limits in [file.limits(), *(file.limits(s) for s in file.keys.values())]:
        for name in QUOTAS:
            value = getattr(limits, name)
            assert value is None or (not isinstance(value, bool) and value >= 0)


_value = st.one_of(
    st.integers(-5, 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.sampled_from(["unlimited", "Unlimited", "", "5"]),
)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            "nan" if value != value else ("inf" if value > 0 else "-inf") if abs(value) == float("inf") else repr(value)
        )
    return json.dumps(value) if isinstance(value, str) else str(value)


def _valid(name: str, value) -> bool:
    if value == "unlimited":
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return name == "stored_gb" and value == value and 0 <= value <= 2**63 - 1
    return isinstance(value, int) and 0 <= value <= 2**63 - 1


@settings(max_examples=200, deadline=None)
@given(
    default=st.dictionaries(st.sampled_from(QUOTAS), _value, max_size=5),
    key=st.dictionaries(st.sampled_from(QUOTAS), _value, max_size=5),
)
def test_values_are_accepted_exactly_when_valid_and_read_back_as_written(default, key):
    text = "[default]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in default.items())
    text += '[keys."0123456789abcdef"]\n' + "".join(f"{k} = {_toml(v)}\n" for k, v in key.items())
    valid = all(_valid(k, v) for k, v in [*default.items(), *key.items()])
    try:
        file = parse(text, "g.toml")
    except QuotaFileError as e:
        assert not valid, str(e)
        bad = next(i for i, (k, v) in enumerate([*default.items(), *key.items()]) if not _valid(k, v))
        assert e.line == bad + 2 + (bad >= len(default)), str(e)  # the line of the first bad value
        return
    assert valid
    merged = {**default, **key}
    got = file.by_key_id(str, ())["0123456789abcdef"]
    assert {k: getattr(got, k) for k in merged} == {k: None if v == "unlimited" else v for k, v in merged.items()}


@pytest.mark.parametrize("command", ["api", "up"])
def test_the_cli_refuses_a_bad_quota_file_before_anything_starts(tmp_path, capsys, command):
    from tinkerflow.cli.main import main

    bad = tmp_path / "q.toml"
    bad.write_text("[default]\nconcurrent_runs = -1\n")
    with pytest.raises(SystemExit) as e:
        main([command, "--state-dir", str(tmp_path / "state"), "--quota-file", str(bad)])
    assert e.value.code == 2
    assert f"quota file {bad}, line 2: default.concurrent_runs" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # nothing started
