"""`blink serve` driven from outside, as a user runs it: in a child process, over HTTP. For the
end-to-end tests (tests/) and the serving benchmarks (bench/), which all start a server this way.

    with ServeProcess(["--device", "emulated", "--model", "random:tiny-llama"]) as s:
        status, body = s.get("/health")      # s.url: http://127.0.0.1:PORT
        s.device_pid()                       # the server's device process (blink.launch)

The server listens on a free port (--port 0); it is up once it logs the URL it serves on, which a
thread reads from its stderr with the other lines the tests and benchmarks look for (the ring's
name, the ring agent's address). Nothing of blink is imported: the child runs the blink this module
belongs to (PYTHONPATH), whatever the working directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import IO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what `blink serve` logs (blink.cli, blink.stack) that tells its state
_SERVING = re.compile(r"serving (\S+) on (http://\S+)/v1")
_RING = re.compile(r"ring /dev/shm/(\S+):")
_AGENT = re.compile(r"ring agent for \S+ listening on (\S+)")
_DEVICE = re.compile(r"blink[./](gpu[./]serve|device)")  # a device process's command line


def child_pids(pid: int) -> list[int]:
    """The children of every thread of `pid` (a device process is forked from a thread that owns it)."""
    out = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                out += [int(c) for c in f.read().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(out)


def gone(pid: int) -> bool:
    """No such process, or a zombie (its parent died; whoever adopted it has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def rss_mib(pid: int | None) -> float | None:
    """A process's resident set in MiB; None for no pid or a process that is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m[1]) / 1024 if m else None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class ServeProcess:
    """`blink serve --port 0 ARGS` in a child process; the constructor returns once it serves, or
    raises RuntimeError with the end of its log (it did not start within `timeout`, or exited).

    log: its stderr lines so far; url, model: where and what it serves; ring: the ring it created
    (not for a frontend of a remote ring); agent: the ring agent's address (with --ring-listen).
    prefix: a command the server runs under (e.g. unshare); log_path: also append the lines to this
    file; env, cwd, preexec_fn: as subprocess.Popen's.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        timeout: float = 300.0,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        log_path: str | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ):
        self.command = [*prefix, sys.executable, "-m", "blink.cli", "serve", "--port", "0", *args]
        # get() and metrics() send the server's --api-key, as its operator would
        self.api_key = args[args.index("--api-key") + 1] if "--api-key" in args[:-1] else None
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        self.log: list[str] = []
        self.url = self.model = self.ring = self.agent = ""
        self.proc = subprocess.Popen(
            self.command,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=cwd,
            preexec_fn=preexec_fn,
        )
        out = open(log_path, "a") if log_path else None  # noqa: SIM115 (closed by the reader thread)
        if out is not None:
            out.write(f"$ {' '.join(self.command)}\n")
        up = threading.Event()
        threading.Thread(target=self._read, args=(up, out), name="serve-log", daemon=True).start()
        if not up.wait(timeout):
            why = f"not up after {timeout:.0f} s"
        elif not self.url:  # its stderr ended: it exited (reaped a moment later)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            why = f"exit code {self.proc.returncode}"
        if not self.url:
            self.proc.kill()
            self.proc.wait()
            tail = "".join(self.log[-40:]) + (f"(log: {log_path})" if log_path else "")
            raise RuntimeError(f"`blink serve` did not start ({why}):\n{tail}")

    def _read(self, up: threading.Event, out: IO[str] | None) -> None:
        assert self.proc.stderr is not None
        try:
            for line in self.proc.stderr:
                self.log.append(line)
                if out is not None:
                    out.write(line)
                    out.flush()
                if m := _RING.search(line):
                    self.ring = m.group(1)
                if m := _AGENT.search(line):
                    self.agent = m.group(1)
                if m := _SERVING.search(line):
                    self.model, self.url = m.group(1), m.group(2)
                    up.set()
        finally:
            if out is not None:
                out.close()
            up.set()  # it exited (or closed its stderr): no need to wait longer

    # -- over HTTP ------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        """(status, body) of GET url + path; status 0 (body: the error) when nothing answered."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return 0, str(e)

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with its labels: value}; empty when it did not answer 200."""
        status, text = self.get("/metrics")
        if status != 200:
            return {}
        return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")}

    # -- its processes --------------------------------------------------------------------------
    def children(self) -> list[int]:
        return child_pids(self.proc.pid)

    def device_pid(self) -> int | None:
        """The device process: the child running blink's device (blink.device.*, blink.gpu.serve),
        or the only child; None when there is none (e.g. a frontend of a remote ring) or it is unclear."""
        kids = [k for k in self.children() if "resource_tracker" not in cmdline(k)]
        named = [k for k in kids if _DEVICE.search(cmdline(k))]
        if len(named) == 1 or len(kids) == 1:
            return (named or kids)[0]
        return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send `sig` (a clean shutdown), wait up to `timeout`, then SIGKILL. Returns the exit code
        (-9 when it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
