"""What the benchmark's inputs are (``bench.models.ModelSpec.inputs``), chosen by the
orchestrator (``python -m bench --inputs``) and read by every process that makes them (the
apps, NTO's clients) from the environment. Torch-free: the orchestrator's harness imports it."""

INPUTS_ENV = "RRTO_BENCH_INPUTS"
# "randn": normal noise (the default); "frames": for an image input, 8-bit camera frames as an
# app normalises them before its model
INPUTS = ("randn", "frames")
