"""Reproducer for the rare SIGABRT of a horovod 0.28.1 rank on torch 2.13 (issue 27, point 1).

A long run of horovod.torch collectives on 2 ranks, interleaved with ops that fail on purpose
(mismatched dtypes, shapes and root ranks across the ranks, duplicate names), plus fused
async allreduce/allgather: the mix under which horovod's own torch suite lost a rank to
SIGABRT now and then. See docs/frameworks.md, "A rank aborted by SIGABRT inside horovod".

Three ways to run it:

    # one rank's work (what each rank runs; horovodrun starts two)
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/repro_sigabrt.py worker

    # N runs under horovodrun, counting the runs where a rank died of a signal
    # (--reinit: what aborts; without it, the failing ops alone, which do not)
    python benchmarks/repro_sigabrt.py horovodrun --runs 10 --iterations 30 --reinit

    # N runs of the same sequence in `%%horovod --np -2` (hvdmagic's local mode), in one IPython shell
    python benchmarks/repro_sigabrt.py hvdmagic --runs 10 --iterations 30 --reinit

What it found: the ops that fail are not the cause. The abort comes from hvd.init() after
hvd.shutdown() in the same processes (horovod's suite does that between tests; --reinit here):
the rendezvous server kept a scope's old addresses, and Gloo's connect to a dead peer threw in
horovod's background thread. --log-rendezvous FILE (horovodrun mode) logs the server's PUTs and
DELETEs, with the keys each DELETE leaves behind.

Options: --iterations (rounds of the sequence per run, default 200), --timeout (seconds per run),
--cores DIR (each rank chdirs to DIR/rank<N> with an unlimited core limit, so that a
crashing rank leaves DIR/rank<N>/core for `gdb -batch -ex 'thread apply all bt' python core`),
--no-errors (the same sequence without the failing ops, to see whether they matter).
Run it under `nice -n 19` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------------
# The rank's work
# ---------------------------------------------------------------------------

def rank_work(iterations: int = 200, errors: bool = True, cores: str | None = None,
              reinit: bool = False) -> dict:
    """Run the sequence on this rank (hvd.init() here); returns counts. Raises when a result is wrong.

    ``reinit``: ``hvd.barrier(); hvd.shutdown(); hvd.init()`` after every iteration, as the
    tearDown of horovod's own torch suite does after every test under Gloo.
    """
    import faulthandler
    import resource

    import horovod.torch as hvd
    import torch

    faulthandler.enable(all_threads=True)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert size >= 2, "needs 2 ranks"
    if cores:
        d = Path(cores) / f"rank{rank}"
        d.mkdir(parents=True, exist_ok=True)
        os.chdir(d)
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    dtypes = [torch.int32, torch.int64, torch.float32, torch.float64]
    counts = {"ok": 0, "raised": 0}

    def expect_error(exc, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except exc:
            counts["raised"] += 1
            return
        raise AssertionError(f"{fn.__name__} did not raise")

    # Ops that fail on every rank: the coordinator sends an ERROR response.
    odd = rank % 2 == 1

    def allreduce_type_error():
        hvd.allreduce(torch.ones([17] * 3, dtype=torch.float32 if odd else torch.int32))

    def allreduce_shape_error():
        hvd.allreduce(torch.ones([17 + rank] * 3))

    def allreduce_rank_error():
        hvd.allreduce(torch.ones([17, 23 * 57] if rank == 0 else [17, 23, 57]))

    def allgather_type_error():
        hvd.allgather(torch.ones([17] * 3, dtype=torch.float32 if odd else torch.int32))

    def allgather_shape_error():
        hvd.allgather(torch.ones([17, 3 + rank]))

    def broadcast_type_error():
        hvd.broadcast(torch.ones([17] * 3, dtype=torch.float32 if odd else torch.int32), 0)

    def broadcast_shape_error():
        hvd.broadcast(torch.ones([17, 10 * (rank + 1), 17]), 0)

    def broadcast_root_error():
        hvd.broadcast(torch.ones([17] * 3), rank)

    def alltoall_type_error():
        hvd.alltoall(torch.ones([size * 2], dtype=torch.float32 if odd else torch.int32))

    failing = (allreduce_type_error, allreduce_shape_error, allreduce_rank_error,
               allgather_type_error, allgather_shape_error, broadcast_type_error,
               broadcast_shape_error, broadcast_root_error, alltoall_type_error)

    for it in range(iterations):
        if reinit and it:
            hvd.barrier()
            hvd.shutdown()
            hvd.init()
            counts["inits"] = counts.get("inits", 1) + 1
            if rank == 0:
                print(f"init {counts['inits']} done", flush=True)
        torch.manual_seed(it)
        # 1. Fused async allreduce (in place and not), several dtypes and ranks of tensor.
        pending = []
        for dtype in dtypes:
            for dim in (1, 2, 3):
                t = torch.randint(-100, 100, [7] * dim).to(dtype)
                if dim == 2:
                    h = hvd.allreduce_async_(t.clone(), op=hvd.Sum)
                else:
                    h = hvd.allreduce_async(t, op=hvd.Sum)
                pending.append((h, t * size))
        for h, want in pending:
            got = hvd.synchronize(h)
            assert torch.equal(got, want), "allreduce result"
        counts["ok"] += len(pending)

        # 2. Fused async allgather with a different first dimension on each rank.
        pending = []
        for dtype in dtypes:
            t = torch.full([rank + 1 + it % 3, 5], rank, dtype=dtype)
            pending.append(hvd.allgather_async(t))
        for h in pending:
            got = hvd.synchronize(h)
            assert got.shape[0] == sum(r + 1 + it % 3 for r in range(size)), "allgather shape"
        counts["ok"] += len(pending)

        # 3. Broadcast and alltoall that work.
        b = hvd.broadcast(torch.full([4, 4], float(rank)), root_rank=0)
        assert float(b.sum()) == 0.0
        a = hvd.alltoall(torch.arange(size * 3, dtype=torch.float32))
        assert a.numel() == size * 3
        counts["ok"] += 2

        if not errors:
            continue
        # 4. The ops that fail on every rank (above), one after the other.
        for fn in failing:
            expect_error(RuntimeError, fn)

        # 5. An async error mixed with fused work: the failing op is in flight beside others.
        good = [hvd.allreduce_async(torch.ones(33) * rank, op=hvd.Sum) for _ in range(4)]
        bad = hvd.allreduce_async(torch.ones([5] * 2, dtype=torch.float64 if odd else torch.float32))
        good += [hvd.allgather_async(torch.ones([rank + 1, 3])) for _ in range(2)]
        for h in good:
            hvd.synchronize(h)
        expect_error(RuntimeError, hvd.synchronize, bad)
        counts["ok"] += len(good)

        # 6. Duplicate names: the second enqueue fails at once, on one rank at a time.
        t = torch.ones([17] * 2)
        for who in range(size):
            if rank == who:
                h = hvd.allreduce_async(t, name=f"dup.{it}")
                expect_error(ValueError, hvd.allreduce_async, t, name=f"dup.{it}")
            hvd.barrier()
            if rank != who:
                h = hvd.allreduce_async(t, name=f"dup.{it}")
            hvd.synchronize(h)
            hvd.barrier()
        if rank == 0 and it % 20 == 0:
            print(f"iteration {it}: {counts}", flush=True)
    hvd.shutdown()
    return counts


# ---------------------------------------------------------------------------
# Drivers: N runs under each launcher
# ---------------------------------------------------------------------------

SIGNALLED = re.compile(r"(Fatal Python error: (Aborted|Segmentation fault)|terminate called|"
                       r"exit with status code (-6|134|-11|139)|Aborted \(core dumped\)|"
                       r"killed by SIG[A-Z]+)")


def horovodrun_logged(log_path: str, argv: list[str]) -> int:
    """horovodrun, with its rendezvous handler logging each PUT and DELETE to log_path."""
    import threading

    from horovod.runner.http import http_server as hs

    lock = threading.Lock()

    def log(msg):
        with lock, open(log_path, "a") as f:
            f.write(f"{time.time():.3f} {msg}\n")

    delete, put = hs.RendezvousHandler.do_DELETE, hs.KVStoreHandler._put_value

    def do_DELETE(self):
        delete(self)
        _, scope, key = self.path.split("/")
        left = {s: sorted(d) for s, d in self.server.cache.items() if d}
        log(f"DELETE {scope}/{key} finished={dict(self.server.finished_list)} left={left}")

    def _put_value(self, scope, key, value):
        stale = key in self.server.cache.get(scope, {})
        put(self, scope, key, value)
        log(f"PUT {scope}/{key}{' (over a key left from before)' if stale else ''}")

    hs.RendezvousHandler.do_DELETE, hs.KVStoreHandler._put_value = do_DELETE, _put_value
    from horovod.runner.launch import run_commandline

    sys.argv = ["horovodrun", *argv]
    return run_commandline()


def run_horovodrun(args) -> list[dict]:
    results = []
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", HOROVOD_GLOO_IFACE="lo", PYTHONFAULTHANDLER="1")
    for i in range(args.runs):
        cores = f"{args.cores}/horovodrun-{i}" if args.cores else None
        launcher = args.horovodrun
        if args.log_rendezvous:
            launcher = [sys.executable, str(HERE), "horovodrun-logged", f"{args.log_rendezvous}.{i}"]
        cmd = [*launcher, "-np", "2", "-H", "localhost:2", "--gloo", "--network-interface", "lo",
               sys.executable, str(HERE), "worker", "--iterations", str(args.iterations)]
        if not args.errors:
            cmd.append("--no-errors")
        if args.reinit:
            cmd.append("--reinit")
        if cores:
            cmd += ["--cores", cores]
        started = time.time()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            out, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            rc = "timeout"
        results.append(record("horovodrun", i, rc, out, time.time() - started, args))
    return results


def run_hvdmagic(args) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from benchmarks._common import ipython_shell, run_cell

    ip = ipython_shell()
    results = []
    for i in range(args.runs):
        cores = f"{args.cores}/hvdmagic-{i}" if args.cores else None
        cell = (f"%%horovod --np -2 --timeout {args.timeout}\n"
                f"import runpy\n"
                f"m = runpy.run_path({str(HERE)!r}, run_name='repro_sigabrt')\n"
                f"print('counts', m['rank_work']({args.iterations}, {args.errors}, {cores!r}, {args.reinit}))\n")
        started = time.time()
        outcome, out, _, _ = run_cell(ip, cell)
        err = outcome.error_in_exec or outcome.error_before_exec
        rc = 0 if outcome.success else type(err).__name__
        out = out + ("\n" + str(err) if err else "")
        results.append(record("hvdmagic", i, rc, out, time.time() - started, args))
    return results


def record(launcher, i, rc, out, seconds, args) -> dict:
    m = SIGNALLED.search(out)
    r = {"launcher": launcher, "run": i, "rc": rc, "seconds": round(seconds, 1),
         "signal": m.group(0) if m else None, "errors": args.errors, "reinit": args.reinit,
         "iterations": args.iterations, "counts": re.findall(r"counts (\{.*?\})", out),
         "inits_done": max([1, *map(int, re.findall(r"init (\d+) done", out))])}
    print(json.dumps(r), flush=True)
    if rc != 0 and args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        Path(args.logs, f"{launcher}-{i}.log").write_text(out)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if sys.argv[1:2] == ["horovodrun-logged"]:  # internal: the launcher of --log-rendezvous
        sys.exit(horovodrun_logged(sys.argv[2], sys.argv[3:]))
    ap.add_argument("mode", choices=["worker", "horovodrun", "hvdmagic"])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--cores", default=None)
    ap.add_argument("--logs", default=None, help="keep the output of failed runs here")
    ap.add_argument("--no-errors", dest="errors", action="store_false")
    ap.add_argument("--reinit", action="store_true",
                    help="shut horovod down and init it again after every iteration (as horovod's suite does per test)")
    ap.add_argument("--log-rendezvous", metavar="FILE",
                    help="horovodrun mode: log the rendezvous server's PUTs and DELETEs to FILE.<run>")
    ap.add_argument("--horovodrun", nargs="+", default=[str(Path(sys.executable).parent / "horovodrun")],
                    help="the launcher's command (default: this venv's horovodrun)")
    args = ap.parse_args()
    if args.mode == "worker":
        print("counts", rank_work(args.iterations, args.errors, args.cores, args.reinit), flush=True)
        return
    results = run_horovodrun(args) if args.mode == "horovodrun" else run_hvdmagic(args)
    bad = [r for r in results if r["rc"] != 0]
    print(json.dumps({"launcher": args.mode, "runs": len(results), "failed": len(bad),
                      "signalled": sum(1 for r in results if r["signal"]), "errors": args.errors,
                      "reinit": args.reinit,
                      "iterations": args.iterations}), flush=True)


if __name__ == "__main__":
    main()
