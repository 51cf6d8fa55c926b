"""Runs in a Spark task (or, in local mode, a thread on the driver): one rank's supervisor.

- ``barrier``: the functions Spark runs in the task (one-shot, elastic, ``--data``).
- ``supervisor``: connects to the driver's channel, says hello, waits for its go, and
  runs its rank in the job's mode (one-shot, session, elastic, ``--controller mpi``).
- ``rank_process``: ``RankProcess``, one rank's process: start, feed, relay, signal, reap.
- ``lines``: splits a rank's output into lines and ``\r`` updates; relays its event lines.
- ``environment`` and ``network``: the rank's variables, and the interface it uses.
- ``shards``: writes and pads the task's ``--data`` shard.
- ``versions``: this task's Python and package versions, for the driver's check.
- ``native_stacks``: the rank's native frames, through py-spy where it is installed, also
  while a crash signal kills it (``CrashWatch``).
- ``flight_recorder``: where torch's flight recorder dumps, asking for a dump, reading it.
- ``mpi``: adopts a rank that mpirun started (``--controller mpi``).
- ``rank_template``: finds or starts the host's rank template and asks it for the rank.
- ``adopted_rank``: a rank another process started and reaps (mpirun's shim, the template).

Modules here may import ``hvdmagic.protocol``, ``hvdmagic.channel``, ``hvdmagic.rank``
(``shards`` reads a shard as its rank will) and the shared readers ``hvdmagic.stacks`` and
``hvdmagic.flight_records``, and pyspark only inside the task
functions; never ``hvdmagic.launch``, ``hvdmagic.kernel``, IPython or widgets. The rank
itself is another process (``hvdmagic.rank``).
"""
