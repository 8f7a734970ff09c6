"""Record/replay end to end: unmodified torch apps (tests/apps) under ``rrto-run`` against a real
``rrtod`` (robot+gpu) with replay on. Replayed inferences must print exactly what local
execution prints, also when the replay mismatches (input shapes that change, control flow that
depends on data, a model switched halfway); a restarted app replays from its first inference
with no reply waited for, and a replayed inference puts little more than its inputs and
outputs on the wire."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testkit.apps import (
    APPS,
    DAEMON_ENV,
    HOST,
    MODELS,
    app_env,
    same_as_local,
    shim_stats,
)
from testkit.daemons import BIN, TEST_DEFAULTS, Launcher

RUNS = 6


def finished(daemon: Any) -> dict:
    return daemon.wait_for(lambda s: not s["sessions"], what="sessions closed")["finished"]


@pytest.fixture(scope="module")
def daemon():
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        yield launcher.start("rrtod", **{**TEST_DEFAULTS, **HOST})


@pytest.fixture
def fresh(daemon):
    """Each test starts with no saved sequence."""
    daemon.ask("flush", all="1")
    yield daemon


@pytest.mark.parametrize("name", MODELS)
def test_replayed_model_equals_local(fresh, name, tmp_path):
    stats = same_as_local(name, fresh, "--runs", str(RUNS), tmp=tmp_path)
    # Back to back, replay starts with the third inference: the shim's third inference start
    # waits for the search the robot runs on the first two (``SearchHint``), unless the
    # definition is there already.
    assert stats["by_inference"]["replays"] == [0, 0] + [1] * (RUNS - 2), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    (seq,) = fresh.ask("sequences")["sequences"]
    assert seq["app"] == f"{name}.py" and seq["operators"] > 0


def per_replayed_inference(daemon: Any, name: str, tmp: Path) -> dict[str, float]:
    """Restarted runs of 4 and 10 inferences, all replayed from the saved sequence: what one
    more replayed inference costs (counter differences, so the first inference's extras cancel
    out). Each run's outputs equal local execution."""
    same_as_local(name, daemon, "--runs", "4", tmp=tmp)
    totals = []
    for runs in (4, 10):
        before = finished(daemon)
        stats = same_as_local(name, daemon, "--runs", str(runs), tmp=tmp)
        after = finished(daemon)
        assert stats["replays"] == runs and stats["mismatches"] == 0, stats
        assert stats["round_trips"] == 1, stats  # the BlobQuery of the weights, nothing else
        # and each replayed inference's pushed outputs: one reply per inference
        assert stats["replay_replies"] == runs, stats
        assert stats["by_inference"]["replays"] == [1] * runs, stats
        totals.append({
            "wire": sum(after[k] - before[k] for k in ("bytes_up", "bytes_down")),
            "tensors_up": stats["bytes_up"],
            "tensors": stats["bytes_up"] + stats["bytes_down"],
            "frames_up": after["frames_up"] - before["frames_up"],
            "frames": sum(after[k] - before[k] for k in ("frames_up", "frames_down"))})
    return {k: (totals[1][k] - totals[0][k]) / 6 for k in totals[0]}


@pytest.mark.parametrize("name", ["resnet", "detection"])
def test_restarted_app_replays_from_its_first_inference(fresh, name, tmp_path):
    """The second run finds the saved sequence: every inference is replayed, and the only reply
    the app ever waits for is the weight cache query. Per replayed inference, the wire carries
    at most 1.02 x its tensors + 2 KiB (counted exactly from two runs of different length)."""
    per = per_replayed_inference(fresh, name, tmp_path)
    assert per["tensors"] > 0
    assert per["wire"] <= 1.02 * per["tensors"] + 2048, per


def test_replayed_gru_sends_its_input_once_and_little_else(fresh, tmp_path):
    """The gru app: 340 operators per inference, a zero initial state made anew by nn.GRU each
    inference (read by two calls per layer) and ``x[:, -1]`` uploaded where it meets the model.
    Per replayed inference only ``x`` and ``x[:, -1]`` travel: the unchanged zero state is
    named (``ReplayArg.same_as``), not sent, and the ~260 dropped intermediate ids cost about
    a byte each (``Release.gaps``). (The app's ``--dump`` reads its outputs again in float64.)"""
    per = per_replayed_inference(fresh, "gru", tmp_path)
    assert per["tensors_up"] == 2 * 8 * 16 * 4 + 2 * 16 * 4, per  # x and x[:, -1], float32
    # start, 6 arguments (x, 4 repeats of the zero state, x[:, -1]), and release frames (one
    # of them sent while the app waits for its output, so that the host frees as it computes)
    assert per["frames_up"] <= 14, per
    assert per["wire"] <= 1.02 * per["tensors"] + 2048, per
    # What is not tensor bytes (frame headers, metadata, ids, releases): measured ~730 B;
    # 2.7 KB with 8-byte release ids (and then 1 KiB of zero state among the tensors too).
    assert per["wire"] - per["tensors"] <= 1024, per


def test_camera_frames_go_up_and_class_maps_come_down_at_a_byte_a_pixel(fresh, tmp_path):
    """segment_frames: 8-bit pixels made float and normalised per channel by the app before
    its model (torchvision's ``ToTensor`` and ``Normalize``), and an int64 class map
    (``argmax`` over 21 classes) read back. Each replayed inference uploads the frame
    palette-coded (``codec.palette_of``: a byte an element and 256 float32 values a channel,
    not four bytes an element) and the host sends the map so (``codec.int_palette_of``: a
    byte a pixel and 256 int64 values, not eight bytes a pixel); the app prints what local
    execution prints. With ``RRTO_PALETTE=0`` the frame goes up raw."""
    per = per_replayed_inference(fresh, "segment_frames", tmp_path)
    pixels = 64 * 96
    assert per["tensors_up"] == 3 * pixels + 3 * 256 * 4, per
    # Down: the class map coded, the first 3 values the app prints (24 B), and the float64
    # copy the harness's ``--dump`` reads (floats: the host codes only integers).
    down = per["tensors"] - per["tensors_up"]
    assert down == (pixels + 256 * 8) + 3 * 8 + pixels * 8, per  # raw map: pixels * 8
    assert per["wire"] <= 1.02 * per["tensors"] + 2048, per
    # Switched off (the sequence is saved by now: every inference replays): float32, as the
    # app has it.
    off = same_as_local("segment_frames", fresh, "--runs", "4", tmp=tmp_path,
                        extra_env={"RRTO_PALETTE": "0"})
    assert off["replays"] == 4 and off["bytes_up"] >= 4 * (4 * 3 * pixels), off


def test_a_large_replayed_input_comes_through_shared_memory_with_outputs_equal_to_local(
        fresh, tmp_path):
    """big_input's 4 MiB input, at least ``SHARED_MIN``: each replayed inference writes it to
    the region the robot daemon gave the app, not to the socket (the daemon counts it), and
    prints what local execution prints. With ``RRTO_SHARED_UPLOADS=0`` the same run goes on
    the socket. (That the host gets the very frame the socket would carry, counted alike:
    tests/test_shared_uploads.py.)"""
    runs = 5
    before = finished(fresh)
    stats = same_as_local("big_input", fresh, "--runs", str(runs), tmp=tmp_path)
    shared = finished(fresh)
    replayed = sum(stats["by_inference"]["replays"])
    assert replayed == runs - 2 and stats["mismatches"] == 0, stats
    assert shared["shared_uploads"] - before["shared_uploads"] == replayed
    same_as_local("big_input", fresh, "--runs", str(runs), tmp=tmp_path,
                  extra_env={"RRTO_SHARED_UPLOADS": "0"})
    assert finished(fresh)["shared_uploads"] == shared["shared_uploads"]


@pytest.mark.parametrize("name", ["replay_shapes", "replay_shapes_conv"])
def test_changing_input_shape_is_forwarded_then_replays_again(fresh, name, tmp_path):
    """12 inferences: six at 32x32, three at 40x40, three at 32x32. Exactly these replay: the
    32x32 ones from the first the sequence was found for (the 4th at the latest) to the 6th,
    none of the 40x40 ones (their inputs do not fit the recorded metadata), and the last three.
    ``replay_shapes_conv``'s output shape follows its input, so a 40x40 input replayed on the
    32x32 sequence could not even run; ``replay_shapes`` pools to a fixed size, and there only
    the exact count tells. (Paced, as a sensor loop: when the search finishes is no race.)"""
    stats = same_as_local(name, fresh, "--pace", "20", tmp=tmp_path)
    replayed = stats["by_inference"]["replays"]
    first = replayed.index(1)
    assert first <= 3, stats
    assert replayed == [0] * first + [1] * (6 - first) + [0, 0, 0] + [1, 1, 1], stats
    assert stats["replays"] == sum(replayed) == 6 - first + 3, stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    assert stats["calls"] > 0


def test_data_dependent_control_flow_mismatches_and_stays_correct(fresh, tmp_path):
    stats = same_as_local("replay_branch", fresh, tmp=tmp_path)
    assert stats["replays"] > 0 and stats["mismatches"] > 0, stats


def test_a_replayed_output_written_after_its_inference_ended_is_read_as_written(fresh,
                                                                                tmp_path):
    """``replay_branch --rewrite 3``: frame 3 replays, and its model then scales the output
    in place (a call no sequence has: forwarded). The host had pushed the output when the
    replay ended; the app's read after the write fetches it (``ReplayClient.rewritten``).
    Before, the read took the pushed value and the app got the output unscaled."""
    stats = same_as_local("replay_branch", fresh, "--rewrite", "3", tmp=tmp_path)
    assert stats["by_inference"]["replays"][3] == 1, stats


def test_model_switch_records_again_and_finds_the_new_sequence(fresh, tmp_path):
    stats = same_as_local("switch_model", fresh, tmp=tmp_path)
    assert stats["mismatches"] == 0, stats
    finished(fresh)
    # Calls of the second model kept being forwarded: the robot recorded again and found its
    # sequence. Both were replayed, and both are kept (the app may switch back).
    found = fresh.ask("sequences")["sequences"]
    assert sorted(s["replays"] > 0 for s in found) == [True, True], found
    assert len({s["operators"] for s in found}) == 2, found


def test_a_model_that_builds_a_grid_on_its_first_call_replays_from_its_third_inference(
        fresh, tmp_path):
    """yolo_grid's first inference builds its anchor grid with extra calls: the search takes
    it, those calls left out, as the first repetition (``search.without_first_extras``), so
    replay starts with the third inference, as for a model whose inferences are all alike."""
    stats = same_as_local("yolo_grid", fresh, tmp=tmp_path)
    assert stats["by_inference"]["replays"] == [0, 0] + [1] * 6, stats
    assert stats["mismatches"] == 0, stats
    (seq,) = fresh.ask("sequences")["sequences"]
    assert seq["found_at"] == 2, seq


def test_two_models_in_one_process(fresh, tmp_path):
    stats = same_as_local("two_models", fresh, tmp=tmp_path)
    assert stats["replays"] >= 8 - 4 and stats["mismatches"] == 0, stats


def test_two_processes_replay_in_isolation(fresh, tmp_path):
    """Two apps at once on one robot and host: each its own session and sequence."""
    env = app_env(**fresh.env, RRTO_STATS="1", OMP_WAIT_POLICY="PASSIVE")
    names = ["small_cnn", "mlp_policy"]
    # Paced as a robot's sensor loop: whether replay starts with the 3rd or 4th inference is a
    # race with the search on these 2 shared cores, not what this test is about.
    procs = [subprocess.Popen([str(BIN / "rrto-run"), "--", sys.executable, str(APPS / f"{n}.py"),
                               "--runs", "10", "--pace", "20"], env=env, cwd=APPS, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in names]
    outs = [p.communicate(timeout=180) for p in procs]
    for n, p, (out, err) in zip(names, procs, outs, strict=True):
        assert p.returncode == 0, err
        local = subprocess.run([sys.executable, str(APPS / f"{n}.py"), "--runs", "10"],
                               cwd=APPS, capture_output=True, text=True, timeout=120,
                               env={**env, "RRTO_OFFLOAD": "0"})
        assert out == local.stdout
        stats = json.loads(err.splitlines()[-1].removeprefix("rrto-stats "))
        assert stats["replays"] >= 10 - 3, stats
    apps = sorted(s["app"] for s in fresh.ask("sequences")["sequences"])
    assert apps == sorted(f"{n}.py" for n in names)


def test_constant_replaced_between_inferences_is_a_mismatch_never_a_stale_value(fresh, tmp_path):
    """The app recomputes, every 5th inference, a tensor its forward reads (on the host): the
    recorded sequence names the old one as a constant. The host replays ahead of the app's
    matching, so it must neither use the old tensor nor fail on it once freed; the app treats
    the new tensor as a mismatch (forwarded, recorded again) and every output equals local."""
    stats = same_as_local("swapped_constant", fresh, tmp=tmp_path)
    assert stats["failed"] == 0, stats
    assert stats["mismatches"] > 0 and stats["replays"] > 0, stats


def test_in_place_writes_and_running_statistics_survive_mismatches(fresh, tmp_path):
    """Values written in place (an inplace ReLU, a residual +=, running statistics of batch
    norms in training mode) end up exactly as forwarding leaves them, also when a branch makes
    the host undo what it ran ahead."""
    stats = same_as_local("inplace_state", fresh, tmp=tmp_path)
    assert stats["replays"] > 0 and stats["mismatches"] > 0, stats


def test_two_robots_share_one_gpu_host_in_isolation(tmp_path):
    """Two robot daemons (each with its own state) offload the same app to one GPU daemon at
    the same time: each robot finds and replays its own sequence, results equal local."""
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        gpu = launcher.start("gpu", roles=["gpu"], **{**TEST_DEFAULTS, **HOST})
        robots = [launcher.start(f"robot{i}", roles=["robot"], wait=False, **TEST_DEFAULTS,
                                 hosts=[{"name": "gpu", "address": gpu.listen}])
                  for i in range(2)]
        launcher.wait_ready(robots)  # started together
        for r in robots:
            r.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="GPU host up")
        env = app_env(OMP_WAIT_POLICY="PASSIVE")
        cmd = [sys.executable, str(APPS / "small_cnn.py"), "--runs", "8", "--pace", "20"]
        local = subprocess.run(cmd, cwd=APPS, capture_output=True, text=True, timeout=120,
                               env=env, check=True).stdout
        procs = [subprocess.Popen([str(BIN / "rrto-run"), "--", *cmd], cwd=APPS, text=True,
                                  env={**env, **r.env, "RRTO_STATS": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for r in robots]
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err
            assert out == local
            stats = json.loads(err.splitlines()[-1].removeprefix("rrto-stats "))
            assert stats["replays"] >= 8 - 3, stats
        for r in robots:
            (seq,) = r.ask("sequences")["sequences"]
            assert seq["app"] == "small_cnn.py"


def test_twin_weights_rebind_by_hash_and_never_raise(fresh, tmp_path):
    """A model and its deep copy with the same weights, used in turn: the copy matches the
    sequence by content hash. Its first weight is rebound before the replay's input goes
    out; a later one would reach the host after it ran ahead, so it is a mismatch (the app
    crashed with ``NO_REPLAY`` before). Outputs equal local."""
    stats = same_as_local("twin_weights", fresh, tmp=tmp_path)
    assert stats["failed"] == 0 and stats["replays"] > 0, stats


# App idioms of the compatibility corpus whose loop is steady after their action: each replays
# once its steady state has shown twice, with outputs bitwise equal to local (computed in this
# process, one thread, as the app runs). Before: state written in place before the replay
# window (ema_copy; tests/test_recorder.py pins the definition) made a definition the host
# refused; a pickled copy (pickle_model) was never offloaded; a fresh model with the same
# operators (save_state_dict) was only found as a two-inference block.
STEADY_IDIOMS = ["ema_copy", "pickle_model", "save_state_dict"]


@pytest.mark.parametrize("name", STEADY_IDIOMS)
def test_steady_app_idiom_replays_with_outputs_equal_to_local(fresh, name, tmp_path):
    import numpy as np
    import torch

    from compat.idioms.apps import IDIOMS, make_model

    root, dump = APPS.parents[1], tmp_path / f"{name}.npz"
    env = app_env(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    env.update(fresh.env, RRTO_STATS="1", RRTO_FALLBACK="error")
    cmd = [str(BIN / "rrto-run"), "--", sys.executable, "-m", "compat.idioms.run",
           "--entry", json.dumps({"idiom": name}), "--dump", str(dump), "--frames", "8"]
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    stats = shim_stats(out.stderr) or {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [torch.as_tensor(o).detach().cpu().numpy() for o in IDIOMS[name](make_model(), 8)]
    finally:
        torch.set_num_threads(threads)
    got = np.load(dump)
    assert len(got.files) == len(want)
    for i, w in enumerate(want):
        g = got[f"o{i}"]
        assert g.dtype == w.dtype and np.array_equal(g, w), (name, i)
    assert stats["replays"] > 0 and stats["failed"] == 0, stats


def run_idiom(name: str, frames: int, daemon: Any, tmp_path: Path) -> dict:
    """Idiom ``name`` of compat/idioms under ``rrto-run`` against ``daemon``: its outputs
    equal, bit for bit, to the same idiom run here without offloading; the shim's stats."""
    import numpy as np
    import torch

    from compat.idioms.apps import IDIOMS, make_model

    root, dump = APPS.parents[1], tmp_path / f"{name}.npz"
    env = app_env(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    env.update(daemon.env, RRTO_STATS="1", RRTO_FALLBACK="error")
    cmd = [str(BIN / "rrto-run"), "--", sys.executable, "-m", "compat.idioms.run",
           "--entry", json.dumps({"idiom": name}), "--dump", str(dump), "--frames", str(frames)]
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [o.numpy() for o in IDIOMS[name](make_model(), frames)]
    finally:
        torch.set_num_threads(threads)
    got = np.load(dump)
    assert [got[f"o{i}"].tobytes() for i in range(frames)] == [w.tobytes() for w in want]
    return shim_stats(out.stderr) or {}


@pytest.mark.parametrize("name", ["thread_per_frame", "worker_turns"])
def test_inferences_that_take_turns_on_changing_threads_replay_as_one_threads(fresh, name,
                                                                             tmp_path):
    """Frames run one at a time, each on another thread (``plugins/torch/lanes.py``): a new
    thread per frame, or three workers in turn. The threads share a lane, so the robot sees
    their inferences one after the other as one thread's: one sequence is found after two
    frames and every later frame replays, whichever thread runs it, with outputs equal to
    local. Before lanes, no thread showed an inference twice: nothing ever replayed."""
    frames = 8
    stats = run_idiom(name, frames, fresh, tmp_path)
    assert stats["by_inference"]["replays"] == [0, 0] + [1] * (frames - 2), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    (seq,) = fresh.ask("sequences")["sequences"]
    assert seq["thread"] == 0 and seq["replays"] == frames - 2, seq


def test_threads_whose_inferences_overlap_each_replay_one_replay_at_a_time(fresh, tmp_path):
    """``two_streams``: two threads run the model at the same time, frame after frame, each in
    a lane of its own, each frame with an input only the model's last call reads (a
    ``ReplayArg`` mid-inference). The robot searches the second lane while the first's
    sequence is in use, and both replay. The host runs one replay at a time per session and
    an argument names no replay, so a replay starts only while no other thread's is under way
    (``ReplayClient._claim``): every output equals local's, and no replay fails on the host
    (a start that lost the race for the session's replay once left a weight unbound there)."""
    stats = run_idiom("two_streams", 16, fresh, tmp_path)
    assert stats["replays"] > 0 and stats["failed"] == 0, stats
    by_lane: dict[int, int] = {}
    for s in fresh.ask("sequences")["sequences"]:
        by_lane[s["thread"]] = by_lane.get(s["thread"], 0) + s["replays"]
    assert sorted(by_lane) == [0, 1] and all(by_lane.values()), by_lane


def test_shapes_that_follow_the_data_replay_with_one_reply_per_inference(fresh, tmp_path):
    """``dynamic_head``: a count of detections that differs every frame (``nonzero``, a boolean
    mask), integers the app derives from it, a buffer it creates in its forward sized by it and
    a value read. Recorded with the host's answers, the sequence replays with outputs equal to
    local, and a replayed inference waits for one reply (the host's answers arrive while the
    app matches its calls, and the sizes of the outputs that follow the data with them),
    against several per forwarded inference."""
    stats = same_as_local("dynamic_head", fresh, "--runs", "10", "--pace", "20", tmp=tmp_path)
    by = stats["by_inference"]
    replayed = [i for i, r in enumerate(by["replays"]) if r]
    assert replayed and replayed[0] <= 3, stats  # the 4th inference at the latest
    assert replayed == list(range(replayed[0], 10)), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    # (a first replay that joined its inference under way also waited for what it forwarded)
    assert all(by["round_trips"][i] <= 1 for i in replayed[stats["joined"]:]), stats
    assert max(by["round_trips"][: replayed[0]]) > 1, stats  # forwarding waited for sizes
    assert stats.get("local_ops", 0) == 0, stats  # its buffer was made on the host
    # the host, ahead, pushed the sizes that follow the data: the shim made proxies from them
    assert stats["sized"] > 0, stats


def test_an_app_that_reads_only_counts_replays(fresh, tmp_path):
    """``count_only``: the app looks at how many boxes each frame has and never downloads a
    value, so no inference ends with a download. The shim's inference marks start the
    searches, which anchor on the answered ``nonzero`` (the app waited for its shape): the
    sequence is found and replayed, each replayed inference waiting for one reply (the count),
    with the counts equal to local."""
    stats = same_as_local("count_only", fresh, "--runs", "10", "--pace", "20", tmp=tmp_path)
    by = stats["by_inference"]
    replayed = [i for i, r in enumerate(by["replays"]) if r]
    assert replayed and replayed[0] <= 3, stats
    assert replayed == list(range(replayed[0], 10)), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    assert all(by["round_trips"][i] <= 1 for i in replayed[stats["joined"]:]), stats
    (seq,) = fresh.ask("sequences")["sequences"]
    assert seq["app"] == "count_only.py" and seq["outputs"] == 0, seq


def test_a_size_that_is_not_the_one_the_host_found_is_a_mismatch(fresh, tmp_path):
    """Forced: in inference 7 the app sizes its buffer one larger than the count the host
    found, so the sequence's symbolic size does not match the app's call. That inference is
    forwarded from there (outputs equal to local); the next ones replay again."""
    stats = same_as_local("dynamic_head", fresh, "--runs", "10", "--pace", "20",
                          "--odd-size", "7", tmp=tmp_path)
    replayed = stats["by_inference"]["replays"]
    assert stats["mismatches"] == 1, stats
    assert replayed[7] == 1 and replayed[8] == 1 and replayed[9] == 1, stats


def test_an_app_buffer_of_any_size_replays_as_an_input(fresh, tmp_path):
    """With ``RRTO_HOST_FACTORIES=0`` the app makes its buffer itself, sized by the count:
    an upload whose shape differs every inference (``SeqSource.any_shape``). It replays all
    the same, with outputs equal to local."""
    stats = same_as_local("dynamic_head", fresh, "--runs", "10", "--pace", "20", tmp=tmp_path,
                          extra_env={"RRTO_HOST_FACTORIES": "0"})
    replayed = stats["by_inference"]["replays"]
    assert 1 in replayed and replayed[replayed.index(1):] == [1] * (10 - replayed.index(1))
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats


def test_an_input_that_only_looked_fixed_is_never_replayed_with_the_recorded_bytes(fresh,
                                                                                   tmp_path):
    """``warmup_same``: four inferences on one dummy input, then real ones. A sequence found
    during the warm-up keeps that input as fixed bytes; the first real input must not be
    answered with it: a mismatch (outputs equal to local), the sequence given up at once, and
    the real inputs are recorded and replayed (as a changing input) from then on."""
    stats = same_as_local("warmup_same", fresh, "--pace", "20", tmp=tmp_path)
    replayed = stats["by_inference"]["replays"]
    assert stats["mismatches"] >= 1 and stats["failed"] == 0, stats
    assert replayed[-3:] == [1, 1, 1], stats  # replays again with real inputs


def test_a_sequence_that_arrives_mid_inference_joins_it(fresh, tmp_path):
    """``join_midway``: the sequence reaches the shim while the third inference is paused
    halfway. The calls it already forwarded are mapped onto the sequence's first calls and the
    host replays the rest from their values: the third inference is replayed (one start, no
    wait per operator after the pause), and every output equals local. (On a loaded machine
    the app may reach its third inference after the sequence: then it starts there as usual;
    ``test_replay_client`` pins the join itself.)"""
    stats = same_as_local("join_midway", fresh, tmp=tmp_path)
    by = stats["by_inference"]
    assert stats["joined"] <= 1, stats
    assert by["replays"] == [0, 0, 1, 1, 1, 1], stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats


def test_a_joined_inference_that_goes_another_way_is_forwarded(fresh, tmp_path):
    """Forced: the joined third inference takes another path a few calls after the join. The
    shim mismatches there, the host restores and drops what it ran ahead, the inference is
    completed by forwarding, and the outputs still equal local; later inferences replay."""
    stats = same_as_local("join_midway", fresh, "--diverge", tmp=tmp_path)
    by = stats["by_inference"]
    assert stats["mismatches"] == 1 and by["mismatches"][2] == 1, stats
    assert by["replays"][3:] == [1, 1, 1] and not any(by["mismatches"][3:]), stats


def test_frames_with_and_without_detections_replay_as_two_variants(fresh, tmp_path):
    """``variants``: irregular runs of frames with detections (S) and without (N); the head
    returns early on N. The first sequence found is S's; N's inferences branch off it (a
    mismatch at the branch, then forwarding), are logged whole and found as a variant next to
    it. From then on each frame replays whichever variant it takes (the shim switches at the
    branch), outputs equal local, and neither is recorded again: two sequences in the end."""
    stats = same_as_local("variants", fresh, tmp=tmp_path)
    by = stats["by_inference"]
    finished(fresh)
    found = fresh.ask("sequences")["sequences"]
    assert len(found) == 2 and all(s["replays"] > 0 for s in found), found
    assert stats["switches"] > 0 and stats["failed"] == 0, stats
    # once both are known every frame replays whole: no mismatch, one reply
    both = max(i for i, (r, m) in enumerate(zip(by["replays"], by["mismatches"], strict=True))
               if not r or m) + 1
    assert both <= 8, stats
    assert all(by["replays"][both:]) and not any(by["mismatches"][both:]), stats
    assert all(n <= 1 for n in by["round_trips"][both:]), stats
    assert any(by["switches"][both:]), stats


def test_integers_from_values_the_app_read_replay_with_one_reply(fresh, tmp_path):
    """``read_values``: a per-box loop that reads each box's width and height (``item()``)
    and passes them on as integers (``interpolate(size=(h, w))``, ``pos % w``), other values
    every frame. They become ``SymbolicInt``s of the values read: the host computes them from
    its own tensors and the shim accepts only the integers the app derives from the values it
    was given. Every frame from the 4th on replays whole, waiting for one reply (the values
    arrive pushed, not fetched), with outputs equal to local."""
    stats = same_as_local("read_values", fresh, "--pace", "20", tmp=tmp_path)
    by = stats["by_inference"]
    replayed = [i for i, r in enumerate(by["replays"]) if r]
    assert replayed and replayed[0] <= 3 and replayed == list(range(replayed[0], 10)), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    assert all(by["round_trips"][i] <= 1 for i in replayed[stats["joined"]:]), stats
    assert max(by["round_trips"][: replayed[0]]) > 3, stats  # forwarding waited per value


def test_a_loop_whose_count_follows_the_data_replays_unrolled(fresh, tmp_path):
    """``read_values --varying``: 2, 3, 4, 1, 2, ... boxes per frame, so the per-box loop runs
    another number of times every frame (once in every fourth) and no two consecutive
    inferences have the same calls. The search folds the loop to one iteration
    (``rrtod.robot.loopfold``); the shim and the host unroll it for each frame's count. Replay
    begins by the 4th frame (the first may join an inference under way), every frame after it
    replays whole with one reply, and no sequence is recorded again; outputs equal to local on
    every frame."""
    stats = same_as_local("read_values", fresh, "--varying", "--runs", "10", tmp=tmp_path)
    by = stats["by_inference"]
    replayed = [i for i, r in enumerate(by["replays"]) if r]
    assert replayed and replayed[0] <= 3 and replayed == list(range(replayed[0], 10)), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    # the first replayed may be joined under way, after values it read were forwarded (a CI
    # run: that frame waited twice); every later one replays whole with one reply
    assert all(by["round_trips"][i] <= 1 for i in replayed[1:]), by
    (seq,) = fresh.ctl("sequences")["sequences"]
    assert seq["replays"] == len(replayed) and seq["loops"] == 1, seq


def test_a_loop_over_the_classes_present_replays_unrolled(fresh, tmp_path):
    """``class_loop``: ``for c in torch.unique(labels)``, as torchvision's ``batched_nms`` runs
    on many boxes: 3 to 6 classes per frame, often the same in consecutive frames. A count
    seen twice in a row first replays as a sequence of its own (a variant per count); once
    frames with other counts are logged, the loop is folded with the ``unbind`` before it
    scattered (an output per iteration), and from then on every frame replays whole with one
    reply, whatever its count. Outputs equal to local on every frame."""
    runs = 24
    stats = same_as_local("class_loop", fresh, "--runs", str(runs), tmp=tmp_path)
    by = stats["by_inference"]
    assert stats["failed"] == 0, stats
    seqs = fresh.ctl("sequences")["sequences"]
    (looped,) = [s for s in seqs if s["loops"] == 1]
    # found when the variant searches have logged frames of other counts (frame 10 on an idle
    # machine); from then on it replays every frame, frame 16 (the first with 6 classes) too
    tail = range(runs - looped["replays"], runs)
    assert len(tail) >= 6 and looped["mismatches"] == 0, (looped, stats)
    assert all(by["replays"][i] == 1 and by["round_trips"][i] <= 1 and not by["mismatches"][i]
               for i in tail), stats


def test_a_loop_that_reads_a_weight_binds_it_once_for_every_iteration(fresh, tmp_path):
    """``--varying --refine``: each iteration runs a linear layer. Its weights are slots of
    the recorded iteration; unrolled, every iteration's copy is bound under that one slot on
    both ends, so one binding serves every count. Replays from the 4th frame, one reply each,
    outputs equal to local."""
    stats = same_as_local("read_values", fresh, "--varying", "--refine", "--runs", "10",
                          tmp=tmp_path)
    by = stats["by_inference"]
    replayed = [i for i, r in enumerate(by["replays"]) if r]
    assert replayed and replayed[0] <= 3 and replayed == list(range(replayed[0], 10)), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    assert all(by["round_trips"][i] <= 1 for i in replayed[1:]), stats


def test_a_loop_the_app_leaves_early_is_a_mismatch_never_a_wrong_output(fresh, tmp_path):
    """``--stop-early 6``: frame 6's loop breaks after one box though the count says more. The
    host, running ahead of the app, unrolled it for the count; the app's next call is not the
    second iteration's: a mismatch, that inference forwarded from there, outputs equal to
    local, and the next frames replay again."""
    stats = same_as_local("read_values", fresh, "--varying", "--runs", "10", "--stop-early", "6",
                          tmp=tmp_path)
    by = stats["by_inference"]
    assert by["mismatches"][6] == 1 and stats["mismatches"] == 1, stats
    assert by["replays"][7:] == [1] * 3 and stats["failed"] == 0, stats


def test_an_integer_taken_for_a_constant_by_coincidence_becomes_a_symbol(fresh, tmp_path):
    """``read_values --same-first 3``: the first frames have boxes of the same sizes, so the
    sequence is found with the widths and heights as constants. Later frames mismatch there;
    the robot rebuilds those aborted inferences with what the host pushed (the values read,
    the outputs taken) and finds the sequence again next to the first, with the integers
    following the values read. A few mismatches, then every frame replays whole with one
    reply; outputs equal to local on every frame."""
    stats = same_as_local("read_values", fresh, "--pace", "20", "--runs", "14", "--same-first", "3",
                          tmp=tmp_path)
    by = stats["by_inference"]
    assert 1 <= stats["mismatches"] <= 5 and stats["failed"] == 0, stats
    assert by["replays"][-5:] == [1] * 5 and by["mismatches"][-5:] == [0] * 5, stats
    assert by["round_trips"][-5:] == [1] * 5, stats
    assert any(s.get("variant") and s["replays"] >= 5 and s["mismatches"] == 0
               for s in fresh.ask("sequences")["sequences"]), fresh.ask("sequences")


def test_a_call_that_fails_on_the_host_ahead_of_the_app_is_never_the_apps_error(fresh,
                                                                               tmp_path):
    """Forced: frame 6 has two boxes, not three. The host runs ahead into the third box's
    iteration and its ``select`` fails there; the app's loop ends after two, so the app never
    made that call: no error reaches it (``Error.base_id``/``position``), the inference is
    forwarded from where it went another way with outputs equal to local, the sequence is
    kept and the next frames replay again."""
    stats = same_as_local("read_values", fresh, "--pace", "20", "--fewer", "6", tmp=tmp_path)
    by = stats["by_inference"]
    assert stats["failed"] == 0 and by["mismatches"][6] == 1, stats
    assert stats["failed_ahead"] <= 1, stats  # 0: the app branched before the host got there
    assert by["replays"][7:] == [1, 1, 1] and not any(by["mismatches"][7:]), stats


def test_an_output_written_after_a_mismatch_is_never_the_push_of_the_run_ahead(fresh,
                                                                               tmp_path):
    """Forced: in frame 6 the app decodes its last box with another integer than the one the
    sequence has (``--odd``). The host has run that inference to its end and pushed the
    buffer the loop fills row by row through views (``rrtod.wire.final_writes``: it is final
    only after the last row); its last row, written after the mismatch, is not the app's. The
    app reads the buffer as the host holds it after the abort and the forwarded rest, never
    the stale push: outputs equal to local, and the next frames replay again."""
    stats = same_as_local("read_values", fresh, "--pace", "20", "--odd", "6", tmp=tmp_path)
    by = stats["by_inference"]
    assert stats["failed"] == 0 and by["mismatches"][6] == 1, stats
    assert by["replays"][7:] == [1, 1, 1] and not any(by["mismatches"][7:]), stats


def test_a_loop_whose_iterations_go_on_as_the_values_read_decide_replays_its_variants(
        fresh, tmp_path):
    """``paste_masks``: Mask R-CNN's mask pasting, 3 to 5 boxes a frame, each iteration's calls
    after its first 23 chosen by four bools the app reads (whether the box crosses each edge):
    four variants. The loop is folded to the body every iteration begins with and the variants
    seen (``rrtod.robot.loopfold.branched``); the host runs every body first, reads the guards
    and runs the variants they chose, the shim unrolls the same from the values the host
    pushes. Replays from the 3rd frame, one reply each, outputs equal to local on every frame."""
    runs = 10
    stats = same_as_local("paste_masks", fresh, "--runs", str(runs), tmp=tmp_path)
    by = stats["by_inference"]
    assert by["replays"][2:] == [1] * (runs - 2), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    assert all(by["round_trips"][i] <= 1 for i in range(2, runs)), stats
    (seq,) = fresh.ctl("sequences")["sequences"]
    assert seq["loops"] == 1 and seq["loop_variants"] == 4 and seq["mismatches"] == 0, seq


@pytest.mark.parametrize("flags", [["--new-variant", "5"], ["--new-variant", "5", "--new-box", "0"],
                                   ["--odd", "5"]])
def test_a_branched_loop_the_app_leaves_is_a_mismatch_never_a_wrong_output(flags, fresh,
                                                                            tmp_path):
    """Frame 5 goes another way inside the loop. ``--odd``: a call no variant has in the last
    box, after the host ran every body and every variant (its abort is at the app's position,
    which the host maps onto its own order); the app forwards the rest of that box, and the
    replay resumes at the calls after the loop; the frames after replay again with the
    sequence of four variants, kept. ``--new-variant``: from frame 5 on, a box (the last, or the first:
    ``--new-box 0``) whose values no variant has. Both ends cut the loop there
    (``loops.unroll(cut=)``): the boxes before it replay, the app's calls on that box's
    branch are forwarded, and the replay resumes at the next box (or at the calls after the
    loop) from one start (``ReplayStart.loop_choices``). Such a frame waits as often
    whichever box is new, and less than a third as often as a frame forwarded whole. That
    one frame is enough: searched with the log the sequence was found from (its replayed
    parts rebuilt from the host's accounts), it gives a sequence with the fifth variant,
    which replaces the first, and the last frames replay with it. Outputs equal to local on
    every frame."""
    runs = 12
    stats = same_as_local("paste_masks", fresh, "--runs", str(runs), *flags, tmp=tmp_path)
    by = stats["by_inference"]
    assert by["replays"][2:5] == [1] * 3 and by["replays"][-3:] == [1] * 3, stats
    assert by["mismatches"][5] == 1 and by["mismatches"][-3:] == [0] * 3, stats
    sequences = fresh.ctl("sequences")["sequences"]
    if flags[0] == "--odd":
        assert stats["mismatches"] == 1 and by["resumed"][5] == 1 and not by["cut"][5], stats
        assert [s["loop_variants"] for s in sequences] == [4], sequences
        return
    # the frames that began before the new sequence was defined miss too
    (seq,) = sequences
    assert seq["loop_variants"] == 5 and seq["replaces"], seq
    assert by["cut"][5] == 1 and by["resumed"][5] == 1, stats
    assert by["round_trips"][5] * 3 < by["round_trips"][0], stats  # frame 0: fewer boxes


def test_a_loop_resumed_after_one_cut_may_be_cut_and_resumed_again(fresh, tmp_path):
    """``paste_masks --new-variant 5 --new-box 0,2``: from frame 5 on, boxes 0 and 2 take a
    variant no frame before had. Frame 5's replay is cut at box 0, resumed at box 1, cut at
    box 2 (the resumed loop's own cut: its iterations before it in the app's order, the later
    bodies first on the host), and resumed at box 3 or after the loop: two starts, each
    joining what the app holds. The robot puts the three replays' calls and the two branches
    forwarded in between into its log in the app's order, and learns the fifth variant from
    that frame; outputs equal to local on every frame."""
    stats = same_as_local("paste_masks", fresh, "--runs", "10", "--new-variant", "5",
                          "--new-box", "0,2", tmp=tmp_path)
    by = stats["by_inference"]
    assert by["cut"][5] == 2 and by["resumed"][5] == 2 and stats["failed"] == 0, stats
    assert by["round_trips"][5] * 3 < by["round_trips"][0], stats
    assert by["replays"][-2:] == [1, 1] and by["mismatches"][-2:] == [0, 0], stats
    (seq,) = fresh.ctl("sequences")["sequences"]
    assert seq["loop_variants"] == 5 and seq["replaces"], seq


def test_a_resumed_loop_the_app_leaves_again_is_a_mismatch_never_a_wrong_output(fresh,
                                                                               tmp_path):
    """Forced: frame 5's replay resumes after a cut at its first box, then meets a call no
    variant has (``--odd``: its last box pasted one row lower) inside the resumed part. The
    resumed replay is aborted at the app's position, which the host maps onto its order (the
    iterations before the resumed one in the app's, the bodies after it first); the rest of
    that box is forwarded, and the replay resumes once more, after the loop. Outputs equal to
    local on every frame; in the frames after, each miss is a cut that resumed (until the
    robot has learnt the new variant from one of them)."""
    stats = same_as_local("paste_masks", fresh, "--runs", "11", "--new-variant", "5",
                          "--new-box", "0", "--odd", "5", tmp=tmp_path)
    by = stats["by_inference"]
    at = 5
    assert by["resumed"][at] == by["mismatches"][at] == 2 and by["cut"][at] == 1, stats
    assert stats["failed"] == 0 and by["replays"][at:] == [1] * (11 - at), stats
    assert by["mismatches"][at + 1:] == by["cut"][at + 1:] == by["resumed"][at + 1:], stats


def test_a_box_the_host_cannot_size_as_the_app_does_is_never_answered_wrongly(fresh, tmp_path):
    """Forced: in frame 5 box 1 has no width (``paste_masks --degenerate``). The app reads
    width 0 and passes ``max(0, 1)`` on; the host, running every body ahead, takes the width
    it read (the sequence's symbol) and its resize of that box fails. The host cuts its
    unrolling at that box instead of failing the loop (``HostReplayer._cut_at_failure``): it
    runs the variant of box 0, pushes what ran, and reports the failure at the app's
    position of that call; the shim replays up to it, the app forwards the rest of box 1,
    and the replay resumes at box 2. It leaves once more at the calls after the loop, which
    gather box 1's image: a forwarded call made it, and the host, running ahead, fails there
    too. Equal to local on every frame; the next frames replay with one reply each."""
    stats = same_as_local("paste_masks", fresh, "--runs", "8", "--degenerate", "5", tmp=tmp_path)
    by = stats["by_inference"]
    assert stats["failed_ahead"] == by["mismatches"][5] == 2 and by["resumed"][5] == 1, stats
    assert by["round_trips"][5] * 3 < by["round_trips"][0], stats
    assert by["replays"][6:] == [1, 1] and by["round_trips"][6:] == [1, 1], stats


def test_a_slice_that_spans_its_dimension_makes_the_same_calls_as_any_other(fresh, tmp_path):
    """``paste_masks --full-width 4``: in frame 4 a box spans the image's whole width, under
    the guard values of a box inside it. PyTorch's indexing makes no ``slice`` call for a slice
    that spans its dimension, so that box's calls were not its variant's, and the frame left
    its sequence inside the loop (Mask R-CNN: 2 of 13 misses in 70 frames). The shim slices a
    proxy itself where a slice names its bounds (``slicing.py``): every frame replays, one
    reply each, outputs equal to local."""
    runs = 7
    stats = same_as_local("paste_masks", fresh, "--runs", str(runs), "--full-width", "4",
                          tmp=tmp_path)
    by = stats["by_inference"]
    assert by["replays"][2:] == [1] * (runs - 2), stats
    assert stats["mismatches"] == 0 and stats["failed"] == 0, stats
    assert all(by["round_trips"][i] <= 1 for i in range(2, runs)), stats


def test_a_frame_that_branches_before_a_branched_loop_is_never_answered_wrongly(fresh, tmp_path):
    """``paste_masks --branch 5 --new-variant 5``: from frame 5 on every other frame scales
    the masks once more right before the loop (a ``mul`` by the same weight as the
    sequence's first call), and every frame's last box takes a variant no frame before had.
    The ``mul`` is a mismatch at the loop; it once also started the sequence anew with the
    masks as its first input (a tensor of the session, of other sizes), and the app got
    masks of that input's size (``zip()`` of masks and boxes failed). Outputs equal to local
    on every frame, however much of them replays."""
    stats = same_as_local("paste_masks", fresh, "--runs", "12", "--new-variant", "5",
                          "--branch", "5", tmp=tmp_path)
    by = stats["by_inference"]
    assert by["replays"][2:5] == [1] * 3 and by["mismatches"][5] == 1, stats
    assert stats["failed"] == 0, stats


def test_an_assignment_of_one_row_makes_the_same_calls_as_of_many(fresh, tmp_path):
    """``level_assign``: boxes written into one buffer level by level (Mask R-CNN's
    ``MultiScaleRoIAlign``); PyTorch views a level's value without its leading 1 where the
    level got one box. The shim does not send that view (``assignment.py``), so every frame
    makes the same calls: replay from the 3rd frame, each whole with one reply (before, the
    frames went eight ways and most left their sequence). Outputs equal to local."""
    stats = same_as_local("level_assign", fresh, tmp=tmp_path)
    by = stats["by_inference"]
    assert by["replays"][2:] == [1] * (len(by["replays"]) - 2), stats
    assert not any(by["mismatches"]) and set(by["round_trips"][2:]) == {1}, stats
    assert stats["failed"] == 0, stats


def test_inferences_that_never_go_the_same_way_twice_in_a_row_still_replay(fresh, tmp_path):
    """``level_assign --squeeze``: the app squeezes a level's value where the level got one
    box, so an inference goes one of eight ways, never the same twice in a row. The log's end
    never repeats; the search pairs the last inference with earlier ones that went its way
    (``search.paired``), so replay starts, and the frames that go a way the robot knows
    replay whole with one reply (before, none ever did). Outputs equal to local on every
    frame."""
    stats = same_as_local("level_assign", fresh, "--squeeze", tmp=tmp_path)
    by = stats["by_inference"]
    assert 1 in by["replays"][:8] and stats["failed"] == 0, stats
    whole = [i for i, (r, m) in enumerate(zip(by["replays"], by["mismatches"], strict=True))
             if r and not m]
    assert len(whole) >= 3 and all(by["round_trips"][i] <= 1 for i in whole), stats


# Loaded by the GPU daemon of the test below (its PYTHONPATH): the host raises, once, while it
# handles the first argument after the third replay it is asked to start - an executor bug.
CRASH_ONCE = '''
import builtins, sys
state = {"starts": 0, "crashed": False}
real_import = builtins.__import__

def hook():
    replay = sys.modules.get("rrtod.gpu.replay")
    if replay is None or not hasattr(replay, "HostReplayer"):
        return False
    process = replay.HostReplayer.process
    def crashing(self, frame, emit):
        kind = frame.WhichOneof("msg")
        state["starts"] += kind == "start"
        if kind == "arg" and state["starts"] >= 3 and not state["crashed"]:
            state["crashed"] = True
            raise KeyError("an executor bug")
        return process(self, frame, emit)
    replay.HostReplayer.process = crashing
    return True

def importing(name, *args, **kwargs):
    module = real_import(name, *args, **kwargs)
    if "rrtod.gpu.replay" in sys.modules and hook():
        builtins.__import__ = real_import
    return module

builtins.__import__ = importing
'''


def test_a_replay_the_host_crashes_on_is_finished_in_the_app(tmp_path):
    """The GPU daemon raises while it handles a replay's own frame (an executor bug): it drops
    the sequence and says the crash was the replay's (``Error.in_replay``), not a call the app
    forwarded. The app (``fallback: local``, the default) does not hear of an error it made no
    call for: it finishes that inference from its own values (the journal), with outputs equal
    to local on every frame, and replays again once the robot has found the sequence anew."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(CRASH_ONCE)
    with Launcher(extra_env={**DAEMON_ENV, "PYTHONPATH": str(inject)}) as launcher:
        daemon = launcher.start("rrtod", **{**TEST_DEFAULTS, **HOST})
        stats = same_as_local("dynamic_head", daemon, "--runs", "12", "--pace", "20",
                              tmp=tmp_path, fallback="local")
    assert stats["failed"] == 1 and stats["finished_here"] == 1, stats
    # the robot is told the sequence is given up, records again and finds it again
    assert stats["by_inference"]["replays"][-3:] == [1, 1, 1], stats
