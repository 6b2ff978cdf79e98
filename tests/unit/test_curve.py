"""CURVE keys and settings, the ZAP handler on real tcp sockets, the ipc directory check and what
`tiller up` says before it starts (common/curve.py, common/sockets.py, common/startup_checks.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog
import zmq
import zmq.asyncio
import zmq.auth
from pydantic import ValidationError

from common import cli_ops, wire
from common.config import Curve, Settings, Tls
from common.curve import ClientHandshakes, CurveError, RefusalLog, keys_of, make_key_pair
from common.sockets import Dealer, PeerLost, Router, bind, owner_only_dir
from common.startup_checks import check_security
from tests.stack import free_port


@pytest.fixture
def pairs(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    """Key pairs of a hub, a listed worker and an unlisted one; the worker's public key in authorized/."""
    made = {name: make_key_pair(tmp_path / name, name) for name in ("hub", "worker", "stranger")}
    (tmp_path / "authorized").mkdir()
    (tmp_path / "authorized" / "worker.key").write_bytes(made["worker"][0].read_bytes())
    return made


def test_tiller_keys_writes_an_owner_only_pair_and_never_overwrites_one(tmp_path: Path, capsys) -> None:
    assert cli_ops.keys(tmp_path / "keys", "host-a") == 0
    public, secret = tmp_path / "keys" / "host-a.key", tmp_path / "keys" / "host-a.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pub, sec = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (pub, None) and len(sec) == 40  # z85 of 32 bytes
    assert f"TILLER_CURVE__SECRET_KEY={secret.resolve()}" in capsys.readouterr().out
    before = secret.read_bytes()
    assert cli_ops.keys(tmp_path / "keys", "host-a") == 1
    assert "exists" in capsys.readouterr().err and secret.read_bytes() == before


def test_keys_load_or_say_what_is_wrong(pairs, tmp_path: Path) -> None:
    hub_public, hub_secret = pairs["hub"]
    worker_public, worker_secret = pairs["worker"]
    assert keys_of(Curve()) is None
    keys = keys_of(Curve(secret_key=worker_secret, server_key=hub_public))
    assert keys is not None and keys.server_public == zmq.auth.load_certificate(hub_public)[0]
    alone = keys_of(Curve(secret_key=hub_secret))
    assert alone is not None and alone.server_public == alone.public  # a host that only talks to itself
    with pytest.raises(CurveError, match="holds a public key only"):
        keys_of(Curve(secret_key=hub_public))
    with pytest.raises(CurveError, match="need secret_key"):
        keys_of(Curve(server_key=hub_public))
    with pytest.raises(CurveError, match="cannot read the secret key"):
        keys_of(Curve(secret_key=tmp_path / "missing.key_secret"))
    with pytest.raises(CurveError, match="not a directory"):
        keys_of(Curve(secret_key=hub_secret, authorized_keys=hub_public))
    worker_secret.chmod(0o640)
    with pytest.raises(CurveError, match="readable by others.*chmod 600"):
        keys_of(Curve(secret_key=worker_secret, server_key=hub_public, authorized_keys=tmp_path))


def test_tls_takes_both_files_or_neither(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="go together"):
        Tls(certfile=tmp_path / "cert.pem")
    assert not Tls().enabled and Tls(certfile=tmp_path / "c", keyfile=tmp_path / "k").enabled


def test_refusals_are_logged_once_per_peer_per_interval() -> None:
    refusals = RefusalLog(interval_s=10)
    assert refusals.due("a", 0.0) == 0
    assert refusals.due("a", 1.0) is None and refusals.due("a", 2.0) is None
    assert refusals.due("b", 2.0) == 0  # another peer is its own line
    assert refusals.due("a", 10.5) == 2  # with the two it did not log


def test_an_ipc_directory_others_may_enter_is_fixed_and_another_users_refused(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh" / "run"
    assert owner_only_dir(fresh) is None and stat.S_IMODE(fresh.stat().st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    assert "made owner-only" in (owner_only_dir(open_dir) or "")
    assert stat.S_IMODE(open_dir.stat().st_mode) == 0o700
    if os.geteuid() == 0:  # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4242, 4242)
        with pytest.raises(PermissionError, match="belongs to uid 4242"):
            owner_only_dir(theirs)


async def test_an_ipc_socket_file_is_owner_only(tmp_path: Path) -> None:
    router = Router(zmq.asyncio.Context.instance(), f"ipc://{tmp_path}/run/x.sock")
    try:
        assert stat.S_IMODE((tmp_path / "run" / "x.sock").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700
    finally:
        router.close()


def test_tiller_up_warns_on_plaintext_tcp_and_refuses_bad_keys_or_certificates(pairs, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    plain = check_security(Settings(run_dir=run_dir, worker_endpoint="tcp://0.0.0.0:5557"))
    assert not plain.refusal and any("WARNING" in n and "tcp://0.0.0.0:5557" in n for n in plain.notes)
    keyed = check_security(Settings(run_dir=run_dir, worker_endpoint="tcp://0.0.0.0:5557",
                                    curve=Curve(secret_key=pairs["hub"][1])))
    assert not keyed.refusal and not keyed.notes
    assert "public key only" in check_security(Settings(run_dir=run_dir, curve=Curve(secret_key=pairs["hub"][0]))).refusal
    (tmp_path / "cert.pem").write_text("not a certificate")
    tls = Tls(certfile=tmp_path / "cert.pem", keyfile=tmp_path / "cert.pem")
    assert "tls: cannot serve" in check_security(Settings(run_dir=run_dir, tls=tls)).refusal


async def _answered(endpoint: str, curve: Curve | None) -> bool | str:
    """True: answered; else what the Dealer's request raised, which names the refusal (never a timeout)."""
    dealer = Dealer(zmq.asyncio.Context.instance(), endpoint, curve=curve)
    try:
        await dealer.request(wire.Health(), timeout=10.0)
        return True
    except PeerLost as exc:
        assert dealer.refusal == str(exc)
        with pytest.raises(PeerLost):  # at once from now on
            await dealer.request(wire.Health(), timeout=10.0)
        return str(exc)
    finally:
        dealer.close()


async def test_a_curve_server_answers_listed_keys_only_and_logs_each_refused_peer(pairs, tmp_path: Path) -> None:
    hub_public, hub_secret = pairs["hub"]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = Router(zmq.asyncio.Context.instance(), endpoint,
                    curve=Curve(secret_key=hub_secret, authorized_keys=tmp_path / "authorized"))

    async def serve() -> None:
        while True:
            identity, msg, _ = await router.recv()
            await router.send(identity, wire.HealthReply(mid=msg.mid, service="test", ready=True))

    serving = asyncio.create_task(serve())
    try:
        with structlog.testing.capture_logs() as logs:
            assert await _answered(endpoint, Curve(secret_key=pairs["worker"][1], server_key=hub_public))
            assert await _answered(endpoint, Curve(secret_key=hub_secret))  # the hub's own processes
            refusal = f"{endpoint} refused this host's CURVE handshake"
            assert refusal in await _answered(endpoint, Curve(secret_key=pairs["stranger"][1], server_key=hub_public))
            assert refusal in await _answered(endpoint, None)  # no key at all
            # a key for another server: the hub cannot read its hello
            assert refusal in await _answered(endpoint, Curve(secret_key=pairs["worker"][1],
                                                              server_key=pairs["stranger"][0]))
            # listed now, it is let in without a restart
            (tmp_path / "authorized" / "stranger.key").write_bytes(pairs["stranger"][0].read_bytes())
            assert await _answered(endpoint, Curve(secret_key=pairs["stranger"][1], server_key=hub_public))
            time.sleep(0.2)  # the monitor thread's last line
        told = [e["reason"] for e in logs if e["event"] == "curve.refused_by_server"]  # each client logs why
        assert len(told) == 3 and "refused this host's key" in told[0] and "has no CURVE key" in told[1], told
        assert "this host has a CURVE key" in told[2], told
        refused = [entry for entry in logs if entry["event"] == "curve.refused"]
        stranger = zmq.auth.load_certificate(pairs["stranger"][0])[0].decode()
        assert any(e.get("key") == stranger and e.get("address") == "127.0.0.1" and e["reason"] == "Unknown key"
                   for e in refused), refused
        handshakes = [e for e in refused if e.get("zmq_event") == "HANDSHAKE_FAILED_PROTOCOL"]
        assert len({e["code"] for e in handshakes}) == 2, refused  # no key; a key for another server
    finally:
        serving.cancel()
        router.close()


def test_a_handshake_refused_or_cut_short_again_and_again_is_final_and_one_that_succeeds_resets() -> None:
    handshakes = ClientHandshakes()
    assert handshakes.refused(zmq.EVENT_HANDSHAKE_FAILED_AUTH) and handshakes.refused(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    cut = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    assert not handshakes.refused(cut) and not handshakes.refused(cut)
    assert not handshakes.refused(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # a server that died mid-handshake, back
    assert not handshakes.refused(cut) and not handshakes.refused(cut) and handshakes.refused(cut)
    assert not ClientHandshakes().refused(zmq.EVENT_CONNECTED)


def _greeting_cutter() -> tuple[socket.socket, threading.Event]:
    """A server that, like a CURVE server seeing a NULL client's mechanism before its own greeting is out,
    closes every connection after the first 11 bytes of its ZMTP greeting."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                with conn:
                    conn.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03")
                    received = b""
                    while len(received) < 64 and (chunk := conn.recv(64)):
                        received += chunk
            except OSError:  # no client this interval (a timeout), one gone mid-greeting, the listener closed
                continue

    threading.Thread(target=serve, daemon=True).start()
    return listener, stop


def _refusing_server(tmp_path: Path, pairs) -> tuple[zmq.Socket, str]:
    """A CURVE server (the hub's key pair, authorized/ listing only the worker) bound on loopback."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    bind(sock, endpoint, Curve(secret_key=pairs["hub"][1], authorized_keys=tmp_path / "authorized"))
    return sock, endpoint


def _worker_exit(endpoint: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "common.cli", "worker", "--scheduler", endpoint],
                          env=dict(os.environ, TILLER_RUN_DIR=str(tmp_path / "run"), **env),
                          capture_output=True, text=True, timeout=60)


def test_a_worker_whose_handshakes_are_cut_short_stops_saying_why(tmp_path: Path) -> None:
    """ZeroMQ retries a handshake the server cut short forever: the worker counts them and stops."""
    listener, stop = _greeting_cutter()
    try:
        worker = _worker_exit(f"tcp://127.0.0.1:{listener.getsockname()[1]}", tmp_path)
    finally:
        stop.set()
        listener.close()
    assert worker.returncode != 0
    assert '"worker.refused"' in worker.stdout + worker.stderr and "this host has no CURVE key" in worker.stderr, \
        worker.stderr[-3000:]


def test_a_worker_whose_key_is_refused_stops_saying_why(tmp_path: Path, pairs) -> None:
    """ZeroMQ drops a connection whose key the server's ZAP handler refused and never retries it: the worker
    must read the refusal on its monitor rather than block on a hello it can no longer queue anywhere."""
    sock, endpoint = _refusing_server(tmp_path, pairs)
    try:
        worker = _worker_exit(endpoint, tmp_path, TILLER_CURVE__SECRET_KEY=str(pairs["stranger"][1]),
                              TILLER_CURVE__SERVER_KEY=str(pairs["hub"][0]))
    finally:
        sock.close(0)
    assert worker.returncode != 0 and "refused this host's key" in worker.stderr, worker.stderr[-3000:]
