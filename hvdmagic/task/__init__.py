"""Runs in a Spark barrier task (or, in local mode, a thread on the driver): one rank's supervisor.

``barrier`` holds the functions Spark runs in the task, ``supervisor`` starts the
rank and relays what it says (``lines`` splits its output), ``environment`` and
``network`` give the rank its variables and interface, ``shards`` writes its
``--data`` shard, and ``mpi`` adopts a rank that mpirun started. Modules here may
import ``hvdmagic.protocol``, ``hvdmagic.channel`` and ``hvdmagic.rank``; pyspark
only inside the task functions; never IPython or widgets.
"""
