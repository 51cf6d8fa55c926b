#!/bin/sh
# Spark's GPU discovery script for a standalone worker: the GPUs nvidia-smi lists, in the JSON Spark reads.
#   spark.worker.resource.gpu.amount=<the GPUs>  spark.worker.resource.gpu.discoveryScript=<this file>
# (docs/clusters.md; tests/test_gpu.py starts a worker with it). A worker without nvidia-smi fails to start,
# as Spark does when a discovery script fails: the worker was told it has GPUs.
set -e
listing=$(nvidia-smi --query-gpu=index --format=csv,noheader)  # set -e: no nvidia-smi, no JSON
addresses=$(printf '%s\n' "$listing" | sed 's/ //g; s/.*/"&"/' | paste -sd, -)
echo "{\"name\": \"gpu\", \"addresses\": [$addresses]}"
