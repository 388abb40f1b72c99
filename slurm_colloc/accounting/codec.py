"""Encode the per-job record for Slurm's AdminComment, and decode it back.

Constraints that shaped the format (see docs/slurm-facts.md):

* **Case-insensitive.** After a job ends the record can only be written with
  ``sacctmgr modify job ... set AdminComment=``, and Slurm 22.05 lowercases the value.
  So the wire form is ``cl<version>:`` + lowercase RFC 4648 base32 without padding of
  zlib-compressed compact JSON. The decoder accepts any case.
* **Versioned.** The version is in the prefix (jobstats does the same with ``JS1:``);
  a decoder per version stays in :data:`_DECODERS` so old records keep decoding.
* **Capped.** The encoded text never exceeds ``admin_comment_max_bytes`` (config,
  4096): when it would, the least useful details are dropped first (free-form notes,
  older attempts' metrics series, the latest attempt's series halved a few times and
  then dropped, co-tenant lists, older attempts' metrics and estimates, then whole
  middle attempts) and the record is marked ``truncated``.
* **Compact series.** An attempt's downsampled metrics series (``MetricsSummary.series``)
  travels as three integer lists: time and memory delta-encoded, SM activity % with -1
  for "not measured". The decoder accepts at most :data:`MAX_SERIES_POINTS` bounded
  points and drops (never fails the record on) any other series.
* **Never crashes its caller on foreign input** (issue 11, M2). Other tools may write
  AdminComment too, and root's epilog reads it before a requeue. Decoding is total:
  :func:`decode` finds our token anywhere in the comment and, whatever the text,
  returns a record or raises :class:`RecordDecodeError` (a ``ValueError``), never
  anything else (a 5,000-digit integer, deep nesting, a float overflow, a non-ASCII
  look-alike letter all end there); :func:`try_decode` returns None instead.
  :func:`append_attempt` keeps foreign text next to our token and raises only
  :class:`RecordTooLargeError`. Work is bounded: the comment is cut at
  :data:`MAX_COMMENT_CHARS`, the token at :data:`MAX_TOKEN_CHARS`, decompression
  at :data:`MAX_DECOMPRESSED` (no zip bombs).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slurm_colloc.accounting.record import (
    Attempt,
    Enforcement,
    Estimate,
    JobRecord,
    MetricsSummary,
    OomInfo,
    Requeue,
)
from slurm_colloc.config import CollocConfig
from slurm_colloc.oom.patterns import CAUSES, AttemptCause

VERSION = 1
PREFIX = f"cl{VERSION}:"
DEFAULT_MAX_BYTES = CollocConfig().admin_comment_max_bytes
MAX_DECOMPRESSED = 1 << 20
MAX_COMMENT_CHARS = 1 << 20
"""Longer AdminComments are looked at only this far (Slurm's own field is far shorter)."""
MAX_TOKEN_CHARS = 64 * 1024
"""Our token is at most ``admin_comment_max_bytes`` long; a longer one is not ours."""
_TOKEN = re.compile(
    r"(?<![a-z0-9])cl(\d{1,3}):([a-z2-7]+)(?![a-z0-9])", re.IGNORECASE | re.ASCII
)
_MIN_ENCODED = len(PREFIX) + 40  # room for an empty, truncated record
MAX_SERIES_POINTS = 512
"""Longest metrics series a record carries (the encoder thins longer ones; the decoder
drops them)."""
MAX_SERIES_SECONDS = 10 * 366 * 86400
"""Largest series time offset (s) accepted: ten years."""
MAX_SERIES_MIB = 1 << 24
"""Largest series memory value (MiB) accepted: 16 TiB."""
SERIES_MIN_POINTS = 6
"""The size cap halves the last attempt's series down to this many points, then drops it."""
MAX_UNSCANNED = 4
"""Unscanned logs an attempt names at most (``Attempt.unscanned``)."""
MAX_UNSCANNED_CHARS = 240


class RecordDecodeError(ValueError):
    """The text holds no colloc record, or one this version cannot read."""


class UnsupportedVersionError(RecordDecodeError):
    """A record written by a newer colloc (or corrupted version digits)."""


class RecordTooLargeError(ValueError):
    """Even an empty record does not fit the cap next to the comment's foreign text."""


# ------------------------------------------------------------------ to/from JSON ---


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None and v != [] and v != {}}


def _attempt_to_json(a: Attempt) -> dict[str, Any]:
    e, o, r, m = a.estimate, a.oom, a.requeue, a.metrics
    return _drop_none(
        {
            "n": a.attempt,
            "e": _drop_none(
                {
                    "m": e.mib, "x": e.estimator, "g": e.margin_mib, "f": e.fingerprint,
                    "b": e.batch_size, "q": e.seq_len, "o": e.optimizer, "p": e.precision,
                }
            )
            if e
            else None,
            "s": a.shards,
            "sm": a.shard_mib,
            "l": a.limit_mib,
            "g": a.gpu,
            "h": a.node,
            "c": list(a.co_tenants),
            "o": _drop_none(
                {"c": o.cause, "p": o.pattern_id, "ev": o.evidence_path, "w": o.whole_gpu or None,
                 "a": o.alloc_mib, "u": o.in_use_mib, "cj": o.culprit}
            )
            if o
            else None,
            "r": _drop_none(
                {"q": r.requeued, "y": r.reason, "t": r.new_request, "l": r.new_limit_mib}
            )
            if r
            else None,
            "m": _drop_none(
                {
                    "p": m.peak_mib,
                    "a": m.mean_mib,
                    "u": m.mean_sm_activity,
                    "j": m.energy_j,
                    "k": m.samples,
                    "d": m.dcgm or None,
                    "s": _series_to_json(m.series),
                    "gp": _gaps_to_json(m.gaps),
                    "sp": m.span_s,
                }
            )
            if m
            else None,
            "t0": a.start,
            "t1": a.end,
            "v": _enforcement_to_json(a.enforcement),
            "ul": [u[:MAX_UNSCANNED_CHARS] for u in a.unscanned[:MAX_UNSCANNED]],
        }
    )


def _enforcement_to_json(v: Enforcement | None) -> dict[str, Any] | None:
    if v is None:
        return None
    return _drop_none({"k": v.kind, "a": v.action, "p": v.peak_mib, "l": v.limit_mib,
                       "o": v.outside_mps or None})


def _oom_from_json(o: dict[str, Any] | None) -> OomInfo | None:
    if o is None:
        return None
    return OomInfo(
        cause=_cause(_get(o, "c", str, "none")),
        pattern_id=_get(o, "p", str),
        evidence_path=_get(o, "ev", str),
        whole_gpu=_get(o, "w", bool, False),
        alloc_mib=_mib(o, "a"),
        in_use_mib=_mib(o, "u"),
        culprit=_get(o, "cj", str),
    )


def _enforcement_from_json(v: dict[str, Any] | None) -> Enforcement | None:
    """The collector's verdict of an attempt (absent in records before issue 27)."""
    if v is None:
        return None
    return Enforcement(kind=_get(v, "k", str, "")[:32], action=_get(v, "a", str, "")[:32],
                       peak_mib=_mib(v, "p"), limit_mib=_mib(v, "l"),
                       outside_mps=_get(v, "o", bool, False))


def _clamp(v: object, lo: int, hi: int) -> int:
    try:
        n = round(v) if isinstance(v, float) else int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        n = lo
    return min(max(n, lo), hi)


def _series_to_json(series: tuple[tuple[int, int, int | None], ...]) -> list[list[int]] | None:
    """``[[dt...], [dmem...], [sm...]]``: times and memory delta-encoded (the first value
    absolute), SM activity % as is with -1 for "not measured". Values are clamped to the
    decoder's bounds; a series over :data:`MAX_SERIES_POINTS` is thinned evenly."""
    if not series:
        return None
    pts = list(series)
    if len(pts) > MAX_SERIES_POINTS:
        step = -(-len(pts) // MAX_SERIES_POINTS)
        pts = pts[::step]
    ts: list[int] = []
    ms: list[int] = []
    us: list[int] = []
    prev_t = prev_m = 0
    for p in pts:
        t = max(_clamp(p[0], 0, MAX_SERIES_SECONDS), prev_t)  # never back in time
        m = _clamp(p[1], 0, MAX_SERIES_MIB)
        u = -1 if p[2] is None else _clamp(p[2], 0, 100)
        ts.append(t - prev_t)
        ms.append(m - prev_m)
        us.append(u)
        prev_t, prev_m = t, m
    return [ts, ms, us]


def _series_from_json(v: Any) -> tuple[tuple[int, int, int | None], ...]:
    """The series of :func:`_series_to_json`; () for anything else (a bad series is
    plot data lost, not a record lost): wrong shape or types, more than
    :data:`MAX_SERIES_POINTS` points, values out of bounds, time going backwards."""
    if not isinstance(v, list) or len(v) != 3 or not all(isinstance(x, list) for x in v):
        return ()
    ts, ms, us = v
    n = len(ts)
    if n > MAX_SERIES_POINTS or len(ms) != n or len(us) != n:
        return ()
    if not all(type(x) is int for col in (ts, ms, us) for x in col):
        return ()
    out: list[tuple[int, int, int | None]] = []
    t = m = 0
    for dt, dm, u in zip(ts, ms, us, strict=True):
        if not (0 <= dt <= MAX_SERIES_SECONDS and -MAX_SERIES_MIB <= dm <= MAX_SERIES_MIB
                and -1 <= u <= 100):
            return ()
        t += dt
        m += dm
        if t > MAX_SERIES_SECONDS or not 0 <= m <= MAX_SERIES_MIB:
            return ()
        out.append((t, m, None if u == -1 else u))
    return tuple(out)


_GAP_CODES = {"collector": "c", "job": "j"}
_GAP_CAUSES = {v: k for k, v in _GAP_CODES.items()}
MAX_GAPS = 16
"""Sampling gaps a record carries per attempt (``metrics.gaps.MAX_GAPS``)."""


def _gaps_to_json(gaps: tuple[tuple[int, int, str], ...]) -> list[list[int | str]] | None:
    """``[[offset s, length s, "c"|"j"], ...]`` (cause codes: collector, job)."""
    out: list[list[int | str]] = [
        [_clamp(o, 0, MAX_SERIES_SECONDS), _clamp(n, 0, MAX_SERIES_SECONDS), _GAP_CODES[c]]
        for o, n, c in gaps[:MAX_GAPS] if c in _GAP_CODES]
    return out or None


def _gaps_from_json(v: Any) -> tuple[tuple[int, int, str], ...]:
    """The gaps of :func:`_gaps_to_json`; () for anything else (lost detail, never a
    lost record), as for a series. Old records have none."""
    if not isinstance(v, list) or len(v) > MAX_GAPS:
        return ()
    out = []
    for g in v:
        if not (isinstance(g, list) and len(g) == 3 and type(g[0]) is int
                and type(g[1]) is int and g[2] in _GAP_CAUSES
                and 0 <= g[0] <= MAX_SERIES_SECONDS and 0 <= g[1] <= MAX_SERIES_SECONDS):
            return ()
        out.append((g[0], g[1], _GAP_CAUSES[g[2]]))
    return tuple(out)


def _span(v: Any) -> int | None:
    return v if type(v) is int and 0 <= v <= MAX_SERIES_SECONDS else None


def _record_to_json(rec: JobRecord) -> dict[str, Any]:
    return _drop_none(
        {
            "a": [_attempt_to_json(a) for a in rec.attempts],
            "tr": rec.truncated or None,
            "da": rec.dropped_attempts or None,
            "x": dict(rec.extra),
        }
    )


def _get(d: dict[str, Any], key: str, typ: type | tuple[type, ...], default: Any = None) -> Any:
    v = d.get(key, default)
    if v is None:
        return default
    if (
        isinstance(v, bool)
        and typ is not bool
        and bool not in (typ if isinstance(typ, tuple) else (typ,))
    ):
        raise RecordDecodeError(f"field {key!r}: expected {typ}, got bool")
    if not isinstance(v, typ):
        raise RecordDecodeError(f"field {key!r}: expected {typ}, got {type(v).__name__}")
    return v


def _obj(d: dict[str, Any], key: str) -> dict[str, Any] | None:
    v = _get(d, key, dict)
    return v if v is None else dict(v)


def _num(d: dict[str, Any], key: str) -> float | None:
    v = _get(d, key, (int, float))
    if v is None:
        return None
    try:
        return float(v)
    except OverflowError as e:
        raise RecordDecodeError(f"field {key!r}: number out of range") from e


def _cause(text: str) -> AttemptCause:
    """A cause this version knows (a newer writer's would come with a newer version)."""
    for c in CAUSES:
        if text == c:
            return c
    raise RecordDecodeError(f"unknown cause {text[:20]!r}")


def _mib(d: dict[str, Any], key: str) -> int | None:
    """A MiB count (older writers may have stored a float)."""
    v = _num(d, key)
    if v is None:
        return None
    if v != v or abs(v) > 1 << 40:  # NaN or absurd
        raise RecordDecodeError(f"field {key!r}: not a MiB count")
    return round(v)


def _attempt_from_json(d: Any) -> Attempt:
    if not isinstance(d, dict):
        raise RecordDecodeError("attempt is not an object")
    e, o, r, m = _obj(d, "e"), _obj(d, "o"), _obj(d, "r"), _obj(d, "m")
    co = _get(d, "c", list, [])
    if not all(isinstance(x, str) for x in co):
        raise RecordDecodeError("co_tenants must be strings")
    return Attempt(
        attempt=_get(d, "n", int, 0),
        estimate=Estimate(
            mib=_get(e, "m", int, 0),
            estimator=_get(e, "x", str, ""),
            margin_mib=_mib(e, "g"),
            fingerprint=_get(e, "f", str),
            batch_size=_get(e, "b", int),
            seq_len=_get(e, "q", int),
            optimizer=_get(e, "o", str),
            precision=_get(e, "p", str),
        )
        if e is not None
        else None,
        shards=_get(d, "s", int),
        shard_mib=_get(d, "sm", int),
        limit_mib=_get(d, "l", int),
        gpu=_get(d, "g", int),
        node=_get(d, "h", str),
        co_tenants=tuple(co),
        oom=_oom_from_json(o),
        requeue=Requeue(
            requeued=_get(r, "q", bool, False),
            reason=_get(r, "y", str, ""),
            new_request=_get(r, "t", str),
            new_limit_mib=_get(r, "l", int),
        )
        if r is not None
        else None,
        metrics=MetricsSummary(
            peak_mib=_get(m, "p", int),
            mean_mib=_num(m, "a"),
            mean_sm_activity=_num(m, "u"),
            energy_j=_num(m, "j"),
            samples=_get(m, "k", int, 0),
            dcgm=_get(m, "d", bool, False),
            series=_series_from_json(m.get("s")),
            gaps=_gaps_from_json(m.get("gp")),
            span_s=_span(m.get("sp")),
        )
        if m is not None
        else None,
        start=_get(d, "t0", int),
        end=_get(d, "t1", int),
        enforcement=_enforcement_from_json(_obj(d, "v")),
        unscanned=_unscanned_from_json(d.get("ul")),
    )


def _unscanned_from_json(v: Any) -> tuple[str, ...]:
    """The logs the epilog could not scan (``"ul"``, issue 28; absent in older
    records); () for anything malformed (lost detail, never a lost record)."""
    if not isinstance(v, list) or len(v) > MAX_UNSCANNED:
        return ()
    if not all(isinstance(x, str) and len(x) <= MAX_UNSCANNED_CHARS for x in v):
        return ()
    return tuple(v)


def _decode_v1(payload: bytes) -> JobRecord:
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError) as e:
        # JSONDecodeError, UnicodeDecodeError, ints beyond the digit limit, nesting
        # deeper than the recursion limit
        raise RecordDecodeError(f"payload is not JSON colloc can read: {e}") from e
    try:
        return _record_from_json(data)
    except RecordDecodeError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError, AttributeError) as e:
        raise RecordDecodeError(f"payload does not hold a colloc record: {e}") from e


def _record_from_json(data: Any) -> JobRecord:
    if not isinstance(data, dict):
        raise RecordDecodeError("payload is not a JSON object")
    extra = _get(data, "x", dict, {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise RecordDecodeError("extra must map strings to strings")
    return JobRecord(
        attempts=tuple(_attempt_from_json(a) for a in _get(data, "a", list, [])),
        truncated=_get(data, "tr", bool, False),
        dropped_attempts=_get(data, "da", int, 0),
        extra=dict(extra),
    )


_DECODERS: dict[int, Callable[[bytes], JobRecord]] = {1: _decode_v1}


# ------------------------------------------------------------------ wire format ---


def _pack(rec: JobRecord) -> str:
    raw = json.dumps(_record_to_json(rec), separators=(",", ":"), ensure_ascii=True)
    packed = zlib.compress(raw.encode("ascii"), 9)
    return PREFIX + base64.b32encode(packed).decode("ascii").rstrip("=").lower()


def _unpack(version: int, body: str) -> JobRecord:
    decoder = _DECODERS.get(version)
    if decoder is None:
        raise UnsupportedVersionError(f"colloc record version {version} is not supported")
    if len(body) > MAX_TOKEN_CHARS:
        raise RecordDecodeError(f"token longer than {MAX_TOKEN_CHARS} characters")
    if not body.isascii():
        raise RecordDecodeError("token is not ASCII")
    body = body.upper()
    try:
        packed = base64.b32decode(body + "=" * (-len(body) % 8))
    except (binascii.Error, ValueError) as e:
        raise RecordDecodeError(f"not base32: {e}") from e
    d = zlib.decompressobj()
    try:
        raw = d.decompress(packed, MAX_DECOMPRESSED)
    except zlib.error as e:
        raise RecordDecodeError(f"not zlib data: {e}") from e
    if d.unconsumed_tail:
        raise RecordDecodeError(f"record expands beyond {MAX_DECOMPRESSED} bytes")
    if not d.eof:
        raise RecordDecodeError("zlib stream is incomplete")
    try:
        return decoder(raw)
    except RecordDecodeError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError, AttributeError) as e:
        # a decoder's own slip on hostile data is still only "cannot read this record"
        raise RecordDecodeError(f"unreadable colloc record: {e}") from e


def find_token(comment: str) -> re.Match[str] | None:
    """The ``cl<N>:<base32>`` token inside an AdminComment, if any (ASCII only, looked
    for in the first :data:`MAX_COMMENT_CHARS` characters)."""
    return _TOKEN.search(comment, 0, MAX_COMMENT_CHARS)


def decode(comment: str) -> JobRecord:
    """Decode the colloc record in ``comment`` (any case, foreign text around it ok).

    Raises :class:`RecordDecodeError` when there is none or it cannot be read.
    """
    if not isinstance(comment, str):
        raise RecordDecodeError("AdminComment is not text")
    m = find_token(comment)
    if m is None:
        raise RecordDecodeError("no colloc record in AdminComment")
    return _unpack(int(m.group(1)), m.group(2))


def try_decode(comment: str | None) -> JobRecord | None:
    """:func:`decode`, but None for an empty, foreign or unreadable comment."""
    if not comment:
        return None
    try:
        return decode(comment)
    except RecordDecodeError:
        return None


# ------------------------------------------------------------------ size cap ---


def _drop_extra(r: JobRecord) -> JobRecord | None:
    return replace(r, extra={}) if r.extra else None


def _trim_co_tenants(r: JobRecord) -> JobRecord | None:
    if all(len(a.co_tenants) <= 4 for a in r.attempts):
        return None
    return replace(
        r,
        attempts=tuple(replace(a, co_tenants=a.co_tenants[:4]) for a in r.attempts),
    )


def _older_attempt(r: JobRecord, fn: Callable[[Attempt], Attempt | None]) -> JobRecord | None:
    # every attempt but the latest, oldest first
    for i, a in enumerate(r.attempts[:-1]):
        b = fn(a)
        if b is not None:
            return replace(r, attempts=(*r.attempts[:i], b, *r.attempts[i + 1 :]))
    return None


def _drop_old_metrics(r: JobRecord) -> JobRecord | None:
    return _older_attempt(r, lambda a: replace(a, metrics=None) if a.metrics else None)


def _drop_old_fingerprints(r: JobRecord) -> JobRecord | None:
    # the history key goes with the fingerprint: without it the rest keys nothing
    return _older_attempt(
        r,
        lambda a: (
            replace(a, estimate=replace(a.estimate, fingerprint=None, batch_size=None,
                                        seq_len=None, optimizer=None, precision=None))
            if a.estimate and a.estimate.fingerprint
            else None
        ),
    )


def _with_series(a: Attempt, series: tuple[tuple[int, int, int | None], ...]) -> Attempt:
    assert a.metrics is not None
    return replace(a, metrics=replace(a.metrics, series=series))


def _drop_old_series(r: JobRecord) -> JobRecord | None:
    return _older_attempt(r, lambda a: _with_series(a, ()) if a.metrics and a.metrics.series
                  else None)


def _halve_last_series(r: JobRecord) -> JobRecord | None:
    # every other point, the latest kept (the end of a plot is what was last seen)
    a = r.attempts[-1] if r.attempts else None
    if a is None or a.metrics is None or len(a.metrics.series) <= SERIES_MIN_POINTS:
        return None
    s = a.metrics.series
    return replace(r, attempts=(*r.attempts[:-1], _with_series(a, s[::-1][::2][::-1])))


def _drop_last_series(r: JobRecord) -> JobRecord | None:
    a = r.attempts[-1] if r.attempts else None
    if a is None or a.metrics is None or not a.metrics.series:
        return None
    return replace(r, attempts=(*r.attempts[:-1], _with_series(a, ())))


def _drop_all_co_tenants(r: JobRecord) -> JobRecord | None:
    if not any(a.co_tenants for a in r.attempts):
        return None
    return replace(r, attempts=tuple(replace(a, co_tenants=()) for a in r.attempts))


def _drop_middle_attempt(r: JobRecord) -> JobRecord | None:
    # keep the first (what was estimated) and the last (what happened in the end)
    if len(r.attempts) <= 2:
        return None
    return replace(
        r,
        attempts=(r.attempts[0], *r.attempts[2:]),
        dropped_attempts=r.dropped_attempts + 1,
    )


def _drop_first_attempt(r: JobRecord) -> JobRecord | None:
    if len(r.attempts) <= 1:
        return None
    return replace(r, attempts=r.attempts[1:], dropped_attempts=r.dropped_attempts + 1)


def _strip_last(r: JobRecord) -> JobRecord | None:
    # the latest attempt in ever slimmer forms; its number and cause go last
    if not r.attempts:
        return None
    a = r.attempts[-1]
    levels = (
        Attempt(
            attempt=a.attempt,
            limit_mib=a.limit_mib,
            gpu=a.gpu,
            oom=OomInfo(a.oom.cause, (a.oom.pattern_id or "")[:32] or None,
                        alloc_mib=a.oom.alloc_mib, culprit=a.oom.culprit)
            if a.oom
            else None,
            enforcement=a.enforcement,
            requeue=Requeue(
                a.requeue.requeued,
                a.requeue.reason[:24],
                (a.requeue.new_request or "")[:24] or None,
            )
            if a.requeue
            else None,
        ),
        Attempt(attempt=a.attempt, oom=OomInfo(a.oom.cause) if a.oom else None),
        Attempt(attempt=a.attempt),
    )
    for slim in levels:
        if len(_pack(replace(r, attempts=(slim,)))) < len(_pack(replace(r, attempts=(a,)))):
            return replace(r, attempts=(slim,))
    return replace(r, attempts=(), dropped_attempts=r.dropped_attempts + 1)


_SHRINKERS: tuple[Callable[[JobRecord], JobRecord | None], ...] = (
    _drop_extra,
    _drop_old_series,
    _halve_last_series,
    _drop_last_series,
    _trim_co_tenants,
    _drop_old_metrics,
    _drop_old_fingerprints,
    _drop_all_co_tenants,
    _drop_middle_attempt,
    _drop_first_attempt,
    _strip_last,
)
"""Steps that each drop some detail, least useful first; a step returns None when it
has nothing left to drop."""


def _fit(rec: JobRecord, budget: int) -> str:
    text = _pack(rec)
    if len(text) <= budget:
        return text
    rec = replace(rec, truncated=True)
    for step in _SHRINKERS:
        while True:
            text = _pack(rec)
            if len(text) <= budget:
                return text
            smaller = step(rec)
            if smaller is None:
                break
            rec = smaller
    text = _pack(rec)
    if len(text) <= budget:
        return text
    raise RecordTooLargeError(f"no colloc record fits in {budget} bytes")


def encode(record: JobRecord, *, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The record as AdminComment text of at most ``max_bytes`` bytes (ASCII)."""
    if max_bytes < _MIN_ENCODED:
        raise RecordTooLargeError(f"max_bytes={max_bytes} is below {_MIN_ENCODED}")
    return _fit(record, max_bytes)


def append_attempt(
    existing: str | None, attempt: Attempt, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> str:
    """Add (or replace, same attempt number) one attempt to a job's AdminComment.

    ``existing`` is the job's current AdminComment (None or "" for none). A readable
    colloc record is extended; foreign text is kept and our token is placed after it;
    an unreadable colloc token (corrupt, or a newer version) is replaced by a fresh
    record marked truncated, because the epilog must record this attempt regardless.
    The result never exceeds ``max_bytes``.
    """
    foreign = ""
    rec = JobRecord()
    if existing:
        # lone surrogates (JSON can carry them) cannot be written back: replace them
        existing = existing.encode("utf-8", "replace").decode("utf-8")
        m = find_token(existing)
        if m is None:
            foreign = existing.strip()
        else:
            foreign = (existing[: m.start()] + " " + existing[m.end() :]).strip()
            try:
                rec = _unpack(int(m.group(1)), m.group(2))
            except RecordDecodeError:
                rec = JobRecord(truncated=True)
    attempts = [a for a in rec.attempts if a.attempt != attempt.attempt]
    attempts.append(attempt)
    attempts.sort(key=lambda a: a.attempt)
    rec = replace(rec, attempts=tuple(attempts))
    sep = " " if foreign else ""
    budget = max_bytes - len(foreign.encode("utf-8")) - len(sep)
    if budget < _MIN_ENCODED:
        raise RecordTooLargeError(
            f"AdminComment already holds {len(foreign)} bytes of other data; "
            f"no room for a colloc record within {max_bytes}"
        )
    return foreign + sep + _fit(rec, budget)
