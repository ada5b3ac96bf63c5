"""Frames between a rank and the switchboard (`launch.switchboard`): a JSON header, then raw tensor bytes.

    frame   = u32 header length | u32 payload length | header (JSON) | payload
    header  = {"k": kind, ..., "tensors": [{"dtype": "float32", "shape": [2, 3]}, ...]}
    payload = the tensors' bytes, in header order (contiguous, CPU)

A large payload goes through the rank's arena instead (`Arena`): shared memory that only the rank and its launcher
map. The header then says where (`"shm": offset`), the payload is empty, and the socket carries descriptors only:
a 64 MiB all-reduce costs memory copies, not a socket's worth of system calls and Python buffers.

The launcher reads its ranks' frames without blocking (`FrameReader`) and trusts none of them: every size and
tensor description is checked before use, and a frame that breaks a rule raises `BadFrame` naming it. A rank
reads the launcher's frames (`read_frame`) on a thread of its own.
"""
from __future__ import annotations

import fcntl
import json
import math
import mmap
import os
import struct

import torch

HEAD = struct.Struct("<II")
MAX_HEADER = 1 << 20        # bytes of a rank's header: a few hundred in practice
# bytes of a rank's tensors in one frame: a lab's are kilobytes, a result at most the 64 MiB a result file may
# have. The launcher buffers at most one frame per rank, so this bounds what a flooding rank costs it.
MAX_PAYLOAD = 64 << 20
MAX_TENSORS = 1024          # tensors in one frame (a coalesced collective over a model's parameters)
MAX_DIMS = 16
# what a collective may carry: numbers and booleans, no quantized or bit-packed type (no collective takes one)
DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
    torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)}


ARENA_BYTES = 256 << 20    # a rank's arena: four times the largest socket payload; pages exist once touched
SHM_MIN = 256 << 10        # a post this large goes through the arena; smaller ones on the socket (latency wins there)
ALIGN = 64                 # every tensor of an arena payload starts here: any dtype can view it, and a cache line


class BadFrame(ValueError):
    """A frame the other side cannot have meant: the link is closed."""


def shape_error(shape) -> str:
    """Why `shape` (from JSON) is no tensor's shape; "" if it is one."""
    # a size over the payload limit is absurd even for an empty tensor, and would overflow torch's int64 sizes
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
            not all(type(s) is int and 0 <= s <= MAX_PAYLOAD for s in shape):    # type(): a bool is an int
        return f"at most {MAX_DIMS} sizes from 0 to {MAX_PAYLOAD}"
    return ""


def _tensor_meta(meta) -> tuple[torch.dtype, list[int]]:
    if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str):
        raise BadFrame('a tensor\'s description is not {"dtype": name, "shape": [sizes]}')
    dt = DTYPES.get(meta["dtype"])
    if dt is None:
        raise BadFrame(f"a tensor's dtype {meta['dtype'][:40]!r} is not one a collective carries")
    why = shape_error(meta.get("shape"))
    if why:
        raise BadFrame(f"a tensor's shape is not a list of {why}")
    return dt, meta["shape"]


def encode(header: dict, tensors=()) -> bytes:
    tensors = [t.detach().to("cpu").contiguous() for t in tensors]
    header = {**header, "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                    for t in tensors]}
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors)
    return HEAD.pack(len(head), len(body)) + head + body


def arena_layout(metas: list[tuple[torch.dtype, list[int]]]) -> tuple[list[int], int]:
    """Where each tensor of an arena payload starts, relative to the payload's offset, and the bytes it spans."""
    starts, at = [], 0
    for dt, shape in metas:
        starts.append(at)
        at += -(-math.prod(shape) * dt.itemsize // ALIGN) * ALIGN
    return starts, at


def _meta(t: torch.Tensor) -> tuple[torch.dtype, list[int]]:
    return t.dtype, list(t.shape)


def _description(metas) -> list[dict]:
    return [{"dtype": str(dt).removeprefix("torch."), "shape": shape} for dt, shape in metas]


class Arena:
    """A rank's shared memory with its launcher: a memfd the launcher creates before it forks the rank, sealed at its
    size (a rank that could shrink it would crash the launcher's next read with SIGBUS). Only the rank and its launcher
    hold it, so no rank can see another's payload. The rank writes a post's tensors at an offset it allocated and
    reads the answer from the same place (`Link`); the switchboard reads the one and writes the other."""

    def __init__(self, fd: int, size: int = ARENA_BYTES):
        self.fd, self.size = fd, size
        self.map = mmap.mmap(fd, size)                         # MAP_SHARED, read-write
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    @classmethod
    def create(cls, name: str) -> "Arena":
        fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)         # inherited by its rank alone (launch.forkrun)
        os.ftruncate(fd, ARENA_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        arena = cls(fd)
        arena.map.madvise(mmap.MADV_DONTFORK)     # the ranks forked after this one do not inherit its mapping
        return arena

    def write(self, at: int, tensors) -> list[dict]:
        """Copy `tensors` to the payload at `at`; their descriptions for the header."""
        metas = [_meta(t) for t in tensors]
        starts, _ = arena_layout(metas)
        for t, start in zip(tensors, starts):
            if t.numel():
                self.view(at + start, t.dtype, list(t.shape)).copy_(t.detach())
        return _description(metas)

    def view(self, at: int, dt: torch.dtype, shape: list[int]) -> torch.Tensor:
        n = math.prod(shape) * dt.itemsize
        return self.bytes[at:at + n].view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt)

    def views(self, at, metas) -> list[torch.Tensor]:
        """The tensors of the payload at `at` (sharing the arena's memory); BadFrame if it is not inside the arena."""
        starts, span = arena_layout(metas)
        if type(at) is not int or at % ALIGN or not 0 <= at <= self.size - span:
            raise BadFrame(f"an arena payload of {span} bytes at {str(at)[:20]} is not inside the rank's "
                           f"{self.size >> 20} MiB arena, or not {ALIGN}-byte aligned")
        return [self.view(at + start, dt, shape) for (dt, shape), start in zip(metas, starts)]


def encode_shared(header: dict, tensors, arena: Arena, at: int) -> bytes:
    """A frame whose tensors are written to `arena` at `at`: only their description travels on the socket."""
    head = json.dumps({**header, "shm": at, "tensors": arena.write(at, tensors)}, separators=(",", ":")).encode()
    return HEAD.pack(len(head), 0) + head


def decode(head: bytes, body: bytearray | memoryview, arena: Arena | None = None) -> tuple[dict, list[torch.Tensor]]:
    """The header and the tensors of one frame; the tensors share `body`'s memory, or `arena`'s when the header says
    they are there (`"shm"`)."""
    try:
        header = json.loads(head)
    except (ValueError, RecursionError) as exc:     # RecursionError: brackets nested past the parser's depth
        raise BadFrame(f"the header is not JSON ({str(exc)[:80]})") from None
    if not isinstance(header, dict):
        raise BadFrame("the header is not a JSON object")
    metas = header.get("tensors", [])
    if not isinstance(metas, list) or len(metas) > MAX_TENSORS:
        raise BadFrame(f"`tensors` is not a list of at most {MAX_TENSORS} tensor descriptions")
    if "shm" in header:
        if arena is None or len(body):
            raise BadFrame("an arena payload from a rank without an arena, or with bytes on the socket too")
        return header, arena.views(header["shm"], [_tensor_meta(meta) for meta in metas])
    tensors, at = [], 0
    for meta in metas:
        dt, shape = _tensor_meta(meta)
        n = math.prod(shape) * dt.itemsize         # Python's integers: no overflow, whatever the sizes say
        if at + n > len(body):
            raise BadFrame("the payload is shorter than the tensors its header describes")
        t = torch.frombuffer(body, dtype=torch.uint8, offset=at, count=n) if n else torch.empty(0, dtype=torch.uint8)
        tensors.append(t.view(dt).reshape(shape))
        at += n
    if at != len(body):
        raise BadFrame("the payload is longer than the tensors its header describes")
    return header, tensors


def _sizes(head, limit: int | None) -> tuple[int, int]:
    hl, bl = HEAD.unpack_from(head)
    if hl > MAX_HEADER or (limit is not None and bl > limit):
        raise BadFrame(f"a frame of {hl} + {bl} bytes is over the limit ({MAX_HEADER} bytes of header, "
                       f"{limit} of tensors)")
    return hl, bl


class FrameReader:
    """A rank's bytes in as they arrive, its frames out one at a time: a frame after a bad one is never decoded,
    so what a rank's link carried before it broke a rule does not depend on how the bytes were chunked."""

    def __init__(self, arena: Arena | None = None):
        self.buf = bytearray()
        self.arena = arena

    def feed(self, data: bytes):
        self.buf += data

    def next_frame(self) -> tuple[dict, list[torch.Tensor]] | None:
        """The next whole frame, or None until more bytes come; BadFrame for a frame that breaks a rule (its
        sizes are checked as soon as they arrive, so at most one frame of a rank is ever buffered)."""
        if len(self.buf) < HEAD.size:
            return None
        hl, bl = _sizes(self.buf, MAX_PAYLOAD)
        end = HEAD.size + hl + bl
        if len(self.buf) < end:
            return None
        head, body = bytes(self.buf[HEAD.size:HEAD.size + hl]), self.buf[HEAD.size + hl:end]
        del self.buf[:end]
        return decode(head, body, self.arena)


def read_frame(sock, arena: Arena | None = None) -> tuple[dict, list[torch.Tensor]] | None:
    """One frame of the launcher's from a blocking socket; None at end of stream. Its tensors are not capped: an
    all-gather's answer is every rank's frame at once."""
    head = _read_exact(sock, HEAD.size)
    if head is None:
        return None
    hl, bl = _sizes(head, None)
    rest = _read_exact(sock, hl + bl)
    if rest is None:
        return None
    return decode(bytes(rest[:hl]), memoryview(rest)[hl:], arena)


def _read_exact(sock, n: int) -> bytearray | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return buf
