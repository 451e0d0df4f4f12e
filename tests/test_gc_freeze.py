"""Start-up heaps out of the garbage collector's full scans (blink.protocol.gc_freeze): a full
collection holds the GIL for as long as it takes to walk every object alive; in the frontend (some
60,000 objects of imports, aiohttp and tokenizer, about 40 ms on a 2-core host) that stopped every
stream and /health whenever requests' allocations set one off."""

from __future__ import annotations

import json
import subprocess
import sys

from test_dpu_ring import HandDevice

from blink.protocol import agent_auth
from blink.protocol.ring_agent import start_agent_process

FROZEN_LINE = (
    r"(\d+) start-up objects frozen out of the garbage collector's full scans "
    r"\(a full collection: ([\d.]+) ms before, ([\d.]+) ms after\)"
)


def test_a_frozen_heap_leaves_a_full_collection_nothing_but_what_came_after():
    """In a process of its own (freezing is process-wide): 100,000 objects made before the freeze are
    out of every generation; a reference cycle made after it is still collected."""
    code = """
import gc, json
from blink.protocol.gc_freeze import freeze_startup_heap
startup = [{"k": [i]} for i in range(50_000)]
frozen = freeze_startup_heap()
tracked = len(gc.get_objects())

class Node:
    pass

n = Node()
n.me = n
del n
print(json.dumps([frozen.objects, tracked, gc.collect()]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    objects, tracked, collected = json.loads(out.stdout)
    assert objects > 100_000 and tracked < 100, (objects, tracked)
    assert collected >= 1  # the node: the collector still runs


def test_the_ring_agent_freezes_its_start_up_heap():
    """The ring agent serves the token path over TCP from the GPU's host: the same freeze, said on stderr."""
    import re

    d = HandDevice(n_slots=4, per_slot=64, cap=64)
    proc, _ = start_agent_process(d.name, secret=agent_auth.new_secret(), stderr=subprocess.PIPE)
    try:
        proc.terminate()
        proc.wait(10)
        err = proc.stderr.read()
    finally:
        d.close()
    m = re.search(FROZEN_LINE, err)
    assert m and int(m[1]) > 5_000 and float(m[3]) < float(m[2]), err
