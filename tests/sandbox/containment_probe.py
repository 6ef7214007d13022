"""Hostile code for the containment suite: runs INSIDE a sandbox and tries every escape.

Run by `containment_driver.py` as ``python3 probe.py ARGS_JSON OUT_JSON``; writes
``{case: "contained" | "ESCAPED: what happened"}``. Every dangerous syscall is
tried in a forked child, so one that succeeds cannot disturb the others.
Syscall numbers are x86_64's (the driver skips other machines).
"""
import ctypes
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

args = json.loads(sys.argv[1])
TAG = args["tag"]
libc = ctypes.CDLL(None, use_errno=True)
results = {}

NR = {"mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
      "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kexec_load": 246,
      "kexec_file_load": 320, "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248,
      "request_key": 249, "init_module": 175, "finit_module": 313, "delete_module": 176, "swapon": 167,
      "swapoff": 168, "reboot": 169, "open_by_handle_at": 304, "userfaultfd": 323, "personality": 135,
      "io_uring_setup": 425, "pidfd_getfd": 438, "acct": 163, "clone": 56}
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000


def in_child(fn):
    """fn() -> None if contained, else a description; run in a fork so success harms nothing."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001
            out = f"probe error {type(e).__name__}: {e}"
        os.write(w, (out or "").encode()[:4000])
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data.decode() or None


def case(name, fn, *, fork=True):
    out = in_child(fn) if fork else fn()
    results[name] = "contained" if not out else f"ESCAPED: {out}"


def syscall(name, *a):
    libc.syscall.restype = ctypes.c_long
    ret = libc.syscall(NR[name], *[ctypes.c_long(x) if isinstance(x, int) else x for x in a])
    return ret, ctypes.get_errno()


def must_fail(name, *a, want=None):
    def fn():
        ret, err = syscall(name, *a)
        if ret >= 0:
            return f"{name} succeeded"
        if want is not None and err != want:
            return f"{name} failed with {errno.errorcode.get(err, err)}, not {errno.errorcode[want]} (no filter)"
        return None
    return fn


def status_field(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return ""


# -- privileges ---------------------------------------------------------------------------------
CAP_SETS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
case("no capabilities", lambda: ", ".join(f"{k} {status_field(k)}" for k in CAP_SETS if int(status_field(k), 16)))
case("not root inside", lambda: None if os.geteuid() != 0 and os.getuid() != 0 else "uid 0")
case("no_new_privs", lambda: None if status_field("NoNewPrivs") == "1" else "NoNewPrivs 0")
case("seccomp filter", lambda: None if status_field("Seccomp") == "2" else f"Seccomp {status_field('Seccomp')}")

# -- remount and mounts -------------------------------------------------------------------------


def remount_and_write():
    done = []
    for path in ("/usr", "/etc", "/"):
        p = subprocess.run(["mount", "-o", "remount,bind,rw", path], capture_output=True)
        if p.returncode == 0:
            done.append(f"remounted {path} rw")
        try:
            with open(os.path.join(path, f"rolloutd-probe-{TAG}"), "w") as f:
                f.write("x")
            done.append(f"wrote {path}")
        except OSError:
            pass
    return "; ".join(done)


case("remount rw", remount_and_write)
os.makedirs("/tmp/mnt", exist_ok=True)
case("mount tmpfs", must_fail("mount", b"none", b"/tmp/mnt", b"tmpfs", 0, None))
case("mount binary (setuid)", lambda: None if subprocess.run(["mount", "-t", "tmpfs", "none", "/tmp/mnt"],
                                                             capture_output=True).returncode else "mounted")
case("su (setuid)", lambda: None if subprocess.run(["su", "-c", "true", "root"], capture_output=True,
                                                   stdin=subprocess.DEVNULL).returncode else "su to root worked")
case("umount2", must_fail("umount2", b"/tmp/mnt", 2, want=errno.EPERM))  # not a mount point: EINVAL unfiltered
case("pivot_root", must_fail("pivot_root", b"/nonexistent-a", b"/nonexistent-b", want=errno.EPERM))
case("chroot", must_fail("chroot", b"/tmp"))

# -- namespaces -----------------------------------------------------------------------------------
case("unshare user ns", must_fail("unshare", CLONE_NEWUSER))
case("unshare mount ns", must_fail("unshare", CLONE_NEWNS))
case("unshare -Ur binary", lambda: None if subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode
     else "unshare -Ur true worked")


def clone_namespaces():
    ret, _ = syscall("clone", CLONE_NEWPID | CLONE_NEWNET | signal.SIGCHLD, 0, 0, 0, 0)
    if ret == 0:
        os._exit(0)  # the new child
    return "clone with new namespaces succeeded" if ret > 0 else None


case("clone new pid+net ns", clone_namespaces)


def setns_init():
    ret, err = syscall("setns", os.open("/proc/self/ns/mnt", os.O_RDONLY), 0)  # a no-op, unless refused
    if ret == 0 or err != errno.EPERM:
        return f"setns answered {ret} ({errno.errorcode.get(err, err)}), not EPERM"
    return None


case("setns", setns_init)

# -- the exec server (pid 1) ------------------------------------------------------------------------


def ptrace_server():
    ret, _ = syscall("ptrace", 16, 1, 0, 0)  # PTRACE_ATTACH: it stops the server
    if ret != 0:
        return None
    os.waitpid(1, 0x40000000)  # __WALL
    syscall("ptrace", 17, 1, 0, 0)  # PTRACE_DETACH, then let it run again (or the sandbox hangs)
    os.kill(1, signal.SIGCONT)
    return "attached to (and froze) the exec server"


case("ptrace attach server", ptrace_server)


def read_server_memory():
    try:
        with open("/proc/1/mem", "rb") as f:
            f.seek(0x400000)
            f.read(16)
        return "read /proc/1/mem"
    except OSError:
        return None


case("server memory", read_server_memory)
case("server environ", lambda: None if not os.access("/proc/1/environ", os.R_OK) else "/proc/1/environ readable")
case("process_vm_readv server", must_fail("process_vm_readv", 1, None, 1, None, 1, 0))


def dumpable_children():  # the probe itself was exec'd by the (non-dumpable) server's bash
    return None if libc.prctl(3, 0, 0, 0, 0) == 1 else "agent code is not dumpable (children of the server broken)"


case("agent code dumpable", dumpable_children)

# -- kernel attack surface: the filter answers EPERM -------------------------------------------------
for name, a in {
    "kexec_load": (0, 0, None, 0x7FFF0000), "kexec_file_load": (-1, -1, 0, None, 0), "bpf": (5, None, 0),
    "perf_event_open": (None, 0, -1, -1, 0), "keyctl": (0, -2, 0), "add_key": (b"user", b"rolloutd", b"x", 1, -2),
    "request_key": (b"user", b"rolloutd", None, 0), "init_module": (None, 0, b""), "finit_module": (-1, b"", 0),
    "delete_module": (b"rolloutd_none", 0), "swapon": (b"/nonexistent", 0), "swapoff": (b"/nonexistent",),
    "reboot": (0, 0, 0, None), "open_by_handle_at": (-1, None, 0), "userfaultfd": (0,),
    "io_uring_setup": (1, None), "acct": (b"/nonexistent/rolloutd",), "personality": (0x0040000,),  # ADDR_NO_RANDOMIZE
}.items():
    case(f"syscall {name}", must_fail(name, *a, want=errno.EPERM))



def i386_abi():
    """The classic filter bypass: the same kernel entered through the 32-bit ABI (int 0x80)."""
    import mmap

    code = b"\xb8\x14\x00\x00\x00\xcd\x80\xc3"  # mov eax, 20 (getpid on i386); int 0x80; ret
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    pid = ctypes.CFUNCTYPE(ctypes.c_int)(addr)()  # a filter that knows its ABI kills us here (SIGSYS)
    return f"an i386 syscall answered ({pid})"




def i386_abi_killed():
    pid = os.fork()
    if pid == 0:
        i386_abi()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS:
        return None  # the filter killed it
    return f"an i386 syscall ran (child status {status:#x})"


case("i386 syscall ABI", i386_abi_killed, fork=False)

# -- files: writes outside the workspace, secrets ----------------------------------------------------


def write_everywhere():
    done = []
    for d in args["write_targets"]:
        try:
            with open(os.path.join(d, f"rolloutd-probe-{TAG}"), "w") as f:
                f.write("x")
            done.append(d)  # the driver checks whether it reached the host
        except OSError:
            pass
    results["_written_inside"] = done


write_everywhere()
for path in args["secrets"]:
    def read_secret(path=path):
        try:
            if os.path.isdir(path):  # bwrap's directories leading to the interpreter are no secret
                names = [n for n in os.listdir(path)
                         if not any(k.startswith(os.path.join(path, n) + "/") or k == os.path.join(path, n)
                                    for k in args["runtime_paths"])]
                return f"listed {path}: {names[:5]}" if names else None
            with open(path, "rb") as f:
                f.read(1)
            return f"read {path}"
        except OSError:
            return None
    case(f"read {path}", read_secret)
case("/proc/1/root escape", lambda: next((f"read {p}" for p in ("/proc/1/root/etc/shadow", "/proc/1/root/root")
                                          if os.access(p, os.R_OK)), None))


def write_sys():
    done = []
    for p in ("/sys/kernel/mm/transparent_hugepage/enabled", "/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern",
              "/proc/sys/vm/drop_caches"):
        try:
            os.close(os.open(p, os.O_WRONLY))  # opening for write is the escape; nothing is written
            done.append(p)
        except OSError:
            pass
    return ", ".join(done)


case("/sys and /proc/sys writes", write_sys)

# -- network ---------------------------------------------------------------------------------------


def raw_sockets():
    done = []
    for fam, typ, proto in ((socket.AF_PACKET, socket.SOCK_RAW, 0), (socket.AF_INET, socket.SOCK_RAW, 1)):
        try:
            socket.socket(fam, typ, proto).close()
            done.append(f"{fam.name}/{typ.name}")
        except OSError:
            pass
    return ", ".join(done)


case("raw sockets", raw_sockets)


def network():
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect(("127.0.0.1", args["host_port"]))
        return "reached the host's 127.0.0.1"
    except OSError:
        pass
    with open("/proc/net/dev") as f:  # this namespace's interfaces (/sys/class/net is the host's view)
        ifaces = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
    return None if ifaces in ([], ["lo"]) else f"interfaces {ifaces}"


case("network false", network)

# -- resources ---------------------------------------------------------------------------------------


def fork_bomb():
    kids = []
    try:
        for _ in range(args["fork_cap"]):
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            kids.append(pid)
    except OSError:
        pass
    n = len(kids)
    for pid in kids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return None if n < args["fork_cap"] else f"forked {n} processes"


case("fork bomb", fork_bomb)


def memory_bomb():
    try:
        blob = bytearray(args["memory_bytes"] * 2)
        return f"allocated {len(blob)} bytes"
    except MemoryError:
        return None


case("memory bomb", memory_bomb)


def fill(path, size):
    try:
        with open(path, "wb") as f:
            chunk = b"\0" * (1 << 20)
            for _ in range(size // len(chunk) + 2):
                f.write(chunk)
        return f"wrote {os.path.getsize(path)} bytes to {path}"
    except OSError:
        return None
    finally:
        if os.path.exists(path):
            os.unlink(path)


signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
case("/tmp fill", lambda: fill("/tmp/fill", args["tmp_bytes"]))
case("workspace file fill", lambda: fill("/workspace/fill", args["file_bytes"]))

# leave a daemon behind: the driver checks it is gone after close
subprocess.Popen(["setsid", "sleep", "1000"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, ROLLOUTD_PROBE=TAG))
with open(sys.argv[2], "w") as out:
    json.dump(results, out)
