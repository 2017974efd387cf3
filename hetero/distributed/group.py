"""Joining the group of ranks that `mlx.launch` started, and the few messages the pipeline passes between them.

`mlx.launch` (ring backend) sets MLX_RANK and MLX_HOSTFILE (a JSON list of "ip:port" lists, one per rank) in each
process. `connect` joins the ring under a watchdog (init blocks while a peer is missing) and returns a `Link`:
hidden states go to the next rank with send/recv; the small control messages (a request as JSON, the tokens of a
decode round) go to every rank: requests with `all_sum` from one root (the others add zeros), the decode rounds'
messages from the last rank down the ring, hop by hop. A closed connection (a rank died) surfaces as one
HeteroError line on every survivor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from hetero.distributed.watchdog import Watchdog
from hetero.errors import HeteroError

DEFAULT_TIMEOUT_S = 60.0  # no progress for this long during a request (or while connecting) ends the rank


def launched() -> bool:
    """Whether this process was started by `mlx.launch` (or by hand with its environment variables)."""
    return "MLX_RANK" in os.environ or "MLX_HOSTFILE" in os.environ


def _hosts() -> list:
    """The ring's hosts from MLX_HOSTFILE; HeteroError (one line) when the launch environment is wrong."""
    rank, path = os.environ.get("MLX_RANK", ""), os.environ.get("MLX_HOSTFILE", "")
    if not rank.isdigit() or not path:
        raise HeteroError(
            f"a distributed run needs both MLX_RANK and MLX_HOSTFILE (got MLX_RANK={rank!r}, MLX_HOSTFILE={path!r}): "
            "start every rank with `mlx.launch --backend ring --hosts IP1,IP2 -- hetero run ...`"
        )
    try:
        text = open(path, encoding="utf-8").read().strip()
        hosts = json.loads(text) if text else []
    except (OSError, ValueError) as e:
        raise HeteroError(f"MLX_HOSTFILE={path}: cannot read the ring's host list ({e}); start the ranks with mlx.launch") from None
    if not isinstance(hosts, list):
        raise HeteroError(f"MLX_HOSTFILE={path} must hold a JSON list of host lists, as mlx.launch writes it")
    if hosts and int(rank) >= len(hosts):
        raise HeteroError(f"MLX_RANK={rank} but MLX_HOSTFILE={path} lists only {len(hosts)} ranks")
    return hosts


def connect(timeout: float = DEFAULT_TIMEOUT_S) -> "Link | None":
    """Join the ring `mlx.launch` set up; None when it is a group of one (run in-process as usual)."""
    hosts = _hosts()
    if len(hosts) <= 1:
        return None
    rank = int(os.environ["MLX_RANK"])
    dog = Watchdog()
    others = ", ".join(f"rank {i} at {h[0] if isinstance(h, list) and h else h}" for i, h in enumerate(hosts) if i != rank)
    dog.arm(timeout, f"hetero: error: rank {rank}: not every rank connected within {timeout:g} s ({others}): "
                     "check that each was started (mlx.launch), that the hosts reach each other on those ports, "
                     "or raise --dist-timeout")
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as e:
        dog.close()
        raise HeteroError(f"rank {rank}: could not join the ring: {str(e).splitlines()[0]}") from None
    dog.disarm()
    dog.on_terminate(f"hetero: error: rank {rank}: stopped by mlx.launch before the pipelined run finished: another "
                     "rank failed or was killed (its [WARN] line and output say which)")
    return Link(group, dog, timeout)


class Link:
    """This rank's place in the pipeline and its channels: hidden states to the next rank, messages to all."""

    def __init__(self, group: mx.distributed.Group, watchdog: Watchdog, timeout: float):
        self.group, self.watchdog, self.timeout = group, watchdog, timeout
        self.rank, self.size = group.rank(), group.size()

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def send_next(self, x: mx.array) -> mx.array:
        """x to the next rank (lazy: evaluating the result sends)."""
        return mx.distributed.send(x, self.rank + 1, group=self.group)

    def recv_prev(self, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        """An array from the previous rank (lazy: evaluating it waits for the data)."""
        return mx.distributed.recv(shape, dtype, self.rank - 1, group=self.group)

    def send(self, x: mx.array, dst: int) -> None:
        with self.guard():
            mx.eval(mx.distributed.send(x, dst, group=self.group))

    def recv(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array:
        with self.guard():
            out = mx.distributed.recv(shape, dtype, src, group=self.group)
            mx.eval(out)
        return out

    def broadcast_ints(self, values: list[int] | None, root: int, length: int) -> list[int]:
        """`values` (on `root`, at most `length` ints) on every rank; zero-padded to `length`."""
        buf = [0] * length
        if self.rank == root:
            if len(values) > length:
                raise ValueError(f"{len(values)} values for a {length}-int message")
            buf[: len(values)] = values
        with self.guard():
            out = mx.distributed.all_sum(mx.array(buf, dtype=mx.int32), group=self.group)
            mx.eval(out)
        return out.tolist()

    def from_last(self, values: list[int] | None, length: int) -> list[int]:
        """`values` (on the last rank, at most `length` ints) on every rank, zero-padded: down the ring, the last
        rank to rank 0, then rank to rank (one message per hop, cheaper than an all_sum; the decode rounds' path)."""
        if self.last:
            buf = mx.array(values + [0] * (length - len(values)), dtype=mx.int32)
            self.send(buf, 0)
            return buf.tolist()
        buf = self.recv((length,), mx.int32, self.rank - 1 if self.rank else self.size - 1)
        if self.rank < self.size - 2:
            self.send(buf, self.rank + 1)
        return buf.tolist()

    def broadcast_json(self, obj: object, root: int) -> object:
        """A JSON-able object from `root` on every rank (its length first, then its UTF-8 bytes)."""
        data = json.dumps(obj).encode() if self.rank == root else b""
        (n,) = self.broadcast_ints([len(data)], root, 1)
        return json.loads(bytes(self.broadcast_ints(list(data), root, n)).decode())

    def gather_ints(self, value: int) -> list[int]:
        """One int (int64) from every rank, in rank order, on every rank."""
        slots = [value if r == self.rank else 0 for r in range(self.size)]
        with self.guard():
            out = mx.distributed.all_sum(mx.array(slots, dtype=mx.int64), group=self.group)
            mx.eval(out)
        return out.tolist()

    def eval(self, *arrays) -> None:
        """mx.eval of a graph that may wait on peers; a lost peer becomes a HeteroError."""
        with self.guard():
            mx.eval(*arrays)
        self.watchdog.pet()

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Turn the ring's errors (a peer died: its socket closed) into one HeteroError line."""
        try:
            yield
        except RuntimeError as e:
            if "[ring]" not in str(e):
                raise
            raise PeerLost(
                f"rank {self.rank}: the pipeline lost a rank ({str(e).splitlines()[0]}): another rank died or its host "
                "went away; see that rank's output (mlx.launch names it)"
            ) from None

    @contextmanager
    def request(self) -> Iterator[None]:
        """Arm the watchdog for the span of one request: no progress for `timeout` seconds ends this rank."""
        self.watchdog.arm(self.timeout, f"hetero: error: rank {self.rank}: no progress from the other ranks for "
                                        f"{self.timeout:g} s during a pipelined request (a rank hung?); stopping")
        try:
            with self.guard():
                yield
        finally:
            self.watchdog.disarm()

    def close(self) -> None:
        self.watchdog.close()


class PeerLost(HeteroError):
    """A rank of the pipeline died (its connection closed) while this one was waiting on it."""
