"""``colloc-report``: what the GPU did for a job, and the admin view over a period.

- :mod:`.inquirer`: where facts come from (sacct/scontrol, node-local series).
- :mod:`.model`: the report as data; :mod:`.recommend`: notes and advice.
- :mod:`.text` (rich), :mod:`.html` (self-contained page), :mod:`.admin` (period).
"""
