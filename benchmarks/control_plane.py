"""Control-plane benchmark: the runtime transport against raw pyzmq, measured in one run.

1. Round trip: controller → agent command → acknowledgement, p50/p99, through
   `ControllerEndpoint`/`AgentEndpoint` vs a raw pyzmq ROUTER/DEALER echoing the same msgpack
   payload. The responder runs in a child process in both cases. Target: runtime ≤ 2× raw.
2. Sustained rate with N (default 64) agent connections, each keeping a window of reliable
   events in flight (sent, acknowledged, de-duplicated) vs raw DEALERs doing send + ack with the
   same window. Connections live in one child process; the controller in this one.
3. Death detection: an agent process launches a worker; we SIGKILL the worker and time until
   the controller receives the agent's `exited` event (pidfd in the agent's poll loop), vs the
   heartbeat path: SIGKILL the agent itself and time until the controller reports it silent.

Run: `.venv/bin/python benchmarks/control_plane.py` (about a minute). Flags for bigger runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from ehp_fsm.runtime import (
    Acked,
    AgentEndpoint,
    ControllerEndpoint,
    FdReady,
    Kind,
    PeerSilent,
    ProcessWatcher,
    Received,
    TransportConfig,
    capture,
    new_launch_token,
)

ARGS = {
    "engine": "e-3",
    "gpus": [0, 1],
    "revision": 17,
    "model": "/ckpt/policy/rev-17",
    "env": {"CUDA_VISIBLE_DEVICES": "0,1"},
    "note": "x" * 96,
}
PAYLOAD = msgpack.packb({"op": "launch", "args": ARGS}, use_bin_type=True)
FAST = TransportConfig(retry_interval_s=1.0, deadline_s=30.0, heartbeat_interval_s=1.0)


def pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- 1. round trip ---------------------------------------------------------------------------


def _raw_echo(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"agent")
    sock.connect(endpoint)
    sock.send(b"ready")
    while True:
        data = sock.recv()
        sock.send(msgpack.packb({"ref": msgpack.unpackb(data)["id"]}))


def _runtime_echo(endpoint: str) -> None:
    agent = AgentEndpoint(connect=endpoint, host_id="agent", config=FAST)
    agent.hello({})
    while True:
        for item in agent.poll(1.0):
            if isinstance(item, Received):
                agent.reply(item, ok=True, result=None)


def bench_rtt(n: int) -> dict[str, float]:
    spawn = mp.get_context("spawn")
    # raw
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    child = spawn.Process(target=_raw_echo, args=(f"tcp://127.0.0.1:{port}",), daemon=True)
    child.start()
    peer, _ = router.recv_multipart()
    raw: list[float] = []
    cpu0 = time.process_time()
    for i in range(n + n // 10):
        frame = msgpack.packb({"id": f"m-{i}", "payload": PAYLOAD}, use_bin_type=True)
        t0 = time.perf_counter()
        router.send_multipart([peer, frame])
        router.recv_multipart()
        if i >= n // 10:  # warm-up discarded
            raw.append(time.perf_counter() - t0)
    raw_cpu = (time.process_time() - cpu0) / (n + n // 10)
    child.terminate()
    child.join()
    router.close(linger=0)
    ctx.term()
    # runtime
    args = msgpack.unpackb(PAYLOAD)["args"]
    with ControllerEndpoint(config=FAST) as ctl:
        child = spawn.Process(target=_runtime_echo, args=(ctl.endpoint,), daemon=True)
        child.start()
        while "agent" not in ctl.peers():
            ctl.poll(0.1)
        ack: list[float] = []
        cpu0 = time.process_time()
        for i in range(n + n // 10):
            t0 = time.perf_counter()
            msg_id = ctl.send_command("agent", "launch", args)
            done = False
            while not done:
                for item in ctl.poll(1.0):
                    if isinstance(item, Acked) and item.msg_id == msg_id:
                        done = True
            if i >= n // 10:
                ack.append(time.perf_counter() - t0)
        rt_cpu = (time.process_time() - cpu0) / (n + n // 10)
        child.terminate()
        child.join()
    return {
        "raw_p50": pct(raw, 0.5),
        "raw_p99": pct(raw, 0.99),
        "rt_p50": pct(ack, 0.5),
        "rt_p99": pct(ack, 0.99),
        "raw_cpu": raw_cpu,
        "rt_cpu": rt_cpu,
    }


# ---- 2. sustained rate with many connections -------------------------------------------------


def _raw_agents(endpoint: str, n: int, window: int) -> None:
    ctx = zmq.Context()
    socks = []
    for i in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, f"a{i}".encode())
        s.connect(endpoint)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    seq = 0
    for s in socks:
        for _ in range(window):
            seq += 1
            s.send(msgpack.packb({"id": f"e{seq}", "payload": {"name": "tick", "data": {}}}))
    while True:
        for s, _ in poller.poll(1000):
            while True:
                try:
                    s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                seq += 1
                s.send(msgpack.packb({"id": f"e{seq}", "payload": {"name": "tick", "data": {}}}))


def _runtime_agents(endpoint: str, n: int, window: int) -> None:
    agents = [AgentEndpoint(connect=endpoint, host_id=f"a{i}", config=FAST) for i in range(n)]
    for a in agents:
        a.hello({})
    while True:
        for a in agents:
            a.poll(0)
            while a.in_flight < window:
                a.send_event("tick", {})
        time.sleep(0)


def bench_rate(n: int, window: int, seconds: float) -> dict[str, float]:
    spawn = mp.get_context("spawn")
    out: dict[str, float] = {}
    # raw
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    child = spawn.Process(
        target=_raw_agents, args=(f"tcp://127.0.0.1:{port}", n, window), daemon=True
    )
    child.start()
    seen: set[bytes] = set()
    count, t_start = 0, 0.0
    while True:
        if not router.poll(10000):
            raise RuntimeError("raw agents never connected")
        peer, data = router.recv_multipart()
        router.send_multipart([peer, msgpack.packb({"ref": msgpack.unpackb(data)["id"]})])
        seen.add(peer)
        if len(seen) == n and not t_start:
            t_start = time.perf_counter()
        elif t_start:
            count += 1
            if time.perf_counter() - t_start >= seconds:
                break
    out["raw_per_s"] = count / (time.perf_counter() - t_start)
    child.terminate()
    child.join()
    router.close(linger=0)
    ctx.term()
    # runtime
    with ControllerEndpoint(config=FAST) as ctl:
        child = spawn.Process(target=_runtime_agents, args=(ctl.endpoint, n, window), daemon=True)
        child.start()
        deadline = time.perf_counter() + 30
        while len(ctl.peers()) < n:
            ctl.poll(0.1)
            if time.perf_counter() > deadline:
                raise RuntimeError("runtime agents never all connected")
        count, t_start = 0, time.perf_counter()
        while time.perf_counter() - t_start < seconds:
            count += sum(
                1 for i in ctl.poll(0.1) if isinstance(i, Received) and i.frame.kind is Kind.EVENT
            )
        out["rt_per_s"] = count / (time.perf_counter() - t_start)
        out["rt_dups"] = ctl.stats["duplicates"]
        child.terminate()
        child.join()
    return out


# ---- 3. death detection ----------------------------------------------------------------------


def _death_agent(endpoint: str, trials: int, hb: float) -> None:
    cfg = TransportConfig(retry_interval_s=0.05, heartbeat_interval_s=hb, missed_heartbeats=3)
    agent = AgentEndpoint(connect=endpoint, host_id="agent", config=cfg)
    watcher = ProcessWatcher()
    agent.hello({})
    worker: subprocess.Popen[bytes] | None = None
    done = 0
    while done < trials or worker is not None:
        if worker is None:
            worker = subprocess.Popen(["sleep", "600"])
            ident = capture(worker.pid, launch_token=new_launch_token())
            agent.watch_fd(watcher.watch(ident))
            agent.send_event("launched", {"pid": worker.pid})
        for item in agent.poll(1.0):
            if isinstance(item, FdReady):
                agent.unwatch_fd(item.fd)
                gone = watcher.collect(item.fd)
                if gone is not None and worker is not None:
                    agent.send_event("exited", gone.identity.to_dict())
                    worker.wait()
                    worker, done = None, done + 1
    while True:  # keep answering until killed
        agent.poll(1.0)


def bench_death(trials: int, hb: float, silent_trials: int) -> dict[str, float]:
    spawn = mp.get_context("spawn")
    cfg = TransportConfig(retry_interval_s=0.05, heartbeat_interval_s=hb, missed_heartbeats=3)
    exited: list[float] = []
    silent: list[float] = []
    with ControllerEndpoint(config=cfg) as ctl:
        child = spawn.Process(target=_death_agent, args=(ctl.endpoint, trials, hb), daemon=True)
        child.start()
        killed_at: float | None = None
        while len(exited) < trials:
            for item in ctl.poll(1.0):
                if isinstance(item, Received) and item.frame.kind is Kind.EVENT:
                    name = item.frame.payload["name"]
                    if name == "launched":
                        time.sleep(0.02)
                        killed_at = time.perf_counter()
                        os.kill(item.frame.payload["data"]["pid"], signal.SIGKILL)
                    elif name == "exited" and killed_at is not None:
                        exited.append(time.perf_counter() - killed_at)
                        killed_at = None
        child.terminate()
        child.join()
    for trial in range(silent_trials):
        with ControllerEndpoint(config=cfg) as ctl:
            child = spawn.Process(target=_death_agent, args=(ctl.endpoint, 0, hb), daemon=True)
            child.start()
            while "agent" not in ctl.peers():
                ctl.poll(0.1)
            t_end = time.perf_counter() + hb * (1 + trial / max(1, silent_trials))
            while time.perf_counter() < t_end:  # kill at varying points of the heartbeat cycle
                ctl.poll(0.01)
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)
            t0 = time.perf_counter()
            got = False
            while not got:
                got = any(isinstance(i, PeerSilent) for i in ctl.poll(0.5))
            silent.append(time.perf_counter() - t0)
            child.join()
    return {
        "exit_p50": pct(exited, 0.5),
        "exit_p99": pct(exited, 0.99),
        "exit_max": max(exited),
        "silent_p50": pct(silent, 0.5),
        "silent_max": max(silent),
        "hb": hb,
    }


def _rtt_repeated(n: int, repeat: int) -> dict[str, Any]:
    """`repeat` raw/runtime pairs; the figures of the pair with the median p50 ratio, plus
    every pair's (p50, p99) ratios."""
    runs = [bench_rtt(n) for _ in range(repeat)]
    runs.sort(key=lambda r: r["rt_p50"] / r["raw_p50"])
    out: dict[str, Any] = dict(runs[len(runs) // 2])
    out["pairs"] = [(r["rt_p50"] / r["raw_p50"], r["rt_p99"] / r["raw_p99"]) for r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt-n", type=int, default=2000)
    p.add_argument(
        "--rtt-repeat",
        type=int,
        default=3,
        help="raw/runtime pairs measured one after the other (the machine is shared)",
    )
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--deaths", type=int, default=30)
    p.add_argument("--heartbeat", type=float, default=0.2)
    p.add_argument("--silent-trials", type=int, default=5)
    a = p.parse_args(argv)
    print(
        f"python {sys.version.split()[0]}, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"payload {len(PAYLOAD)} B"
    )
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("rtt", lambda: _rtt_repeated(a.rtt_n, a.rtt_repeat)),
        ("rate", lambda: bench_rate(a.agents, a.window, a.seconds)),
        ("death", lambda: bench_death(a.deaths, a.heartbeat, a.silent_trials)),
    ]
    for name, run in steps:
        t0 = time.perf_counter()
        r = run()
        took = time.perf_counter() - t0
        if name == "rtt":
            for i, (p50, p99) in enumerate(r["pairs"]):
                print(f"  pair {i + 1}: ratio p50 {p50:.2f}× p99 {p99:.2f}×")
            print(
                f"[rtt n={a.rtt_n}, median pair of {a.rtt_repeat}] command→ack  "
                f"raw p50 {r['raw_p50'] * 1e6:.0f} µs "
                f"p99 {r['raw_p99'] * 1e6:.0f} µs | runtime p50 {r['rt_p50'] * 1e6:.0f} µs "
                f"p99 {r['rt_p99'] * 1e6:.0f} µs | ratio p50 {r['rt_p50'] / r['raw_p50']:.2f}× "
                f"p99 {r['rt_p99'] / r['raw_p99']:.2f}× | controller CPU per round trip "
                f"raw {r['raw_cpu'] * 1e6:.0f} µs, runtime {r['rt_cpu'] * 1e6:.0f} µs  "
                f"({took:.1f} s)"
            )
        elif name == "rate":
            print(
                f"[rate {a.agents} connections, window {a.window}, {a.seconds:.0f} s] "
                f"raw {r['raw_per_s']:.0f} msg/s | runtime {r['rt_per_s']:.0f} events/s "
                f"(acked, deduped) | ratio {r['rt_per_s'] / r['raw_per_s']:.2f}×  "
                f"({took:.1f} s)"
            )
        else:
            print(
                f"[death n={a.deaths}] worker SIGKILL → controller event  p50 "
                f"{r['exit_p50'] * 1e3:.2f} ms p99 {r['exit_p99'] * 1e3:.2f} ms max "
                f"{r['exit_max'] * 1e3:.2f} ms | agent SIGKILL → PeerSilent (heartbeat "
                f"{r['hb']:.2f} s × 3) p50 {r['silent_p50'] * 1e3:.0f} ms max "
                f"{r['silent_max'] * 1e3:.0f} ms | pidfd/heartbeat-interval "
                f"{r['exit_p50'] / r['hb']:.4f}×  ({took:.1f} s)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
