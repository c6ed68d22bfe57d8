"""`kvroute keys generate`: CurveZMQ key pairs for routers, workers and clients across hosts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import zmq


def generate(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (secret, mode 0600) and NAME.pub (public) in Z85 text; returns their paths."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path, key_path = directory / f"{name}.pub", directory / f"{name}.key"
    if key_path.exists():
        raise FileExistsError(f"{key_path} exists; remove it first or choose another --name")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"public = {public.decode()}\nsecret = {secret.decode()}\n")
    pub_path.write_text(f"public = {public.decode()}\n")
    return key_path, pub_path


def read_key(path: str | Path, *, secret: bool) -> bytes:
    """The Z85 public (or secret) key from a file written by `generate`. Raises ValueError naming the file."""
    want = "secret" if secret else "public"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read key file {path}: {exc.strerror}") from None
    for line in text.splitlines():
        k, _, v = line.partition("=")
        if k.strip() == want and len(v.strip()) == 40:
            return v.strip().encode()
    raise ValueError(f"{path} holds no {want} key (expected a line '{want} = <40 Z85 characters>')")


def read_public_keys(directory: str | Path) -> set[bytes]:
    """Every public key in the *.pub files of `directory`: the peers allowed in."""
    keys = {read_key(p, secret=False) for p in sorted(Path(directory).glob("*.pub"))}
    if not keys:
        raise ValueError(f"no *.pub files in {directory}: no peer could connect")
    return keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    gen = sub.add_parser("generate", help="write NAME.key and NAME.pub", description="Generate a CurveZMQ key pair.")
    gen.add_argument("--dir", default="/etc/kvroute/keys", help="where to write them (default: /etc/kvroute/keys)")
    gen.add_argument("--name", default="router", help="file name stem, e.g. router, worker-gpu3, client (default: router)")


def run(args: argparse.Namespace) -> int:
    from common.config import UsageError

    try:
        key_path, pub_path = generate(Path(args.dir), args.name)
    except (OSError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    print(
        f"secret key: {key_path} (keep it on this host)\npublic key: {pub_path} (copy it to the peers that must let this one in)"
    )
    return 0
