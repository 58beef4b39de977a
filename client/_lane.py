"""The client's side of a lane (:mod:`shmrpc.schema.lane`): ring the worker and wait for its DONE.

One request at a time goes through the lane (a synchronous ``Loan.send`` or ``Client.call``
while nothing else is in flight); everything else, and every control message, goes over
ZeroMQ. Waiting spins on the page's done_seq for at most ``spin_s``, then blocks in poll()
on our eventfd and the worker's pidfd, so a worker that dies fails the wait at once.
"""

from __future__ import annotations

import mmap
import os
import select
import stat
import time

from shmrpc.schema import lane as L
from shmrpc.schema.errors import ConnectError, Timeout, WorkerGoneError

__all__ = ["ClientLane"]



class ClientLane:
    """The page and the two eventfds the WELCOME handed over, checked before they are used."""

    def __init__(self, page_fd: int, doorbell_fd: int, own_fd: int, worker_uid: int, spin_s: float) -> None:
        self.doorbell_fd, self.fd, self.spin_s = doorbell_fd, own_fd, spin_s
        self.seq = 0
        self.busy = 0  # the request_id in the lane, 0 when none
        try:
            st = os.fstat(page_fd)
            if st.st_uid != worker_uid or stat.S_IMODE(st.st_mode) != 0o600 or st.st_size != L.LANE_NBYTES:
                raise ConnectError(f"the lane page is owned by uid {st.st_uid} with mode "
                                   f"{stat.S_IMODE(st.st_mode):04o} and {st.st_size} bytes, not by the worker's uid "
                                   f"{worker_uid}, 0600 and {L.LANE_NBYTES}: refusing it")
            self._map = mmap.mmap(page_fd, L.LANE_NBYTES)
        finally:
            os.close(page_fd)
        self.page = memoryview(self._map)
        self._call_seq, self._done_seq = L.seq_word(self._map, L.CALL_SEQ), L.seq_word(self._map, L.DONE_SEQ)
        self._poll = select.poll()
        self._poll.register(own_fd, select.POLLIN)

    def ring(self, frame: bytes, request_id: int) -> None:
        """Publish a CALL frame in the page and wake the worker."""
        self.seq += 1
        L.post(self.page, self._call_seq, L.CALL_SEQ, self.seq, frame)
        self.busy = request_id
        os.eventfd_write(self.doorbell_fd, 1)

    def answer(self) -> bytes | None:
        """The DONE frame for the request in the lane, once the worker wrote it (else None)."""
        if self._done_seq.value != self.seq:
            return None
        frame = L.read_frame(self.page, L.DONE_SEQ)
        self.busy = 0
        return frame or b""

    def wait(self, deadline: float | None, pidfd: int | None, name: str) -> bytes:
        """Spin up to ``spin_s``, then block until the DONE of the request in the lane; returns it.

        Raises:
            Timeout: ``deadline`` (time.monotonic) passed first.
            WorkerGoneError: the worker process exited.
        """
        # no local of the seq word: a traceback through this frame would keep the page mapped after close()
        seq = self.seq
        if self.spin_s:
            end = time.perf_counter() + self.spin_s
            while self._done_seq.value != seq and time.perf_counter() < end:
                pass
        if pidfd is not None and not hasattr(self, "_pidfd"):
            self._pidfd = pidfd
            self._poll.register(pidfd, select.POLLIN)
        while True:
            got = self.answer()
            if got is not None:
                return got
            wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            events = self._poll.poll(wait_ms)
            for fd, _ in events:
                if fd == pidfd:
                    raise WorkerGoneError(f"worker {name!r} exited")
            if events:
                try:
                    os.eventfd_read(self.fd)  # NOTE: reset before the seq is read again at the loop's top
                except BlockingIOError:
                    pass
            elif deadline is not None and time.monotonic() >= deadline:
                raise Timeout(f"no answer from worker {name!r} in time")

    def close(self) -> None:
        del self._call_seq, self._done_seq  # they export the mapping's buffer
        self.page.release()
        try:
            self._map.close()
        except BufferError:  # a seq word still referenced (a traceback's frame): unmapped when it goes
            pass
        for fd in (self.doorbell_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.doorbell_fd = self.fd = -1
