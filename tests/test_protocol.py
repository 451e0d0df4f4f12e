"""Ring protocol: generated headers are fresh, a slot round-trips through the Transport, and a
layout change is caught by the freshness check."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from blink.gpu.engine import abi
from blink.protocol import cgen, layout
from blink.protocol.layout import HEADER_DTYPE, SLOT_DTYPE, SlotState
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("module", ["blink.protocol.cgen", "blink.gpu.engine.abi"])
def test_checked_in_headers_are_fresh(module):
    r = subprocess.run([sys.executable, "-m", module, "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_changed_slot_dtype_makes_the_check_fail(monkeypatch, tmp_path):
    out = tmp_path / "blink_ring.h"
    assert cgen.main(["--out", str(out)]) == 0
    assert cgen.main(["--check", "--out", str(out)]) == 0
    names = list(SLOT_DTYPE.names)
    fields = [(n, SLOT_DTYPE.fields[n][0]) for n in names]
    i = names.index("top_k")
    fields[i] = ("top_k", np.dtype("<u8"))  # widen one field: offsets after it move
    monkeypatch.setattr(layout, "SLOT_DTYPE", np.dtype(fields, align=True))
    assert cgen.main(["--check", "--out", str(out)]) == 1
    assert "uint64_t top_k" in cgen.render()


def test_changed_engine_dtype_makes_the_check_fail(monkeypatch):
    assert abi.main(["--check"]) == 0
    fields = [(n, abi.ENGINE_DTYPE.fields[n][0]) for n in abi.ENGINE_DTYPE.names]
    monkeypatch.setattr(abi, "ENGINE_DTYPE", np.dtype(fields[:-1], align=True))
    assert abi.main(["--check"]) == 1


def test_header_offsets_match_the_dtypes():
    text = cgen.render()
    for name in HEADER_DTYPE.names:
        off = HEADER_DTYPE.fields[name][1]
        assert f"{name};  // offset {off}" in text or f"{name}[" in text
    assert f"static_assert(sizeof(RingSlot) == {layout.SLOT_BYTES}" in text


@pytest.fixture
def shm_ring():
    name = f"blink-test-proto-{os.getpid()}"
    t = ShmTransport.create(name, RingGeometry(8, 1024, 32))
    yield t
    t.close()
    t.unlink()


def test_slot_round_trip_through_the_transport(shm_ring):
    t = shm_ring
    geo = RingGeometry.from_header(t.read_into(0, np.zeros(1, HEADER_DTYPE))[0])
    rec = np.zeros(1, SLOT_DTYPE)
    values = {
        "state": SlotState.EMPTY,
        "cancel": 1,
        "request_id": 0xDEADBEEF12345678,
        "prompt_offset": 100,
        "prompt_len": 37,
        "max_new_tokens": layout.UNLIMITED,
        "min_new_tokens": 3,
        "temperature": 0.75,
        "top_p": 0.9,
        "seed": 2**63 + 5,
        "top_k": 40,
        "n_stop": 2,
        "generated": 11,
        "consumed": 9,
        "finish_reason": layout.FinishReason.CONTEXT,
        "error": layout.SlotError.BAD_PARAMS,
        "flags": layout.SlotFlags.LOGPROBS,
        "t_submit_ns": 1_700_000_000_123_456_789,
        "t_admit_ns": 1_700_000_000_223_456_789,
        "t_first_ns": 1_700_000_000_323_456_789,
    }
    for k, v in values.items():
        rec[k] = v
    rec["stop_ids"][0, :2] = [2, 49151]
    t.write(geo.slot_offset(5), rec)
    t.store_u32(geo.slot_offset(5), SlotState.PREFILL_PENDING)

    # another party's view: a second mapping of the same file, field by field
    other = ShmTransport.open(t.path)
    try:
        back = other.read_into(geo.slot_offset(5), np.zeros(1, SLOT_DTYPE))[0]
        for k, v in values.items():
            want = SlotState.PREFILL_PENDING if k == "state" else v
            assert back[k] == np.asarray(want, SLOT_DTYPE.fields[k][0]), k
        assert back["stop_ids"].tolist() == [2, 49151, 0, 0, 0, 0, 0, 0]
        view = other.view()
        assert int(view.slots[5]["prompt_len"]) == 37 and int(view.slots[4]["request_id"]) == 0
        assert other.load_u32(geo.slot_offset(5) + SLOT_DTYPE.fields["generated"][1]) == 11
        assert other.load_u64(geo.slot_offset(5) + SLOT_DTYPE.fields["seed"][1]) == 2**63 + 5
        del view
    finally:
        other.close()


def test_output_ring_wraps():
    geo = RingGeometry(4, 64, 16)
    assert geo.output_offset(2, 17) == geo.output_offset(2, 1)
    assert geo.output_offset(3, 0) - geo.output_offset(2, 0) == 4 * 16
