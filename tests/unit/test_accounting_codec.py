"""AdminComment codec: round trips through Slurm's lowercasing, cap, versions, garbage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_colloc.accounting import (
    PREFIX,
    Attempt,
    Estimate,
    JobRecord,
    MetricsSummary,
    OomInfo,
    RecordDecodeError,
    RecordTooLargeError,
    Requeue,
    UnsupportedVersionError,
    append_attempt,
    decode,
    encode,
    try_decode,
)
from slurm_colloc.oom.patterns import CAUSES

FULL = Attempt(
    attempt=0,
    estimate=Estimate(8000, "layer-aware", 1333, "sha256:ab12"),
    shards=8,
    shard_mib=1024,
    limit_mib=8192,
    gpu=2,
    node="node01",
    co_tenants=("101", "102"),
    oom=OomInfo("gpu-oom", "torch-cuda-oom", "/var/lib/colloc/evidence/100/0.err"),
    requeue=Requeue(True, "gpu-oom on a shared gpu", "gres:shard:40", 40960),
    metrics=MetricsSummary(8100, 6000.5, 0.43, 12345.6, 3600, True),
    start=1_700_000_000,
    end=1_700_003_600,
)

text = st.text(max_size=30)
opt_int = st.one_of(st.none(), st.integers(0, 2**40))
opt_float = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=64))
series = st.lists(  # valid series (time never goes back, values in bounds) round-trip
    st.tuples(st.integers(0, 10**5), st.integers(0, 10**6),
              st.one_of(st.none(), st.integers(0, 100))),
    max_size=60,
).map(lambda pts: tuple(
    (sum(p[0] for p in pts[: i + 1]), m, u) for i, (_, m, u) in enumerate(pts)))
attempts = st.builds(
    Attempt,
    attempt=st.integers(0, 50),
    estimate=st.one_of(
        st.none(),
        st.builds(Estimate, st.integers(0, 10**6), text,
                  st.one_of(st.none(), st.integers(0, 10**6)), st.one_of(st.none(), text),
                  opt_int, opt_int, st.one_of(st.none(), text), st.one_of(st.none(), text)),
    ),
    shards=opt_int,
    shard_mib=opt_int,
    limit_mib=opt_int,
    gpu=opt_int,
    node=st.one_of(st.none(), text),
    co_tenants=st.lists(text, max_size=5).map(tuple),
    oom=st.one_of(
        st.none(),
        st.builds(
            OomInfo, st.sampled_from(CAUSES), st.one_of(st.none(), text),
            st.one_of(st.none(), text), st.booleans(),
        ),
    ),
    requeue=st.one_of(
        st.none(), st.builds(Requeue, st.booleans(), text, st.one_of(st.none(), text), opt_int)
    ),
    metrics=st.one_of(
        st.none(),
        st.builds(
            MetricsSummary,
            opt_int,
            opt_float,
            opt_float,
            opt_float,
            st.integers(0, 10**6),
            st.booleans(),
            series,
        ),
    ),
    start=opt_int,
    end=opt_int,
)


def norm(a: Attempt) -> Attempt:
    """Floats come back as floats: compare after the same conversion."""
    return a


@settings(max_examples=150, deadline=None)
@given(atts=st.lists(attempts, max_size=4, unique_by=lambda a: a.attempt))
def test_roundtrip_through_case_changes(atts) -> None:
    rec = JobRecord(attempts=tuple(sorted(atts, key=lambda a: a.attempt)))
    enc = encode(rec, max_bytes=1 << 20)
    assert enc.startswith(PREFIX) and enc == enc.lower() and enc.isascii()
    for variant in (enc, enc.lower(), enc.upper()):
        assert decode(variant) == rec


@settings(max_examples=100, deadline=None)
@given(
    atts=st.lists(attempts, min_size=1, max_size=12, unique_by=lambda a: a.attempt),
    cap=st.integers(200, 3000),
)
def test_cap_never_exceeded(atts, cap) -> None:
    s: str | None = None
    for a in atts:
        s = append_attempt(s, a, max_bytes=cap)
        assert len(s.encode()) <= cap
        rec = decode(s.upper())
        assert rec.attempts  # the latest attempt always survives in some form
        assert rec.attempts[-1].attempt == max(x.attempt for x in atts[: atts.index(a) + 1])


def test_full_attempt_roundtrip_and_size() -> None:
    enc = append_attempt(None, FULL)
    assert len(enc) < 600
    assert decode(enc).attempts == (FULL,)


def test_append_replaces_same_attempt_and_sorts() -> None:
    s = append_attempt(None, Attempt(attempt=1, gpu=1))
    s = append_attempt(s.lower(), Attempt(attempt=0, gpu=0))
    s = append_attempt(s, Attempt(attempt=1, gpu=3))
    assert [(a.attempt, a.gpu) for a in decode(s).attempts] == [(0, 0), (1, 3)]


def test_truncation_marks_and_drops_least_important_first() -> None:
    big = tuple(f"{i:07d}" for i in range(300))
    rec = JobRecord(
        attempts=(
            FULL,
            Attempt(attempt=1, co_tenants=big, metrics=MetricsSummary(1, 2.0, 0.1, 5.0, 9, False)),
            Attempt(attempt=2, limit_mib=40960, co_tenants=big),
        )
    )
    enc = encode(rec, max_bytes=700)
    out = decode(enc)
    assert len(enc) <= 700 and out.truncated
    assert out.attempts[0].attempt == 0 and out.attempts[-1].attempt == 2
    assert out.attempts[-1].limit_mib == 40960


def test_foreign_text_kept() -> None:
    s = append_attempt("site: project=abc", FULL)
    assert s.startswith("site: project=abc ")
    s2 = append_attempt(s.lower(), Attempt(attempt=1))
    assert s2.startswith("site: project=abc ")
    assert [a.attempt for a in decode(s2).attempts] == [0, 1]


def test_foreign_text_too_big() -> None:
    with pytest.raises(RecordTooLargeError):
        append_attempt("x" * 4090, FULL, max_bytes=4096)


def test_corrupt_token_is_replaced_by_fresh_truncated_record() -> None:
    s = append_attempt("cl1:aaaaaaaaaaaaaaaa", Attempt(attempt=3))
    rec = decode(s)
    assert rec.truncated and [a.attempt for a in rec.attempts] == [3]


@pytest.mark.parametrize(
    "junk",
    [
        "",
        "hello world",
        "JS1:eyJhIjoxfQ==",
        "cl1:",
        "cl1:!!!!",
        "cl1:aaaaaaaa",
        "cl1:" + "a" * 5000,
        "CL1:0189",
        "xcl1:abc",
    ],
)
def test_garbage_is_a_decode_error(junk: str) -> None:
    with pytest.raises(RecordDecodeError):
        decode(junk)
    assert try_decode(junk) is None


def test_newer_version_is_specific_error() -> None:
    enc = encode(JobRecord(attempts=(FULL,)))
    with pytest.raises(UnsupportedVersionError):
        decode("cl9:" + enc[len(PREFIX) :])


def test_zip_bomb_refused() -> None:
    import base64
    import zlib

    bomb = zlib.compress(b"[" * (5 << 20), 9)
    body = base64.b32encode(bomb).decode().rstrip("=").lower()
    with pytest.raises(RecordDecodeError):
        decode("cl1:" + body)


def test_wrong_types_refused() -> None:
    import base64
    import json
    import zlib

    raw = zlib.compress(json.dumps({"a": [{"n": "zero"}]}).encode())
    with pytest.raises(RecordDecodeError):
        decode("cl1:" + base64.b32encode(raw).decode().rstrip("=").lower())


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_crashes(s: str) -> None:
    try_decode(s)
    try_decode("cl1:" + s)


# ------------------------------------------------ issue 11, M2: a total decoder ---


def _tok(payload: bytes, version: str = "1") -> str:
    import base64
    import zlib

    return f"cl{version}:" + base64.b32encode(zlib.compress(payload)).decode().rstrip("=").lower()


HOSTILE_PAYLOADS = [
    b'{"a":[{"n":' + b"9" * 5000 + b"}]}",  # int beyond Python's digit limit
    b'{"da":' + b"9" * 5000 + b"}",
    b"[" * 200_000,  # nesting deeper than the recursion limit
    b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"x":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    b'{"a":[{"e":{"m":1,"x":"","g":' + b"9" * 400 + b"}}]}",  # float overflow
    b'{"a":[{"m":{"a":1e999}}]}',
    b'{"a":[{"n":1e5}]}',
    b'{"a":[{"c":"\\ud800"}]}',  # lone surrogate
    b'{"a":[{"n":NaN}]}',
    b"\xff\xfe",
]


@pytest.mark.parametrize("payload", HOSTILE_PAYLOADS)
def test_m2_hostile_payload_is_a_decode_error(payload: bytes) -> None:
    """M2 (issue 11): a 5,000-digit integer, deep nesting or a float overflow in a token
    raised ValueError/RecursionError/OverflowError out of the codec; now only the
    codec's own RecordDecodeError (or a result), and append_attempt still works."""
    token = _tok(payload)
    for comment in (token, "site: x " + token.upper()):
        try:
            rec: JobRecord | None = decode(comment)
        except RecordDecodeError:
            rec = None
        assert try_decode(comment) == rec
        out = append_attempt(comment, FULL)
        assert decode(out).attempts[-1] == FULL


def test_m2_lookalike_unicode_letters_are_not_a_token() -> None:
    """M2: case-insensitive matching must not read non-ASCII letters (long s, Kelvin
    sign: their upper case is ASCII) as base32: a token is ASCII only."""
    enc = append_attempt(None, FULL)
    i = next(i for i, ch in enumerate(enc) if i >= len(PREFIX) and ch == "s")
    sneaky = enc[:i] + "\u017f" + enc[i + 1 :]
    with pytest.raises(RecordDecodeError):
        decode(sneaky)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(
        st.sampled_from(["a", "n", "e", "m", "x", "g", "f", "s", "o", "r", "c", "p", "tr", "da"])
        | st.text(max_size=3),
        children,
        max_size=5,
    ),
    max_leaves=30,
)


def _decode_is_total(comment: str) -> None:
    import time

    t0 = time.monotonic()
    try:
        rec = decode(comment)
    except RecordDecodeError:
        rec = None
    assert rec is None or isinstance(rec, JobRecord)
    assert try_decode(comment) == rec
    try:
        out = append_attempt(comment, Attempt(attempt=7))
    except RecordTooLargeError:
        assert len(comment.encode()) > 1000  # only foreign text that leaves no room
    else:
        assert len(out.encode()) <= 4096 and decode(out).attempts[-1].attempt == 7
    assert time.monotonic() - t0 < 5


def test_m2_lone_surrogate_in_foreign_text() -> None:
    """M2: AdminComment from JSON may hold a lone surrogate; appending still works."""
    out = append_attempt("site \ud800 x", FULL)
    assert "\ud800" not in out and decode(out).attempts == (FULL,)
    out.encode("utf-8")  # writable


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=600))
def test_m2_fuzz_arbitrary_text(s: str) -> None:
    """M2: arbitrary text in, a record or RecordDecodeError out, never another error."""
    _decode_is_total(s)
    _decode_is_total("cl1:" + s)


@settings(max_examples=300, deadline=None)
@given(
    v=json_values,
    version=st.sampled_from(["1", "01", "001", "2", "999"]),
    pre=st.text(max_size=20),
    upper=st.booleans(),
)
def test_m2_fuzz_well_formed_tokens_with_any_json(v, version, pre, upper) -> None:
    """M2: a well-formed token (valid zlib, valid base32) around any JSON value."""
    import json

    tok = _tok(json.dumps(v).encode(), version)
    _decode_is_total(pre + " " + (tok.upper() if upper else tok))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_m2_fuzz_tokens_with_any_bytes(b: bytes) -> None:
    """M2: a token around arbitrary (decompressible) bytes."""
    _decode_is_total(_tok(b))


def test_a_cause_this_version_does_not_know_is_refused_not_carried() -> None:
    """One cause type end to end: the decoder gives the report only causes it knows."""
    import base64
    import json as _json
    import zlib

    payload = {"a": [{"n": 0, "o": {"c": "gpu-meltdown"}}]}
    body = base64.b32encode(zlib.compress(_json.dumps(payload).encode())).decode()
    with pytest.raises(RecordDecodeError, match="unknown cause"):
        decode(PREFIX + body.rstrip("=").lower())
