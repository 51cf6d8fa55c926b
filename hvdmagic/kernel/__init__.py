"""Runs in the notebook kernel: what the user touches, and how a run is shown.

``magic`` parses ``%%horovod`` and hands off; ``capture`` turns the cell into a
payload; ``runner`` wires a run's record, view and the launcher core together
for the magic and ``api`` (``hvdmagic.run``, ``HorovodRunner``); ``record`` and
``history`` keep what a run reported; ``ui`` shows it; ``timeline`` reads a
Horovod Timeline. Modules here may import IPython, ipywidgets and
``hvdmagic.launch``; pyspark only through ``hvdmagic.launch``.
"""
