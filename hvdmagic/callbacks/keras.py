"""Keras: not available with this project's horovod build, and why.

``scripts/setup.sh`` builds horovod for PyTorch only (``HOROVOD_WITHOUT_TENSORFLOW=1``),
so ``horovod.tensorflow.keras`` cannot load here and hvdmagic ships no Keras
callback it could not test. Importing this module raises an ImportError that
says what to do instead; ``docs/workflow.md`` has the details.
"""

from __future__ import annotations


def _horovod_has_tensorflow() -> bool:
    try:
        import horovod.tensorflow  # noqa: F401  (loads the compiled TensorFlow ops, or fails)
    except ImportError:
        return False
    return True


_BUILD = (
    "The installed horovod was built without TensorFlow (scripts/setup.sh builds it for PyTorch only), so "
    "horovod.tensorflow.keras cannot load. To train Keras on Horovod ranks, install tensorflow-cpu 2.15 "
    "(Keras 2; Keras 3's DistributedOptimizer does not average gradients) and rebuild horovod with "
    "HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 and the same C++17 compiler "
    "wrapper, as described in docs/workflow.md. "
)
_INSTEAD = (
    "hvdmagic has no Keras callback; inside a %%horovod cell, use horovod.tensorflow.keras's callbacks and "
    "feed the dashboard with keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: "
    "hvdmagic.log_metrics(step=epoch, **logs))."
)

raise ImportError(("" if _horovod_has_tensorflow() else _BUILD) + _INSTEAD)
