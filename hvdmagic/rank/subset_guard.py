"""Collectives refused while a session's cell runs on some of its ranks (``%%horovod --ranks 0``).

A collective waits until every rank of its group has called it. In a cell that runs on rank 0
alone the others never will: rank 0 would wait inside Horovod's or Gloo's C++, where no signal
reaches Python, until a stall timeout caught it, and the session would have to restart its ranks
and lose their state. So while such a cell runs, each collective that horovod.torch or
torch.distributed would start raises ``CollectiveOnSomeRanks`` before anything is submitted: no
rank waits, nothing is left pending in Horovod's queue, and the session keeps its ranks and state.

Where the collectives are caught, each at a point every path to them passes:

- horovod.torch: every collective submits through ``mpi_ops.mpi_lib`` (the extension's
  ``horovod_torch_*_async_*`` functions, ``join``, ``barrier``), so a stand-in for that module
  refuses them; ``hvd.init()`` (a rendezvous of every rank) through its ``_basics.init``, when
  Horovod is not initialised yet (a second call does nothing, and stays allowed).
- torch.distributed: its collectives in ``distributed_c10d`` and their re-exports in
  ``torch.distributed``, on a group that has a rank outside the cell's (the default group has them
  all); ``init_process_group`` before there is one, ``new_group``; and ``DistributedDataParallel``,
  whose construction broadcasts the model and whose forward and backward synchronise buffers and
  gradients from C++ (``model.module`` runs the model without them).

The patches are made when such a cell starts (and as one of those modules is imported while it
runs: ``framework_bars``' import hook calls ``adopt``) and undone when it ends, so the cells that
run on every rank meet the libraries' own functions. Not seen: TensorFlow's collectives, which
run as graph ops inside TensorFlow; a cell that calls them on some ranks waits until Stop or
``--stall-timeout``.
"""

from __future__ import annotations

import functools
import inspect
import sys

_only: tuple[int, ...] | None = None  # the ranks of the cell that runs now, while it runs on some of them
_in_pdb = False  # what runs there is the debugger's (rank.debugger), not a cell's
_undo: list = []  # (object, attribute, what it was; _ABSENT: nothing of its own) for each patch made

_ABSENT = object()
_TORCH_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list",
)
_HOROVOD_SUBMITS = ("horovod_torch_join", "horovod_torch_barrier", "horovod_torch_reset")


class CollectiveOnSomeRanks(RuntimeError):
    """A collective called in a cell that runs on some of the session's ranks only."""

    # Its traceback ends at the user's call (rank.outcome): the library's frames down to the refusal say nothing.
    ends_at_the_users_call = True


def refusal(what: str) -> CollectiveOnSomeRanks:
    ranks = _only or ()
    which = f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"
    if _in_pdb:
        return CollectiveOnSomeRanks(f"{what} is a collective: every rank must call it, and pdb runs on {which} "
                                     "alone; nothing was sent to the other ranks")
    return CollectiveOnSomeRanks(
        f"{what} is a collective: every rank must call it, and this cell runs on {which} only; nothing was sent "
        "to the other ranks. Call collectives in a cell that runs on every rank (without --ranks)")


class engaged:
    """While a cell runs on ``ranks`` only (None: on every rank, and nothing is patched); ``in_pdb``: while
    the debugger runs on them, between cells."""

    def __init__(self, ranks: tuple[int, ...] | None, in_pdb: bool = False):
        self.ranks = ranks
        self.in_pdb = in_pdb

    def __enter__(self) -> engaged:
        global _only, _in_pdb
        if self.ranks is not None:
            _only, _in_pdb = tuple(self.ranks), self.in_pdb
            for name in _ADOPTERS:
                if (module := sys.modules.get(name)) is not None:
                    adopt(module)
        return self

    def __exit__(self, *exc_info) -> None:
        global _only, _in_pdb
        _only, _in_pdb = None, False
        while _undo:
            owner, attribute, before = _undo.pop()
            if before is _ABSENT:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, before)


def adopt(module) -> None:
    """Patch ``module`` (one of ``_ADOPTERS``'), if a cell on some ranks runs now; called for those
    imported when it starts, and by ``framework_bars``' hook for those it imports."""
    if _only is not None and not getattr(module, "_hvdmagic_subset_guarded", False):
        _patch(module, "_hvdmagic_subset_guarded", True)
        _ADOPTERS[module.__name__](module)


def _patch(owner, attribute: str, value) -> None:
    _undo.append((owner, attribute, vars(owner).get(attribute, _ABSENT)))
    setattr(owner, attribute, value)


# -- horovod.torch ---------------------------------------------------------------------------------
class _RefusingLibrary:
    """horovod.torch's extension module, with the functions that submit a collective refused."""

    def __init__(self, library):
        self._library = library

    def __getattr__(self, name: str):
        if _only is not None and (name in _HOROVOD_SUBMITS or (name.startswith("horovod_torch_") and "_async" in name)):
            raise refusal(f"`{_horovod_name(name)}`")
        return getattr(self._library, name)


def _horovod_name(function: str) -> str:
    """``horovod_torch_allreduce_async_torch_FloatTensor`` -> "hvd.allreduce"; reset is hvd.shutdown's."""
    name = function.removeprefix("horovod_torch_").split("_async")[0].removeprefix("grouped_")
    return "hvd.shutdown" if name == "reset" else f"hvd.{name}"


def _guard_horovod_torch(package) -> None:
    mpi_ops = sys.modules.get("horovod.torch.mpi_ops")
    if mpi_ops is None:
        return
    _patch(mpi_ops, "mpi_lib", _RefusingLibrary(mpi_ops.mpi_lib))
    basics = mpi_ops._basics
    init = basics.init

    @functools.wraps(init)
    def guarded_init(*args, **kwargs):
        if _only is not None and not basics.is_initialized():  # a rendezvous of every rank; a second call: nothing
            raise refusal("`hvd.init()`")
        return init(*args, **kwargs)

    _patch(basics, "init", guarded_init)


# -- torch.distributed -----------------------------------------------------------------------------
def _guard_torch_distributed(c10d) -> None:
    distributed = sys.modules.get("torch.distributed")
    for name in (*_TORCH_COLLECTIVES, "init_process_group", "new_group", "new_subgroups"):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        guarded = _guarded_torch(c10d, name, original)
        _patch(c10d, name, guarded)
        if distributed is not None and getattr(distributed, name, None) is original:
            _patch(distributed, name, guarded)


def _guarded_torch(c10d, name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if _only is None:  # a copy the patch's undo missed (torch.distributed's, made as it imported c10d)
            refused = False
        elif name == "init_process_group":
            refused = not c10d.is_initialized()  # a rendezvous of every rank
        elif name in ("new_group", "new_subgroups"):
            refused = True  # every rank of the default group takes part in making one
        else:
            # Without a process group the call fails on its own, saying so; on a group of the cell's ranks alone
            # (dist.new_group, made in a cell on every rank) it is no collective of the others'.
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            refused = c10d.is_initialized() and not set(
                c10d.get_process_group_ranks(group or c10d.GroupMember.WORLD)) <= set(_only or ())
        if refused:
            raise refusal(f"`torch.distributed.{name}`")
        return original(*args, **kwargs)

    return guarded


def _guard_ddp(module) -> None:
    ddp = module.DistributedDataParallel

    for method in ("__init__", "forward"):
        original = vars(ddp)[method]

        @functools.wraps(original)
        def refused(*args, _original=original, **kwargs):
            if _only is None:
                return _original(*args, **kwargs)
            raise refusal("DistributedDataParallel (its construction broadcasts the model; its forward and backward "
                          "synchronise buffers and gradients: `model.module(...)` runs the model without them)")

        _patch(ddp, method, refused)


_ADOPTERS = {
    "horovod.torch": _guard_horovod_torch,
    "torch.distributed.distributed_c10d": _guard_torch_distributed,
    "torch.nn.parallel.distributed": _guard_ddp,
}
