"""The master key never appears in logs, errors, records, files or the bucket; plaintext KV of a
private scope never reaches the disk or the remote tier."""

from __future__ import annotations

import base64
import logging

import pytest
import torch

from kvtier.errors import KvtierError
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import FileKeyProvider, LocalKeyProvider, parse_master_key
from kvtier.security.tokens import HmacKey, MintRequest, TokenVerifier, mint
from tests.security.builders import (
    ALICE,
    BOB,
    CacheRig,
    files_under,
    plant,
    raw_record,
    rehead,
    request,
    tensors,
)


def needles(secret: bytes) -> list[bytes]:
    b64 = base64.b64encode(secret)
    return [secret, secret.hex().encode(), secret.hex().upper().encode(), b64, b64.rstrip(b"="),
            base64.urlsafe_b64encode(secret).rstrip(b"=")]


def test_master_key_and_plaintext_stay_out_of_everything(tmp_path, make_s3_tier, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    rig = CacheRig(tmp_path / "node", ("memory", "lmdb", "s3"), make_s3=make_s3_tier)
    kek = parse_master_key(rig.master_key_path.read_bytes(), "test")
    errors: list[str] = []
    closed = False

    def attempt(fn) -> None:
        try:
            fn()
        except (KvtierError, ValueError, TypeError) as exc:
            errors.append(f"{exc!s} {exc!r}")

    try:
        a_chain = rig.save_request(ALICE, seed=11)
        blocks = rig.cache.load(ALICE, a_chain)
        rig.tier("lmdb").put(blocks)
        rig.tier("s3").put(blocks)
        secret_plain = bytes(tensors(5, seed=11)[3].reshape(-1).view(torch.uint8).numpy()[:96])
        # Every kind of failure, each leaving its message behind.
        attempt(lambda: rig.cache.load(BOB, a_chain))
        attempt(lambda: rig.cache.save(BOB, a_chain, tensors(5)))
        attempt(lambda: rig.cache.purge(BOB, "user:acme/alice"))
        attempt(lambda: KeyRing(LocalKeyProvider(bytes(32), source="wrong"), rig.local_keys))
        rig.master_key_path.chmod(0o644)
        attempt(lambda: FileKeyProvider(rig.master_key_path))
        rig.master_key_path.chmod(0o600)
        verifier = TokenVerifier([HmacKey("k", b"t" * 32)])
        attempt(lambda: verifier.verify(mint(HmacKey("k", b"f" * 32), MintRequest(ALICE, 60))))
        b_chain = rig.cache.chain(BOB, request())
        plant(rig, "s3", b_chain[3].key, rehead(raw_record(rig, "s3", a_chain[3].key), k=b_chain[3].key,
                                                 d=b_chain[3].key[:16], p=b_chain[2].key))
        attempt(lambda: rig.cache.load(BOB, b_chain))
        rig.policy.revoke(ALICE.id, actor="acme/boss")
        attempt(lambda: rig.cache.lookup(ALICE, a_chain))
        rig.policy.grant(ALICE.id, actor="acme/boss")
        rig.cache.purge(ALICE, "session")
        errors.extend([repr(rig.keyring), repr(rig.keyring.provider), repr(rig.cache.options.keyring)])
        # Everything that left process memory, or could: the bucket, every file, logs, errors.
        s3 = rig.tier("s3")
        bucket = [s3._client.get_object(Bucket=s3.config.bucket, Key=n)["Body"].read()
                  for n in _names(s3)]
        assert any(b"/_keys/" in n.encode() for n in _names(s3)), "wrapped keys are in the bucket"
        rig.close()
        closed = True
        files = {p: p.read_bytes() for p in files_under(tmp_path) if p != rig.master_key_path}
        assert any(p.name == "data.mdb" for p in files)
        haystacks = {**{str(p): b for p, b in files.items()}, **{f"s3:{i}": b for i, b in enumerate(bucket)},
                     "logs": caplog.text.encode(), "errors": "\n".join(errors).encode()}
        assert len(errors) >= 8
        for where, hay in haystacks.items():
            for needle in needles(kek):
                assert needle not in hay, f"master key found in {where}"
            if where.startswith("s3:") or where.endswith("data.mdb"):
                assert secret_plain not in hay, f"alice's plaintext KV found in {where}"
    finally:
        if not closed:
            rig.close()


def _names(s3) -> list[str]:
    out: list[str] = []
    for page in s3._client.get_paginator("list_objects_v2").paginate(Bucket=s3.config.bucket,
                                                                     Prefix=f"{s3.config.prefix}/"):
        out.extend(o["Key"] for o in page.get("Contents") or [])
    return out


@pytest.mark.parametrize("bad", [b"", b"0" * 63, b"not base64 at all!"])
def test_bad_key_material_errors_do_not_echo_it(tmp_path, bad: bytes) -> None:
    path = tmp_path / "k"
    path.write_bytes(bad)
    path.chmod(0o600)
    with pytest.raises(KvtierError) as exc:
        FileKeyProvider(path)
    if bad:
        assert bad.decode() not in str(exc.value)
