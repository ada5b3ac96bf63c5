"""Frames between a rank and the switchboard (`launch.switchboard`): a JSON header, then raw tensor bytes.

    frame   = u32 header length | u32 payload length | header (JSON) | payload
    header  = {"k": kind, ..., "tensors": [{"dtype": "float32", "shape": [2, 3]}, ...]}
    payload = the tensors' bytes, in header order (contiguous, CPU)

The launcher's side reads frames without blocking (`FrameReader`); a rank reads them on a thread of its own.
"""
from __future__ import annotations

import json
import struct

import torch

HEAD = struct.Struct("<II")
MAX_HEADER = 1 << 20        # bytes: a header is a few hundred
MAX_PAYLOAD = 1 << 30       # bytes: a frame's tensors (the box caps a rank's memory far below)


class BadFrame(ValueError):
    """A frame the other side cannot have meant: the link is closed."""


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise BadFrame(f"unknown dtype {name!r}")
    return dt


def encode(header: dict, tensors=()) -> bytes:
    tensors = [t.detach().to("cpu").contiguous() for t in tensors]
    header = {**header, "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                    for t in tensors]}
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors)
    return HEAD.pack(len(head), len(body)) + head + body


def decode(head: bytes, body: bytes) -> tuple[dict, list[torch.Tensor]]:
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise BadFrame(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors", []), list):
        raise BadFrame("header is not an object with a tensor list")
    tensors, at = [], 0
    buf = bytearray(body)
    for meta in header.get("tensors", []):
        try:
            dt, shape = _dtype(meta["dtype"]), [int(s) for s in meta["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise BadFrame(f"bad tensor description ({exc})") from None
        if any(s < 0 for s in shape):
            raise BadFrame("negative size")
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        if at + n > len(buf):
            raise BadFrame("payload shorter than its tensors")
        t = (torch.frombuffer(buf, dtype=torch.uint8, offset=at, count=n) if n else torch.empty(0, dtype=torch.uint8))
        tensors.append(t.view(dt).reshape(shape))
        at += n
    if at != len(buf):
        raise BadFrame("payload longer than its tensors")
    return header, tensors


class FrameReader:
    """Bytes in as they arrive, whole frames out."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict, list[torch.Tensor]]]:
        self.buf += data
        frames = []
        while len(self.buf) >= HEAD.size:
            hl, bl = HEAD.unpack_from(self.buf)
            if hl > MAX_HEADER or bl > MAX_PAYLOAD:
                raise BadFrame(f"frame of {hl} + {bl} bytes is over the limit")
            if len(self.buf) < HEAD.size + hl + bl:
                break
            head = bytes(self.buf[HEAD.size:HEAD.size + hl])
            body = bytes(self.buf[HEAD.size + hl:HEAD.size + hl + bl])
            del self.buf[:HEAD.size + hl + bl]
            frames.append(decode(head, body))
        return frames


def read_frame(sock) -> tuple[dict, list[torch.Tensor]] | None:
    """One frame from a blocking socket; None at end of stream."""
    head = _read_exact(sock, HEAD.size)
    if head is None:
        return None
    hl, bl = HEAD.unpack(head)
    if hl > MAX_HEADER or bl > MAX_PAYLOAD:
        raise BadFrame(f"frame of {hl} + {bl} bytes is over the limit")
    rest = _read_exact(sock, hl + bl)
    if rest is None:
        return None
    return decode(rest[:hl], rest[hl:])


def _read_exact(sock, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
