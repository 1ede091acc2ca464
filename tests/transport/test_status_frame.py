"""The one status-frame check (:func:`kvpool.transport.frames.parse_status_head`), which the UCX
client (through ``parse_status``) and the TCP client both read status frames with."""

from __future__ import annotations

from kvpool.transport import frames as T


def test_the_head_of_each_status_frame() -> None:
    header = b"h" * (T.MAX_STATUS_TEXT + 100)  # an OK's header may pass a failure text's limit
    ok = T.pack_status(9, T.STATUS_OK_MAY_ABORT, 1 << 20, 64 << 10, "", header)
    assert T.parse_status_head(ok, 9) == (T.STATUS_OK_MAY_ABORT, len(header), 1 << 20, 64 << 10)
    # only the head is read: the body's place is the caller's
    assert T.parse_status_head(ok[:T.STATUS.size], 9) == (T.STATUS_OK_MAY_ABORT, len(header), 1 << 20, 64 << 10)
    miss = T.pack_status(9, T.STATUS_MISS, 0, 0, "not here")
    assert T.parse_status_head(miss, 9) == (T.STATUS_MISS, len(b"not here"), 0, 0)


def test_what_is_not_a_status_frame_for_this_request() -> None:
    frame = T.pack_status(9, T.STATUS_OK, 10, 10, "")
    assert T.parse_status_head(frame, 8) is None  # another request's
    assert T.parse_status_head(frame[:T.STATUS.size - 1], 9) is None  # short
    assert T.parse_status_head(bytearray(b"XXXX") + frame[4:], 9) is None  # another protocol's
    old = bytearray(frame)
    old[4] = T.PROTOCOL_VERSION - 1
    assert T.parse_status_head(old, 9) is None  # another version's
    long_failure = T.pack_status(9, T.STATUS_ERROR, 0, 0, "", b"x" * (T.MAX_STATUS_TEXT + 1))
    assert T.parse_status_head(long_failure, 9) is None  # a failure's text is at most MAX_STATUS_TEXT
    assert T.parse_status(long_failure, 9) is None
