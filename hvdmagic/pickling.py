"""cloudpickle, keeping the file name of the code it ships by value.

Used by the kernel (captured globals, ``hvdmagic.run``'s function) and by the ranks
(their results). A rank names a frame of a notebook function ``Cell In[3], line 5``
by the file IPython compiled that cell into (``/tmp/ipykernel_1234/567.py``), and
the timeline, Lightning and Keras report code by it too. cloudpickle 3.1.3 writes
``<dynamic-code>`` as the file name of every code object it pickles, to make its
payloads deterministic; releases before it kept the real one. This pickler ships
the real name beside the code and puts it back on load, whatever cloudpickle does.
"""

from __future__ import annotations

import io
import types

import cloudpickle

# What the code object itself carries while its real file name travels beside it.
_PLACEHOLDER = "<hvdmagic-code>"


def with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """Rebuilds a shipped code object on load (pickled by reference: every process imports hvdmagic)."""
    return code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        # Each code object, nested ones included (they are reduced as the constants of their
        # parent), gets its own wrapper; the placeholder copy falls through to cloudpickle.
        if type(obj) is types.CodeType and obj.co_filename != _PLACEHOLDER:
            return with_filename, (obj.replace(co_filename=_PLACEHOLDER), obj.co_filename)
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)``, with every shipped code object's file name intact."""
    with io.BytesIO() as buffer:
        _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
        return buffer.getvalue()
