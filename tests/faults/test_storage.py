"""Storage faults are visible and retryable on a real controller: its data dir on a small filesystem of its own
(tmpfs with size=, mounted for the test: needs root) fills up and is freed; its store file is deleted under it.
Writes answer 503 with the reason (not 500), /readyz says why, nothing written before is lost, the admin token stays
the same, and a controller whose store file is gone stops serving instead of writing into the unlinked file."""
from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from support.controller_process import ControllerProcess
from support.sim.noop import NOOP, PLUGINS
from rolloutd.controller.store.faults import StorageWatch, storage_reason
from support.waiting import wait_until

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))}  # bench-noop


ROWS = Path(__file__).resolve().parent / "data" / "rows.jsonl"  # a dataset the controller can read (checked at apply)


def job(name: str) -> dict:
    """A job no executor runs (the controller starts with none): only the store is exercised."""
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name}, "spec": {
        "tasks": {"kind": NOOP, "source": str(ROWS)}, "agent": {"kind": "oracle", "maxTurns": 1},
        "executor": {"kind": "local", "nodes": 1}}}


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder: Path) -> Path:
    """A file that takes every free byte of `folder`'s filesystem. Unbuffered: a buffered file kept the bytes its
    last write could not place and raised ENOSPC again when closed (a flake, depending on where the disk ran out)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:
            pass
    return filler


def _logs(tmp_path: Path, fs: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in [*tmp_path.glob("controller-*.log"), *fs.glob("*.log")])


def test_a_full_disk_answers_503_with_the_reason_and_loses_nothing_once_freed(small_fs, tmp_path):
    data = small_fs / "data"
    data.mkdir()
    c = ControllerProcess(data, env=ENV).start()
    try:
        token = c.token
        with c.client() as api:
            for i in range(3):
                assert api.post(P, json=job(f"before-{i}")).status_code == 201
            assert api.get("/readyz").status_code == 200
            filler = _fill(small_fs)
            refused = [api.post(P, json=job(f"full-{i}")) for i in range(20)]  # some may fit in SQLite's last pages
            assert {r.status_code for r in refused} <= {201, 503}, [r.text for r in refused]
            full = [r for r in refused if r.status_code == 503]
            assert full, "a write on a full disk was taken"
            assert "full" in full[-1].json()["message"] and full[-1].headers["Retry-After"]
            ready = api.get("/readyz")
            assert ready.status_code == 503 and "full" in ready.text
            assert api.get("/healthz").status_code == 200  # alive: restarting it would not free the disk
            filler.unlink()
            wait_until(lambda: api.get("/readyz").status_code == 200, 30, "readiness once the disk has room", every=0.2)
            assert api.post(P, json=job("after")).status_code == 201
            names = {j["metadata"]["name"] for j in api.get(P).json()["items"]}
            taken = {f"full-{i}" for i, r in enumerate(refused) if r.status_code == 201}
            assert names == {"before-0", "before-1", "before-2", "after"} | taken
        assert c.token == token
    finally:
        c.stop()
    c.start()  # the same store, the same token: nothing lost across a restart either
    try:
        with c.client(token) as api:
            assert {"before-0", "before-1", "before-2", "after"} <= {j["metadata"]["name"]
                                                                     for j in api.get(P).json()["items"]}
    finally:
        c.stop()
    assert _logs(tmp_path, small_fs).count("Traceback") <= 1


def test_a_store_file_deleted_under_a_running_controller_stops_it_serving(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    c = ControllerProcess(data, env=ENV).start()
    try:
        with c.client() as api:
            assert api.post(P, json=job("kept")).status_code == 201
            (data / "rolloutd.db").unlink()
            wait_until(lambda: api.get("/healthz").status_code == 503, 10, "the controller to see its store gone",
                       every=0.1)
            assert "was removed" in api.get("/healthz").text and api.get("/readyz").status_code == 503
            refused = api.post(P, json=job("void"))
            assert refused.status_code == 503 and "restore it from a backup" in refused.json()["message"]
            assert api.get(P).status_code == 503  # nothing served from the unlinked file either
    finally:
        c.stop()


def test_a_missing_token_is_never_silently_re_minted_and_a_corrupt_store_names_the_file(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    c = ControllerProcess(data, env=ENV).start()
    c.stop()
    (data / "token").unlink()  # as after an fsck that lost it
    run = [*c_args(data), "--port", "0"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, env={**os.environ, **ENV})
    assert out.returncode != 0 and "token" in out.stderr and "Restore the file from a backup" in out.stderr
    assert not (data / "token").exists()
    (data / "token").write_text("kept\n")
    (data / "rolloutd.db").write_bytes(b"not a database" * 100)
    for extra in ("rolloutd.db-wal", "rolloutd.db-shm"):
        (data / extra).unlink(missing_ok=True)
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, env={**os.environ, **ENV})
    assert out.returncode != 0 and str(data / "rolloutd.db") in out.stderr and "backup" in out.stderr
    assert "Traceback" not in out.stderr


def c_args(data: Path) -> list[str]:
    import sys
    return [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(data),
            "--executors", ""]


def test_a_read_only_filesystem_is_not_ready_and_its_write_errors_are_storage_faults(small_fs):
    """The filesystem goes read-only (remounted: the kernel refuses that while a file is open for writing, so no
    controller holds this store): readiness names it, and SQLite's refusal is a storage fault (503), not a bug."""
    db = small_fs / "rolloutd.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    watch = StorageWatch(db)
    assert watch.problem() is None
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        assert "not writable" in watch.problem()
        conn = sqlite3.connect(db)
        with pytest.raises(sqlite3.OperationalError) as refused:
            conn.execute("INSERT INTO t VALUES (1)")
            conn.commit()
        conn.close()
        assert "cannot be written" in storage_reason(refused.value)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    assert watch.problem() is None
    assert storage_reason(ValueError("a bug")) is None


def test_a_statement_libpq_refuses_is_not_read_as_the_server_out_of_reach(pg_server):
    """On a real server: a statement past 65 535 parameters is refused by libpq with no SQLSTATE, as a lost
    connection's error is; read as an outage, one request made the controller not ready for every tenant. A
    connection the server ended is still the server's fault."""
    import psycopg
    url = pg_server.create_database()
    with psycopg.connect(url, autocommit=True) as conn, psycopg.connect(url, autocommit=True) as other:
        with pytest.raises(psycopg.OperationalError) as refused:
            conn.execute("SELECT 1 WHERE 1 IN (" + ",".join(["%s"] * 70_000) + ")", [1] * 70_000)
        assert refused.value.sqlstate is None and storage_reason(refused.value) is None
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the connection was fine
        conn.execute("SELECT pg_terminate_backend(%s)", [other.info.backend_pid])
        with pytest.raises(psycopg.OperationalError) as gone:
            other.execute("SELECT 1")
        assert "cannot be reached" in storage_reason(gone.value)


@pytest.fixture
def ext4_disk(tmp_path) -> Iterator[tuple[Path, str]]:
    """An ext4 filesystem of its own (a loop device, mounted with errors=remount-ro as a real data disk is): the
    kernel turns it read-only under open files when it records an error (`/sys/fs/ext4/<dev>/trigger_fs_error`,
    the kernel's own test hook), which `mount -o remount,ro` refuses to do while a file is open for writing."""
    if os.geteuid() != 0:
        pytest.skip("a loop device needs root")
    image, mnt = tmp_path / "disk.img", tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    dev = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        subprocess.run(["blockdev", "--setrw", dev], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True)
        subprocess.run(["mount", "-o", "errors=remount-ro", dev, str(mnt)], check=True)
        yield mnt, dev
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        subprocess.run(["losetup", "-d", dev], check=False)


def test_a_disk_turned_read_only_under_a_live_controller_refuses_writes_serves_reads_and_loses_nothing(ext4_disk):
    """The store's disk goes read-only while the controller runs: API writes and node calls that write answer 503
    with the reason, reads keep working, /readyz says why (its write probe: the kernel's emergency read-only passes
    `access` and `statvfs`), /healthz stays 200. ext4 lifts that state only by unmounting (fsck, mount): the
    recovery is a restart on the repaired disk, with every write that was answered 201 there and the same token
    (#37: CI lost one of three 201s when the journal aborted right after them, before a checkpoint synced the WAL;
    a write is now answered only once its commit is synced, `durability.Durable`)."""
    from rolloutd.crds.node import NODE_PROTOCOL
    mnt, dev = ext4_disk
    c = ControllerProcess(mnt / "data", env=ENV).start()
    try:
        token = c.token
        with c.client() as api:
            assert api.get("/readyz").status_code == 200
            for i in range(3):
                assert api.post(P, json=job(f"before-{i}")).status_code == 201
            # at once after the last 201: no checkpoint (every 50 ms, `wal_checkpoints.py`) has synced it yet
            Path(f"/sys/fs/ext4/{Path(dev).name}/trigger_fs_error").write_text("rolloutd test: disk gone read-only\n")
            refused = api.post(P, json=job("during"))
            assert refused.status_code == 503, refused.text
            assert "cannot be written" in refused.json()["message"] and int(refused.headers["Retry-After"]) > 0
            node = api.post(f"{P}/before-0/nodes/register", json={"job": "before-0", "name": "n0",
                                                                    "protocol": NODE_PROTOCOL})
            assert node.status_code == 503 and "cannot be written" in node.json()["message"], node.text
            assert {j["metadata"]["name"] for j in api.get(P).json()["items"]} == {f"before-{i}" for i in range(3)}
            assert api.get(f"{P}/before-1").status_code == 200
            ready = api.get("/readyz")
            assert ready.status_code == 503 and "cannot be written" in ready.text, ready.text
            assert api.get("/healthz").status_code == 200
    finally:
        c.stop()
    subprocess.run(["umount", str(mnt)], check=True)
    subprocess.run(["e2fsck", "-fy", dev], check=False, capture_output=True)  # 1: errors corrected
    subprocess.run(["mount", "-o", "errors=remount-ro", dev, str(mnt)], check=True)
    c.start()
    try:
        assert c.token == token
        with c.client(token) as api:
            assert api.get("/readyz").status_code == 200
            assert api.post(P, json=job("after")).status_code == 201
            names = {j["metadata"]["name"] for j in api.get(P).json()["items"]}
            assert names == {"before-0", "before-1", "before-2", "after"}, names
    finally:
        c.stop()
