"""What every estimator of ``hvdmagic.spark`` shares: params, store, backend, fit and transform."""
