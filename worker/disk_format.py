"""The disk tier's file format (worker/disk_cache.py): one saved state per file, checked on every read.

File format (little-endian):
    header    40 bytes  magic b"KVRDISK\\n", format version u16, fingerprint length u16, state version length u16,
                        salt length u16, token count u32, n_exact i32, pos_min i32, state bytes u64, checkpoint count u32
              ...       fingerprint (utf-8), state version (utf-8), salt (utf-8: the tenant, usually empty),
                        tokens (int32 each), checkpoints (each: its position i32 and its bytes u64)
    meta crc  u32       zlib.crc32 of everything before it: `load` trusts the tokens without reading the state
    state     ...       raw, as llama.cpp wrote it, then the checkpoints' states in their order (worker/checkpoints.py;
                        the state bytes count them too)
    file crc  u32       zlib.crc32 of everything before it
CRC-32 rather than a cryptographic hash: it guards against accidental damage (torn or truncated writes, bit rot, a
file from elsewhere), not against someone who can write the directory anyway, and it runs at ~4.7 GB/s here against
~1 GB/s for blake2b, on the path that restores a state (both release the GIL).
"""

from __future__ import annotations

import struct
import zlib
from io import FileIO

from protocol.tokens import pack_tokens, unpack_tokens

MAGIC = b"KVRDISK\n"
FORMAT_VERSION = 2  # 2: checkpoints
_HEAD = struct.Struct("<8sHHHHIiiQI")
_CUT = struct.Struct("<iQ")
_CRC = struct.Struct("<I")
CRC_BYTES = _CRC.size

Cuts = tuple[tuple[int, int], ...]  # a saved state's checkpoints: (position, bytes) each, ascending
Header = tuple[list[int], int, int, int, str, Cuts]  # tokens, n_exact, pos_min, state bytes, salt, checkpoints


class Bad(Exception):
    """A file that is not a usable entry; the message says why."""


def file_size(fingerprint: bytes, state_version: bytes, salt: str, n_tokens: int, state_bytes: int, n_cuts: int = 0) -> int:
    """The whole file's bytes: what an entry counts against the tier's capacity."""
    meta = len(fingerprint) + len(state_version) + len(salt.encode()) + 4 * n_tokens + _CUT.size * n_cuts
    return _HEAD.size + meta + _CRC.size + state_bytes + _CRC.size


def header_bytes(
    fingerprint: bytes,
    state_version: bytes,
    salt: str,
    tokens: list[int],
    n_exact: int,
    pos_min: int,
    state_bytes: int,
    cuts: Cuts = (),
) -> bytes:
    """Everything before the state, its checksum included."""
    salt_b = salt.encode()
    fields = (len(fingerprint), len(state_version), len(salt_b), len(tokens), n_exact, pos_min, state_bytes, len(cuts))
    head = (
        _HEAD.pack(MAGIC, FORMAT_VERSION, *fields)
        + fingerprint
        + state_version
        + salt_b
        + pack_tokens(tokens)
        + b"".join(_CUT.pack(n, nbytes) for n, nbytes in cuts)
    )
    return head + _CRC.pack(zlib.crc32(head))


def read_header(f: FileIO, size: int, fingerprint: bytes, state_version: bytes) -> Header:
    """Check a file's header against this model and format and its length; returns (tokens, n_exact, pos_min,
    state bytes, salt, checkpoints), leaving `f` at the state. Raises Bad."""
    raw = f.read(_HEAD.size)
    if raw is None or len(raw) < _HEAD.size:
        raise Bad(f"truncated: {size} bytes")
    magic, version, fp_len, sv_len, salt_len, n_tokens, n_exact, pos_min, state_bytes, n_cuts = _HEAD.unpack(raw)
    if magic != MAGIC:
        raise Bad("bad magic: not a kvroute disk entry")
    if version != FORMAT_VERSION:
        raise Bad(f"file format version {version}, this build reads {FORMAT_VERSION}")
    meta_len = fp_len + sv_len + salt_len + 4 * n_tokens + _CUT.size * n_cuts
    if _HEAD.size + meta_len + _CRC.size + state_bytes + _CRC.size != size:
        raise Bad(f"truncated or overlong: {size} bytes, the header announces others")
    meta = read_exact(f, meta_len)
    (stored,) = _CRC.unpack(read_exact(f, _CRC.size))
    if zlib.crc32(meta, zlib.crc32(raw)) != stored:
        raise Bad("header checksum differs")
    fp, sv = meta[:fp_len], meta[fp_len : fp_len + sv_len]
    if fp != fingerprint:
        raise Bad(f"other model: fingerprint {fp[:16].decode(errors='replace')}")
    if sv != state_version:
        raise Bad(f"other state version: {sv.decode(errors='replace')}")
    if n_tokens == 0:
        raise Bad("no tokens")
    at = fp_len + sv_len
    salt = meta[at : at + salt_len].decode(errors="replace")
    at += salt_len + 4 * n_tokens
    cuts = tuple(_CUT.unpack_from(meta, at + i * _CUT.size) for i in range(n_cuts))
    if sum(nbytes for _, nbytes in cuts) > state_bytes or any(not 0 < n <= n_tokens for n, _ in cuts):
        raise Bad("checkpoints outside the state")
    return unpack_tokens(meta[at - 4 * n_tokens : at]), n_exact, pos_min, state_bytes, salt, cuts


def crc_bytes(crc: int) -> bytes:
    return _CRC.pack(crc)


def check_crc(f: FileIO, crc: int) -> None:
    """The file's last field, read from `f`, is `crc`; raises Bad otherwise."""
    (stored,) = _CRC.unpack(read_exact(f, _CRC.size))
    if stored != crc:
        raise Bad(f"checksum {crc:#010x} differs from the stored {stored:#010x}")


def read_exact(f: FileIO, n: int) -> bytes:
    out = bytearray(n)
    readinto_exact(f, memoryview(out))
    return bytes(out)


def readinto_exact(f: FileIO, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            raise Bad(f"truncated: {got} of {len(buf)} bytes")
        got += n


def write_all(f: FileIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = f.write(view)
        view = view[n:]
