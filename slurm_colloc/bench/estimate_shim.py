"""Stand-in for ``colloc estimate`` while that subcommand is not installed.

The cli_filter runs ``<estimator> estimate --summary FILE --batch-size N ... --json``
(``COLLOC_ESTIMATOR_COMMAND`` may name another program). This module answers the
same call with the registry's default estimator, so the replay measures the real
estimator's error even before the CLI lands. The replayer uses it only when
``colloc estimate --help`` fails, and says so in the results.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """``estimate --summary FILE --batch-size N [--seq-len L] [...] --json``."""
    from slurm_colloc.estimators import registry
    from slurm_colloc.estimators.base import Job
    from slurm_colloc.estimators.errors import EstimatorInputError
    from slurm_colloc.estimators.parsers import read_summary_file

    p = argparse.ArgumentParser(prog="colloc-estimate-shim")
    p.add_argument("command", choices=["estimate"])
    p.add_argument("--summary", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        est = registry.get(registry.DEFAULT).estimate(
            read_summary_file(a.summary),
            Job(batch_size=a.batch_size, seq_len=a.seq_len, optimizer=a.optimizer,
                precision=a.precision),
        )
    except (EstimatorInputError, OSError, ValueError) as e:
        sys.stderr.write(f"colloc estimate: {e}\n")
        return 2
    sys.stdout.write(json.dumps(est.to_json()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
