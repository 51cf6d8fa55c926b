"""Runs in the notebook kernel, on the driver: what the user touches, and how a run is shown.

Entry points, each handing a run to ``runner``:

- ``magic``: the ``%%horovod`` and ``%%torchrun`` cell magics: arguments, capture, hand-off;
- ``warm_sessions``: ``%horovod start|stop|status`` (and ``%torchrun``'s), ``hvdmagic.session``, and
  the registry of this kernel's warm sessions, one per magic;
- ``api``: ``hvdmagic.run``, and the ``HorovodRunner``, ``TorchDistributor`` and ``DeepspeedTorchDistributor`` drop-ins.
- ``serverless_gpu``: Databricks' serverless GPU ``@distributed`` as a drop-in, and its imports' stand-in.
- ``rank_debugger``: ``%debug``, ``%pdb on``, ``%horovod debug`` and ``hvdmagic.debug``: pdb in the rank whose
  session cell failed.
- ``breakpoint_console``: where a rank's ``breakpoint()`` asks: the notebook's input box, or a terminal.

What a run goes through:

- ``framework_check``: before launch, whether this kernel's horovod was built for the frameworks a
  cell's source imports;
- ``capture``: a cell or function as a picklable ``rank.cell.CellFunction`` plus the notebook
  globals it reads;
- ``runner``: one run: the launcher core, a ``RunRecord`` and a view, wired together;
- ``record``: ``RunRecord``, built from the job's events; ``hvdmagic.last_run()``;
- ``history``: a run's metric history in typed columns, and as a pandas DataFrame;
- ``noise``: start-up chatter to leave out of rank output;
- ``timeline``: reading a Horovod Timeline (where it is, time per tensor);
- ``mlflow_export``: ``log_run``, a finished run's rank-0 metrics to MLflow (``--mlflow``);
- ``ui``: how a run is shown: the widget dashboard, the text view, the saved snapshot.

Modules here may import IPython, ipywidgets (``ui`` only), cloudpickle, pandas and numpy (on
use), mlflow (``mlflow_export`` only, which the magic imports on use), ``hvdmagic.launch``,
the shared top-level modules (``protocol``, ``errors``, ``pickling``, ``metric_rows``) and,
from ``hvdmagic.rank``, only what travels to a rank (``rank.cell``, ``rank.scripts``).
pyspark only through ``hvdmagic.launch``; never ``hvdmagic.task`` or ``hvdmagic.callbacks``.
Nothing outside ``kernel`` imports it but the top-level package, which imports it on first use.
"""
