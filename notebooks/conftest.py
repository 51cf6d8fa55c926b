"""nbval's kernel client, made to keep every IOPub message a cell sends.

nbval reads a cell's IOPub messages only after the kernel's reply. Until then they wait in zmq's
pipes, which hold 1000 messages on each side; beyond that (plus what TCP buffers) the kernel's PUB
socket drops new ones. A live dashboard sends hundreds of widget messages a fit, and a
CrossValidator cell of notebook 13 sent over 1600 in 21 s on a quiet machine: on a loaded one the
kernel dropped the cell's idle status, and nbval failed the cell with "Timeout of 5 seconds
exceeded waiting for output" although it had passed. JupyterLab, VS Code and nbclient read IOPub
while a cell runs, so they never meet this. With no receive limit, the client's zmq I/O thread
takes every message off the socket as it comes. tests/test_notebook_harness.py checks this file.
"""

import zmq
from jupyter_client.blocking.client import BlockingKernelClient

_start_channels = BlockingKernelClient.start_channels


def _start_channels_keeping_every_message(self, *args, **kwargs):
    # A context's socket options are the defaults of the sockets it creates from then on.
    self.context.setsockopt(zmq.RCVHWM, 0)
    return _start_channels(self, *args, **kwargs)


BlockingKernelClient.start_channels = _start_channels_keeping_every_message
