"""cloudpickle, keeping the file name of the code it ships by value.

Used by the kernel (captured globals, ``hvdmagic.run``'s function) and by the ranks
(their results). A rank names a frame of a notebook function ``Cell In[3], line 5``
by the file IPython compiled that cell into (``/tmp/ipykernel_1234/567.py``), and
the timeline, Lightning and Keras report code by it too. cloudpickle 3.1.3 writes
``<dynamic-code>`` as the file name of every code object it pickles, to make its
payloads deterministic; releases before it kept the real one. This pickler ships
the real name beside the code and puts it back on load, whatever cloudpickle does.

Large buffers (numpy, pandas and Arrow data; CPU tensors, which this pickler hands over
as numpy arrays sharing their memory) can leave the pickle stream: ``dumps_out_of_band``
returns them apart (pickle protocol 5), uncopied, for the payload's blobs.
"""

from __future__ import annotations

import io
import pickle
import types

import cloudpickle

# What the code object itself carries while its real file name travels beside it.
_PLACEHOLDER = "<hvdmagic-code>"
# Smaller buffers stay in the pickle: a blob costs a file and a lookup on every host.
OUT_OF_BAND_MIN = 1 << 20


def with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """Rebuilds a shipped code object on load (pickled by reference: every process imports hvdmagic)."""
    return code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        # Each code object, nested ones included (they are reduced as the constants of their
        # parent), gets its own wrapper; the placeholder copy falls through to cloudpickle.
        if type(obj) is types.CodeType and obj.co_filename != _PLACEHOLDER:
            return with_filename, (obj.replace(co_filename=_PLACEHOLDER), obj.co_filename)
        if (tensor := _as_numpy(obj)) is not None:
            return tensor
        return super().reducer_override(obj)


def tensor_from_numpy(array, requires_grad: bool, parameter: bool):
    """Rebuilds a CPU tensor on load, over the array's memory (a mapped blob's, for a large one)."""
    import torch

    tensor = torch.from_numpy(array)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _as_numpy(obj):
    """A plain CPU tensor or parameter as an array sharing its memory, or None.

    torch pickles a tensor by writing its whole storage with ``torch.save`` into the stream:
    a copy, and never out of band. An array over the same memory pickles as protocol 5
    buffers. Anything else (GPU, sparse, quantized, bfloat16, a subclass) keeps torch's way.
    """
    kind = type(obj)
    if kind.__module__ not in ("torch", "torch.nn.parameter") or kind.__name__ not in ("Tensor", "Parameter"):
        return None
    try:
        if obj.device.type != "cpu" or (obj.requires_grad and not obj.is_leaf):
            return None
        array = obj.detach().numpy()
    except (RuntimeError, TypeError, AttributeError):  # numpy lacks the dtype, a conj/neg bit, ...
        return None
    return tensor_from_numpy, (array, obj.requires_grad, kind.__name__ == "Parameter")


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)``, with every shipped code object's file name intact."""
    with io.BytesIO() as buffer:
        _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
        return buffer.getvalue()


def dumps_out_of_band(obj) -> tuple[bytes, list[memoryview]]:
    """``dumps(obj)`` with its buffers of ``OUT_OF_BAND_MIN`` bytes or more left out of the
    stream: views of the objects' own memory, in the order ``pickle.loads(head, buffers=...)``
    wants them back."""
    views: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < OUT_OF_BAND_MIN:
            return True  # in the stream
        views.append(view)
        return False

    with io.BytesIO() as stream:
        _Pickler(stream, protocol=5, buffer_callback=out_of_band).dump(obj)
        return stream.getvalue(), views
