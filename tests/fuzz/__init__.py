"""Coverage-guided fuzzing (atheris/libFuzzer) of every decoder of socket bytes: targets.py
says which and what each may raise; ``make fuzz`` runs them longer and keeps the corpus."""

# The host's side of torch: what a peer's frames reach once decoded (the executor and the
# native runs), not the shim's modules.
_HOST_TORCH = tuple(f"rrto_plugins.torch.{m}" for m in (
    "aliasing", "allowlist", "batch", "bounds", "codec", "executor", "libops", "native",
    "pointwise", "prepared", "resampling", "schemas", "sizing", "store"))
_HOST = ("rrtod.gpu", "rrtod.executor", "rrtod.partition", "rrtod.wire", *_HOST_TORCH)

# Per target, the modules (name prefixes) instrumented for coverage: those its inputs reach,
# as a profile of each target over its corpus found them (2026-11-30), plus the message
# builder the fuzzer steers. The rest is imported plain. Instrumenting every module of the
# package costs ~5.7 s of start-up a target (11 targets on two cores: ~30 s of the test's short
# round); a module a target comes to reach later and is not listed here only steers less.
TARGET_CODE: dict[str, tuple[str, ...]] = {
    "frames": ("rrtod.framing",),
    "local_socket": ("rrtod.framing", "rrtod.local_server", "rrtod.robot", "rrtod.shared_uploads",
                     "rrtod.wire", "rrto_plugins.search"),
    "peer_session": _HOST,
    "codec": ("rrto_plugins.torch.codec",),
    "replay_defs": (*_HOST, "rrtod.loops", "testkit.loopdefs"),
    "native_runs": _HOST,
    "loop_defs": ("rrtod.loops", "rrtod.gpu.replay", "rrtod.wire", "testkit.loopdefs"),
    "shim_down": ("rrto_plugins.torch.replay", "rrto_plugins.torch.recorded",
                  "rrto_plugins.torch.hotpath", "rrto_plugins.torch.proxy",
                  "rrto_plugins.torch.codec", "rrto_plugins.torch.allowlist", "rrtod.loops",
                  "rrtod.wire"),
    "robot_replayed": ("rrtod.robot", "rrtod.loops", "rrtod.wire", "rrto_plugins.search"),
    "robot_search": ("rrtod.robot.shapes", "rrtod.robot.oplog"),
    "robot_placement": ("rrtod.robot.placement", "rrtod.loops", "rrtod.wire"),
    "robot_scheduling": ("rrtod.robot.scheduling", "rrtod.robot.energy_ledger", "rrtod.partition",
                         "rrtod.wire", "rrto_plugins.balancers", "rrto_plugins.schedulers"),
}
TARGET_NAMES = tuple(TARGET_CODE)
