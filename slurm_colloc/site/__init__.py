"""Site installation of the submit path: the SPANK plugin and the two Lua filters.

Sources shipped as package data:

- ``spank/colloc_spank.c`` (+ ``colloc_spank.map``, the linker version script that
  exports only ``slurm_spank_*`` and the plugin identification symbols): registers
  ``--colloc[=SUMMARY]``, ``--colloc-mem``, ``--colloc-batch-size``,
  ``--colloc-seq-len``, ``--colloc-optimizer``, ``--colloc-precision``.
- ``lua/cli_filter.lua``: runs ``colloc estimate`` as the user inside sbatch.
- ``lua/job_submit.lua``: validates, turns MiB into ``gres/shard:K`` (the only
  spelling 24.11+ accepts from it), records the decision in AdminComment.

What the node scripts (Prolog/Epilog, issue 5) can rely on, verified on Slurm 22.05:

Environment of Prolog and Epilog (raw user input, *untrusted*; only tells that the
job asked for colloc and how)::

    SPANK__SLURM_SPANK_OPTION_colloc_colloc=SUMMARY   (literal "(null)" for bare --colloc)
    SPANK__SLURM_SPANK_OPTION_colloc_colloc_mem=SIZE
    SPANK__SLURM_SPANK_OPTION_colloc_colloc_batch_size=N
    SPANK__SLURM_SPANK_OPTION_colloc_colloc_seq_len=L
    SPANK__SLURM_SPANK_OPTION_colloc_colloc_optimizer=NAME
    SPANK__SLURM_SPANK_OPTION_colloc_colloc_precision=NAME

(the job itself sees them as ``SLURM_SPANK__SLURM_SPANK_OPTION_colloc_*``).
job_submit.lua cannot add variables to that environment in 22.05 (assigning
``job_desc.spank_job_env`` is silently ignored), and neither Comment nor AdminComment
reaches the Prolog environment. The trusted record is the job's AdminComment
(``scontrol -o show job -d $SLURM_JOB_ID``), parsed by :func:`parse_record`::

    colloc1:mode=M,need_mib=N,shards=K,shard_mib=S,alloc_mib=K*S[,est=NAME,est_mib=E,
            margin_mib=G,fp=HEX][,why=REASON]

``mode`` is ``estimate`` (cli_filter's estimate), ``explicit`` (--colloc-mem),
``default`` (no estimate arrived: the site default, normally a whole GPU) or
``shards`` (a plain ``--gres=shard:K`` job without --colloc). ``alloc_mib`` is the
memory Slurm reserved on the GPU: the MPS limit to enforce.
"""

from slurm_colloc.accounting.submit_record import RECORD_PREFIX, CollocRecord, parse_record

__all__ = ["RECORD_PREFIX", "CollocRecord", "parse_record"]
