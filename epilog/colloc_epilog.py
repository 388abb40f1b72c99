#!/usr/bin/env python3
"""Slurm Epilog (root, compute node): a shim over ``slurm_colloc.node.scripts.epilog``.

Installed sites point slurm.conf at the console script ``colloc-epilog``; this file
serves a source checkout. Contract: docs/node.md. Always exits 0.
"""

import sys

if __name__ == "__main__":
    from slurm_colloc.node.scripts import epilog

    sys.exit(epilog())
