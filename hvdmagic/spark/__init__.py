"""Spark ML estimators for deep learning: a drop-in for ``horovod.spark``'s, without Petastorm.

Runs in the notebook kernel (the Spark driver). ``fit`` trains on a DataFrame through the same
launcher as a ``%%horovod`` cell (``hvdmagic.run`` with ``data=``): the DataFrame reaches the ranks
as Arrow shards, the cell's dashboard shows the training, and rank 0's weights come back as a
Spark ML model. The model's ``transform`` predicts in batches inside the executors' Python workers
(a scalar-iterator pandas UDF), lazily, like every Spark transformer.

Where horovod.spark's users look for them:

- ``hvdmagic.spark.torch``: ``TorchEstimator`` and ``TorchModel``;
- ``hvdmagic.spark.keras``: ``KerasEstimator`` and ``KerasModel`` (Keras 3 or tf_keras);
- ``hvdmagic.spark.lightning``: ``TorchEstimator`` for a LightningModule;
- ``hvdmagic.spark.common.store``: ``Store`` (``Store.create(path)``): checkpoints, logs, models;
- ``hvdmagic.spark.common.backend``: ``SparkBackend`` (``num_proc``).

The package's other modules: ``common.params`` (the params every estimator shares, declared
once), ``common.estimator`` (what every framework's fit and transform share: the checks, the
DataFrame's preparation, the run, the output columns, persistence), ``common.columns`` (the
columns' Spark types and the checks on them), ``common.model_delivery`` (a large model served to
the executors once per host) and ``common.transform_progress`` (a transform's progress under the
cell whose action runs it).

What runs elsewhere sits with its process: the training in ``hvdmagic.rank.estimator_torch``,
``estimator_keras`` and ``estimator_lightning`` (a rank), the batch prediction and its progress
reports in ``hvdmagic.task.batch_inference`` and ``transform_reports`` (an executor's Python worker).
Modules here may import pyspark, ``hvdmagic.kernel`` (the launcher's Python API), and what
travels to the ranks and executors; nothing below imports them.
"""

from hvdmagic.launch.spark_session import prefer_this_python

# A script or notebook that imports the estimators makes its SparkSession next: on one machine, its
# executors run this Python (launch.spark_session.prefer_this_python says when, and why).
prefer_this_python()
