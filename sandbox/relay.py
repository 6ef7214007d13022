"""The relay that brings a Unix socket of the host onto a sandbox's own loopback: a Python script run inside it.

Used by the harness gateway (agents/gateway/server.py: the harness's `OPENAI_BASE_URL`) and by image builds
(build_step.py: a RUN step's `http_proxy`, the egress proxy of egress.py). Two blocking threads per connection:
~0.05 ms per call, where an asyncio pipe added ~0.3 ms (bench/results/RESULTS-gateway.md).

    python3 -I -c RELAY SOCKET PORT               serve until killed; prints "relay ready" once listening
    python3 -I -c RELAY SOCKET PORT CMD ARG...    serve in a child (its output to /dev/null), exec CMD
"""
from __future__ import annotations

RELAY = r"""
import os, socket, sys, threading
def pipe(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
def serve(client):
    try:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream = socket.socket(socket.AF_UNIX)
        upstream.connect(sys.argv[1])
    except OSError:
        client.close()
        return
    back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
    back.start()
    pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()
def accept(server):
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
server = socket.create_server(("127.0.0.1", int(sys.argv[2])), backlog=64)
if len(sys.argv) > 3:
    if os.fork() == 0:
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        accept(server)
    server.close()
    os.execvp(sys.argv[3], sys.argv[3:])
print("relay ready", flush=True)
accept(server)
"""
