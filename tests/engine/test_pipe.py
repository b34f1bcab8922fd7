"""The engine pipe's framing on non-blocking descriptors: partial reads, full pipes, corrupt frames."""

from __future__ import annotations

import os
import struct

import pytest

from engine.front.pipe import FrameReader, FrameWriter, encode


@pytest.fixture
def pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    yield r, w
    os.close(r)
    os.close(w)


def test_a_message_larger_than_the_pipe_crosses_in_pieces(pipe):
    r, w = pipe
    reader, writer = FrameReader(r), FrameWriter(w)
    big = {"tokens": list(range(400_000)), "text": "x" * 1_000_000}  # several MB, the pipe holds less
    assert writer.write(("out", big)) is False and writer.pending  # the rest waits in the writer
    assert writer.write(("small", 1)) is False  # queued behind it, in order
    got, rounds = [], 0
    while writer.pending or not got or len(got) < 2:
        messages, is_eof = reader.read_available()  # what arrived so far: never a partial message
        got += messages
        assert not is_eof
        writer.flush()
        rounds += 1
    assert got == [("out", big), ("small", 1)] and rounds > 2


def test_a_partial_frame_waits_for_its_rest(pipe):
    r, w = pipe
    reader = FrameReader(r)
    data = encode(("hello", [1, 2, 3]))
    os.write(w, data[:5])
    assert reader.read_available() == ([], False)
    os.write(w, data[5:] + data[:3])
    assert reader.read_available() == ([("hello", [1, 2, 3])], False)
    os.write(w, data[3:])
    assert reader.read_available() == ([("hello", [1, 2, 3])], False)


def test_the_end_of_the_pipe_is_reported_after_the_messages_before_it():
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.write(w, encode("last words"))
    os.close(w)
    try:
        reader = FrameReader(r)
        messages, is_eof = reader.read_available()
        assert messages == ["last words"]
        assert is_eof or reader.read_available() == ([], True)  # at the latest on the next call
    finally:
        os.close(r)


def test_a_corrupt_length_is_an_error_not_a_huge_allocation(pipe):
    r, w = pipe
    os.write(w, struct.pack("!Q", 1 << 40) + b"junk")
    with pytest.raises(OSError, match="corrupt frame"):
        FrameReader(r).read_available()
