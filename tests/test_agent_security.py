"""The ring agent as an attacker meets it: without the secret nothing is served; with it, a frontend
writes only its own words of its own slots and reads only its own live requests; frames, replies,
connections and idle peers are bounded. Also the frontend side: several frontends on one ring each
keep their own slots, an impossible slot record is a fault of that slot only, and a request's
prompt does not outlive it. The "device" is driven by hand through a local mapping of the ring
(tests/test_dpu_ring.py's HandDevice); the agent runs on a thread of the test (fast limits) or as
its own process (memory)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time

import msgspec
import numpy as np
import pytest
from test_dpu_ring import HandDevice, _req

from blink.dpu.request_tracker import RequestTracker
from blink.dpu.slot_tracker import SlotTracker
from blink.protocol import agent_auth
from blink.protocol.layout import HEADER_DTYPE, SLOT_DTYPE, DeviceFeatures, DeviceStatus, FinishReason, SlotState
from blink.protocol.ring_agent import AgentLimits, RingAgent, start_agent_process
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.tcp_transport import TcpTransport
from blink.protocol.transport import ShmTransport, TransportError

SECRET = agent_auth.new_secret()
FAST = AgentLimits(handshake_timeout_s=0.5, frame_timeout_s=0.5, max_pending=8, max_clients=4)


@pytest.fixture
def dev():
    d = HandDevice(n_slots=8, per_slot=64, cap=64)
    yield d
    d.close()


def _agent(dev: HandDevice, **kw) -> RingAgent:
    kw.setdefault("limits", FAST)
    a = RingAgent(dev.name, "127.0.0.1:0", secret=SECRET, **kw)
    a.start_thread()
    return a


def _off(name: str) -> int:
    return HEADER_DTYPE.fields[name][1]


def _soff(dev: HandDevice, slot: int, name: str) -> int:
    return dev.v.geo.slot_offset(slot) + SLOT_DTYPE.fields[name][1]


# -- a client that speaks the frames but not the handshake ------------------------------------
def _raw(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=3)


def _send(s: socket.socket, obj) -> None:
    body = msgspec.msgpack.encode(obj)
    s.sendall(struct.pack("<I", len(body)) + body)


def _closed(s: socket.socket, timeout: float = 3.0) -> bool:
    """Whether the agent closed the connection without sending a ring byte."""
    s.settimeout(timeout)
    try:
        data = s.recv(1 << 16)
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return data == b""


def test_without_the_secret_nothing_is_read_written_or_cancelled(dev):
    """The old protocol's attacks (hello, then batches) and a client with the wrong secret."""
    s0 = SlotTracker(ShmTransport.open(dev.name), RingGeometry.from_header(dev.v.header))
    slot = s0.claim(_req(1))
    dev.admit(slot)
    dev.publish(slot, [42, 43])
    agent = _agent(dev)
    try:
        geo = dev.v.geo
        for first in (
            ["hello", 1],  # the unauthenticated protocol: hello, welcome, then anything
            ["batch", [], [[geo.prompt_arena_offset, 64]], True],  # a read without any hello
            ["batch", [[_soff(dev, slot, "cancel"), b"\x01\0\0\0"]], [], False],  # a cancel
        ):
            with _raw(agent.address) as s:
                _send(s, first)
                if first[0] == "hello":
                    _send(s, ["batch", [], [[geo.output_arena_offset, 64]], True])
                assert _closed(s), first
        with _raw(agent.address) as s:  # a hello of this protocol, then a batch instead of the proof
            _send(s, ["hello", 2, os.urandom(32)])
            s.settimeout(3)
            (n,) = struct.unpack("<I", s.recv(4))
            assert s.recv(n, socket.MSG_WAITALL)[:1]  # the agent's challenge
            _send(s, ["batch", [[_soff(dev, slot, "generated"), b"\xff\xff\xff\xff"]], [], False])
            assert _closed(s)
        with pytest.raises(TransportError, match="does not hold this frontend's secret"):
            TcpTransport(agent.address, agent_auth.new_secret(), timeout_s=2)
        assert int(dev.v.slots["cancel"][slot]) == 0 and int(dev.v.slots["generated"][slot]) == 2
        assert agent.batches == 0 and agent.refused >= 4
    finally:
        agent.stop_thread()


def test_the_client_checks_the_agent_too(dev):
    """Mutual: an agent that does not hold the secret gets neither the client's proof nor a batch."""
    other = RingAgent(dev.name, "127.0.0.1:0", secret=agent_auth.new_secret(), limits=FAST)
    other.start_thread()
    try:
        with pytest.raises(TransportError, match="does not hold"):
            TcpTransport(other.address, SECRET, timeout_s=2)
        assert other.batches == 0
    finally:
        other.stop_thread()


@pytest.fixture
def half(dev):
    """An agent splitting the ring in two partitions, and a frontend of partition 0."""
    agent = _agent(dev, partitions=2)
    fe = TcpTransport(agent.address, SECRET, timeout_s=2, owner=0, owners=2)
    yield fe
    fe.close()
    agent.stop_thread()


def test_a_frontend_writes_only_its_own_words_of_its_own_slots(dev, half):
    fe = half
    st = SlotTracker(fe, RingGeometry.from_header(dev.v.header), fe.owner, fe.owners)
    mine = st.claim(_req(1))
    fe.load_u32(0)
    dev.admit(mine)
    other = 1  # partition 1's slot, busy with another frontend's request
    dev.v.slots["state"][other] = SlotState.DECODE_PROCESSING
    u32 = lambda v: np.array([v], "<u4")  # noqa: E731
    attacks = [
        (_soff(dev, mine, "generated"), u32(0xFFFFFFFF)),  # a device word of its own busy slot
        (_soff(dev, mine, "state"), u32(SlotState.DECODE_COMPLETED)),
        (_off("device_status"), u32(DeviceStatus.FAILED)),
        (_off("shutdown"), u32(2)),
        (_off("heartbeat"), np.array([0], "<u8")),
        (_soff(dev, other, "cancel"), u32(1)),  # another frontend's request
        (_soff(dev, other + 2, "request_id"), np.array([9], "<u8")),  # another partition's EMPTY slot
        (_off("submit_seq"), np.array([7 * 2 + 1], "<u8")),  # a doorbell value of partition 1
        (dev.v.geo.output_offset(mine, 0), u32(5)),  # the output arena is the device's
        (dev.v.geo.prompt_arena_offset + 4 * st.prompt_capacity * mine, u32(5)),  # its prompt, now the device's
    ]
    before = bytes(dev.t.read(0, dev.t.size))
    for off, data in attacks:
        with pytest.raises(TransportError, match="refused"):
            fe.transact([(off, data)])
        fe.reconnect()  # a refused batch closes the connection
    assert bytes(dev.t.read(0, dev.t.size)) == before
    # its own words are fine: consumed, cancel, and the release once the device completed the slot
    fe.transact([(_soff(dev, mine, "consumed"), u32(0)), (_soff(dev, mine, "cancel"), u32(1))])
    dev.complete(mine, FinishReason.CANCELLED)
    fe.transact(st.release_writes(mine))
    assert dev.v.slots["state"][mine] == SlotState.EMPTY


def test_a_frontend_reads_only_its_own_live_requests(dev, half):
    fe = half
    geo = dev.v.geo
    region = geo.prompt_arena_tokens // geo.n_slots
    for s in range(geo.n_slots):  # every slot busy with a request: prompt and output hold data
        dev.v.slots["state"][s] = SlotState.DECODE_PROCESSING
        dev.v.slots["request_id"][s] = 100 + s
        dev.v.prompt_arena[s * region : (s + 1) * region] = 1000 + s
        dev.v.output_arena[s] = 2000 + s
    whole = np.zeros(geo.total_bytes, np.uint8)
    fe.transact((), [(0, whole)])
    view = np.ndarray((geo.n_slots,), SLOT_DTYPE, whole, geo.slots_offset)
    prompts = np.ndarray((geo.prompt_arena_tokens,), np.int32, whole, geo.prompt_arena_offset)
    outs = np.ndarray((geo.n_slots, geo.output_capacity), np.int32, whole, geo.output_arena_offset)
    for s in range(geo.n_slots):
        own = s % 2 == 0
        assert int(view["request_id"][s]) == (100 + s if own else 0)
        assert (prompts[s * region : (s + 1) * region] == (1000 + s if own else 0)).all()
        assert (outs[s] == (2000 + s if own else 0)).all()
    assert int(np.ndarray((), HEADER_DTYPE, whole, 0)["n_slots"]) == geo.n_slots  # the header is readable
    # a request that ended (slot EMPTY) is no longer readable, even by its own frontend
    dev.v.slots["state"][0] = SlotState.EMPTY
    out = fe.read_into(geo.output_offset(0, 0), np.zeros(geo.output_capacity, np.int32))
    assert (out == 0).all()


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_frames_and_replies_are_bounded_before_allocating():
    """The old agent went to ~2 GB for one 66-byte frame (8 reads of the whole ring) and raised
    MemoryError for a read of 1e18 bytes; a length header of 2 GiB is refused unread."""
    d = HandDevice(n_slots=64, per_slot=8192, cap=4096)  # a ring of ~45 MB
    proc, addr = start_agent_process(d.name, secret=SECRET)
    try:
        fe = TcpTransport(addr, SECRET, timeout_s=10)
        rss0 = _rss_kb(proc.pid)
        size = d.t.size
        with pytest.raises(TransportError, match="at most"):
            fe.transact((), [(0, np.empty(size, np.uint8))] * 8)
        fe.reconnect()
        sock = fe._sock  # past the handshake: the frames themselves
        _send(sock, ["batch", [], [[0, 10**18]], True])
        body = sock.recv(4096)
        assert b"outside the ring" in body  # a range error, nothing allocated
        sock.sendall(struct.pack("<I", 0x7FFFFFFF) + b"x" * 16)  # a 2 GiB frame
        assert _closed(sock)
        assert _rss_kb(proc.pid) - rss0 < 32 * 1024, (rss0, _rss_kb(proc.pid))
        assert proc.poll() is None
        assert TcpTransport(addr, SECRET, timeout_s=2).load_u64(0) == int(d.v.header["magic"])
    finally:
        proc.terminate()
        proc.wait(10)
        d.close()


def test_partial_frames_and_silent_peers_are_timed_out(dev):
    agent = _agent(dev)
    try:
        with _raw(agent.address) as s:  # connects and says nothing
            t0 = time.monotonic()
            assert _closed(s) and time.monotonic() - t0 < 2.0
        with _raw(agent.address) as s:  # half a length header
            s.sendall(b"\x10\x00")
            assert _closed(s)
        with _raw(agent.address) as s:  # a hello announced at 8 MiB: more than a handshake frame
            s.sendall(struct.pack("<I", 8 << 20))
            t0 = time.monotonic()
            assert _closed(s) and time.monotonic() - t0 < 0.3
        fe = TcpTransport(agent.address, SECRET, timeout_s=2)
        fe._sock.sendall(struct.pack("<I", 100) + b"abc")  # authenticated, then a frame that never ends
        assert _closed(fe._sock)
        assert agent.connections == 0
    finally:
        agent.stop_thread()


def test_a_connection_flood_is_refused_and_serving_goes_on(dev):
    agent = _agent(dev)
    try:
        fe = TcpTransport(agent.address, SECRET, timeout_s=2)
        flood = []
        for _ in range(300):
            try:
                flood.append(_raw(agent.address))
            except OSError:
                break
        time.sleep(0.2)
        assert agent.connections <= FAST.max_pending + FAST.max_clients
        assert fe.load_u64(0) == int(dev.v.header["magic"])  # the frontend already attached is served
        for s in flood:
            s.close()
        fe.close()
        time.sleep(FAST.handshake_timeout_s + 0.3)
        assert TcpTransport(agent.address, SECRET, timeout_s=2).load_u64(0) == int(dev.v.header["magic"])
        assert agent.refused >= 300 - FAST.max_pending - FAST.max_clients
    finally:
        agent.stop_thread()


@pytest.mark.asyncio
async def test_a_second_frontend_attaching_cancels_nothing(dev):
    """README's two-host example: the first frontend's request in flight, a second attaches."""
    agent = _agent(dev, partitions=3, reserved=(0,))  # partition 0: the frontend that maps the ring
    local = RequestTracker(ShmTransport.open(dev.name), owner=0, owners=3, reader_kwargs={"health_interval_s": 0.02})
    await local.start()
    try:
        dev.beat()
        h = await local.submit(_req(local.new_request_id()))
        dev.admit(h.slot)
        dev.publish(h.slot, [1, 2])
        a = TcpTransport(agent.address, SECRET, timeout_s=2)
        b = TcpTransport(agent.address, SECRET, timeout_s=2)
        assert (a.owner, a.owners, b.owner, b.owners) == (1, 3, 2, 3)
        with pytest.raises(TransportError, match="taken"):
            TcpTransport(agent.address, SECRET, timeout_s=2)
        with pytest.raises(TransportError, match="not one a frontend can attach to"):
            TcpTransport(agent.address, SECRET, timeout_s=2, owner=0, owners=3)
        remote = RequestTracker(a, owner=a.owner, owners=a.owners)
        await remote.start()
        assert remote.reclaimed == 0 and int(dev.v.slots["cancel"][h.slot]) == 0
        r = await remote.submit(_req(remote.new_request_id()))
        assert r.slot % 3 == 1 and h.slot % 3 == 0
        dev.publish(h.slot, [3])
        dev.complete(h.slot, FinishReason.LENGTH)
        got = []
        while not (got and got[-1].finished):
            got.append(await asyncio.wait_for(h.queue.get(), 2))
        assert [t for e in got for t in e.token_ids] == [1, 2, 3] and got[-1].finish_reason == FinishReason.LENGTH
        await remote.close()
        b.close()
    finally:
        await local.close()
        agent.stop_thread()


@pytest.mark.asyncio
async def test_an_impossible_slot_record_faults_that_request_only(dev):
    """The old reader died at one 4-byte write of a slot's `generated` (output ring overrun), and
    every request then got 503 forever."""
    rt = RequestTracker(ShmTransport.open(dev.name), reader_kwargs={"health_interval_s": 0.02})
    await rt.start()
    try:
        dev.beat()
        good = await rt.submit(_req(rt.new_request_id()))
        bad = await rt.submit(_req(rt.new_request_id()))
        worse = await rt.submit(_req(rt.new_request_id()))
        for h in (good, bad, worse):
            dev.admit(h.slot)
        dev.v.slots["generated"][bad.slot] = 0xFFFFFFF0  # past the output ring's flow control
        dev.v.slots["state"][worse.slot] = 77  # no state of the protocol
        for h in (bad, worse):
            ev = await asyncio.wait_for(h.queue.get(), 2)
            assert ev.finish_reason == FinishReason.ERROR and "slot fault" in ev.message
        dev.publish(good.slot, [5, 6])
        ev = await asyncio.wait_for(good.queue.get(), 2)
        assert ev.token_ids == [5, 6] and rt.health().ok and rt.reader.slot_faults == 2
        assert int(dev.v.slots["cancel"][bad.slot]) == 1  # the device is asked to stop it
        dev.v.slots["state"][worse.slot] = SlotState.DECODE_COMPLETED  # the device ends it: released
        for _ in range(100):
            if dev.v.slots["state"][worse.slot] == SlotState.EMPTY:
                break
            await asyncio.sleep(0.01)
        assert dev.v.slots["state"][worse.slot] == SlotState.EMPTY
    finally:
        await rt.close()


@pytest.mark.asyncio
async def test_a_released_slot_holds_no_prompt(dev):
    """Nor its block keys (a prefix-caching device: the keys follow the prompt in its region)."""
    dev.v.header["features"] = int(dev.v.header["features"]) | DeviceFeatures.PREFIX_CACHING
    dev.v.header["kv_block_size"] = 4
    rt = RequestTracker(ShmTransport.open(dev.name), reader_kwargs={"health_interval_s": 0.02})
    await rt.start()
    try:
        dev.beat()
        h = await rt.submit(_req(rt.new_request_id(), n=20))
        region = rt.slots.prompt_capacity
        words = dev.v.prompt_arena[h.slot * region : (h.slot + 1) * region]
        assert (words[:20] == np.arange(10, 30)).all()
        rec = dev.v.slots[h.slot]
        keys = int(rec["block_keys_offset"]) - h.slot * region
        assert int(rec["n_block_keys"]) == 5 and keys >= 20 and words[keys : keys + 20].any()
        dev.admit(h.slot)
        dev.publish(h.slot, [7])
        dev.complete(h.slot, FinishReason.LENGTH)
        while not (await asyncio.wait_for(h.queue.get(), 2)).finished:
            pass
        for _ in range(100):
            if dev.v.slots["state"][h.slot] == SlotState.EMPTY:
                break
            await asyncio.sleep(0.01)
        assert dev.v.slots["state"][h.slot] == SlotState.EMPTY and not words.any()
    finally:
        await rt.close()


def test_secret_files(tmp_path):
    path = str(tmp_path / "d" / "secret")
    s = agent_auth.ensure_secret_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600 and agent_auth.ensure_secret_file(path) == s
    assert agent_auth.read_secret_file(path) == s
    os.chmod(path, 0o644)
    with pytest.raises(agent_auth.SecretError, match="chmod 600"):
        agent_auth.read_secret_file(path)
    with pytest.raises(agent_auth.SecretError, match="not found"):
        agent_auth.read_secret_file(str(tmp_path / "missing"))
    # the proofs: each side's differs, and neither verifies with another secret or nonce
    c, n = os.urandom(32), os.urandom(32)
    assert agent_auth.agent_proof(s, c, n) != agent_auth.client_proof(s, c, n)
    assert agent_auth.client_proof(s, c, n) != agent_auth.client_proof(agent_auth.new_secret(), c, n)
    assert agent_auth.client_proof(s, c, n) != agent_auth.client_proof(s, c, os.urandom(32))


def test_read_masks_match_a_byte_by_byte_reference():
    """RingAccess.mask_read (a fast path for reads in one slot's unit, a general one otherwise)
    against the rule spelled out per byte, for random reads."""
    from blink.protocol.layout import HEADER_BYTES, LOGPROB_DTYPE, SLOT_BYTES
    from blink.protocol.ring_access import RingAccess
    from blink.protocol.ring_geometry import RingView

    geo = RingGeometry(6, 6 * 40, 8)
    view = RingView.create(bytearray(geo.total_bytes), geo)
    view.slots["state"][:] = [SlotState.EMPTY, SlotState.DECODE_PROCESSING, SlotState.PREFILL_PENDING] * 2
    acc = RingAccess(view, 1, 2)
    region = 4 * (geo.prompt_arena_tokens // geo.n_slots)
    units = [
        (geo.slots_offset, SLOT_BYTES, False),
        (geo.prompt_arena_offset, region, True),
        (geo.output_arena_offset, 4 * geo.output_capacity, True),
        (geo.logprob_arena_offset, LOGPROB_DTYPE.itemsize * geo.output_capacity, True),
    ]
    ref = np.zeros(geo.total_bytes, bool)
    ref[:HEADER_BYTES] = True
    for base, stride, live in units:
        for s in range(geo.n_slots):
            if s % 2 == 1 and (not live or view.slots["state"][s] != SlotState.EMPTY):
                ref[base + s * stride : base + (s + 1) * stride] = True
    rng = np.random.default_rng(0)
    for _ in range(3000):
        off = int(rng.integers(0, geo.total_bytes))
        n = int(rng.integers(1, min(geo.total_bytes - off, 64 if rng.random() < 0.5 else 5000) + 1))
        out = np.ones(n, np.uint8)
        acc.mask_read(off, out)
        assert (out.astype(bool) == ref[off : off + n]).all(), (off, n)


def test_serve_without_a_usable_secret_says_so_in_one_line(tmp_path):
    import subprocess
    import sys

    wide = tmp_path / "wide.secret"
    agent_auth.ensure_secret_file(str(wide))
    wide.chmod(0o644)
    for path, why in ((tmp_path / "missing", "not found"), (wide, "chmod 600")):
        argv = ["serve", "--device", "emulated", "--model", "random:tiny-llama", "--ring-address", "127.0.0.1:9"]
        r = subprocess.run(
            [sys.executable, "-m", "blink.cli", *argv, "--ring-secret-file", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bitmasks_of_the_mask_arena_follow_the_partition():
    """Structured output's bitmasks: a frontend writes only its partition's (m % owners == owner),
    names only those in a request's mask_slot, and stores mask_position of its busy slots."""
    from blink.protocol.ring_access import AccessDenied, RingAccess
    from blink.protocol.ring_geometry import RingView

    geo = RingGeometry(4, 4 * 16, 8, n_masks=4, mask_vocab=64)
    view = RingView.create(bytearray(geo.total_bytes), geo)
    acc = RingAccess(view, 1, 2)
    bits = bytes(4 * geo.mask_words)
    acc.check_write(geo.mask_offset(1), bits)
    acc.check_write(geo.mask_offset(3), bits)
    for m in (0, 2):
        with pytest.raises(AccessDenied, match="bitmask"):
            acc.check_write(geo.mask_offset(m), bits)
    with pytest.raises(AccessDenied):
        acc.check_write(geo.mask_offset(1), bits + b"\0\0\0\0")  # into the next bitmask
    rec = np.zeros((), SLOT_DTYPE)
    rec["prompt_offset"], rec["prompt_len"], rec["state"] = 16, 2, SlotState.PREFILL_PENDING
    for mask, ok in ((0, True), (2, True), (4, True), (1, False), (3, False), (5, False)):
        rec["mask_slot"] = mask
        publish = lambda: acc.check_write(geo.slot_offset(1), rec.tobytes())  # noqa: E731
        if ok:
            publish()
        else:
            with pytest.raises(AccessDenied, match="mask_slot"):
                publish()
    view.slots["state"][1] = SlotState.DECODE_PROCESSING
    acc.check_write(geo.slot_offset(1) + SLOT_DTYPE.fields["mask_position"][1], np.uint32(3).tobytes())


def test_prefix_caching_words_follow_the_partition():
    """Prefix caching through the agent: a publish's block keys lie in the slot's own region of the
    prompt arena, reset_cache_seq is a doorbell of the partition, and the device's cached_tokens and
    prefix counters are readable."""
    from blink.protocol.layout import BLOCK_KEY_WORDS
    from blink.protocol.ring_access import AccessDenied, RingAccess
    from blink.protocol.ring_geometry import RingView

    geo = RingGeometry(4, 4 * 64, 8)
    view = RingView.create(bytearray(geo.total_bytes), geo)
    acc = RingAccess(view, 1, 2)
    region = geo.prompt_arena_tokens // geo.n_slots
    keys = bytes(4 * BLOCK_KEY_WORDS * 2)
    acc.check_write(geo.prompt_arena_offset + 4 * (region + 40), keys)  # slot 1's region, EMPTY
    rec = np.zeros((), SLOT_DTYPE)
    rec["prompt_offset"], rec["prompt_len"], rec["state"] = region, 40, SlotState.PREFILL_PENDING
    rec["n_block_keys"] = 2
    for at, ok in ((region + 40, True), (2 * region - 2 * BLOCK_KEY_WORDS, True), (2 * region - 7, False),
                   (region - 1, False), (3 * region + 40, False), (1 << 30, False)):  # fmt: skip
        rec["block_keys_offset"] = at
        publish = lambda: acc.check_write(geo.slot_offset(1), rec.tobytes())  # noqa: E731
        if ok:
            publish()
        else:
            with pytest.raises(AccessDenied, match="block keys"):
                publish()
    view.slots["state"][1] = SlotState.DECODE_PROCESSING
    for field in ("n_block_keys", "block_keys_offset", "cached_tokens"):  # fixed while it holds a request
        with pytest.raises(AccessDenied):
            acc.check_write(geo.slot_offset(1) + SLOT_DTYPE.fields[field][1], np.uint32(0).tobytes())
    reset = HEADER_DTYPE.fields["reset_cache_seq"][1]
    acc.check_write(reset, np.uint64(5 * 2 + 1).tobytes())
    with pytest.raises(AccessDenied, match="partition"):
        acc.check_write(reset, np.uint64(5 * 2).tobytes())
    for name in ("kv_cache_key", "prefix_cache_hits", "kv_blocks_cached"):  # the device's header words
        with pytest.raises(AccessDenied, match="device"):
            acc.check_write(HEADER_DTYPE.fields[name][1], bytes(HEADER_DTYPE.fields[name][0].itemsize))
    view.header["kv_cache_key"], view.header["prefix_cache_hits"] = 0x1234, 77
    view.slots["cached_tokens"][1], view.slots["cached_tokens"][0] = 32, 48
    head = np.frombuffer(view.header.tobytes(), np.uint8).copy()
    acc.mask_read(0, head)
    got = head.view(HEADER_DTYPE)[0]
    assert int(got["kv_cache_key"]) == 0x1234 and int(got["prefix_cache_hits"]) == 77
    recs = np.frombuffer(view.slots.tobytes(), np.uint8).copy()
    acc.mask_read(geo.slots_offset, recs)
    assert recs.view(SLOT_DTYPE)["cached_tokens"].tolist() == [0, 32, 0, 0]  # its own slots only
