"""The elastic training the tests run: a tiny model, a commit every few steps, a fault on cue.

Every step is recorded in the state (so a restore takes back the steps after the
commit), and logged as a metric on every rank.
"""

from __future__ import annotations


def task_index() -> int:
    """This rank's Spark task: an elastic rank's Horovod host is named t<task>.<attempt>."""
    import os

    return int(os.environ["HOROVOD_HOSTNAME"][1:].split(".")[0])


def train(steps: int, *, commit_every: int = 5, kill: tuple[int, int] | None = None, marker: str = "",
          until_size: int | None = None, max_steps: int = 3000, step_time: float = 0.02,
          ready_at: int | None = None):
    """Train ``steps`` steps in ``hvd.elastic.run``; return what the tests check, on every rank.

    ``kill``: (task, step): that task's rank SIGKILLs itself at that step, once (``marker``
    is created first, so its next rank does not). ``until_size``: go on past ``steps``
    until the world has this many ranks again, then ``commit_every`` steps more; more
    than ``max_steps`` steps fails. ``ready_at``: at that step rank 0 creates ``marker``
    (for a test that causes the fault from outside), and each rank writes its pid and its
    task's next to it (``<marker>.<Horovod host>.pids``); with ``until_size`` too, rank 0
    creates ``<marker>.shrunk`` once it trains in a world smaller than that (for a test that
    gives the lost rank's replacement a place to run only then).
    """
    import os
    import signal
    import time

    import horovod.torch as hvd
    import torch

    import hvdmagic

    hvd.init()
    if marker:
        # Who this rank is, for a test that kills its process or its task from outside: a rank forked
        # from a template shows the template's environment in /proc, not its own.
        registry = f"{marker}.{os.environ.get('HOROVOD_HOSTNAME', '')}.pids"
        with open(registry, "w") as pids:
            pids.write(f"{os.getpid()} {os.environ['HVDMAGIC_SUPERVISOR_PID']}")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, samples=0, trace=[])

    def finished(trace: list) -> bool:
        if len(trace) < steps:
            return False
        if not until_size:
            return True
        sizes = [size for _, size in trace]
        back = len(sizes) - next((i + 1 for i in range(len(sizes) - 1, -1, -1) if sizes[i] != until_size), 0)
        return min(sizes) < until_size and back >= commit_every  # shrank, then trained a while at full size

    @hvd.elastic.run
    def loop(state):
        while not finished(state.trace):
            if state.step >= max_steps:
                raise RuntimeError(f"the world did not get back to {until_size} ranks within {max_steps} steps")
            x = torch.full((8, 4), 1.0 + hvd.rank())
            loss = (model(x) - 1.0).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():
                p.grad = hvd.allreduce(p.grad)
            optimizer.step()
            state.step += 1
            state.samples += 8 * hvd.size()
            state.trace = state.trace + [(state.step, hvd.size())]
            hvdmagic.log_metrics(step=state.step, loss=loss.item(), size=hvd.size())
            if state.step % commit_every == 0:
                state.commit()
            if ready_at is not None and state.step == ready_at and hvd.rank() == 0:
                # The test kills a worker once the marker is there, maybe this rank's own: its metric
                # rows must be on their way first, or the step's row dies with it.
                from hvdmagic.rank import telemetry

                telemetry.flush()
                open(marker, "w").close()
            if ready_at is not None and until_size and hvd.size() < until_size and hvd.rank() == 0:
                open(f"{marker}.shrunk", "a").close()
            if kill and task_index() == kill[0] and state.step == kill[1]:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(step_time)

    loop(state)
    weights = [float(v) for p in model.parameters() for v in p.detach().flatten()]
    return {"trace": state.trace, "samples": state.samples, "weights": weights, "rank": hvd.rank(),
            "size": hvd.size()}
