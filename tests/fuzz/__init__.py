"""Coverage-guided fuzzing (atheris/libFuzzer) of every decoder of socket bytes: targets.py
says which and what each may raise; ``make fuzz`` runs them longer and keeps the corpus."""

TARGET_NAMES = ("frames", "local_socket", "peer_session", "codec", "replay_defs", "native_runs",
                "loop_defs",
                "shim_down", "robot_replayed", "robot_placement", "robot_scheduling")
