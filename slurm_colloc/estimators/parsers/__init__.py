"""Model summary parsers: detect the format, parse, return one :class:`ModelSummary`.

One module per format. Detection is by each format's header, most specific first,
so a torchinfo table (which also says "Layer (type") is never taken for torchsummary.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from slurm_colloc.estimators.errors import EstimatorInputError, SummaryParseError
from slurm_colloc.estimators.model import ModelSummary
from slurm_colloc.estimators.parsers import (
    flax,
    json_format,
    keras,
    pytorch_print,
    torchinfo,
    torchsummary,
)
from slurm_colloc.estimators.parsers._common import check_plausible

_ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[A-Za-z]")
"""A CSI escape sequence (colours, bold); bounded, so linear on any input."""
MAX_SUMMARY_BYTES = 4 * 1024 * 1024
"""Largest summary accepted: a torchinfo table of a 1,000-layer model is ~150 kB; more
than this is a wrong file (a log, a checkpoint) and must not be slurped on a login node."""

Detector = Callable[[str], bool]
Parser = Callable[[str], ModelSummary]
FORMATS: dict[str, tuple[Detector, Parser]] = {
    "json": (json_format.looks_like, json_format.parse),
    "torchinfo": (torchinfo.looks_like, torchinfo.parse),
    "keras": (keras.looks_like, keras.parse),
    "torchsummary": (torchsummary.looks_like, torchsummary.parse),
    "pytorch-print": (pytorch_print.looks_like, pytorch_print.parse),
}
"""The PyTorch/Keras/JSON formats (the security tests feed each a hostile line)."""
JAX_FORMATS: dict[str, tuple[Detector, Parser]] = {
    "flax": (flax.looks_like, flax.parse),
}
"""JAX formats (Flax ``nn.tabulate``), detected after torchinfo and before Keras."""
ALL_FORMATS: dict[str, tuple[Detector, Parser]] = {
    "json": FORMATS["json"], "torchinfo": FORMATS["torchinfo"], **JAX_FORMATS,
    "keras": FORMATS["keras"], "torchsummary": FORMATS["torchsummary"],
    "pytorch-print": FORMATS["pytorch-print"],
}
"""Every format, in detection order (most specific header first)."""


def parse_summary(text: str, fmt: str | None = None) -> ModelSummary:
    """Parse summary text, detecting the format unless ``fmt`` names one.

    Any text gives a :class:`ModelSummary` or an :class:`EstimatorInputError`
    (normally :class:`SummaryParseError`), in time linear in its size: sizes no real
    model has are refused (:func:`~slurm_colloc.estimators.parsers._common.check_plausible`), and
    an unexpected ``ValueError`` / ``RecursionError`` / ``OverflowError`` inside a
    parser still becomes a parse error rather than a traceback in ``sbatch``.
    """
    return check_plausible(_parse(text, fmt))


def _parse(text: str, fmt: str | None) -> ModelSummary:
    if len(text) > MAX_SUMMARY_BYTES:
        raise EstimatorInputError(
            f"summary is larger than {MAX_SUMMARY_BYTES // (1024 * 1024)} MiB; not a model summary"
        )
    if "\x00" in text:
        raise SummaryParseError("summary contains NUL bytes: not a text summary")
    if "\x1b" in text:
        # terminal styling: Flax's nn.tabulate and Keras 3 print through rich with a
        # forced terminal, so a redirected table still carries ANSI escape codes
        text = _ANSI.sub("", text)
    if fmt is not None:
        if fmt not in ALL_FORMATS:
            raise EstimatorInputError(
                f"unknown summary format {fmt!r}; known: {', '.join(ALL_FORMATS)}")
        return _guarded(fmt, ALL_FORMATS[fmt][1], text)
    for name, (detect, parse) in ALL_FORMATS.items():
        if detect(text):
            return _guarded(name, parse, text)
    if "Layer (type)" in text and "Output Shape" in text and "Param #" not in text:
        raise SummaryParseError(
            "the table has no 'Param #' column: the console cut it off (Keras 3 prints "
            "through rich at the terminal's width); run model.summary() with COLUMNS=200 "
            "in the environment")
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    raise SummaryParseError(
        "not a recognised model summary (torchinfo, torchsummary, print(model), Keras, "
        "Flax tabulate or colloc JSON)", line_no=1 if first else None, line=first or None,
    )


def _guarded(name: str, parse: Callable[[str], ModelSummary], text: str) -> ModelSummary:
    """``parse(text)`` with any stray error of bad input turned into a parse error."""
    try:
        return parse(text)
    except EstimatorInputError:
        raise
    except RecursionError:
        raise SummaryParseError(f"{name}: nested too deeply; not a model summary") from None
    except (ValueError, OverflowError, ArithmeticError) as e:
        raise SummaryParseError(f"{name}: unreadable summary ({str(e)[:100]})") from None


def read_summary_file(path: str | Path) -> ModelSummary:
    """Read and parse a summary file, refusing oversized or unreadable files early."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; only a regular file
        # is read (a FIFO, a device or a socket could block or never end)
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise EstimatorInputError(f"{p}: cannot read summary: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EstimatorInputError(f"{p}: not a regular file; give the summary as a file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_SUMMARY_BYTES + 1)
    except OSError as e:
        raise EstimatorInputError(f"{p}: cannot read summary: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SUMMARY_BYTES:
        raise EstimatorInputError(
            f"{p}: larger than {MAX_SUMMARY_BYTES // (1024 * 1024)} MiB; not a model summary")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SummaryParseError(f"{p}: not UTF-8 text") from None
    try:
        return parse_summary(text)
    except SummaryParseError as e:
        raise SummaryParseError(f"{p}: {e}") from None
