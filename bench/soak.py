"""Soak: 8 client processes x N calls with random sizes, the worker SIGKILLed once mid-run and restarted.

``python bench/soak.py [--clients 8] [--calls 100000] [--kill-at 0.4] [--seed S]``

Each client process makes ``--calls`` calls of random size (64 B .. 1 MiB, log-uniform),
alternating ``echo`` on random bytes and ``scale`` (a=1, b=0) on random float32, and compares
every answer with what it sent, exactly. When the worker is gone (``WorkerGoneError``,
``ConnectError``, ``Timeout``) the call counts as *raised*, the client reconnects (retrying every 50 ms until the successor
serves, counted as ``connect_retries``, not as calls) and goes on. Every call either succeeds with the right answer or raises:
a wrong answer is counted, and must be 0.

When the clients together have made ``--kill-at`` of all calls, the worker is SIGKILLed and a
new one started under the same name (which removes what the dead one left).

Measured: open fds (``/proc/<pid>/fd``) and RSS of the worker and of every client after
warm-up (10 % of the calls; for a client that reconnected, again 5000 calls after its
reconnect, since its new Client's descriptor cache fills again) and at the end, still connected (the worker: after warm-up and
just before the kill, then after warm-up of the successor and at 95 % of the calls); ``/dev/shm``
entries before and after. RSS counts the region pages a process touched (``RssShmem``) as
well as its own memory (``RssAnon``); both are recorded. A client is judged by its RSS without
the region pages (``VmRSS - RssShmem``, since 2026-12-04): a client that borrows slots (``--via
async``: more requests at once than its lease) touches pages of slots it never used before, which
are the worker's region, bounded by it and given back at unmap, not the client's memory; its
``VmRSS`` growth is still recorded (``clients_rss_pct*``). Also counted: the PULSE frames the clients received (over
ZeroMQ, before a launched request's DONE); the environment's ``SHMRPC_*`` settings are recorded. Prints a table;
writes ``bench/results/soak-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SLOTS = "64K:64,1M:24,4M:24"
LEASE = "2,1,1"
WARM_FRACTION = 0.1
#: a client that reconnected starts a new Client, whose caches (descriptors, up to 4096 of them) fill
#: again: its memory is measured again this many calls after the reconnect
REWARM_CALLS = 5000


def proc_facts(pid: int | str = "self") -> dict[str, int]:
    """Open fds and memory (kB) of a process, from /proc."""
    out: dict[str, int] = {}
    try:
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
                out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def shm_entries() -> int:
    """Entries in /dev/shm."""
    return len(os.listdir("/dev/shm"))


# ------------------------------------------------------------ the client process


def _ask(c: Any, submit: bool, op: str, **kw: Any) -> dict[str, np.ndarray]:
    """One call through ``Client.submit(...).result()`` or ``Client.call``."""
    return c.submit(op, **kw).result() if submit else c.call(op, **kw)


def _draw(rng: np.random.Generator, pool: np.ndarray, i: int, strided: bool = False
          ) -> tuple[str, dict[str, Any], np.ndarray]:
    """Call ``i``'s op, keywords and expected ``out``: an even one ``echo`` of a run of ``pool`` (``strided``: every
    second byte of it), an odd one ``scale`` of random float32 by 1; sizes log-uniform from 64 B to 1 MiB."""
    nbytes = int(np.exp(rng.uniform(np.log(64), np.log(1 << 20))))
    if i % 2 == 0:
        step = 2 if strided else 1
        start = int(rng.integers(0, pool.size - step * nbytes))
        x = pool[start:start + step * nbytes:step]
        return "echo", {"x": x}, x
    xf = rng.standard_normal(max(1, nbytes // 4)).astype(np.float32)
    return "scale", {"x": xf, "a": 1.0, "b": 0.0}, xf


class _Tally:
    """One soak client's counts and its own memory at warm-up, after a reconnect and at the end (the final JSON
    line :func:`client_main` and :func:`async_client_main` print)."""

    def __init__(self, seed: int, calls: int) -> None:
        self.r: dict[str, Any] = {"seed": seed, "calls": calls, "ok": 0, "wrong": 0, "raised": {}, "reconnects": 0,
                                  "connect_retries": 0, "pulses": 0, "warm": {}, "rewarm": {}}
        self.calls, self.rewarm_at, self.t0 = calls, -1, time.perf_counter()

    def answered(self, out: dict[str, np.ndarray], want: np.ndarray) -> None:
        good = out["out"].dtype == want.dtype and np.array_equal(out["out"], want)
        self.r["ok"] += good
        self.r["wrong"] += not good

    def raised(self, e: BaseException) -> None:
        """A call raised ``e`` (counted by its type)."""
        self.r["raised"][type(e).__name__] = self.r["raised"].get(type(e).__name__, 0) + 1

    def reconnecting(self, pulses: int, i: int) -> None:
        """The client is closed (``pulses``: the PULSE frames it received) and made again; its memory is sampled
        once more ``REWARM_CALLS`` calls after call ``i``."""
        self.r["pulses"] += pulses
        self.r["reconnects"] += 1
        self.rewarm_at, self.r["rewarm"] = i + REWARM_CALLS, {}

    def passed(self, before: int, i: int) -> None:
        """Calls ``before`` .. ``i - 1`` are done: the memory samples and progress lines they passed."""
        if before < int(self.calls * WARM_FRACTION) <= i:
            self.r["warm"] = proc_facts()
        if before < self.rewarm_at <= i:
            self.r["rewarm"] = proc_facts()
        if before // 1000 != i // 1000:
            print(f"progress {i}", flush=True)

    def report(self, end: dict[str, int], pulses: int) -> None:
        """The final JSON line: ``end``, the memory while still connected (like at warm-up), and the last client's
        pulses."""
        self.r["end"], self.r["elapsed_s"] = end, time.perf_counter() - self.t0
        self.r["pulses"] += pulses
        print(json.dumps(self.r), flush=True)


def client_main(name: str, seed: int, calls: int, spin_us: int = 0, lane: str = "", via: str = "call") -> None:
    """Make ``calls`` checked calls; print progress lines and a final JSON line. ``via``: ``call`` (``Client.call``),
    ``submit`` (``Client.submit(...).result()``), ``mixed``: every third call through ``submit``, and every other
    ``echo`` of a strided view of the pool (every second byte) instead of a contiguous run of it; or ``async``
    (:func:`async_client_main`)."""
    if via == "async":
        async_client_main(name, seed, calls, lane)
        return
    from shmrpc.client import Client, ConnectError, RequestError, Timeout, WorkerGoneError

    rng = np.random.default_rng(seed)
    tally = _Tally(seed, calls)
    c: Any = None
    pool = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
    i = 0
    while i < calls:
        if c is None:
            try:
                c = Client(name, timeout_s=20, connect_timeout_s=30, spin_us=spin_us,
                           **({"lane": lane} if lane else {}))
            except (ConnectError, WorkerGoneError, Timeout):
                # no call was made: the successor is not serving yet (a missing or dead socket fails at once)
                tally.r["connect_retries"] += 1
                time.sleep(0.05)
                continue
        op, kw, want = _draw(rng, pool, i, strided=via == "mixed" and i % 4 == 0)
        try:
            tally.answered(_ask(c, via == "submit" or (via == "mixed" and i % 3 == 0), op, **kw), want)
        except (WorkerGoneError, ConnectError, Timeout, RequestError) as e:
            tally.raised(e)
            if not isinstance(e, RequestError):
                pulses = c._inflight.pulses
                c.close()
                c = None
                tally.reconnecting(pulses, i)
        i += 1
        tally.passed(i - 1, i)
    end = proc_facts()  # still connected, like at warm-up
    pulses = 0
    if c is not None:
        pulses = c._inflight.pulses
        c.close()
    tally.report(end, pulses)


ASYNC_GROUP = 8  # requests an async client sends at once: more than its lease, so some wait for a slot


def async_client_main(name: str, seed: int, calls: int, lane: str = "") -> None:
    """``client_main`` through an ``AsyncClient``: the calls go out ``ASYNC_GROUP`` at a time (``submit``, then
    ``asyncio.gather``), more than the client's lease: some wait on the loop for a slot, a larger one borrows one
    from the executor. Every answer is compared with its own inputs; a group the worker's death cut short counts
    its calls that raised, and the client reconnects."""
    import asyncio

    from shmrpc.client import AsyncClient, ConnectError, RequestError, Timeout, WorkerGoneError

    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
    tally = _Tally(seed, calls)

    async def main() -> None:
        c: Any = None
        i = 0
        while i < calls:
            if c is None:
                try:
                    c = await AsyncClient.connect(name, timeout_s=20, connect_timeout_s=30,
                                                  **({"lane": lane} if lane else {}))
                except (ConnectError, WorkerGoneError, Timeout):
                    tally.r["connect_retries"] += 1
                    await asyncio.sleep(0.05)
                    continue
            n = min(ASYNC_GROUP, calls - i)
            futs, wants = [], []
            for k in range(n):
                op, kw, want = _draw(rng, pool, i + k)
                futs.append(c.submit(op, **kw))
                wants.append(want)
            gone = False
            for out, want in zip(await asyncio.gather(*futs, return_exceptions=True), wants):
                if isinstance(out, (WorkerGoneError, ConnectError, Timeout, RequestError)):
                    tally.raised(out)
                    gone |= not isinstance(out, RequestError)
                elif isinstance(out, BaseException):
                    raise out
                else:
                    tally.answered(out, want)
            before, i = i, i + n
            if gone:
                pulses = c.client._inflight.pulses
                await c.aclose()
                c = None
                tally.reconnecting(pulses, i)
            tally.passed(before, i)
        end = proc_facts()  # still connected, like at warm-up
        pulses = 0
        if c is not None:
            pulses = c.client._inflight.pulses
            await c.aclose()
        tally.report(end, pulses)

    asyncio.run(main())


# ------------------------------------------------------------ the driver


def start_worker(name: str, spin_us: int = 0) -> subprocess.Popen[str]:
    """A NumPy worker; returns once it prints its ready line (dumpable, so /proc/<pid>/fd can be counted)."""
    args = [sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--slots", SLOTS, "--lease", LEASE,
            "--backend", "numpy", "--no-mlock", "--log-level", "ERROR", "--spin-us", str(spin_us), "--dumpable"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline() if p.stdout else ""
    if "ready" not in line:
        p.kill()
        p.wait()
        raise RuntimeError(f"worker {name} did not start: {line!r}")
    return p


def _growth(a: dict[str, int], b: dict[str, int], key: str) -> float | None:
    if key == "private":  # RSS without the region pages touched (RssShmem)
        a, b = ({"private": f["VmRSS"] - f.get("RssShmem", 0)} if "VmRSS" in f else {} for f in (a, b))
    if not a.get(key) or key not in b:
        return None
    return round(100.0 * (b[key] - a[key]) / a[key], 2)


def main(argv: list[str] | None = None) -> int:
    """Run the soak; exit status 1 on a wrong answer, growth over 5 %, or a leaked /dev/shm entry."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--calls", type=int, default=100_000, help="calls per client")
    ap.add_argument("--kill-at", type=float, default=0.4, help="fraction of all calls at which the worker is killed")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--spin-us", type=int, default=0, help="worker --spin-us and the clients' spin_us (default 0)")
    ap.add_argument("--lane", choices=("block", "spin"), default=None,
                    help="every other client asks for this lane (Client(lane=...)); the others use ZeroMQ")
    ap.add_argument("--via", choices=("call", "submit", "mixed", "async"), default="call",
                    help="how the clients call: call(), submit().result(), mixed (a third through submit(), every "
                         "other echo of a strided view), or async (an AsyncClient, 8 requests at a time)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/soak-<date>.json; '-' for none)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    name = "soak-" + uuid.uuid4().hex[:10]
    total = args.clients * args.calls
    print(f"soak: {args.clients} clients x {args.calls} calls, kill at {args.kill_at:.0%}, seed {seed}, worker {name}",
          flush=True)
    started = _dt.datetime.now(_dt.timezone.utc)
    shm_before = shm_entries()
    worker = start_worker(name, args.spin_us)
    w_facts: dict[str, dict[str, int]] = {"first_start": proc_facts(worker.pid)}
    t0 = time.perf_counter()
    clients = [subprocess.Popen([sys.executable, __file__, "client", name, str(seed + k), str(args.calls),
                                 str(args.spin_us), (args.lane or "") if k % 2 else "", args.via],
                                stdout=subprocess.PIPE, text=True) for k in range(args.clients)]
    progress = [0] * args.clients
    results: list[dict[str, Any] | None] = [None] * args.clients
    killed_at: float | None = None
    restart_s = 0.0
    last = t0
    try:
        while any(r is None for r in results):
            fds = {c.stdout.fileno(): k for k, c in enumerate(clients) if results[k] is None and c.stdout}
            ready, _, _ = select.select(list(fds), [], [], 1.0)
            for fd in ready:
                k = fds[fd]
                line = clients[k].stdout.readline()  # type: ignore[union-attr]
                if not line:
                    results[k] = {"error": f"client exited {clients[k].wait()} without a result"}
                elif line.startswith("progress"):
                    progress[k] = int(line.split()[1])
                elif line.startswith("{"):
                    results[k] = json.loads(line)
                    progress[k] = args.calls
            done = sum(progress)
            if "first_warm" not in w_facts and done >= total * WARM_FRACTION:
                w_facts["first_warm"] = proc_facts(worker.pid)
            if killed_at is None and done >= total * args.kill_at:
                w_facts["first_before_kill"] = proc_facts(worker.pid)
                worker.kill()
                worker.wait()
                killed_at = time.perf_counter() - t0
                t_r = time.perf_counter()
                worker = start_worker(name, args.spin_us)
                restart_s = time.perf_counter() - t_r
                print(f"  worker SIGKILLed at {done} calls ({killed_at:.1f} s); successor ready in {restart_s:.2f} s",
                      flush=True)
                kill_done = done
            if killed_at is not None and "second_warm" not in w_facts and \
                    done >= kill_done + (total - kill_done) * WARM_FRACTION:
                w_facts["second_warm"] = proc_facts(worker.pid)
            if "second_end" not in w_facts and done >= total * 0.95:  # clients still connected
                w_facts["second_end"] = proc_facts(worker.pid)
            now = time.perf_counter()
            if now - last > 10:
                last = now
                print(f"  {done:>9} / {total} calls  {done / (now - t0):8.0f} calls/s  worker {proc_facts(worker.pid)}",
                      flush=True)
        w_facts["after_clients"] = proc_facts(worker.pid)
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
            c.wait()
            if c.stdout:
                c.stdout.close()
        worker.send_signal(signal.SIGTERM)
        try:
            rc: int | str = worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
            rc = "did not drain within 30 s (killed)"
    elapsed = time.perf_counter() - t0
    time.sleep(0.2)
    shm_after = shm_entries()
    ok = sum(r.get("ok", 0) for r in results if r)
    wrong = sum(r.get("wrong", 0) for r in results if r)
    raised: dict[str, int] = {}
    for r in results:
        for k, v in (r or {}).get("raised", {}).items():
            raised[k] = raised.get(k, 0) + v
    errors = [r["error"] for r in results if r and "error" in r]
    pulses = sum(r.get("pulses", 0) for r in results if r)
    growth = {
        "worker_first_rss_pct": _growth(w_facts.get("first_warm", {}), w_facts.get("first_before_kill", {}), "VmRSS"),
        "worker_first_rss_anon_pct": _growth(w_facts.get("first_warm", {}), w_facts.get("first_before_kill", {}),
                                             "RssAnon"),
        "worker_second_rss_anon_pct": _growth(w_facts.get("second_warm", {}), w_facts.get("second_end", {}), "RssAnon"),
        "worker_first_fds": [w_facts.get("first_warm", {}).get("fds"), w_facts.get("first_before_kill", {}).get("fds")],
        "worker_second_rss_pct": _growth(w_facts.get("second_warm", {}), w_facts.get("second_end", {}), "VmRSS"),
        "worker_second_fds": [w_facts.get("second_warm", {}).get("fds"), w_facts.get("second_end", {}).get("fds")],
        "clients_rss_pct": [_growth(r["warm"], r["end"], "VmRSS") for r in results if r and "warm" in r],
        "clients_rss_anon_pct": [_growth(r["warm"], r["end"], "RssAnon") for r in results if r and "warm" in r],
        "clients_fds": [[r["warm"].get("fds"), r["end"].get("fds")] for r in results if r and "warm" in r],
        "clients_rss_pct_after_rewarm": [_growth(r["rewarm"], r["end"], "VmRSS") for r in results
                                         if r and r.get("rewarm")],
        "clients_rss_anon_pct_after_rewarm": [_growth(r["rewarm"], r["end"], "RssAnon") for r in results
                                              if r and r.get("rewarm")],
        "clients_private_pct_after_rewarm": [_growth(r["rewarm"], r["end"], "private") for r in results
                                             if r and r.get("rewarm")],
        "clients_fds_after_rewarm": [[r["rewarm"].get("fds"), r["end"].get("fds")] for r in results
                                     if r and r.get("rewarm")],
    }
    # judged after warm-up of the process that is measured: the worker and its successor, and each client's
    # Client after its last (re)connect (its first warm-up when it never had to reconnect)
    client_rss = [_growth(r["rewarm"] or r["warm"], r["end"], "private") for r in results if r and "warm" in r]
    client_fds = [[(r["rewarm"] or r["warm"]).get("fds"), r["end"].get("fds")] for r in results if r and "warm" in r]
    rss = [g for g in [growth["worker_first_rss_pct"], growth["worker_second_rss_pct"], *client_rss] if g is not None]
    fds_grew = any(b is not None and a is not None and b > a
                   for a, b in [growth["worker_first_fds"], growth["worker_second_fds"], *client_fds])
    print(f"\n{args.clients} clients x {args.calls} calls in {elapsed:.1f} s ({(ok + wrong) / elapsed:.0f} calls/s), "
          f"seed {seed}")
    print(f"{'ok':>10} {'wrong':>7} {'raised':>7}  raised by class")
    print(f"{ok:>10} {wrong:>7} {sum(raised.values()):>7}  {raised}")
    print(f"worker killed at {killed_at:.1f} s, successor ready in {restart_s:.2f} s, exit on SIGTERM: {rc}")
    print(f"worker facts: {json.dumps(w_facts)}")
    print(f"growth after warm-up: {json.dumps(growth)}")
    print(f"judged: RSS growth (clients: without the region pages) {rss} %, fds grew: {fds_grew}")
    print(f"/dev/shm entries: {shm_before} before, {shm_after} after; client errors: {errors}; PULSE frames received: "
          f"{pulses}")
    result = {
        "program": "bench/soak.py", "date": started.isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SHMRPC_")}, "pulses": pulses,
        "seed": seed, "clients": args.clients, "calls_per_client": args.calls, "elapsed_s": round(elapsed, 2),
        "calls_per_s": round((ok + wrong) / elapsed, 1), "ok": ok, "wrong": wrong, "raised": raised,
        "client_errors": errors, "worker": {"slots": SLOTS, "lease": LEASE, "backend": "numpy",
                                            "spin_us": args.spin_us, "lane": args.lane, "via": args.via, "killed_at_s": killed_at, "restart_s": round(restart_s, 3),
                                            "exit_on_sigterm": rc},
        "worker_facts": w_facts, "growth": growth,
        "judged": {"rss_growth_pct": rss, "clients_rss": "VmRSS - RssShmem", "fds_grew": fds_grew, "limit_pct": 5}, "shm_entries": {"before": shm_before, "after": shm_after},
        "per_client": results, "machine": _machine(),
    }
    out = args.out or str(ROOT / "bench" / "results" / f"soak-{started.date().isoformat()}.json")
    if out != "-":
        Path(out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"wrote {out}")
    bad = wrong or errors or any(g > 5 for g in rss) or fds_grew or shm_after > shm_before or rc != 0
    return 1 if bad else 0


def _machine() -> dict[str, Any]:
    import importlib.util

    # the fuzzer (test support) records the same machine facts; one definition for both programs
    spec = importlib.util.spec_from_file_location("shmrpc_fuzz", ROOT / "tests" / "support" / "fuzz.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.machine_facts()  # type: ignore[no-any-return]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 0,
                    sys.argv[6] if len(sys.argv) > 6 else "", sys.argv[7] if len(sys.argv) > 7 else "call")
    else:
        sys.exit(main())
