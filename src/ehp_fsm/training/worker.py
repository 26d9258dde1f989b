"""One trainer process of a pool: `python -m ehp_fsm.training.worker --rank R ...`.

Start-up: join the Gloo world (`--rendezvous`) and form the Core group; a Core rank builds its
lane (a Core DP rank with a sharded DP-zero optimizer); a warm Hybrid worker builds a lane
once and drops it (imports and file cache warm), so it holds no model, gradient or optimizer
tensor until state is loaded into it (`recv_state` builds its DP1 lane). Then it connects a
ZeroMQ DEALER to the pool (`--control`; a CURVE client when its environment names the pool's
keys: `pool_socket.client_keys_from_env`) and says hello with this process's identity. Process
groups other than the Core group are formed when the pool first steps with their membership
(`form_group`, sent to every rank of the world in one order, since torch names a group by the
count of groups before it: the members meet in a rendezvous of their own, the others only count
it) — as many groups as memberships formed, not one per subset of warm ranks. It executes
commands one at a time and answers each with a reply:

    compute     forward/backward on the assigned whole groups → delivery record, loss, time
    commit      the sample-weighted reduction over the named ranks' group, then the Adam step;
                Core rank 0 optionally saves the weights as a revision
    send_state  (Core ranks) DP-zero gather to Core rank 0, which sends it to a warm worker
    recv_state  (warm worker) receive the world state and scatter it into the DP1 lane
    save_state  write the lane's exact state in `verify`'s state-dir format
    restore_state  (Core ranks) install a saved state dir, then hold the lane to its digests
    publish     (Core rank 0) save the current weights as a revision
    form_group  form the process group of the named members (see above)
    park        (warm worker) drop the lane and report what the process still holds, measured
                (`ehp_fsm.training.memory`: lane tensors by kind, CUDA allocator and NVML)
    memory      the same report, measured again (the GPU finalizer asks until it is free)
    reform      leave the Gloo world (destroy every group) and join a fresh one of the named
                members (a new rendezvous): what the pool does after a member died inside a
                collective, and to admit a replacement warm worker (started with `--standby`:
                hello said, no world joined yet; a torch lane built once, a Megatron lane
                built at its admission, with the world). Accepted even after a failed
                collective; answers the lane's version
    shutdown    reply, then exit

Ranks: the pool names workers by their *pool rank* (fixed for the process's life). The Gloo
rank of a worker is its index among the current world's members (`members`, sorted), so Core
ranks 0..dp-1 keep their Gloo rank across a re-form and the survivors are renumbered densely.
A failed `commit` reply says whether the optimizer had stepped (`stepped`): a failure inside the
reduction, or a reduced gradient refused as non-finite, leaves the lane exactly as it was before
the step. Only a failed collective makes the worker unusable until the next `reform` (it still
answers `ping`, `park` and `memory`, which are its own): a failure of this process alone after
its collectives completed (writing a state dir, saving a revision) is a `LocalFailure` — a plain
error reply marked `local` (or, for the revision a commit saves after its optimizer step, the
`publish_error` of an ok reply: the step stands), and the worker serves on.

Tensor and pipeline parallelism (Megatron, `PoolConfig.lane_size` = TP × PP > 1): a lane is
`tp × pp` processes, lane rank = PP stage × tp + TP rank. The worker the pool starts is lane
rank 0; before joining the world it starts lane ranks 1.. as its children (`--lane-rank K`,
their control channel a ROUTER of its own on loopback), relays every command to them before
running its own part (the lane's collectives need every process of it), and answers the pool
once all have: its own reply, or the first follower's failure named by its place in the lane
(`PoolConfig.lane_part`). Gloo rank = member index × lane size + lane rank, so Megatron's TP
and PP groups are the lanes' processes, and every process group the pool forms is formed once
per lane rank (DP-zero transfers, the reduction, the state dir shards `tp-<K>` go lane rank to
lane rank). A world of lanes of several processes re-forms like any other: every process of
every surviving lane gets the `reform` and joins the new world. Two rules keep a lane's shards
together: before a commit steps, the lane's processes agree that each reduced (and found
finite) its shard (`_lane_agrees`: each lane rank reduces in a group of its own, so one group
can fail while another completes); and lane rank 0 exits when a follower's process is gone
(`_follower_lost`), so that the pool sees a dead lane, not one that answers and can no longer
run a collective.

Threads: one CPU "device" is one core — the worker runs with exactly one intra-op and one
inter-op thread (set before anything else, reported in its hello as `threads`).

What it knows: executing one command on its lane. What it does not know: which replica should
train, epochs, the ledger's verdicts (the pool decides and sends only accepted work), time
beyond its own deadlines. It exits when its coordinator process is gone (`--parent`), ignores
SIGINT (the coordinator stops it), and never unpickles anything from the socket.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
import zmq
from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout

from ehp_fsm.core.batch import Delivery
from ehp_fsm.errors import EhpError, exit_words
from ehp_fsm.fspaths import LogStream
from ehp_fsm.models.load import ModelError
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.runtime import identity as ident
from ehp_fsm.runtime.keys import CurveClientKeys
from ehp_fsm.runtime.pool_launch import (
    ROUTE_ENV,
    new_route,
    pool_token_from_env,
    route_from_env,
    routing_id,
    same_route,
    split_routing_id,
)
from ehp_fsm.runtime.protocol import Dropped, Frame, Kind, decode, encode
from ehp_fsm.training import memory, pool_socket, verify
from ehp_fsm.training.backend import GradientDelivery
from ehp_fsm.training.grpo import GroupBatch
from ehp_fsm.training.lanes import PoolLane, build_lane, lane_ranks, move_lane
from ehp_fsm.training.pool_protocol import (
    FOLLOWER_LOST_EXIT,
    PoolConfig,
    decode_batch,
    delivery_to_wire,
    parse_parent,
    worker_argv,
)
from ehp_fsm.training.reduction import ReductionError, release_staging, require_finite

_EPOCH = 1  # this worker's incarnation on the control channel (a worker never restarts)
REDUCE_HOOK_ENV = "EHP_TEST_REDUCE_HOOK"
_COLLECTIVE_OPS = (
    "commit",
    "send_state",
    "recv_state",
    "build_lane",
    "save_state",
    "restore_state",
    "form_group",
)
_LOCAL_OPS = ("ping", "park", "memory")  # served even after a failed collective
#: The most a group's formation waits (`form_timeout_s`). Its members are idle and told at
#: once (a formation takes milliseconds, in a run ~15 ms), so this is arrival slack for a
#: loaded machine, not a collective's time-out.
FORM_TIMEOUT_S = 10.0


def form_timeout_s(collective_timeout_s: float) -> float:
    """The time-out `dist.new_group` forms a group with: `FORM_TIMEOUT_S`, or the collective
    time-out when shorter. A Gloo group's time-out bounds its formation as well as its
    collectives: its members' wait in the store for one another's addresses (1 x) and each
    pair's wait for its peer to connect (5 x: gloo's tcp `Pair::waitUntil` multiplies it, "a
    longer timeout when waiting for initial connect"). Formed with `collective_timeout_s`
    (60 s in a run), a Hybrid killed inside the formation after giving its address held the
    Core in `new_group` for 300 s; with this, at most 50 s, and 10 s when it died at the door.
    The group's collectives then get `collective_timeout_s` (`_set_pg_timeout`)."""
    return min(FORM_TIMEOUT_S, collective_timeout_s)


#: The errors of a write that found no room (a full disk, a quota, a file-size limit) or a
#: read-only file system: a revision's write failing so is the revision store's, named by path.
_NO_ROOM: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class LocalFailure(Exception):
    """A command failed in this process only, after (or without) any collective: no peer is
    left inside a half-done collective, so the worker stays usable (its reply says `local`)."""


class TrainerWorker:
    def __init__(
        self,
        config: PoolConfig,
        *,
        rank: int,
        control: str,
        rendezvous: str,
        launch_token: str,
        parent: ident.ProcessIdentity | None,
        lane_rank: int = 0,
        curve: CurveClientKeys | None = None,
        route: str,
    ) -> None:
        self.config = config
        self.rank = rank
        self.lane_rank = lane_rank
        # a follower: `trainer-R.tpK` at one pipeline stage, `trainer-R.ppS.tpK` over several
        self.name = f"trainer-{rank}" + _follower_suffix(config, lane_rank)
        self.rendezvous = rendezvous
        self.launch_token = launch_token
        self.parent = parent
        self.role = "core" if rank < config.core_dp else "hybrid"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        # the name and this launch's secret route (`pool_launch.routing_id`): only the process
        # its launcher gave the route to can take this rank's route on the pool's ROUTER
        self._sock.setsockopt(zmq.IDENTITY, routing_id(self.name, route))
        self._sock.setsockopt(zmq.LINGER, 2000)
        pool_socket.connect(self._sock, control, curve)  # CURVE when the pool is on another host
        self._seq = 0
        self._groups: dict[frozenset[int], dist.ProcessGroup] = {}
        self.groups_formed: list[tuple[int, ...]] = []  # in the current world, in order
        self._memory_of: memory.Storages = {}  # the dropped lane's storages, by kind
        self._frozen = 0  # tensor bytes referenced before the first lane (not watched)
        # bytes held outside torch's allocator on the GPU (NVML) right before parking
        self._nvml_baseline: int | None = None
        self._offloaded: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._kept: object = None  # test hook only: a parked lane's tensors kept alive
        self._backend: PoolLane | None = None
        # a parked Megatron warm lane: its storages emptied, with the bytes to give back
        self._emptied: list[tuple[torch.UntypedStorage, int]] | None = None
        self._pending: tuple[str, int, GradientDelivery] | None = None  # (ref, step, delivery)
        self._broken: str | None = None
        self._stepping = False  # inside `commit` after the reduction: the optimizer may step
        self._reforms = 0  # `reform` commands received (names the test hook's files)
        self.members: tuple[int, ...] = tuple(range(config.world_size))
        self._hook = os.environ.get(REDUCE_HOOK_ENV)
        # A lane of TP × PP > 1: its lane rank 0 (this worker, the pool's) starts the others
        # and relays every command to them (`_start_followers`, `_relay`).
        self._followers: list[subprocess.Popen[bytes]] = []
        self._follower_routes: dict[int, str] = {}  # lane rank -> its launch's secret route
        self._tp_sock: zmq.Socket[bytes] | None = None

    # -- start-up ---------------------------------------------------------------------------
    def _join(self, rendezvous: str, members: Sequence[int], *, first: bool = False) -> None:
        """Join the Gloo world of `members` (pool ranks) and form the Core group. Every other
        group is formed when the pool first needs its membership (`form_group`). The first
        world's rendezvous waits `join_timeout_s` for its last member to start; a re-formed
        one, whose members all run and said hello, `collective_timeout_s` (a member that died
        unnoticed fails the re-form at once, and the pool leaves it out)."""
        cfg = self.config
        members = tuple(sorted(int(m) for m in members))
        if self.rank not in members or not set(cfg.core_ranks) <= set(members):
            raise RuntimeError(f"world members {list(members)} must hold me and every Core rank")
        n = cfg.lane_size
        dist.init_process_group(
            "gloo",
            init_method=rendezvous,
            rank=members.index(self.rank) * n + self.lane_rank,
            world_size=len(members) * n,
            # the first rendezvous waits for the last member to start (`join_timeout_s`) ...
            timeout=timedelta(
                seconds=max(cfg.join_timeout_s if first else 0.0, cfg.collective_timeout_s)
            ),
        )
        # ... then the world's rendezvous store and its own collectives (DP-zero transfers)
        # wait `collective_timeout_s`, as before the join (a group's formation waits for its
        # members as long as the group's own time-out says, not the store's: `_form`)
        collective = timedelta(seconds=cfg.collective_timeout_s)
        _get_default_store().set_timeout(collective)
        _set_pg_timeout(collective, None)
        self.members = members
        self.rendezvous = rendezvous
        self._groups = {}
        self.groups_formed = []
        self._form(cfg.core_ranks)

    def _form(self, ranks: Sequence[int]) -> None:
        """Form the process group of pool ranks `ranks`. Every rank of the world calls this for
        every membership, in the order the pool sends them (`form_group` commands), because
        torch names a group by how many the world created before it; a rank outside `ranks`
        only counts it (no rendezvous, it returns at once), the members meet in a store
        rendezvous of their own. A re-formed world starts again from the Core group."""
        key = tuple(sorted(int(r) for r in ranks))
        if key in self.groups_formed:
            raise RuntimeError(f"the group of pool ranks {list(key)} was already formed")
        n = self.config.lane_size
        mine = None
        # formed within `form_timeout_s` (what a member dying in it costs the others: not
        # 5 x the collective time-out), then given `collective_timeout_s` for its collectives
        form = timedelta(seconds=form_timeout_s(self.config.collective_timeout_s))
        # The world's store too: a file store whose folder was removed retries opening its
        # file for the store's time-out at every operation (with `collective_timeout_s`, a run
        # directory removed mid-run held a borrow's formation for a minute).
        store = _get_default_store()
        store.set_timeout(form)
        try:
            for k in range(n):  # one group per lane rank of the lanes (a lane's ranks don't mix)
                group = dist.new_group(
                    lane_ranks(key, self.members, lane_size=n, lane_rank=k), timeout=form
                )
                if k == self.lane_rank:
                    mine = group
        finally:
            store.set_timeout(timedelta(seconds=self.config.collective_timeout_s))
        self.groups_formed.append(key)
        if self.rank in key:
            assert mine is not None
            _set_pg_timeout(timedelta(seconds=self.config.collective_timeout_s), mine)
            self._groups[frozenset(key)] = mine

    def _group(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The formed process group of pool ranks `ranks` (this rank among them)."""
        group = self._groups.get(frozenset(int(r) for r in ranks))
        if group is None:
            raise RuntimeError(
                f"no process group of pool ranks {sorted(ranks)} with me in this world; formed: "
                f"{self.groups_formed} (the pool forms a membership before its first step)"
            )
        return group

    def gloo_rank(self, pool_rank: int) -> int:
        """The Gloo rank of this lane rank of pool rank `pool_rank`'s lane in the current
        world."""
        return self.members.index(pool_rank) * self.config.lane_size + self.lane_rank

    def start(self, *, standby: bool = False) -> None:
        """Join the world and build the lane, then say hello. `standby` (a replacement warm
        worker started after the world was formed): say hello without joining (a torch lane
        built and dropped first; a Megatron lane, built with its world, at the admission); the
        pool admits it with a `reform` of the whole world."""
        cfg = self.config
        if standby and self.role != "hybrid":
            raise RuntimeError("only a warm Hybrid worker can start on standby")
        if cfg.lane_size > 1 and self.lane_rank == 0:
            self._start_followers(standby=standby)
        if not standby:
            self._join(self.rendezvous, range(cfg.world_size), first=True)
        if self.role == "core":
            self._backend = self._build_lane()
        elif cfg.backend != "torch":
            # A Megatron lane is built with its world (collective group creation): every warm
            # worker builds it now, with the others; parking empties its storages instead. A
            # replacement on standby builds it with the world it is admitted into (`_reform`).
            if not standby:
                self._backend = self._build_lane()
                self._frozen = memory.baseline()
                self._empty_lane()  # nothing held until the first borrow loads state into it
        else:
            # Warm: build a lane once and drop it (imports, file cache: the borrow's build is
            # then fast), and hold no model tensor until a state load (`_lane_for_load`).
            self._build_lane().close()
            self._frozen = memory.baseline()
        if self._followers:
            self._await_followers(None, timeout_s=cfg.command_timeout_s)
        be = self._backend
        me = ident.capture(os.getpid(), launch_token=self.launch_token)
        self._send(
            Kind.HELLO,
            {
                "host_id": me.host,
                "inventory": {
                    "rank": self.rank,
                    "role": self.role,
                    "world_size": cfg.world_size,
                    "identity": me.to_dict(),
                    "version": self._version(),
                    "grad_shapes": [] if be is None else [list(s) for s in be.grad_shapes()],
                    "standby": standby,
                    "threads": {
                        "intra_op": torch.get_num_threads(),
                        "inter_op": torch.get_num_interop_threads(),
                    },
                },
            },
        )

    def _build_lane(self) -> PoolLane:
        """This rank's lane on the pool's backend (`training.lanes.build_lane`): a Core DP rank
        (in the Core group) or a warm worker's DP1 lane."""
        core = self.role == "core"
        return build_lane(
            self.config,
            rank=self.rank,
            core_group=self._group(self.config.core_ranks) if core else None,
            members=self.members,
            lane_rank=self.lane_rank,
        )

    @property
    def backend(self) -> PoolLane:
        if self._backend is None or self._emptied is not None:
            raise LocalFailure(
                f"warm worker {self.rank} holds no lane (parked, or never loaded): "
                "load the Core's state into it first"
            )
        return self._backend

    def _version(self) -> int:
        return 0 if self._backend is None else self._backend.version

    def _lane_for_load(self) -> PoolLane:
        """A warm worker builds its lane when state is loaded into it (the borrow), not before:
        until then it holds no model, gradient or optimizer memory. A parked Megatron lane gets
        its storages back (their contents are what the load then writes)."""
        if self._emptied is not None:
            memory.restore_storages(self._offloaded)
            self._offloaded = []
            for storage, nbytes in self._emptied:
                storage.resize_(nbytes)
            self._emptied = None
        if self._backend is None:
            self._backend = self._build_lane()
        return self._backend

    # -- loop -------------------------------------------------------------------------------
    def serve(self) -> int:
        handlers: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
            "compute": self._compute,
            "commit": self._commit,
            "send_state": self._send_state,
            "recv_state": self._recv_state,
            "build_lane": self._build_for_load,
            "save_state": self._save_state,
            "restore_state": self._restore_state,
            "publish": self._publish_cmd,
            "form_group": self._form_group,
            "park": self._park,
            "memory": self._memory,
            "ping": lambda args, ref: {
                "version": self._version(),
                "lane": self._backend is not None,
                "groups": [list(g) for g in self.groups_formed],
            },
        }
        while True:
            if not self._sock.poll(1000):
                if self.parent is not None and not ident.is_alive(self.parent):
                    print(f"{self.name}: coordinator is gone, exiting", file=sys.stderr)
                    # the lane's followers watch this process, not the coordinator: told
                    # nothing, they lived on the 10 s `close` waits for them (a killed run's
                    # trainer processes outlived it by 12-14 s)
                    for proc in self._followers:
                        if proc.poll() is None:
                            proc.terminate()
                    return 4
                if (lost := self._follower_lost()) is not None:
                    return lost
                continue
            frame = decode(self._sock.recv(), max_bytes=self.config.max_message_bytes)
            if isinstance(frame, Dropped):
                print(f"{self.name}: dropped frame: {frame.log_fields()}", file=sys.stderr)
                continue
            if frame.kind is not Kind.COMMAND:
                continue
            op, args = frame.payload["op"], frame.payload["args"]
            if self._followers:  # before our own part: the lane's collectives need all of it
                self._relay(frame.id, op, args)
            if op == "shutdown":
                if self._followers:
                    self._await_followers(frame.id, timeout_s=10.0)
                self._reply(frame.id, True, {})
                return 0
            ok, result = self._execute(handlers, op, args, frame.id)
            if self._followers:
                timeout = self.config.command_timeout_s
                ok, result = self._merge(op, ok, result, self._await_followers(frame.id, timeout))
                if (lost := self._follower_lost()) is not None:
                    return lost  # no reply: to the pool the lane is dead, as it is
                if ok:
                    try:
                        self._join_parts(op, args, result)
                    except LocalFailure as exc:
                        ok, result = False, {"error": str(exc), "local": True}
            self._reply(frame.id, ok, result)

    def _execute(
        self,
        handlers: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]],
        op: str,
        args: dict[str, Any],
        ref: str,
    ) -> tuple[bool, dict[str, Any]]:
        """Run one command on this process's lane: (ok, the reply's result)."""
        if op == "reform":
            try:
                return True, self._reform(args)
            except Exception as exc:
                traceback.print_exc()
                self._broken = f"reform failed: {exc}"
                return False, {"error": f"{type(exc).__name__}: {exc}"}
        handler = handlers.get(op)
        if handler is None:
            return False, {"error": f"unknown op {op!r}"}
        if self._broken is not None and op not in _LOCAL_OPS:
            return False, {"error": f"worker unusable: {self._broken}"}
        try:
            return True, handler(args, ref)
        except Exception as exc:
            traceback.print_exc()
            local = isinstance(exc, LocalFailure)
            if op in _COLLECTIVE_OPS and not local:
                self._broken = f"{op} failed inside a collective: {exc}"
            error: dict[str, Any] = {
                "error": str(exc) if local else f"{type(exc).__name__}: {exc}",
                "local": local,
            }
            if op == "commit":
                # `apply` refuses a non-finite gradient (ReductionError) before any state
                # changes: the optimizer did not step
                error["stepped"] = self._stepping and not isinstance(exc, ReductionError)
                error["version"] = self._version()
            return False, error
        finally:
            self._stepping = False

    # -- lane followers ---------------------------------------------------------------------
    def _start_followers(self, *, standby: bool = False) -> None:
        """Lane rank 0 of a lane of TP × PP > 1 starts lane ranks 1..tp×pp-1 as its children:
        the same
        worker, its control channel this process (a ROUTER on loopback) instead of the pool,
        this process as the parent they outlive by at most a poll. They join the Gloo world and
        build their lane shard with everyone; the pool sees one worker per lane."""
        self._tp_sock = self._ctx.socket(zmq.ROUTER)
        self._tp_sock.setsockopt(zmq.LINGER, 0)
        self._tp_sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        port = self._tp_sock.bind_to_random_port("tcp://127.0.0.1")
        me = ident.capture(os.getpid(), launch_token=self.launch_token)
        for k in range(1, self.config.lane_size):
            argv = worker_argv(
                self.config,
                rank=self.rank,
                control=f"tcp://127.0.0.1:{port}",
                rendezvous=self.rendezvous,
                parent=me,
                standby=standby,
            )
            self._follower_routes[k] = route = new_route()
            self._followers.append(
                subprocess.Popen(
                    [*argv, "--lane-rank", str(k)],
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, ROUTE_ENV: route},
                )
            )

    def followers(self) -> list[subprocess.Popen[bytes]]:
        """The lane's follower processes started so far (a copy: read from another thread)."""
        return list(self._followers)

    def _follower_lost(self) -> int | None:
        """A follower's process is gone: its shard of the lane with it, so the lane is lost.
        Lane rank 0 then exits too (exit code 5, after stopping the other followers): the pool
        sees a dead worker — a Hybrid's world is re-formed without it, a Core's pool breaks —
        instead of a lane that answers but can never run a collective again."""
        for k, proc in enumerate(self._followers, 1):
            code = proc.poll()
            if code is None:
                continue
            why = f"{self.config.lane_part(k)} of the lane {exit_words(code)}: exiting"
            print(f"{self.name}: {why}", file=sys.stderr)
            for other in self._followers:
                if other.poll() is None:
                    other.kill()
                    other.wait(10)
            return FOLLOWER_LOST_EXIT
        return None

    def _relay(self, ref: str, op: str, args: dict[str, Any]) -> None:
        """Send the pool's command `ref` on to every follower (same id, same arguments)."""
        assert self._tp_sock is not None
        for k in range(1, self.config.lane_size):
            frame = Frame(
                kind=Kind.COMMAND,
                id=ref,
                seq=self._seq,
                epoch=_EPOCH,
                sender=self.name,
                payload={"op": op, "args": args, "target_epoch": _EPOCH},
            )
            self._tp_sock.send_multipart(
                [
                    routing_id(
                        self.name + _follower_suffix(self.config, k), self._follower_routes[k]
                    ),
                    encode(frame, max_bytes=self.config.max_message_bytes),
                ]
            )

    def _await_followers(
        self, ref: str | None, timeout_s: float
    ) -> list[tuple[int, bool, dict[str, Any]]]:
        """Every follower's reply to command `ref` ((lane rank, ok, result)), or with `ref`
        None their hellos (raising when one fails to start). A follower that exits or stays
        silent past `timeout_s` answers as failed: its lane shard is gone."""
        assert self._tp_sock is not None
        waiting = set(range(1, self.config.lane_size))
        out: list[tuple[int, bool, dict[str, Any]]] = []
        deadline = time.monotonic() + timeout_s
        while waiting:
            for k in sorted(waiting):
                code = self._followers[k - 1].poll()
                if code is not None or time.monotonic() > deadline:
                    why = exit_words(code) if code is not None else "did not answer"
                    part = self.config.lane_part(k)
                    if ref is None:
                        raise RuntimeError(f"{part} of pool rank {self.rank} {why}")
                    waiting.discard(k)
                    out.append((k, False, {"error": f"{part} of the lane {why}"}))
            if not waiting or not self._tp_sock.poll(100):
                continue
            parts = self._tp_sock.recv_multipart()
            if len(parts) != 2:
                continue
            follower = self._follower_of(*split_routing_id(parts[0]))
            frame = decode(parts[1], max_bytes=self.config.max_message_bytes)
            if follower is None or isinstance(frame, Dropped):
                continue  # not one of this lane's followers (no route of theirs), or malformed
            k = follower
            if frame.kind is Kind.EVENT and frame.payload["name"] == "worker_failed":
                error = str(frame.payload["data"].get("error", ""))
                if ref is None:
                    part = self.config.lane_part(k)
                    raise RuntimeError(f"{part} of pool rank {self.rank} failed: {error}")
                continue  # its exit is seen above
            if ref is None and frame.kind is Kind.HELLO:
                waiting.discard(k)
            elif ref is not None and frame.kind is Kind.REPLY and frame.payload["ref"] == ref:
                waiting.discard(k)
                out.append((k, bool(frame.payload["ok"]), dict(frame.payload["result"])))
        return sorted(out, key=lambda r: r[0])

    def _follower_of(self, name: str, route: str) -> int | None:
        """The lane rank of this lane's follower with routing id (`name`, `route`), or None."""
        for k, mine in self._follower_routes.items():
            if name == self.name + _follower_suffix(self.config, k):
                return k if same_route(route, mine) else None
        return None

    def _merge(
        self,
        op: str,
        ok: bool,
        result: dict[str, Any],
        replies: Sequence[tuple[int, bool, dict[str, Any]]],
    ) -> tuple[bool, dict[str, Any]]:
        """One reply for the lane: this process's, unless a follower failed where it did not
        (then the follower's failure, named by its place in the lane); a parked lane holds
        what its most holding process still holds."""
        for k, fine, theirs in replies:
            if fine or not ok:
                continue
            local = bool(theirs.get("local", False))
            part = self.config.lane_part(k)
            if (op in _COLLECTIVE_OPS and not local) or op == "reform":
                self._broken = f"{op} failed on {part} of the lane: {theirs.get('error')}"
            return False, {**theirs, "error": f"{part}: {theirs.get('error')}"}
        if ok and op == "restore_state":  # every shard's check (`_check_restored`)
            checked = dict(result["checked"])
            for _, _, theirs in replies:
                checked.update(theirs["checked"])
            return ok, {**result, "checked": checked}
        if ok and op in ("park", "memory"):
            for _, _, theirs in replies:
                if memory.HeldMemory.from_wire(theirs["held"]).why_not_free() is not None:
                    return ok, {**result, "held": theirs["held"]}
        if ok and "fingerprint" in result:  # --verify: the whole lane's weights, every shard
            return ok, {**result, "fingerprint": self._lane_fingerprint(result, replies)}
        return ok, result

    def _lane_fingerprint(
        self, result: dict[str, Any], replies: Sequence[tuple[int, bool, dict[str, Any]]]
    ) -> dict[str, Any]:
        """This process's fingerprint and each follower's, under its name in the lane: lane
        rank 0's weights keep their names, a follower's get its part as a prefix (`tp1/…`,
        `pp1.tp0/…`) — a shard (TP) or a stage's layers (PP, whose local layer names repeat
        on every stage) that a step changed wrongly is then named at that step as well."""
        merged = dict(result["fingerprint"])
        for k, _, theirs in replies:
            prefix = _follower_suffix(self.config, k)[1:] + "/"
            for name, sums in theirs["fingerprint"].items():
                merged[prefix + name] = sums
        return merged

    def _reform(self, args: dict[str, Any]) -> dict[str, Any]:
        """Leave the current Gloo world and join the survivors' fresh one (see the docstring).
        The lane's state is untouched, and so is a pending delivery: a commit names the compute
        it belongs to, so it is used only by its own step — which goes on when the member that
        died was an idle warm worker (its group is formed again in the new world), and is
        retried (a new compute replaces it) when a member died."""
        t0 = time.perf_counter()
        self._reforms += 1
        if self._hook is not None:
            self._reduce_hook(self._reforms, where="reform")
        if dist.is_initialized():
            dist.destroy_process_group()  # every group; no collective, peers may be dead
        self._groups = {}
        self._join(str(args["rendezvous"]), [int(m) for m in args["members"]])
        if self.config.backend != "torch" and self._backend is None:
            # a Megatron replacement admitted from standby: its lane is built now, in the same
            # collective order as the members' rebuilt lanes (`move_lane`)
            self._backend = self._build_lane()
            self._frozen = memory.baseline()
            self._empty_lane()  # nothing held until a borrow loads state into it
        elif self.config.backend != "torch" or self._backend is not None:
            parked = self._emptied is not None
            self._backend = move_lane(
                self._lane_for_load() if parked else self.backend,
                self.config,
                rank=self.rank,
                core_group=self._groups.get(frozenset(self.config.core_ranks)),
                members=self.members,
                lane_rank=self.lane_rank,
            )
            if parked:  # rebuilt in the new world: parked again
                self._empty_lane()
        # the pending delivery stays: its gradients are owned copies, and the commit that
        # follows a re-form names the compute it belongs to
        self._broken = None
        print(
            f"{self.name}: re-formed the Gloo world of pool ranks {list(self.members)} "
            f"(gloo rank {self.gloo_rank(self.rank)}) in {time.perf_counter() - t0:.3f} s",
            file=sys.stderr,
        )
        return {"version": self._version(), "seconds": time.perf_counter() - t0}

    def _reduce_hook(self, step: int, *, where: str = "enter") -> None:
        """Test hook (`EHP_TEST_REDUCE_HOOK=<dir>`, never set in production): announce entering
        the reduction of `step` as `<dir>/enter-<rank>-<step>` (and leaving it, before the
        optimizer step, as `<dir>/after-<rank>-<step>`; receiving a state load, as
        `<dir>/recv-<rank>-<version>`; entering its n-th re-form, as `<dir>/reform-<rank>-<n>`),
        then wait while `<dir>/hold-<rank>` (resp. `<dir>/hold-after-<rank>`,
        `<dir>/hold-recv-<rank>`, `<dir>/hold-reform-<rank>`) exists (at most 60 s), so a test
        can kill a peer deterministically inside (or about to enter) the collective, just after
        it, in the middle of a state load, or while the world re-forms; likewise entering the
        formation of its n-th group, `<dir>/form-<rank>-<n>` and `<dir>/hold-form-<rank>`."""
        assert self._hook is not None
        d = Path(self._hook)
        (d / f"{where}-{self.rank}-{step}").write_text(str(os.getpid()))
        hold = d / (f"hold-{self.rank}" if where == "enter" else f"hold-{where}-{self.rank}")
        end = time.monotonic() + 60
        while hold.exists() and time.monotonic() < end:
            time.sleep(0.005)

    # -- commands ---------------------------------------------------------------------------
    def _compute(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        be = self.backend
        step, epoch, replica = int(args["step"]), int(args["epoch"]), str(args["replica"])
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = 0.0
        metrics: dict[str, Any] = {}
        if "batch" in args:
            batch: GroupBatch = decode_batch(args["batch"])
            d = be.compute(batch, step=step, epoch=epoch)
            loss = d.loss  # read off the same forward pass (no second one)
            metrics = asdict(d.metrics)
            d = replace(d, record=replace(d.record, replica=replica))
        else:  # a live lane without groups this step: contributes n = 0
            shapes = be.grad_shapes()
            d = GradientDelivery(
                record=Delivery(step=step, epoch=epoch, replica=replica, samples=0, shapes=shapes),
                grads=tuple(torch.zeros(s, dtype=torch.float32) for s in shapes),
            )
        self._pending = (ref, step, d)
        return {
            "record": delivery_to_wire(d.record),
            "loss": loss,
            "metrics": metrics,
            "compute_s": time.perf_counter() - t0,
            "compute_cpu_s": time.thread_time() - c0,  # on-CPU time: what a free core gives
        }

    def _commit(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        be = self.backend
        if self._pending is None or self._pending[0] != args["ref"]:
            raise RuntimeError(
                f"commit of compute {args['ref']} but the pending delivery is "
                f"{None if self._pending is None else self._pending[0]}"
            )
        _, _, d = self._pending
        self._pending = None
        group = self._group([int(r) for r in args["members"]])
        if self._hook is not None:
            self._reduce_hook(int(args["step"]))
        t0 = time.perf_counter()
        failure: Exception | None = None
        try:
            reduced = be.reduce(
                d,
                total_samples=int(args["total_samples"]),
                group=group,
                bucket_bytes=self.config.bucket_bytes,
            )
            if self.config.lane_size > 1:
                require_finite(reduced, [name for name, _ in be.named_parameters()])
        except Exception as exc:
            failure = exc
        if self.config.lane_size > 1:
            self._lane_agrees(failure is None)  # even when this rank failed: peers wait for it
        if failure is not None:
            raise failure
        t1 = time.perf_counter()
        if self._hook is not None:
            self._reduce_hook(int(args["step"]), where="after")
        self._stepping = True
        version = be.apply(reduced)
        t2 = time.perf_counter()
        out: dict[str, Any] = {"version": version, "reduce_s": t1 - t0, "apply_s": t2 - t1}
        if args.get("fingerprint"):  # --verify: the weights after the step, found again by replay
            out["fingerprint"] = {
                k: list(v) for k, v in verify.fingerprint(be.named_parameters()).items()
            }
        if "publish" in args:
            # After the optimizer stepped on every lane: a failed save is this process's alone
            # (a full disk, a revision not newer than the last) and the step stands.
            try:
                out["revision_path"] = self._publish(args["publish"])
            except Exception as exc:
                traceback.print_exc()
                out["publish_error"] = f"{type(exc).__name__}: {exc}"
            out["publish_s"] = time.perf_counter() - t2
        return out

    def _lane_agrees(self, mine: bool) -> None:
        """Before a lane of several processes steps its optimizer, they agree that every one
        of them reduced its shard's gradient and found it finite (a MIN over the lane's
        processes: Megatron's model-parallel group, TP × PP); raises when another did not. Why:
        each lane rank reduces with the same lane rank of the other lanes, in a process group of
        its own. When a Hybrid's TP rank 0 dies inside the all-reduce, the TP rank 0 group fails
        but the TP rank 1 group completes — and without this a Core's TP rank 1 stepped while
        its TP rank 0 did not, leaving the Core's shards a version apart (found by
        tests/training_pool/test_megatron_tp2_reform.py). A failed agreement (a peer of this
        lane gone) is a failure too: no process steps alone."""
        from megatron.core import parallel_state

        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        # the lane's processes: its TP ranks of every PP stage (Megatron's model-parallel group)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=parallel_state.get_model_parallel_group())
        if mine and int(flag.item()) == 0:
            raise RuntimeError(
                "another process of this lane failed its reduction or refused a non-finite "
                "gradient: no process of the lane steps (its shards stay at one version)"
            )

    def _publish(self, spec: dict[str, Any]) -> str:
        be = self.backend
        store = RevisionStore(spec["root"])
        revision = int(spec["revision"])
        if not self.config.model:
            raise RuntimeError(
                "the built-in toy policy has no Hugging Face directory to publish revisions of; "
                "train a model given by its directory (PoolConfig.model)"
            )
        state = be.revision_state_dict()  # collective over the lane's processes (mbridge gathers)
        if self.lane_rank != 0:
            return ""  # lane rank 0 saves the gathered HF tensors
        model = Path(self.config.model)
        if not (model / "config.json").is_file():
            # said in the operator's terms: the store's own refusal blamed `base`, an argument,
            # and the run's message then blamed the revision store's space
            raise ModelError(
                f"the model directory {model} (the plan's [model] path) has no config.json "
                "any more: it was moved or deleted while the run ran",
                "every revision copies its config and tokenizer files from it",
                "put the model directory back where the plan says, then go on with "
                "`ehp-fsm run PLAN --resume`",
            )
        try:
            store.save(
                revision=revision, step=int(spec["step"]), state_dict=state, base=self.config.model
            )
        except OSError as exc:  # a full disk named no path: "[Errno 28] No space left on device"
            if exc.errno not in _NO_ROOM:
                raise
            raise OSError(
                exc.errno,
                f"{exc.strerror or exc} (writing revision {revision} in {store.root}, the run's "
                "[run] revisions: free space or fix permissions there)",
            ) from exc
        return str(store.path(revision))

    def _publish_cmd(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        if self.rank != 0:
            raise RuntimeError("only Core rank 0 publishes revisions")
        return {"revision_path": self._publish(args)}

    def _send_state(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        be = self.backend
        state = be.gather_dp_zero(group=self._group(self.config.core_ranks), dst=0)
        if self.rank == 0:
            assert state is not None
            dst = self.gloo_rank(int(args["dst"]))
            be.send_dp_zero(state, dst=dst)
        return {"version": be.version}

    def _build_for_load(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        """A load's first half (`TrainerPool.load_state`): the warm worker builds (or gets
        back) its lane before any Core rank starts sending to it, so that a lane it cannot build
        (its model folder moved away, no memory) fails the load at once, the Core untouched.
        Alone (no lane followers) nothing of another process was involved: a plain failure, the
        worker serves on; a lane of several processes may have built part of it: unusable."""
        try:
            self._lane_for_load()
        except Exception as exc:
            if self._followers or self.lane_rank != 0:
                raise
            raise LocalFailure(f"building its lane failed: {type(exc).__name__}: {exc}") from exc
        return {"version": self._version()}

    def _recv_state(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        be = self._lane_for_load()
        be.restore_reference()  # a parked Megatron lane dropped its KL reference
        if self._hook is not None:
            self._reduce_hook(be.version, where="recv")
        state = be.recv_dp_zero(src=self.gloo_rank(int(args["src"])))
        be.scatter_dp_zero(state, group=None)
        return {"version": be.version}

    def _save_state(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        be = self.backend
        if self.role == "core":
            state = be.gather_dp_zero(group=self._group(self.config.core_ranks), dst=0)
        else:
            state = be.local_state()
        if state is not None:  # the gather (a collective) is done: a failure now is ours alone
            try:
                verify.write_state(
                    self._part(Path(args["path"])),
                    params=dict(be.named_parameters()),
                    world=state,
                    layout=be.layout,
                )
            except Exception as exc:
                raise LocalFailure(
                    f"writing the state to {args['path']} failed: {type(exc).__name__}: {exc}"
                ) from exc
        return {"version": be.version, "wrote": state is not None}

    def _part(self, path: Path) -> Path:
        """This process's shard of the state dir `path` (`verify.tp_part`)."""
        return verify.tp_part(path, tp=self.config.lane_size, tp_rank=self.lane_rank)

    def _join_parts(self, op: str, args: dict[str, Any], result: dict[str, Any]) -> None:
        """After every TP rank of the lane wrote its shard of a state dir: its index over all
        shards (`verify.join_tp_parts`), so the pool's state dir reads as one state."""
        if op != "save_state" or not result.get("wrote"):
            return
        try:
            verify.join_tp_parts(Path(args["path"]), tp=self.config.lane_size)
        except (OSError, verify.VerifyError) as exc:
            raise LocalFailure(f"indexing the TP shards of {args['path']} failed: {exc}") from exc

    def _restore_state(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        """Install a Core state dir (`save_state`'s) into the Core lanes: rank 0 reads it and
        scatters it over the Core group (a resumed run). A file rank 0 cannot read is refused
        before any transfer (the scatter's verdict), so no rank is left half-loaded. Then the
        lane is held to the save's digests (`_check_restored`)."""
        be = self.backend
        part = self._part(Path(args["path"]))
        state, unreadable = None, None
        if self.rank == 0:
            try:
                state = verify.read_state(part, be.layout)
            except (OSError, verify.VerifyError) as exc:
                unreadable = exc
        try:
            be.scatter_dp_zero(state, group=self._groups[frozenset(self.config.core_ranks)])
        except EhpError as exc:
            raise LocalFailure(f"the state was not restored: {unreadable or exc}") from exc
        return {"version": be.version, "checked": self._check_restored(part)}

    def _check_restored(self, part: Path) -> dict[str, Any]:
        """The restored lane against the digests its save recorded (`verify.check_restored`):
        every rank its parameters; Core rank 0, which gathers the world state again (a
        collective over the Core group), every master weight and Adam moment too. Its reply
        names this TP shard's count of tensors compared and the digest computed from the lane
        (`tp<K>`, merged over the lane's TP ranks by `_merge`)."""
        be = self.backend
        world = be.gather_dp_zero(group=self._group(self.config.core_ranks), dst=0)
        try:
            n, digest = verify.check_restored(
                part, params=dict(be.named_parameters()), world=world, layout=be.layout
            )
        except (OSError, verify.VerifyError) as exc:
            raise LocalFailure(str(exc)) from exc
        if digest is None:
            return {}
        return {f"tp{self.lane_rank}": {"tensors": n, "digest": digest}}

    def _form_group(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        """Form the group of `members` (collective over its members; see `_form`)."""
        if self._hook is not None:
            self._reduce_hook(len(self.groups_formed), where="form")
        self._form([int(r) for r in args["members"]])
        return {"groups": len(self.groups_formed)}

    # -- parking ----------------------------------------------------------------------------
    def _park(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        """A warm worker leaves its borrow: drop the lane (model, gradients, master weights,
        optimizer state, reference, staging bucket), free the CUDA cache, and report what the
        process still holds, measured (`ehp_fsm.training.memory`). A Megatron lane, built with
        its world, is kept but emptied (`_empty_lane`). Test hook: with `<hook dir>/keep-<rank>`
        present the lane's tensors stay referenced until that file is gone (seen by the next
        `memory`), so a test sees a worker that did not let go."""
        if self.role != "hybrid":
            raise LocalFailure("only a warm Hybrid worker parks (the Core keeps its lane)")
        if self._backend is not None and self._emptied is None:
            # what the process holds outside torch's allocator while its lane is live: all
            # it may keep once parked (None off CUDA)
            self._nvml_baseline = memory.cuda_context_bytes()
            self._memory_of = memory.lane_storages(self._backend.memory_tensors())
            if self._hook is not None and (Path(self._hook) / f"keep-{self.rank}").exists():
                self._kept = self._backend.memory_tensors()
        # first what is not the lane's (a Megatron lane's emptying moves every CUDA tensor
        # still referenced to host memory: these must be gone by then)
        self._pending = None
        release_staging()
        if self._backend is not None and self._emptied is None:
            if self.config.backend == "torch":
                self._backend.close()
                self._backend = None
            elif self._kept is None:
                self._empty_lane()
        return {"held": self._held().to_wire()}

    def _empty_lane(self) -> None:
        """Give back the memory of a Megatron lane without dropping the lane: every storage of
        its parameters (and the DDP buffer they view), main gradients, FP32 masters and Adam
        state is resized to 0 bytes; `_lane_for_load` gives the bytes back and the state load
        writes them. A KL reference, which no state load writes, is dropped whole and built
        again at the next load (`_recv_state`)."""
        assert self._backend is not None
        # what the process holds outside torch's allocator while the lane is whole: all it may
        # keep once emptied (None off CUDA)
        self._nvml_baseline = memory.cuda_context_bytes()
        # the staging bucket goes with `release_staging`
        self._emptied = memory.empty_storages(
            self._backend.memory_tensors(), keep=("reference", "staging")
        )
        self._backend.drop_reference()
        # on CUDA, what else the lane keeps there (module buffers, cached rotary tables,
        # Megatron's global memory buffer, optimizer scalars) waits in host memory
        self._offloaded = memory.offload_cuda()

    def _memory(self, args: dict[str, Any], ref: str) -> dict[str, Any]:
        """What this worker holds now (the GPU finalizer asks until it is free)."""
        hook = self._hook
        if self._kept is not None and hook and not (Path(hook) / f"keep-{self.rank}").exists():
            self._kept = None  # the test lets go
            if self._backend is not None and self._emptied is None and self.role == "hybrid":
                self._empty_lane()  # a parked Megatron lane the hook held
        lane = self._backend is not None and self._emptied is None
        return {"held": self._held().to_wire(), "lane": lane}

    def _held(self) -> memory.HeldMemory:
        """The measurement against the dropped lane's storages (a built lane counts whole). A
        Megatron lane (built before the baseline froze what the worker then held) is measured
        directly: the bytes its tensors' storages still have."""
        be = self._backend
        if be is not None and self.config.backend != "torch":
            direct: dict[str, int] = {}
            for kind, n in memory.lane_storages(be.memory_tensors()).values():
                direct[kind] = direct.get(kind, 0) + n
            del be
            base = memory.measure({}, frozen=self._frozen, nvml_baseline=self._nvml_baseline)
            return replace(base, by_kind=direct)
        recorded = self._memory_of if be is None else memory.lane_storages(be.memory_tensors())
        del be  # not a reference the measurement would see
        return memory.measure(recorded, frozen=self._frozen, nvml_baseline=self._nvml_baseline)

    # -- wire -------------------------------------------------------------------------------
    def _send(self, kind: Kind, payload: dict[str, Any]) -> None:
        self._seq += 1
        frame = Frame(
            kind=kind,
            id=uuid.uuid4().hex,
            seq=self._seq,
            epoch=_EPOCH,
            sender=self.name,
            payload=payload,
        )
        self._sock.send(encode(frame, max_bytes=self.config.max_message_bytes))

    def _reply(self, ref: str, ok: bool, result: dict[str, Any]) -> None:
        self._send(Kind.REPLY, {"ref": ref, "ok": ok, "result": result})

    def fail(self, error: str) -> None:
        # The channel itself may be what failed; the exit code still tells the pool.
        with contextlib.suppress(Exception):
            self._send(Kind.EVENT, {"name": "worker_failed", "data": {"error": error[-4000:]}})

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
        for proc in self._followers:  # they exit on shutdown or when we are gone
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._tp_sock is not None:
            self._tp_sock.close()
        self._sock.close()
        self._ctx.term()


def _follower_suffix(config: PoolConfig, lane_rank: int) -> str:
    """What a follower's name adds to its lane's: `.tpK` at one pipeline stage, `.ppS.tpK`."""
    if lane_rank == 0:
        return ""
    stage, tp_rank = config.stage_and_tp(lane_rank)
    return f".tp{tp_rank}" if config.pp == 1 else f".pp{stage}.tp{tp_rank}"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ehp_fsm.training.worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--control", required=True, help="the pool's ZeroMQ endpoint")
    p.add_argument("--rendezvous", required=True, help="Gloo init method (file://… or tcp://…)")
    p.add_argument("--config", required=True, help="PoolConfig as JSON")
    p.add_argument("--parent", default=None, help="coordinator identity as JSON")
    p.add_argument(
        "--lane-rank",
        type=int,
        default=0,
        help="a follower of the lane's worker: PP stage × TP + TP rank (started by it, never "
        "by the pool)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="a replacement warm worker: say hello first, join the world when admitted",
    )
    return p.parse_args(argv)


PARENT_POLL_S = 0.5  # how often a worker looks for its coordinator


def _exit_with_parent(
    parent: ident.ProcessIdentity,
    name: str,
    *,
    started: threading.Event,
    ended: threading.Event,
    followers: Callable[[], Sequence[subprocess.Popen[bytes]]],
) -> None:
    """End this process, and its lane's followers, once its coordinator is gone — whatever
    the main thread is doing.

    Why a thread: start-up (the world's rendezvous, which waits `join_timeout_s` for its last
    member, and the lane's build) polls no socket: a worker whose run was killed then lived on
    for all of it (~10 s on the tiny model), not yet in the run's `run.json`, so `ehp-fsm stop`
    said nothing was running. And `serve` looks for its coordinator only after a second with
    no command: a rank in the middle of a command (a training step, a state load; a
    collective whose peers died with the run waits for Gloo's timeout) outlived a killed run
    for as long as that command took. Once `ended` is set (`serve` returned: the worker is
    closing, within its own bounds) it watches no more."""

    def watch() -> None:
        while not ended.wait(PARENT_POLL_S):
            if ident.is_alive(parent):
                continue
            when = "in the middle of a command" if started.is_set() else "while starting"
            print(f"{name}: coordinator is gone {when}, exiting", file=sys.stderr)
            for proc in followers():  # they watch this process, not the coordinator
                with contextlib.suppress(Exception):
                    if proc.poll() is None:
                        proc.terminate()
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(4)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # `kill -USR1 PID` writes every thread's stack to the worker's log: where a stuck rank waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # the log may be on a full disk: writing to it must not be what kills the worker
    sys.stdout, sys.stderr = LogStream(sys.stdout), LogStream(sys.stderr)
    torch.set_num_threads(1)  # one CPU "device" = one core (see the module docstring)
    torch.set_num_interop_threads(1)
    parent = parse_parent(ns.parent) if ns.parent else None
    try:
        # The pool's keys (`pool_socket`: set by the agent that launched this worker); a TP
        # follower connects to its lane's TP rank 0 on loopback, plainly, whatever it inherits.
        curve = pool_socket.client_keys_from_env(os.environ) if ns.lane_rank == 0 else None
        route = route_from_env(os.environ)
        # the pool's launch token, in the environment (a follower inherits it): a command line
        # is readable by every user, and the token proves to `ehp-fsm stop` we are the run's
        launch_token = pool_token_from_env(os.environ)
    except EhpError as exc:
        print(f"ehp_fsm.training.worker: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    worker = TrainerWorker(
        PoolConfig.from_json(ns.config),
        rank=ns.rank,
        control=ns.control,
        rendezvous=ns.rendezvous,
        launch_token=launch_token,
        parent=parent,
        lane_rank=ns.lane_rank,
        curve=curve,
        route=route,
    )
    code = 3
    started, ended = threading.Event(), threading.Event()
    if parent is not None:
        followers = worker.followers
        _exit_with_parent(parent, worker.name, started=started, ended=ended, followers=followers)
    try:
        worker.start(standby=ns.standby)
        started.set()  # (`serve` also looks for its coordinator between commands)
        code = worker.serve()
    except Exception as exc:
        traceback.print_exc()
        worker.fail(f"{type(exc).__name__}: {exc}")
    finally:
        ended.set()
        worker.close()
    # Skip interpreter teardown of the Gloo world: peers may already be gone, and tearing it
    # down collectively could block; the process exit releases every socket.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
