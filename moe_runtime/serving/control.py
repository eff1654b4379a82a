"""The serving loop's control plane: lockstep decisions across ranks, signals, rank failures.

Expert parallelism makes every MoE forward a collective, so all ranks must agree, step by step,
on whether to run a batch, to stop, or to report progress. ``ControlPlane.sync`` does that with
one small all-reduce (MAX) on a dedicated gloo group whose timeout is the serving timeout (a hung rank
is then detected after ``timeout_s``, not after the default 30 minutes).

When a collective fails (a peer died: the socket closes at once; a peer hangs: the timeout), the
surviving ranks work out who is to blame through the rendezvous store, which under torchrun lives
in the agent process and so outlives any worker: every rank writes a heartbeat while serving and a
``failed`` note when it raises; after a failure each survivor writes ``alive`` and waits briefly
for the others'. Ranks that wrote ``failed`` or never answered are named in ``RankFailureError``.
"""

from __future__ import annotations

import datetime
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

kStoreNamespace = "moe_serve/"
kHeartbeatEvery_s = 0.5
kAliveWait_s = 2.0


class RankFailureError(RuntimeError):
    """A peer rank died, raised, or stopped answering; ``suspect_ranks`` names it (them)."""

    def __init__(self, message: str, suspect_ranks: list[int]):
        super().__init__(message)
        self.suspect_ranks = suspect_ranks


class ShutdownSignal:
    """Turns SIGINT/SIGTERM into a flag that the loop polls at batch boundaries.

    Repeats are absorbed rather than escalated: on Ctrl-C a worker gets SIGINT from the terminal
    and again from torchrun, which forwards the signal it received, and both must lead to the same
    clean stop. A rank that cannot stop is ended by the collective timeout or by torchrun's
    SIGKILL after its shutdown grace period.
    """

    kSignals = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int = 0
        self._previous: dict[int, object] = {}

    def install(self) -> "ShutdownSignal":
        for sig in self.kSignals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if not self.received:
            self.received = signum

    def __enter__(self) -> "ShutdownSignal":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


@dataclass(frozen=True)
class StepDecision:
    """What all ranks agreed on for one step."""

    stop_signal: int        # a signal number some rank received (SIGINT/SIGTERM), 0 if none
    any_pending: bool       # some rank still has requests running, waiting or to come
    any_tokens: bool        # some rank has tokens in this step's batch
    log: bool               # rank 0 asks for a progress report this step


# gloo raises plain RuntimeErrors whose text names its transport; NCCL and the c10d store raise
# DistError subclasses.
kCommErrorMarkers = ("gloo", "nccl", "timed out", "connection", "socket", "peer")


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective or the store rather than from local computation."""
    if isinstance(exc, (dist.DistError, TimeoutError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in kCommErrorMarkers)


def _store() -> dist.Store | None:
    try:
        return dist.PrefixStore(kStoreNamespace, dist.distributed_c10d._get_default_store())
    except (RuntimeError, ValueError, AttributeError):
        return None


class ControlPlane:
    """Lockstep control over all ranks of the default process group.

    ``timeout_s`` bounds every control collective: a rank that does not reach the next step within
    that time is reported as hung.
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) \
            if self.distributed else None
        self.store = _store() if self.distributed else None
        self._last_heartbeat = -float("inf")
        self.step = 0

    def _store_call(self, method: str, *args):
        if self.store is None:
            return None
        try:
            return getattr(self.store, method)(*args)
        except (RuntimeError, OSError, ValueError):
            return None

    def heartbeat(self, step: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_heartbeat >= kHeartbeatEvery_s:
            self._store_call("set", f"heartbeat/{self.rank}", f"{step} {time.time():.3f}")
            self._last_heartbeat = now

    def _guarded(self, what: str, fn, *args):
        try:
            return fn(*args)
        except RankFailureError:
            raise
        except (RuntimeError, TimeoutError) as exc:
            if not is_communication_error(exc):
                raise
            raise self.diagnose(exc, what) from exc

    def sync(self, *, stop_signal: int, pending: bool, batch_tokens: int, log: bool) -> StepDecision:
        """One lockstep decision; every rank calls it once per step with its local state.

        ``stop_signal``: the signal number this rank received (0: none).
        """
        self.heartbeat(self.step)
        state = torch.tensor([stop_signal, int(pending), batch_tokens, int(log)], dtype=torch.int64)
        if self.distributed:
            self._guarded(f"control step {self.step}", dist.all_reduce, state, dist.ReduceOp.MAX, self.group)
        self.step += 1
        stop, any_pending, tokens, log_flag = (int(v) for v in state.tolist())
        return StepDecision(stop, any_pending > 0, tokens > 0, log_flag > 0)

    def max(self, value: float, what: str) -> float:
        """Maximum of ``value`` over all ranks."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        self._guarded(what, dist.all_reduce, tensor, dist.ReduceOp.MAX, self.group)
        return float(tensor.item())

    def gather(self, obj, what: str) -> list:
        """``obj`` of every rank, in rank order (pickled; for small metadata only)."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        self._guarded(what, dist.all_gather_object, out, obj, self.group)
        return out

    def guard(self, what: str, fn, *args):
        """Run a collective-bearing call (a forward over the EP group) with failure diagnosis."""
        return self._guarded(what, fn, *args)

    def report_failure(self, exc: BaseException) -> None:
        """Tell the peers, through the store, that this rank is going down and why."""
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
        self._store_call("set", f"failed/{self.rank}", text)

    def _read(self, key: str) -> str | None:
        if not self._store_call("check", [key]):
            return None
        value = self._store_call("get", key)
        return None if value is None else value.decode(errors="replace")

    def diagnose(self, exc: BaseException, what: str) -> RankFailureError:
        """Turn a failed collective into an error that names the rank(s) at fault."""
        original = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        failed_at = time.time()
        header = f"rank {self.rank}: {what} failed"
        if self.store is None:
            return RankFailureError(f"{header} (no rendezvous store to ask which rank failed). {original}", [])
        self._store_call("set", f"alive/{self.rank}", str(self.step))
        peers = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + kAliveWait_s
        failed: dict[int, str] = {}
        silent = set(peers)
        while True:
            for r in list(silent):
                note = self._read(f"failed/{r}")
                if note is not None:
                    failed[r] = note
                    silent.discard(r)
                elif self._store_call("check", [f"alive/{r}"]):
                    silent.discard(r)
            if not silent or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if self._store_call("check", [f"alive/{self.rank}"]) is None:
            return RankFailureError(
                f"{header}; the rendezvous store is unreachable too, so the rank hosting it (rank 0 "
                f"without torchrun) has probably died. {original}", [0])
        parts = [f"rank {r} failed with {note}" for r, note in sorted(failed.items())]
        for r in sorted(silent):
            beat = self._read(f"heartbeat/{r}")
            if beat is None:
                parts.append(f"rank {r} did not answer (no heartbeat)")
            else:
                step, stamp = beat.split()
                parts.append(f"rank {r} did not answer (last heartbeat at step {step}, "
                             f"{failed_at - float(stamp):.1f}s before the failure): it died or hung")
        suspects = sorted(failed) + sorted(silent)
        if not parts:
            parts.append("every peer is alive and saw the failure too (this rank may itself have stalled past "
                         f"the {self.timeout_s:g}s timeout, or the network failed)")
        return RankFailureError(f"{header}: {'; '.join(parts)}. Original error: {original}", suspects)

    def close(self) -> None:
        """Destroy the control group after a successful run (every rank calls it).

        The barrier first: a gloo rank that closes its sockets while a peer still drains the last
        collective has made that peer abort under load. After a failure nothing is torn down, since
        a barrier with a dead peer would only wait for the timeout.
        """
        if self.group is not None:
            dist.barrier(group=self.group)
            dist.destroy_process_group(self.group)
            self.group = None
