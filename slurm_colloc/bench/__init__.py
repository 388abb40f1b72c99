"""Trace replay benchmarks: traces, submission per policy, collection, metrics, plots.

One module per concept: :mod:`.trace` (the job model and its CSV form),
:mod:`.profiles` (measured job profiles and model summaries), :mod:`.generators`
(the three traces), :mod:`.policies` (how each policy submits a job),
:mod:`.replayer` (clusters, arrivals, waiting), :mod:`.collect` (sacct and
AdminComment), :mod:`.sampler` (GPU time series), :mod:`.metrics`, :mod:`.report`
and :mod:`.plots`.
"""
