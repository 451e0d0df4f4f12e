"""The ring agent's handshake: mutual authentication over a shared secret, before anything else.

Both ends hold the same secret (32 random bytes; `blink serve` / `blink deploy` make it, see
`ensure_secret_file`). A connection opens with

    client -> agent   AgentHello(version, nonce_c)
    agent  -> client  AgentChallenge(nonce_s, mac(secret, "agent",  nonce_c, nonce_s))
    client -> agent   AgentAuth(mac(secret, "client", nonce_s, nonce_c), partition asked for)
    agent  -> client  AgentWelcome(...)  (or RingReply(error=...) and the connection closes)

mac is HMAC-SHA256; each side checks the other's proof with a constant-time compare
(hmac.compare_digest). Both nonces are fresh random 32 bytes, so a recorded handshake proves
nothing on a new connection, and the two proofs carry different labels, so the agent's own proof
cannot be reflected back to it as a client's. The agent proves itself first: a client never sends
its proof, nor any ring access, to an agent that does not hold the secret.

What it does not do: encrypt or sign the frames after the handshake. The secret keeps out whoever
lacks it; someone who can rewrite packets on the path can still hijack an established connection.
Use a network only the cluster reaches, or a tunnel (WireGuard, IPsec) across untrusted ones.
The RDMA bootstrap runs on the same authenticated connection (rdma_transport.py).

Secret files hold the secret as 64 hex digits and must not be readable by group or others (like
ssh's keys): a secret file with a wider mode is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

SECRET_BYTES = 32
NONCE_BYTES = 32


class SecretError(ValueError):
    """A missing, malformed or too widely readable secret (file)."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise SecretError("the ring agent's secret must be at least 16 bytes")
    return secret


def mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 over a role label and both nonces (each length-prefixed by its fixed framing)."""
    h = hmac.new(secret, b"blink-ring-agent/2 " + label, hashlib.sha256)
    h.update(len(first).to_bytes(2, "little") + first)
    h.update(len(second).to_bytes(2, "little") + second)
    return h.digest()


def agent_proof(secret: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return mac(secret, b"agent", nonce_c, nonce_s)


def client_proof(secret: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return mac(secret, b"client", nonce_s, nonce_c)


def proofs_equal(got: bytes, want: bytes) -> bool:
    return hmac.compare_digest(got, want)


def read_secret_file(path: str) -> bytes:
    """The secret in `path` (64 hex digits); refused when group or others may read the file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise SecretError(
            f"ring agent secret file {path} not found: copy the GPU host's secret file here (mode 0600), "
            "or point ring.secret_file (--ring-secret-file) at it"
        ) from None
    except OSError as e:
        raise SecretError(f"ring agent secret file {path}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"ring agent secret file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(
                f"ring agent secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}; "
                f"it must be readable by its owner only (chmod 600 {path})"
            )
        text = os.read(fd, 4096).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    try:
        return check_secret(bytes.fromhex(text))
    except ValueError:
        raise SecretError(f"ring agent secret file {path}: expected at least 32 hex digits") from None


def ensure_secret_file(path: str) -> bytes:
    """The secret in `path`, created (mode 0600, its directory 0700) with a fresh one if the file
    does not exist yet: the GPU host's side. A restarted server keeps its secret, so the frontends
    that hold a copy keep working."""
    try:
        return read_secret_file(path)
    except SecretError:
        if os.path.lexists(path):
            raise
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o700, exist_ok=True)
    secret = new_secret()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # made meanwhile by another server on this host: use that one
        return read_secret_file(path)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def default_secret_file() -> str:
    """Where `blink serve --ring-listen` keeps its secret unless told otherwise."""
    return os.path.join(os.path.expanduser("~"), ".blink", "ring_agent.secret")
