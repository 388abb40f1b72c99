"""AdminComment codec, issue 13: the history key in the estimate and the metrics series."""

from __future__ import annotations

import base64
import json
import random
import zlib
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_colloc.accounting import (
    Attempt,
    Estimate,
    JobRecord,
    MetricsSummary,
    OomInfo,
    RecordDecodeError,
    Requeue,
    append_attempt,
    codec,
    decode,
    encode,
    try_decode,
)


def _series(n: int, seed: int = 0, t0: int = 5) -> tuple[tuple[int, int, int | None], ...]:
    rnd = random.Random(seed)
    out: list[tuple[int, int, int | None]] = []
    t, mem = t0, 1500
    for i in range(n):
        t += rnd.randint(60, 90)
        mem = max(0, mem + rnd.randint(-400, 900))
        out.append((t, mem, None if i % 7 == 3 else rnd.randint(0, 100)))
    return tuple(out)


def _attempt(n: int, points: int = 48, **kw: Any) -> Attempt:
    return Attempt(
        attempt=n,
        estimate=Estimate(12266, "layer-aware", 2044, "ab" * 32, batch_size=32, seq_len=512,
                          optimizer="adamw", precision="amp-bf16"),
        shards=12, shard_mib=1024, limit_mib=12288, gpu=1, node="gpu-node-017",
        co_tenants=("1001", "1002", "1003"),
        metrics=MetricsSummary(11873, 9876.5, 0.613, 1234567.8, 5400, True,
                               series=_series(points, seed=n)),
        start=1_763_000_000 + n * 4000, end=1_763_003_600 + n * 4000, **kw,
    )


def _no_series(a: Attempt) -> Attempt:
    assert a.metrics is not None
    return replace(a, metrics=replace(a.metrics, series=()))


def _tok(payload: bytes) -> str:
    b = base64.b32encode(zlib.compress(payload)).decode().rstrip("=").lower()
    return codec.PREFIX + b


def _payload_with_series(s: Any) -> bytes:
    return json.dumps({"a": [{"n": 0, "m": {"p": 5, "k": 3, "s": s}}]}).encode()


def test_new_estimate_fields_and_series_round_trip() -> None:
    a = _attempt(0)
    rec = JobRecord(attempts=(a,))
    enc = encode(rec)
    for variant in (enc, enc.upper()):
        assert decode(variant) == rec
    e = decode(enc).attempts[0].estimate
    assert e is not None and (e.batch_size, e.seq_len, e.optimizer, e.precision) == (
        32, 512, "adamw", "amp-bf16")


def test_series_is_compact_on_the_wire() -> None:
    raw = json.dumps(codec._record_to_json(JobRecord(attempts=(_attempt(0),))))
    body = json.loads(raw)["a"][0]["m"]["s"]
    assert len(body) == 3 and all(len(col) == 48 for col in body)
    assert -1 in body[2]  # None SM activity
    assert all(dt >= 0 for dt in body[0])


def test_old_record_without_new_fields_decodes() -> None:
    """A record written before issue 13 (no b/q/o/p, no series) still decodes."""
    old = {"a": [{"n": 0, "e": {"m": 8000, "x": "layer-aware", "g": 1333.0, "f": "ab12"},
                  "m": {"p": 8100, "a": 6000.5, "k": 3600, "d": True}}]}
    rec = decode(_tok(json.dumps(old, separators=(",", ":")).encode()))
    a = rec.attempts[0]
    assert a.estimate == Estimate(8000, "layer-aware", 1333, "ab12")
    assert a.metrics is not None and a.metrics.series == () and a.metrics.peak_mib == 8100


def test_empty_series_is_not_written() -> None:
    a = Attempt(attempt=0, metrics=MetricsSummary(5, None, None, None, 1, False))
    assert "s" not in codec._record_to_json(JobRecord(attempts=(a,)))["a"][0]["m"]


def test_values_are_clamped_and_long_series_thinned_on_encode() -> None:
    long = tuple((i, i * 3, 50) for i in range(10_000))
    a = Attempt(attempt=0, metrics=MetricsSummary(5, None, None, None, 1, False, series=long))
    out = decode(encode(JobRecord(attempts=(a,)), max_bytes=1 << 20)).attempts[0]
    assert out.metrics is not None
    assert 0 < len(out.metrics.series) <= codec.MAX_SERIES_POINTS
    odd = ((-5, -3, 250), (10, 1 << 40, -7), (4, 7, None))  # time going back, huge, bad SM
    a = Attempt(attempt=0, metrics=MetricsSummary(5, None, None, None, 1, False, series=odd))
    out = decode(encode(JobRecord(attempts=(a,)))).attempts[0]
    assert out.metrics is not None
    assert out.metrics.series == ((0, 0, 100), (10, codec.MAX_SERIES_MIB, 0), (10, 7, None))


HOSTILE_SERIES: list[Any] = [
    [[1, 2], [3, 4]],  # two columns
    [[1, 2], [3, 4], [5]],  # ragged
    [[1, 2], [3, 4], [5, "x"]],  # wrong type
    [[1, 2.5], [3, 4], [5, 6]],  # float
    [[1, True], [3, 4], [5, 6]],  # bool is not an int here
    [[1, 2], [3, None], [5, 6]],
    [[10**30, 1], [3, 4], [5, 6]],  # huge time
    [[1, 2], [10**30, 4], [5, 6]],  # huge memory
    [[1, 2], [3, -10], [5, 6]],  # memory below zero
    [[1, -2], [3, 4], [5, 6]],  # time going back
    [[1, 2], [3, 4], [5, 101]],  # SM over 100 %
    [[1, 2], [3, 4], [-2, 6]],  # SM below -1
    [[codec.MAX_SERIES_SECONDS, 1], [3, 4], [5, 6]],  # adds up past the bound
    [[0] * 100_000, [0] * 100_000, [0] * 100_000],  # 10^5 points
    {"t": [1]},
    "1,2,3",
    7,
]


@pytest.mark.parametrize("series", HOSTILE_SERIES, ids=range(len(HOSTILE_SERIES)))
def test_hostile_series_is_dropped_cleanly(series: Any) -> None:
    """A bad series costs the plot, never the record (and never an exception other
    than the codec's own)."""
    rec = decode(_tok(_payload_with_series(series)))
    m = rec.attempts[0].metrics
    assert m is not None and m.series == () and m.peak_mib == 5 and m.samples == 3
    out = append_attempt(_tok(_payload_with_series(series)), _attempt(1))
    assert decode(out).attempts[-1] == _attempt(1)


@pytest.mark.parametrize("payload", [
    b'{"a":[{"m":{"p":5,"s":[[' + b"9" * 5000 + b'],[1],[1]]}}]}',  # beyond the digit limit
    b'{"a":[{"e":{"m":1,"x":"a","b":"32"}}]}',  # batch size as text
    b'{"a":[{"e":{"m":1,"x":"a","b":true}}]}',
    b'{"a":[{"e":{"m":1,"x":"a","o":5}}]}',
    b'{"a":[{"e":{"m":1,"x":"a","q":1.5}}]}',
])
def test_hostile_estimate_or_numbers_are_a_decode_error(payload: bytes) -> None:
    with pytest.raises(RecordDecodeError):
        decode(_tok(payload))
    assert try_decode(_tok(payload)) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-10**6, 10**12), st.integers(-10**6, 10**12),
                          st.one_of(st.none(), st.integers(-1000, 1000))), max_size=600))
def test_any_series_encodes_and_decodes_within_bounds(pts: list[Any]) -> None:
    a = Attempt(attempt=0, metrics=MetricsSummary(5, None, None, None, 1, False,
                                                  series=tuple(pts)))
    out = decode(encode(JobRecord(attempts=(a,)), max_bytes=1 << 20)).attempts[0]
    assert out.metrics is not None
    s = out.metrics.series
    assert len(s) <= codec.MAX_SERIES_POINTS and (len(s) > 0) == bool(pts)
    assert all(0 <= t <= codec.MAX_SERIES_SECONDS and 0 <= m <= codec.MAX_SERIES_MIB
               and (u is None or 0 <= u <= 100) for t, m, u in s)
    assert [t for t, _, _ in s] == sorted(t for t, _, _ in s)


def test_cap_4096_holds_three_attempts_with_48_points() -> None:
    """The default cap: three attempts with 48-point series fit, all series kept."""
    s: str | None = None
    for n in range(3):
        a = _attempt(n, oom=OomInfo("gpu-oom", "torch-cuda-oom") if n < 2 else None,
                     requeue=Requeue(True, "gpu-oom", "gres:shard:24", 24576) if n < 2 else None)
        s = append_attempt(s, a, max_bytes=4096)
        assert len(s.encode()) <= 4096
    assert s is not None
    rec = decode(s)
    assert [a.attempt for a in rec.attempts] == [0, 1, 2]
    last = rec.attempts[-1]
    assert last.metrics is not None and len(last.metrics.series) == 48
    assert last.estimate is not None and last.estimate.batch_size == 32


def test_shrinking_drops_older_series_then_halves_the_last() -> None:
    atts = tuple(_attempt(n, points=200) for n in range(3))
    rec = JobRecord(attempts=atts)
    full = len(encode(rec, max_bytes=1 << 20))
    last_only = len(encode(JobRecord(attempts=(*map(_no_series, atts[:2]), atts[2])),
                           max_bytes=1 << 20))
    assert last_only < full
    # room for everything but the older attempts' series
    out = decode(encode(rec, max_bytes=last_only + 10))
    assert out.truncated
    assert [len(a.metrics.series) for a in out.attempts if a.metrics] == [0, 0, 200]
    assert all(a.estimate and a.estimate.fingerprint for a in out.attempts)
    # less room: the last series thinned (every other point, the latest kept), details stay
    out = decode(encode(rec, max_bytes=last_only - 300))
    a = out.attempts[-1]
    assert a.metrics is not None and 0 < len(a.metrics.series) < 200
    assert a.metrics.series[-1] == atts[2].metrics.series[-1]  # type: ignore[union-attr]
    assert set(a.metrics.series) <= set(atts[2].metrics.series)  # type: ignore[union-attr]
    assert [x.co_tenants for x in out.attempts] == [x.co_tenants for x in atts]
    # tight: the series goes, before the latest attempt's other details
    tight = len(encode(JobRecord(attempts=tuple(map(_no_series, atts))), max_bytes=1 << 20))
    out = decode(encode(rec, max_bytes=tight + 5))
    assert all(x.metrics is not None and x.metrics.series == () for x in out.attempts)
    assert out.attempts[-1].metrics.peak_mib == 11873  # type: ignore[union-attr]
    assert out.attempts[-1].co_tenants == atts[2].co_tenants
