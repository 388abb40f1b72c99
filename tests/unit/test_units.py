"""Size parsing, MPS limit lists and PyTorch's OOM text."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_colloc.gpu.sim.oom import torch_oom_message
from slurm_colloc.units import (
    SizeError,
    limit_for,
    parse_device_limits,
    parse_size_mib,
    torch_format_size,
)


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("8G", 8192),
        ("8192M", 8192),
        ("8192", 8192),
        ("1.5GiB", 1536),
        ("512MiB", 512),
        ("1T", 1048576),
        ("1024K", 1),
        ("1B", 1),
        ("0", 0),
    ],
)
def test_parse_size(text, mib):
    assert parse_size_mib(text) == mib


@pytest.mark.parametrize("text", ["-5G", "five", "5Q", "", "G8"])
def test_bad_sizes(text):
    with pytest.raises(SizeError):
        parse_size_mib(text)


def test_device_limits_forms():
    assert parse_device_limits("0=8G") == {0: 8192}
    assert parse_device_limits("8G") == {None: 8192}
    assert parse_device_limits("0=8192M,1=4G") == {0: 8192, 1: 4096}
    assert limit_for(parse_device_limits("8G"), 3) == 8192
    assert limit_for(parse_device_limits("1=4G"), 0) is None
    with pytest.raises(SizeError):
        parse_device_limits("x=8G")


def test_torch_format_size_matches_pytorch():
    assert torch_format_size(0) == "0 bytes"
    assert torch_format_size(1024) == "1024 bytes"
    assert torch_format_size(2048) == "2.00 KiB"
    assert torch_format_size(20 * 1024 * 1024) == "20.00 MiB"
    assert torch_format_size(1024**3) == "1024.00 MiB"  # PyTorch's <= boundaries
    assert torch_format_size(int(1.95 * 1024**3)) == "1.95 GiB"


@given(st.integers(min_value=0, max_value=1 << 50))
def test_torch_format_size_always_two_decimals_or_bytes(n):
    assert re.fullmatch(r"\d+ bytes|\d+\.\d\d (KiB|MiB|GiB)", torch_format_size(n))


def test_oom_message_is_pytorch_2_format():
    msg = torch_oom_message(2048, 0, 40960, 1024, 8192, [(4242, 30720)])
    assert msg.startswith(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
        "GPU 0 has a total capacity of 40.00 GiB of which 1024.00 MiB is free. "
        "Process 4242 has 30.00 GiB memory in use. "
        "Including non-PyTorch memory, this process has 8.00 GiB memory in use. "
    )
    assert "is reserved by PyTorch but unallocated." in msg
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in msg
    assert "\n" not in msg
