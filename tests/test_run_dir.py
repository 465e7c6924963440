import json

import pytest

from qevolve.evolve.run_dir import RunDirectory, RunError


def stage_writer(text, metric):
    def fn(workdir):
        (workdir / "out.txt").write_text(text)
        return {"file": "out.txt"}, {"value": metric}
    return fn


def test_stages_are_recorded_once_and_skipped_on_resume(tmp_path):
    run = RunDirectory(tmp_path / "r", {"a": 1}, seed=0)
    rec = run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    assert rec.outputs == {"file": "bc/out.txt"}
    assert (tmp_path / "r/bc/out.txt").read_text() == "x"
    run.close()  # releases the run's lock
    with pytest.raises(RunError, match="already holds a run"):
        RunDirectory(tmp_path / "r", {"a": 1}, seed=0)
    with pytest.raises(RunError, match="started with a=1, this config has a=2"):
        RunDirectory(tmp_path / "r", {"a": 2}, seed=0, resume=True)
    # where the run lives and whether it draws progress bars compute nothing: they may change on resume
    RunDirectory(tmp_path / "r", {"a": 1, "name": "moved", "progress": False}, seed=0, resume=True).close()
    again = RunDirectory(tmp_path / "r", {"a": 1}, seed=0, resume=True)
    calls = []
    again.run_stage("bc", {}, lambda w: calls.append(1) or ({}, {}), log=lambda m: None)
    assert calls == []
    lines = (tmp_path / "r/metrics.jsonl").read_text().splitlines()
    assert [json.loads(l) for l in lines] == [{"stage": "bc", "value": 1.0}]


def test_killed_stage_leaves_nothing_and_resume_matches_uninterrupted(tmp_path):
    def killed(workdir):
        (workdir / "half.txt").write_text("partial")
        raise KeyboardInterrupt

    run = RunDirectory(tmp_path / "a", {"k": 1}, seed=0)
    run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    with pytest.raises(KeyboardInterrupt):
        run.run_stage("iter_1/critic", {"buffer": "bc/out.txt"}, killed, log=lambda m: None)
    assert not (tmp_path / "a/iter_1/critic").exists()
    assert not list((tmp_path / "a").glob("**/.*partial*"))
    run.close()
    resumed = RunDirectory(tmp_path / "a", {"k": 1}, seed=0, resume=True)
    resumed.run_stage("iter_1/critic", {"buffer": "bc/out.txt"}, stage_writer("y", 2.0), log=lambda m: None)

    clean = RunDirectory(tmp_path / "b", {"k": 1}, seed=0)
    clean.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    clean.run_stage("iter_1/critic", {"buffer": "bc/out.txt"}, stage_writer("y", 2.0), log=lambda m: None)
    assert (tmp_path / "a/manifest.json").read_text() == (tmp_path / "b/manifest.json").read_text()
    assert (tmp_path / "a/metrics.jsonl").read_text() == (tmp_path / "b/metrics.jsonl").read_text()


def test_resume_reads_a_field_added_since_the_run_started_as_its_default(tmp_path):
    from qevolve.evolve.loop import EvolveConfig

    def upgrade(recorded):
        return EvolveConfig.model_validate(recorded).model_dump(mode="json")

    config = EvolveConfig().model_dump(mode="json")
    RunDirectory(tmp_path / "r", config, seed=0).close()
    manifest = tmp_path / "r/manifest.json"
    old = json.loads(manifest.read_text())
    del old["config"]["bc"]["model"]["malloc_mmap_threshold_mb"]  # as written before the field existed
    manifest.write_text(json.dumps(old))
    with pytest.raises(RunError, match='malloc_mmap_threshold_mb="<missing>"'):
        RunDirectory(tmp_path / "r", config, seed=0, resume=True)  # no upgrade: a difference
    RunDirectory(tmp_path / "r", config, seed=0, resume=True, upgrade=upgrade).close()
    changed = EvolveConfig.model_validate({"bc": {"model": {"malloc_mmap_threshold_mb": 4}}}).model_dump(mode="json")
    with pytest.raises(RunError, match="bc.model.malloc_mmap_threshold_mb=null, this config has "
                                       "bc.model.malloc_mmap_threshold_mb=4"):
        RunDirectory(tmp_path / "r", changed, seed=0, resume=True, upgrade=upgrade)


def interrupted_after(filename):
    def fn(workdir):
        (workdir / filename).write_text("checkpoint")
        raise KeyboardInterrupt
    return fn


def test_an_interrupted_training_stage_keeps_its_work_folder_and_continues_in_it(tmp_path):
    run = RunDirectory(tmp_path / "r", {"k": 1}, seed=0)
    run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    with pytest.raises(KeyboardInterrupt) as caught:
        run.run_stage("iter_1/critic", {"buffer": "bc/out.txt"}, interrupted_after("ckpt.txt"), log=lambda m: None,
                      resumable=True)
    assert caught.value.stage == "iter_1/critic" and caught.value.resume_step is None  # no trainer checkpoint
    assert (tmp_path / "r/iter_1/.critic.partial/ckpt.txt").read_text() == "checkpoint"
    run.close()

    seen, messages = [], []

    def continues(workdir):
        seen.append(sorted(p.name for p in workdir.iterdir()))
        (workdir / "out.txt").write_text("y")
        return {"file": "out.txt"}, {"value": 2.0}

    resumed = RunDirectory(tmp_path / "r", {"k": 1}, seed=0, resume=True)
    resumed.run_stage("iter_1/critic", {"buffer": "bc/out.txt"}, continues, log=messages.append, resumable=True)
    assert seen == [[".stage.json", "ckpt.txt"]]
    assert any("continuing the unfinished stage" in m for m in messages)
    assert (tmp_path / "r/iter_1/critic/ckpt.txt").exists() and not (tmp_path / "r/iter_1/.critic.partial").exists()
    assert not any(".stage" in path for path in resumed.manifest["stages"][-1]["digests"])  # not a result


def test_unfinished_work_is_reused_only_from_the_same_inputs_and_config(tmp_path):
    def interrupt(run):
        with pytest.raises(KeyboardInterrupt):
            run.run_stage("iter_1/policy", {"labelled": "bc/out.txt"}, interrupted_after("ckpt.txt"),
                          log=lambda m: None, resumable=True)
        run.close()

    def contents(run, inputs=None):
        seen, messages = [], []

        def fn(workdir):
            seen.extend(p.name for p in workdir.iterdir() if not p.name.startswith("."))
            return {}, {}
        run.run_stage("iter_1/policy", inputs or {"labelled": "bc/out.txt"}, fn, log=messages.append, resumable=True)
        run.close()
        return seen, messages

    run = RunDirectory(tmp_path / "r", {"k": 1}, seed=0)
    run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    interrupt(run)
    # other inputs: discarded, with a line saying so
    seen, messages = contents(RunDirectory(tmp_path / "r", {"k": 1}, seed=0, resume=True), {"labelled": "bc/other"})
    assert seen == [] and any("discarding unfinished work" in m for m in messages)

    # --redo of a stage it read: discarded (the redone stage may compute something else)
    run = RunDirectory(tmp_path / "r3", {"k": 1}, seed=0)
    run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    interrupt(run)
    redone = RunDirectory(tmp_path / "r3", {"k": 1}, seed=0, redo="bc")
    assert not (tmp_path / "r3/iter_1/.policy.partial").exists()
    redone.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    assert contents(redone)[0] == []

    # the inputs' content changed (the stage that wrote them recorded other digests): discarded
    run = RunDirectory(tmp_path / "r4", {"k": 1}, seed=0)
    run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    interrupt(run)
    manifest_path = tmp_path / "r4/manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["stages"][0]["digests"] = {"out.txt": "0" * 64}
    manifest_path.write_text(json.dumps(manifest))
    assert contents(RunDirectory(tmp_path / "r4", {"k": 1}, seed=0, resume=True))[0] == []

    # same inputs and config, and a changed setting that does not change results: reused
    run = RunDirectory(tmp_path / "r5", {"k": 1, "num_threads": 1}, seed=0)
    run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    interrupt(run)
    assert contents(RunDirectory(tmp_path / "r5", {"k": 1, "num_threads": 2}, seed=0, resume=True))[0] == ["ckpt.txt"]


def test_a_stage_that_is_not_resumable_starts_empty_and_leaves_nothing(tmp_path):
    run = RunDirectory(tmp_path / "r", {"k": 1}, seed=0)
    leftover = tmp_path / "r/bc/.eval_seen.partial"  # as a kill -9 leaves it
    leftover.mkdir(parents=True)
    (leftover / "part-0.parquet").write_text("half")
    seen = []
    run.run_stage("bc/eval_seen", {}, lambda w: seen.extend(w.iterdir()) or ({}, {}), log=lambda m: None)
    assert seen == []
    with pytest.raises(KeyboardInterrupt) as caught:
        run.run_stage("iter_1/rollouts", {}, interrupted_after("part-0.parquet"), log=lambda m: None)
    assert caught.value.stage == "iter_1/rollouts" and caught.value.resume_step is None
    assert not list((tmp_path / "r").glob("**/.*.partial"))


def test_a_training_stage_renamed_but_not_recorded_continues_from_its_folder(tmp_path, monkeypatch):
    """A kill between the rename into place and the manifest write: the training stage's finished folder
    becomes its work folder again (its trainer then finds the final checkpoint)."""
    import os

    import qevolve.evolve.run_dir as run_dir

    run = RunDirectory(tmp_path / "r", {"k": 1}, seed=0)
    real_replace = os.replace

    def killed_after_rename(src, dst):
        real_replace(src, dst)
        if str(dst).endswith("/bc"):
            raise KeyboardInterrupt

    monkeypatch.setattr(run_dir.os, "replace", killed_after_rename)
    with pytest.raises(KeyboardInterrupt):
        run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None, resumable=True)
    monkeypatch.undo()
    run.close()
    assert (tmp_path / "r/bc/out.txt").exists() and not json.loads((tmp_path / "r/manifest.json").read_text())["stages"]
    seen = []
    again = RunDirectory(tmp_path / "r", {"k": 1}, seed=0, resume=True)
    again.run_stage("bc", {}, lambda w: seen.extend(p.name for p in w.iterdir()) or ({}, {}), log=lambda m: None,
                    resumable=True)
    assert "out.txt" in seen


def test_resume_allows_thread_worker_and_logging_changes_and_records_them(tmp_path):
    from qevolve.evolve.loop import EvolveConfig

    config = EvolveConfig().model_dump(mode="json")
    run = RunDirectory(tmp_path / "r", config, seed=0)
    run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    run.close()
    changed = EvolveConfig.model_validate({
        "num_threads": 4, "tensorboard": False, "wandb": True, "progress": False,
        "rollout": {"agent": {"num_workers": 7}}, "eval": {"agent": {"num_workers": 3}},
        "bc": {"tensorboard": False, "save_every": 5}, "critic": {"checkpoint_every_steps": 10}}).model_dump(mode="json")
    resumed = RunDirectory(tmp_path / "r", changed, seed=0, resume=True)
    resumed.close()
    entries = json.loads((tmp_path / "r/manifest.json").read_text())["resume_changes"]
    assert entries == [{"after_stage": "bc", "changes": {
        "num_threads": [None, 4], "tensorboard": [True, False], "wandb": [False, True],
        "rollout.agent.num_workers": [2, 7], "eval.agent.num_workers": [2, 3], "bc.tensorboard": [True, False],
        "bc.save_every": [50, 5], "critic.checkpoint_every_steps": [200, 10]}}]
    assert "num_threads null -> 4" in resumed.resume_changes
    # the same settings again: nothing new to record
    RunDirectory(tmp_path / "r", changed, seed=0, resume=True).close()
    assert len(json.loads((tmp_path / "r/manifest.json").read_text())["resume_changes"]) == 1
    # what changes results is still refused
    lr = EvolveConfig.model_validate({"num_threads": 4, "policy": {"optim": {"lr": 1e-3}}}).model_dump(mode="json")
    with pytest.raises(RunError, match="started with policy.optim.lr=5e-05, this config has policy.optim.lr=0.001"):
        RunDirectory(tmp_path / "r", lr, seed=0, resume=True)
    with pytest.raises(RunError, match="rollout.agent.batch_size"):
        RunDirectory(tmp_path / "r", EvolveConfig.model_validate({"rollout": {"agent": {"batch_size": 3}}})
                     .model_dump(mode="json"), seed=0, resume=True)


def test_a_run_that_completed_no_stage_does_not_hold_its_name(tmp_path):
    run = RunDirectory(tmp_path / "r", {"k": 1}, seed=0)
    with pytest.raises(KeyboardInterrupt):  # the first stage fails
        run.run_stage("bc", {}, interrupted_after("ckpt.txt"), log=lambda m: None)
    run.close()
    fresh = RunDirectory(tmp_path / "r", {"k": 2}, seed=5)  # no --resume, another config
    assert fresh.restarted
    assert json.loads((tmp_path / "r/manifest.json").read_text())["config"] == {"k": 2}
    fresh.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    fresh.close()
    with pytest.raises(RunError, match="already holds a run"):  # now it holds one
        RunDirectory(tmp_path / "r", {"k": 2}, seed=5)


def test_timings_record_each_stages_peak_gpu_memory_only_where_cuda_is_in_use(tmp_path, monkeypatch):
    """A fake CUDA: the peak is reset at each stage's start, read at its end, in MiB; none without CUDA."""
    import torch

    peak = {"bytes": 0, "resets": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: peak.update(bytes=0, resets=peak["resets"] + 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak["bytes"])

    def allocating(mib):
        def stage(workdir):
            peak["bytes"] = max(peak["bytes"], mib * 2**20)
            return {}, {}
        return stage

    run = RunDirectory(tmp_path / "r", {"a": 1}, seed=0)
    run.run_stage("bc", {}, allocating(300), log=lambda m: None)
    run.run_stage("iter_1/critic", {}, allocating(100), log=lambda m: None)  # reset: not bc's 300
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    run.run_stage("iter_1/label", {}, allocating(500), log=lambda m: None)
    run.close()
    timings = [json.loads(line) for line in (tmp_path / "r/timings.jsonl").read_text().splitlines()]
    assert [t.get("peak_gpu_mb") for t in timings] == [300, 100, None]
    assert peak["resets"] == 2
    assert "peak_gpu_mb" not in (tmp_path / "r/manifest.json").read_text()


def test_timings_record_the_gpu_memory_a_stage_starts_with_where_cuda_is_in_use(tmp_path, monkeypatch):
    """A fake CUDA: what a stage measures when its work starts (gpu_memory_now) goes into its timings line, in
    MiB; without CUDA nothing is measured and the line has no such field."""
    import torch

    from qevolve.evolve.run_dir import gpu_memory_now

    memory = {"allocated": 700 * 2**20, "free": 1000 * 2**20}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (memory["free"], 4000 * 2**20))

    def measuring(timing, allocated_after):
        def stage(workdir):
            timing.update(gpu_memory_now())
            memory["allocated"] = allocated_after
            return {}, {}
        return stage

    run = RunDirectory(tmp_path / "r", {"a": 1}, seed=0)
    timing: dict = {}
    run.run_stage("bc/eval_seen", {}, measuring(timing, 2000 * 2**20), log=lambda m: None, timing=timing)
    timing = {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    run.run_stage("iter_1/critic", {}, measuring(timing, 0), log=lambda m: None, timing=timing)
    run.close()
    timings = [json.loads(line) for line in (tmp_path / "r/timings.jsonl").read_text().splitlines()]
    assert (timings[0]["gpu_mb_at_start"], timings[0]["gpu_used_mb_at_start"]) == (700, 3000)
    assert "gpu_mb_at_start" not in timings[1] and "gpu_used_mb_at_start" not in timings[1]
    assert "gpu_mb_at_start" not in (tmp_path / "r/manifest.json").read_text()
