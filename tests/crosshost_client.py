"""HTTP client run inside a test "host" (tests/netns.py), where the test process cannot reach.

python tests/crosshost_client.py health URL            -> prints the status code
python tests/crosshost_client.py complete URL N        -> prints the JSON response
python tests/crosshost_client.py stream URL N          -> prints each SSE data line as it arrives
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request


def main() -> None:
    what, url = sys.argv[1], sys.argv[2]
    if what == "health":
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                print(r.status)
        except urllib.error.HTTPError as e:
            print(e.code)
        return
    n, model = int(sys.argv[3]), sys.argv[4]
    body = {"model": model, "prompt": "hello", "max_tokens": n, "ignore_eos": True, "temperature": 0}
    body["stream"] = what == "stream"
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        if what == "complete":
            print(r.read().decode())
            return
        for line in r:
            if line.startswith(b"data: "):
                print(line[6:].decode().strip(), flush=True)


if __name__ == "__main__":
    main()
