"""``colloc selftest``: acceptance checks an admin runs on a site's own hardware.

The unit tests prove colloc against models of NVIDIA's documented behaviour; only a
run on the real driver, MPS and PyTorch shows whether the models hold on a given
GPU, driver and kernel. :mod:`.gpu_kit` drives the node scripts (prolog, TaskProlog,
epilog) for made-up jobs on one GPU, :mod:`.torch_client` is the process each job
runs, :mod:`.system` connects the kit to the machine, :mod:`.report` prints the
verdicts and writes the JSON the team asks for (docs/selftest.md).
"""
