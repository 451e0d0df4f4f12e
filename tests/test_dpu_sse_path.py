"""The SSE path of a first token: from the token reader to the response's first bytes, it does not
wait for the other streams' work of the same step.

A step publishes a token for every running stream at once; the reader hands them over in one
cycle, first tokens first. The server under test runs on a hand-driven ring (test_dpu_ring's
HandDevice) with a detokenizer made slow on purpose (each decode blocks the event loop 1 ms), so
the order in which the streams' work runs shows in the first token's read -> write time: a pump
task per stream (the previous design) ran every stream's detokenization before the new request's
handler (~2 ms x streams); the handler that iterates its own generation goes first (~2 ms).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_dpu_ring import HandDevice, _req

from blink.config import ServerConfig
from blink.dpu.request_tracker import RequestTracker, TokenEvent
from blink.dpu.server import OpenAIServer
from blink.dpu.tokenizer import load_tokenizer
from blink.protocol.layout import FinishReason, SlotState
from blink.protocol.transport import ShmTransport

N_RUNNING = 8
DECODE_S = 1e-3


def _body(max_tokens: int) -> dict:
    return {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True}


def _stamp_first(d: HandDevice, s: int) -> None:
    now = time.time_ns()
    rec = d.v.slots[s]
    rec["t_admit_ns"], rec["t_launch_ns"], rec["t_first_ns"] = now, now, now


async def _pending_slots(d: HandDevice, n: int) -> list[int]:
    for _ in range(500):
        s = [i for i in range(d.v.geo.n_slots) if d.v.slots[i]["state"] == SlotState.PREFILL_PENDING]
        if len(s) >= n:
            return s
        await asyncio.sleep(0.005)
    raise TimeoutError("requests did not reach the ring")


@pytest.mark.asyncio
async def test_first_token_bytes_do_not_wait_for_other_streams():
    d = HandDevice(n_slots=16, per_slot=64, cap=4096)
    tok = load_tokenizer("random:tiny-llama")
    rt = RequestTracker(ShmTransport.open(d.name), reader_kwargs={"health_interval_s": 0.05})
    await rt.start()
    server = OpenAIServer(rt, tok, ServerConfig())
    try:
        async with TestClient(TestServer(server.app())) as c:
            real = tok.decode  # every stream's detokenizer decodes through this (slowed below)
            tok.decode = lambda ids, *a: (time.sleep(DECODE_S), real(ids, *a))[1]
            running = [asyncio.ensure_future(c.post("/v1/completions", json=_body(50))) for _ in range(N_RUNNING)]
            slots = await _pending_slots(d, N_RUNNING)
            for s in slots:
                d.admit(s)
                _stamp_first(d, s)
                d.publish(s, [100])
            resps = await asyncio.wait_for(asyncio.gather(*running), 5)
            new = asyncio.ensure_future(c.post("/v1/completions", json=_body(2)))
            (x,) = set(await _pending_slots(d, 1)) - set(slots)
            write = server.metrics.stages[5]  # token read -> first response byte written
            sum0 = write._sum.get()
            d.admit(x)  # one step: the new request's first token and a token of every running stream
            _stamp_first(d, x)
            d.publish(x, [101])
            for s in slots:
                d.publish(s, [102])
            r = await asyncio.wait_for(new, 5)
            read_to_write = write._sum.get() - sum0
            tok.decode = real
            for s in [*slots, x]:
                d.complete(s, FinishReason.LENGTH)
            assert (await asyncio.wait_for(r.text(), 5)).endswith("data: [DONE]\n\n")
            for rr in resps:
                await asyncio.wait_for(rr.text(), 5)
    finally:
        await rt.close()
        d.close()
    # its own two decodes (2 ms) and the response's headers; not the other streams' 2 ms each
    assert 0 < read_to_write < N_RUNNING / 2 * 2 * DECODE_S, read_to_write


@pytest.mark.asyncio
async def test_events_queued_meanwhile_go_out_as_one():
    """A consumer that fell behind gets the tokens that queued up as one event (one chunk, one
    write); an error event stays apart from the tokens before it."""
    d = HandDevice()
    rt = RequestTracker(ShmTransport.open(d.name), reader_kwargs={"health_interval_s": 0.05})
    try:
        h = await rt.submit(_req(1))
        for ids in ([1], [2, 3], [4]):
            h.queue.put_nowait(TokenEvent(1, ids))
        h.queue.put_nowait(TokenEvent(1, [5], FinishReason.LENGTH))
        evs = [e async for e in h]
        assert [e.token_ids for e in evs] == [[1, 2, 3, 4, 5]] and evs[0].finish_reason == FinishReason.LENGTH
        h2 = await rt.submit(_req(2))
        h2.queue.put_nowait(TokenEvent(2, [7]))
        h2.queue.put_nowait(TokenEvent(2, [8]))
        h2.queue.put_nowait(TokenEvent(2, [], FinishReason.ERROR, message="device gone"))
        evs = [e async for e in h2]
        assert [e.token_ids for e in evs] == [[7, 8], []] and evs[1].finish_reason == FinishReason.ERROR
    finally:
        await rt.close()
        d.close()
