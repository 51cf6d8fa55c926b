"""tqdm's and Keras' progress bars, adopted in a rank: they drive the rank's row instead of printing.

A rank's stdout and stderr are pipes to its supervisor, which relays them as log lines.
A bar drawn there is text that redraws itself with ``\\r`` (or, for Keras on a terminal,
backspaces): the dashboard could only show it as the rank's last line, cut to the
column, with its bar empty. So in a rank:

- every ``tqdm`` bar bound for the rank's stdout or stderr (the default) draws into a
  file of its own that prints nothing: each time tqdm would draw (at most every
  ``mininterval``, and when it closes) that file reports the bar's ``n`` and ``total``
  through ``telemetry.progress``, under the bar's ``desc``. Bars open at the same time
  get a name each; the kernel then shows the most recently started one as the row's
  bar, and an older one still open with a total (the epoch loop around it) as the
  ``epoch 3/5`` counter and the run's overall progress, as for nested ``hvdmagic.track``
  calls. ``disable=True`` is respected (a library or the user chose no bar);
  ``disable=None``, tqdm's "only on a terminal", is adopted, since the row is where a
  user looks. ``tqdm.notebook`` is plain tqdm here: a rank has no notebook front end,
  and rank code never imports IPython or widgets. ``tqdm.auto`` already picks plain tqdm
  in a process without IPython.
- Keras' ``Progbar`` with ``verbose=1`` (Keras 2, ``tf_keras``, as ``tf.keras`` on the ranks;
  and Keras 3, ``keras.utils.Progbar``) keeps its own bookkeeping but draws nothing, and
  reports its ``current`` of ``target``. ``fit(verbose=1)``'s ``ProgbarLogger`` no longer
  prints ``Epoch 3/5``: it reports an ``epoch`` bar around the ``batch`` bar, and logs Keras'
  ``logs`` as metrics the way ``callbacks.keras.HvdmagicCallback`` does (per batch, and
  ``epoch_*``/``val_*`` per epoch), unless that callback reports the same ``fit``.
  ``verbose=2`` is left alone: it prints one log line per epoch and no bar.

Lightning's, Hugging Face's and accelerate's trainers are adopted by the same hook (``rank/trainers.py``).

Nothing here imports tqdm, TensorFlow or Keras: ``install`` puts a finder on
``sys.meta_path`` that adopts each of them as it is imported (see ``_Finder``). The same
finder tells the kernel while a framework's import runs (``rank.framework_imports``).
"""

from __future__ import annotations

import functools
import importlib.machinery
import sys
import threading
import weakref

from hvdmagic import protocol
from hvdmagic.rank import collective_wait, framework_imports, subset_guard, telemetry, trainers

_DESC = "_hvdmagic_desc"  # a Keras Progbar's bar name; None: report nothing (HvdmagicCallback reports it)
_ADOPTED = "_hvdmagic_adopted"

# -- tqdm ---------------------------------------------------------------------------

_open_lock = threading.Lock()
_open_bars: dict[str, weakref.ref] = {}  # bar name -> the open tqdm bar that holds it


class _BarFile:
    """Where an adopted tqdm bar draws: its text goes nowhere, its numbers to the rank's row.

    Every draw of tqdm's (``update``, ``refresh``, ``reset``, ``clear``, ``close``, and any
    subclass's ``display``) writes to the bar's file, so reporting on ``write`` reports
    exactly when tqdm would have drawn, whichever of its methods drew. The numbers are
    read from the bar itself, never parsed from the text.
    """

    encoding = "utf-8"  # tqdm picks its bar characters from it

    def __init__(self, bar, name: str):
        self._bar = weakref.ref(bar)  # the bar holds this file: no cycle
        self._name = name

    def write(self, text: str) -> int:
        bar = self._bar()
        if bar is not None:
            telemetry.progress(bar.n, bar.total, self._name)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _bar_name(bar, desc) -> str:
    """The bar's ``desc`` (without the ``: `` tqdm adds), made unique among the bars open now.

    Fixed when the bar opens: a loop that calls ``set_description`` every step keeps one bar.
    """
    base = str(desc or "").strip().rstrip(":").strip()
    name, n = base, 1
    with _open_lock:
        while _is_open(_open_bars.get(name)):
            n += 1
            name = f"{base or 'bar'} {n}"
        if len(_open_bars) >= 256:  # a name per epoch (desc=f"epoch {e}"): forget the closed bars
            for gone in [other for other, held in _open_bars.items() if not _is_open(held)]:
                del _open_bars[gone]
        _open_bars[name] = weakref.ref(bar)
    return name


def _is_open(held: weakref.ref | None) -> bool:
    bar = held() if held is not None else None
    return bar is not None and not getattr(bar, "disable", True)  # tqdm sets disable when it closes a bar


def _is_rank_stream(file) -> bool:
    return file is None or any(file is stream for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))


def adopt_tqdm(module) -> None:
    """Make ``module.tqdm`` (``tqdm.std``'s, the base of every tqdm class) report instead of printing."""
    cls = module.tqdm
    if cls.__dict__.get(_ADOPTED):
        return
    import inspect  # here, not at the top: it costs a rank that never imports tqdm ~5 ms

    original = cls.__init__  # tqdm's envwrap makes it a partialmethod: TQDM_* defaults still apply
    names = list(inspect.signature(original).parameters)[1:]

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if len(args) <= len(names) and not kwargs.keys() & set(names[: len(args)]):
            kwargs.update(zip(names, args))
            args = ()
            disable = kwargs.get("disable", False)
            if _is_rank_stream(kwargs.get("file")) and (disable is None or not disable) and not kwargs.get("gui"):
                if disable is None:
                    kwargs["disable"] = False  # "no bar off a terminal": the row is this rank's terminal
                kwargs["file"] = _BarFile(self, _bar_name(self, kwargs.get("desc")))
        original(self, *args, **kwargs)

    cls.__init__ = __init__
    setattr(cls, _ADOPTED, True)


class _PlainNotebook:
    """``tqdm.notebook`` in a rank: plain tqdm under the notebook names (adopted like any bar).

    The real module imports IPython and ipywidgets, which a rank never loads, and draws
    widgets that no front end would ever show.
    """

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        from tqdm.std import tqdm, trange

        module.tqdm = module.tqdm_notebook = tqdm
        module.trange = module.tnrange = trange
        module.__all__ = ["tqdm_notebook", "tnrange", "tqdm", "trange"]


# -- Keras ----------------------------------------------------------------------------

# id() of the models whose epoch under way an HvdmagicCallback reports. Keras runs the callbacks
# in order and appends its ProgbarLogger last, so the callback's on_epoch_begin says so before
# the logger's, which takes the claim: a claim lasts one epoch, and a fit that raised leaves none.
_claims: set[int] = set()


def callback_reports(model) -> None:
    """``HvdmagicCallback`` reports ``model``'s epoch: its ProgbarLogger then only stays silent."""
    _claims.add(id(model))


def keras_numbers(logs, prefix: str = "") -> dict[str, float]:
    """The numeric entries of Keras' ``logs``; a tensor or numpy scalar becomes a float."""
    numbers = {}
    for name, value in (logs or {}).items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue  # e.g. a learning-rate schedule object
        numbers[name if name.startswith("val_") or not prefix else prefix + name] = number
    return numbers


def _adopt_progbar(cls) -> None:
    original = cls.update

    @functools.wraps(original)
    def update(self, current, values=None, finalize=None):
        if self.verbose != 1:
            return original(self, current, values, finalize)
        self.verbose = 0  # Keras' own bookkeeping (its averages, ``add``'s count) without its drawing
        try:
            original(self, current, values, finalize)
        finally:
            self.verbose = 1
        desc = self.__dict__.get(_DESC, "")
        if desc is not None:
            telemetry.progress(current, self.target, desc)

    cls.update = update


def _adopt_progbar_logger(cls) -> None:
    """``fit``/``evaluate``/``predict``'s bar: named, with an epoch bar around it, and Keras' logs as metrics.

    Only the ``on_*`` hooks, ``verbose``, ``epochs``, ``target``, ``progbar`` and ``model`` are
    used: Keras 2 and 3 share them.
    """
    originals = {name: getattr(cls, name) for name in
                 ("on_train_begin", "on_epoch_begin", "on_train_batch_end", "on_epoch_end",
                  "on_test_begin", "on_predict_begin")}

    def adopted(self) -> bool:
        return self.verbose == 1

    def reports(self) -> bool:
        return not getattr(self, "_hvdmagic_silent", False)

    def name_bar(self, desc: str | None) -> None:
        if getattr(self, "progbar", None) is not None:
            setattr(self.progbar, _DESC, desc)

    def on_train_begin(self, logs=None):
        originals["on_train_begin"](self, logs)
        self._hvdmagic_step = 0  # batches since the start of fit: the metrics' step, as HvdmagicCallback's

    def on_epoch_begin(self, epoch, logs=None):
        if not adopted(self):
            return originals["on_epoch_begin"](self, epoch, logs)
        epochs = self.epochs
        self.epochs = 1  # Keras prints "Epoch 3/5" only for several epochs: the row's epoch counter says it
        try:
            originals["on_epoch_begin"](self, epoch, logs)
        finally:
            self.epochs = epochs
        self._hvdmagic_silent = id(self.model) in _claims
        _claims.discard(id(self.model))
        reporting = reports(self)
        name_bar(self, "batch" if reporting else None)
        if reporting:
            telemetry.progress(epoch, epochs, "epoch")
            telemetry.progress(0, self.target, "batch")

    def on_train_batch_end(self, batch, logs=None):
        originals["on_train_batch_end"](self, batch, logs)
        if adopted(self):
            self._hvdmagic_step = getattr(self, "_hvdmagic_step", 0) + 1
            if reports(self) and (numbers := keras_numbers(logs)):
                telemetry.log_metrics(step=self._hvdmagic_step, **numbers)

    def on_epoch_end(self, epoch, logs=None):
        originals["on_epoch_end"](self, epoch, logs)
        if adopted(self) and reports(self):
            telemetry.progress(epoch + 1, self.epochs, "epoch")
            if numbers := keras_numbers(logs, prefix="epoch_"):
                telemetry.log_metrics(step=getattr(self, "_hvdmagic_step", 0), **numbers)

    def on_test_begin(self, logs=None):
        originals["on_test_begin"](self, logs)
        if adopted(self) and not getattr(self, "_called_in_fit", False):  # fit's validation draws no bar
            name_bar(self, "evaluate")

    def on_predict_begin(self, logs=None):
        originals["on_predict_begin"](self, logs)
        if adopted(self):
            name_bar(self, "predict")

    for hook in (on_train_begin, on_epoch_begin, on_train_batch_end, on_epoch_end, on_test_begin, on_predict_begin):
        setattr(cls, hook.__name__, functools.wraps(originals[hook.__name__])(hook))


def adopt_keras(module) -> None:
    """Adopt the ``Progbar`` or ``ProgbarLogger`` that ``module`` defines (Keras 2 or 3)."""
    for name, adopt in (("Progbar", _adopt_progbar), ("ProgbarLogger", _adopt_progbar_logger)):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and cls.__module__ == module.__name__ and not cls.__dict__.get(_ADOPTED):
            adopt(cls)
            setattr(cls, _ADOPTED, True)


# -- the import hook ------------------------------------------------------------------

def _adopt_horovod_torch(package) -> None:
    collective_wait.adopt_horovod_torch(package)
    subset_guard.adopt(package)


# The modules that define the bars, and what to do once each has run.
_HOOKS = {
    "tqdm.std": adopt_tqdm,
    "tf_keras.src.utils.generic_utils": adopt_keras,  # Progbar: Keras 2, tf.keras with TF_USE_LEGACY_KERAS=1
    "tf_keras.src.callbacks": adopt_keras,  # ProgbarLogger
    "keras.src.utils.progbar": adopt_keras,  # Keras 3
    "keras.src.callbacks.progbar_logger": adopt_keras,
    # Not bars, but the same hook serves them: the straggler check's view of ranks in step, and the
    # collectives a session's cell on some of its ranks must not start (imported while it runs).
    "horovod.torch": _adopt_horovod_torch,
    "torch.distributed.distributed_c10d": subset_guard.adopt,
    "torch.nn.parallel.distributed": subset_guard.adopt,
    **trainers.HOOKS,  # Lightning's, Hugging Face's and accelerate's trainers: their bars and logged values
}
_REPLACED = {"tqdm.notebook": _PlainNotebook}


class _PatchingLoader:
    """The module's own loader, then its hook (if any); the module keeps its own loader as ``__loader__``.
    A framework's (``framework_imports.FRAMEWORKS``) runs saying that the rank imports it."""

    def __init__(self, loader, hook, name: str):
        self._loader = loader
        self._hook = hook
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self._loader  # for linecache and get_source
        if self._name in framework_imports.FRAMEWORKS:
            with framework_imports.importing(self._name):
                self._loader.exec_module(module)
        else:
            self._loader.exec_module(module)
        if self._hook is not None:
            _adopt(self._hook, module)


def _adopt(hook, module) -> None:
    """Run ``hook`` on ``module``; a version whose bars it does not know keeps its printed bars.

    Never fails the user's import: a one-line note says what was not adopted.
    """
    try:
        hook(module)
    except Exception as exc:
        telemetry.emit(protocol.note(f"hvdmagic: {module.__name__}'s progress bar prints as text in the ranks "
                                     f"instead of driving their rows ({type(exc).__name__}: {exc})",
                                     once=f"framework_bars {module.__name__}"))


class _Finder:
    """Adopts the bars as their modules are imported: importing tqdm or TensorFlow in every
    rank up front would cost each cell seconds for the cells that use neither. It also wraps a
    framework's own import, to say it (``framework_imports``).

    A meta-path finder is asked only about modules not imported yet, and answers all but a
    handful with one dict lookup; a wrapped ``builtins.__import__`` would run on every import
    statement, of modules long loaded too. A module imported before ``install`` is adopted there.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _REPLACED:
            return importlib.machinery.ModuleSpec(fullname, _REPLACED[fullname]())
        hook = _HOOKS.get(fullname)
        if hook is None and fullname not in framework_imports.FRAMEWORKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, hook, fullname)
                return spec
        return None


def install() -> None:
    """Adopt tqdm's and Keras' bars in this rank, now for those imported, on import for the rest."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name, hook in _HOOKS.items():
        if (module := sys.modules.get(name)) is not None:
            _adopt(hook, module)
