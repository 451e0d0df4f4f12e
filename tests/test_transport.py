"""Transport conformance: one suite, run over every transport the frontend can use.

`shm` maps the ring file; `tcp` goes through a ring agent in another process (the GPU host side);
`rdma` (marker `rdma`) through a ring agent that registers the ring with a real RDMA device, and
runs only where one exists. Each case checks the transport against the ring's own bytes, seen
through a local shared-memory mapping (the "device" side). The accesses are a frontend's (its own
words, a slot's output while it holds a request: what the agent's allow-list lets through; the
allow-list itself is tests/test_agent_security.py's).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from blink.protocol.agent_auth import new_secret
from blink.protocol.layout import HEADER_DTYPE, SLOT_DTYPE, SlotState
from blink.protocol.ring_agent import start_agent_process
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.tcp_transport import TcpTransport
from blink.protocol.transport import RangeError, ShmTransport, TransportError

GEO = RingGeometry(8, 8 * 8192, 64)
N = 8192  # ints published at once (one slot's prompt region): long enough for the other party to look in between
KINDS = ["shm", "tcp", pytest.param("rdma", marks=pytest.mark.rdma)]
SECRET = new_secret()
BUSY = SlotState.DECODE_PROCESSING  # a slot holding a request: its output is readable, its prompt the device's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ends:
    """The ring (local mapping, the device's view) and a transport to it of the kind under test."""

    def __init__(self, kind: str, name: str):
        self.kind = kind
        self.ring = ShmTransport.create(name, GEO)
        self.local = self.ring.view()
        self.agent: subprocess.Popen | None = None
        self.address = ""
        if kind != "shm":
            self.address = f"127.0.0.1:{_free_port()}"
            self.start_agent()
        self.t = self.open()

    def start_agent(self) -> None:
        self.agent, addr = start_agent_process(self.ring.path, self.address, secret=SECRET)
        assert addr == self.address

    def kill_agent(self) -> None:
        self.agent.kill()
        self.agent.wait()

    def open(self):
        if self.kind == "shm":
            return ShmTransport.open(self.ring.path)
        if self.kind == "tcp":
            return TcpTransport(self.address, SECRET, timeout_s=2.0)
        from blink.protocol.rdma_transport import RdmaTransport

        return RdmaTransport(self.address, SECRET, timeout_s=2.0)

    def close(self) -> None:
        self.t.close()
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            self.agent.wait(10)
        del self.local
        self.ring.close()
        self.ring.unlink()


@pytest.fixture(params=KINDS)
def ends(request) -> Iterator[Ends]:
    e = Ends(request.param, f"blink-test-transport-{os.getpid()}-{request.param}")
    yield e
    e.close()


def test_reads_and_writes_land_on_the_ring_bytes(ends: Ends):
    t, buf = ends.t, np.frombuffer(ends.local.buf, np.uint8)
    assert t.size == GEO.total_bytes
    data = np.arange(1000, dtype=np.int32)
    t.write(GEO.prompt_arena_offset + 4, data)
    assert (ends.local.prompt_arena[1:1001] == data).all()
    t.write(GEO.prompt_arena_offset, b"\x01\x02\x03")
    assert bytes(buf[GEO.prompt_arena_offset : GEO.prompt_arena_offset + 3]) == b"\x01\x02\x03"
    ends.local.output_arena[3, :] = np.arange(GEO.output_capacity) + 7
    ends.local.slots["state"][3] = BUSY
    out = np.zeros(GEO.output_capacity, np.int32)
    assert t.read_into(GEO.output_offset(3, 0), out) is out
    assert (out == np.arange(GEO.output_capacity) + 7).all()
    assert t.read(GEO.output_offset(3, 1), 4) == np.int32(8).tobytes()
    rec = np.zeros(2, SLOT_DTYPE)  # structured arrays travel as their bytes
    rec["request_id"] = [11, 12]
    rec["temperature"] = [0.5, 0.25]
    t.write(GEO.slot_offset(4), rec[0])  # a frontend writes a record while the slot is EMPTY
    t.write(GEO.slot_offset(5), rec[1])
    assert ends.local.slots["request_id"][4:6].tolist() == [11, 12]
    back = t.read_into(GEO.slot_offset(4), np.zeros(2, SLOT_DTYPE))
    assert back.tobytes() == rec.tobytes()


def test_words_publish_and_acquire(ends: Ends):
    t, h = ends.t, ends.local.header
    off = HEADER_DTYPE.fields["submit_seq"][1]
    t.store_u64(off, (1 << 63) + 5)
    assert int(h["submit_seq"]) == (1 << 63) + 5
    assert t.load_u64(off) == (1 << 63) + 5
    soff = GEO.slot_offset(1)
    t.store_u32(soff + SLOT_DTYPE.fields["cancel"][1], 1)
    assert int(ends.local.slots["cancel"][1]) == 1
    h["heartbeat"] = 42
    assert t.load_u64(HEADER_DTYPE.fields["heartbeat"][1]) == 42
    for bad in (lambda: t.store_u32(soff + 2, 1), lambda: t.load_u64(soff + 4), lambda: t.store_u64(3, 1)):
        with pytest.raises(RangeError):
            bad()


def test_a_batch_writes_in_order_then_reads_what_it_wrote(ends: Ends):
    t = ends.t
    a, b = GEO.prompt_arena_offset, GEO.output_arena_offset
    hdr = np.zeros(1, HEADER_DTYPE)
    slots = np.zeros(GEO.n_slots, SLOT_DTYPE)
    toks = np.zeros(16, np.int32)
    ends.local.header["steps"] = 99
    t.transact(
        [
            (a, np.full(16, 1, np.int32)),
            (a + 8, np.full(4, 2, np.int32)),
            (GEO.slot_offset(5) + 4, np.uint32(1).tobytes()),
            (GEO.slot_offset(0), np.uint32(SlotState.PREFILL_PENDING).tobytes()),
        ],  # slot 0 published: its prompt readable
        [(0, hdr), (GEO.slots_offset, slots), (a, toks)],
    )
    # later writes win where they overlap; reads see every write of the batch
    assert toks.tolist() == [1, 1, 2, 2, 2, 2] + [1] * 10
    assert int(slots["cancel"][5]) == 1 and int(hdr[0]["steps"]) == 99
    # a batch of reads only, of many regions
    ends.local.slots["state"][:] = BUSY
    ends.local.output_arena[:, 0] = np.arange(GEO.n_slots) * 10
    outs = [np.zeros(1, np.int32) for _ in range(GEO.n_slots)]
    t.transact((), [(GEO.output_offset(s, 0), outs[s]) for s in range(GEO.n_slots)])
    assert [int(o[0]) for o in outs] == [s * 10 for s in range(GEO.n_slots)]
    t.transact((), ())  # an empty batch is fine
    ends.local.slots["state"][:] = SlotState.EMPTY
    if hasattr(t, "round_trips"):
        before = t.round_trips
        t.transact([(a, b"\0" * 4)], [(b, np.zeros(4, np.uint8)), (0, np.zeros(8, np.uint8))])
        assert t.round_trips == before + 1


def test_out_of_range_is_refused_and_the_transport_stays_usable(ends: Ends):
    t, n = ends.t, GEO.total_bytes
    for bad in (
        lambda: t.read(n - 4, 8),
        lambda: t.read_into(n, np.zeros(1, np.uint8)),
        lambda: t.write(n - 2, b"abcd"),
        lambda: t.write(-4, b"abcd"),
        lambda: t.transact([(0, b"x")], [(n - 1, np.zeros(2, np.uint8))]),
        lambda: t.load_u32(n),
    ):
        with pytest.raises(RangeError):
            bad()
    assert bytes(np.frombuffer(ends.local.buf, np.uint8)[n - 4 :]) == b"\0" * 4  # nothing was written
    assert t.load_u64(0) == int(ends.local.header["magic"])


def test_published_data_is_never_seen_before_its_word(ends: Ends):
    """Acquire (remote reads) and release (remote writes) under a concurrent local party."""
    t = ends.t
    data_off, word_off = GEO.prompt_arena_offset, GEO.slot_offset(0) + SLOT_DTYPE.fields["generated"][1]
    arena, slots = ends.local.prompt_arena, ends.local.slots
    slots["state"][0] = BUSY
    stop = threading.Event()
    bad: list[str] = []

    def local_publisher() -> None:  # the device publishing: data, then the word
        k = 0
        while not stop.is_set():
            k += 1
            arena[:N] = k
            slots["generated"][0] = k

    th = threading.Thread(target=local_publisher, daemon=True)
    th.start()
    word, data = np.zeros(1, np.uint32), np.zeros(N, np.int32)
    t_end = time.monotonic() + 0.5
    while time.monotonic() < t_end:
        t.transact((), [(word_off, word), (data_off, data)])  # acquire: the word first
        if int(data.min()) < int(word[0]):
            bad.append(f"word {int(word[0])}, data {int(data.min())}")
    stop.set()
    th.join()
    assert not bad, bad[:5]

    # the frontend publishing: data, then the word, in one batch; a local observer checks the order
    stop.clear()
    slots["state"][0] = SlotState.EMPTY
    word_off = GEO.slot_offset(0) + SLOT_DTYPE.fields["consumed"][1]
    arena[:N] = 0
    slots["consumed"][0] = 0

    def local_observer() -> None:
        while not stop.is_set():
            w = int(slots["consumed"][0])
            d = int(arena[N - 1])  # the last element the publisher's copy writes: stale longest
            if d < w:
                bad.append(f"observer: word {w}, data {d}")

    th = threading.Thread(target=local_observer, daemon=True)
    th.start()
    for k in range(1, 300):
        t.transact([(data_off, np.full(N, k, np.int32)), (word_off, np.uint32(k).tobytes())])
    stop.set()
    th.join()
    assert not bad, bad[:5]


def test_reconnect(ends: Ends):
    t = ends.t
    t.write(GEO.prompt_arena_offset, np.arange(8, dtype=np.int32))
    ends.local.slots["state"][0] = BUSY  # a published request: the frontend may read its prompt back
    if ends.kind == "shm":  # nothing remote: reopening the file is the reconnect
        t2 = ends.open()
        assert t2.read_into(GEO.prompt_arena_offset, np.zeros(8, np.int32)).tolist() == list(range(8))
        t2.close()
        return
    ident = t.identity
    ends.kill_agent()
    t0 = time.monotonic()
    with pytest.raises(TransportError):
        t.load_u32(0)
    with pytest.raises(TransportError):  # stays broken until reconnected, and says so at once
        t.load_u32(0)
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(TransportError):
        t.reconnect()  # nobody listens yet
    ends.start_agent()
    assert t.reconnect() != ident  # a restarted agent is a new incarnation of the ring
    assert t.read_into(GEO.prompt_arena_offset, np.zeros(8, np.int32)).tolist() == list(range(8))


def test_a_silent_agent_times_out_instead_of_hanging(ends: Ends):
    if ends.kind == "shm":
        pytest.skip("nothing remote to fall silent")
    os.kill(ends.agent.pid, 19)  # SIGSTOP: the connection stays open, nothing answers
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            ends.t.load_u32(0)
        assert 1.5 < time.monotonic() - t0 < 5.0  # the transport's 2 s deadline
    finally:
        os.kill(ends.agent.pid, 18)  # SIGCONT


def test_agent_refuses_garbage_and_keeps_serving(ends: Ends):
    if ends.kind != "tcp":
        pytest.skip("TCP framing")
    host, port = ends.address.split(":")
    with socket.create_connection((host, int(port)), timeout=2) as s:
        s.sendall(b"\xff\xff\xff\x7f" + b"x" * 16)  # a 2 GiB frame
        assert s.recv(16) == b""  # closed on us
    with socket.create_connection((host, int(port)), timeout=2) as s:
        s.sendall(b"\x04\x00\x00\x00junk")
        assert s.recv(16) == b""
    assert ends.t.load_u64(0) == int(ends.local.header["magic"])  # other clients unaffected


def test_pyverbs_is_optional_and_rdma_without_a_device_says_how_to_fix_it():
    """Without pyverbs (or a device) asking for RDMA is a clear error, never an ImportError."""
    code = (
        "import sys; sys.modules['pyverbs'] = None\n"
        "from blink.protocol import rdma_transport as r\n"
        "assert r.rdma_devices() == []\n"
        "try:\n    r.RdmaTransport('127.0.0.1:1', bytes(32))\nexcept r.RdmaUnavailable as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "python3-pyverbs" in out.stdout
    import importlib.util

    from blink.protocol.rdma_transport import RdmaUnavailable, rdma_devices

    if importlib.util.find_spec("pyverbs") is not None and not rdma_devices():  # pyverbs present, no device
        from blink.protocol.rdma_transport import RdmaTransport

        with pytest.raises(RdmaUnavailable, match="no RDMA device"):
            RdmaTransport("127.0.0.1:1", SECRET)


def test_posted_writes_land_before_every_later_batch(ends: Ends):
    t = ends.t
    word = GEO.slot_offset(3) + SLOT_DTYPE.fields["consumed"][1]
    for k in range(1, 300):
        t.post([(word, np.uint32(k).tobytes()), (GEO.prompt_arena_offset + 4 * (k % 64), np.int32(k).tobytes())])
    assert t.load_u32(word) == 299  # the read is a later batch: every post before it has landed
    assert int(ends.local.slots["consumed"][3]) == 299
    t.post([])
    with pytest.raises(RangeError):  # checked before anything is sent
        t.post([(GEO.total_bytes - 2, b"abcd")])
    assert t.load_u64(0) == int(ends.local.header["magic"])
