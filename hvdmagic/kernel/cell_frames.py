"""The notebook cells in a run's stacks, named as IPython names them: ``Cell In[5], line 3``, with the line.

A rank's fault handler writes a frame as the file its code was compiled from: a function
defined in another notebook cell as ``/tmp/ipykernel_1234/567.py`` (a file that exists in the
kernel's linecache alone), the %%horovod cell itself as ``<horovod-cell>``, a session's cell as
``<horovod-cell-3>`` (``rank.cell.session_filename``). The kernel names
them as a run's stacks reach it: ``kernel.record`` for the where answers, ``kernel.runner`` for
the stacks of the run's error and of a crashed rank; ``stacks.name_cells`` writes them. Every view
then shows the same: the error and its summary line, ``hvdmagic.where()``, the dashboard,
``last_run().stacks`` and ``last_run().where``.

Named as they arrive rather than each time they are shown, because ``<horovod-cell>`` is the cell
of the run that is live then: the next %%horovod cell compiles to the same name.
"""

from __future__ import annotations

from collections.abc import Sequence

from hvdmagic import stacks
from hvdmagic.kernel.capture import notebook_cell, running_shell
from hvdmagic.rank.cell import CELL_FILENAME, CellFunction

# A session's cells by the file its ranks compiled each into (``rank.cell.session_filename``): a function
# an earlier session cell defined lives on in the ranks, and a later cell's stacks name that cell's file.
# A new session numbers its cells from 1 again and replaces them, as its ranks start with an empty namespace.
_SESSION_CELLS: dict[str, tuple[str, list[str]]] = {}


class CellFrames:
    """How one run names the notebook cells in its stacks.

    ``cell``: the run's %%horovod cell, which the ranks compiled as ``<horovod-cell>``, numbered
    as the notebook numbers the cell (``kernel.magic.cell_source`` pads it), and named as the
    capture found it (``CellFunction.display_name``); None for a run of a function
    (``hvdmagic.run``). The other cells are looked up in the running IPython shell when a frame
    names their file.
    """

    def __init__(self, cell: CellFunction | None = None, filename: str = CELL_FILENAME):
        named = cell is not None and getattr(cell, "display_name", "")
        self._own = (cell.display_name, cell.source.splitlines()) if named else None
        self._filename = filename
        if self._own is not None and filename != CELL_FILENAME:
            _SESSION_CELLS[filename] = self._own

    def cell_of(self, filename: str) -> tuple[str, Sequence[str]] | None:
        """(the cell's name, its lines) for a file a notebook cell was compiled into; else None."""
        if filename == self._filename:
            return self._own
        if filename in _SESSION_CELLS:
            return _SESSION_CELLS[filename]
        shell = running_shell()
        return None if shell is None else notebook_cell(shell, filename)

    def named(self, text: str) -> str:
        return stacks.name_cells(text, self.cell_of) if text else text

    def each_named(self, by_rank: dict[int, str]) -> dict[int, str]:
        return {rank: self.named(text) for rank, text in by_rank.items()}
