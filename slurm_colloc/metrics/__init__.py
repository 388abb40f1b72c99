"""Metrics sidecar: the node collector, per-job time series, summaries and history.

- :mod:`.launch` (prolog): write the attempt's meta, start the collector if needed.
- :mod:`.collector`: the node-level sampler (one per node).
- :mod:`.store`: on-disk layout of per-job series (bounded, with retention).
- :mod:`.summary` (epilog): :func:`~.summary.job_summary` and the estimator history.
"""
