#!/usr/bin/env python3
"""Slurm Prolog (root, compute node): a shim over ``slurm_colloc.node.scripts.prolog``.

Installed sites point slurm.conf at the console script ``colloc-prolog``; this file
serves a source checkout. Contract: docs/node.md. Always exits 0.
"""

import sys

if __name__ == "__main__":
    from slurm_colloc.node.scripts import prolog

    sys.exit(prolog())
