"""Goodput: a job's time accounted across its processes and reinits (core/goodput.py), the job
file each process appends to (records/job_ledger.py), `hbm-watchdog goodput`, and the series on
/metrics. A whole supervised job with a reinit, a restart and a preemption is in
tests/test_exact_resume.py."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from watchdog.actions.action_path import projected_oom
from watchdog.commands.cli import main
from watchdog.core import goodput
from watchdog.core.errors import InputError
from watchdog.core.verdict import Status, Verdict
from watchdog.records.job_ledger import GoodputFigures, JobLedger, start_job
from watchdog.station.exporter import TelemetryCollector
from watchdog.station.telemetry import Telemetry


def rec(event: str, t: float, **fields) -> dict:
    return {"v": goodput.VERSION, "event": event, "t": t, **fields}


def crashed_and_resumed_job() -> list[dict]:
    """Process 1 starts at 0 s, trains steps 0-150 with a checkpoint at 100, is killed at about 40 s;
    process 2 starts at 50 s from checkpoint 100 and finishes at 200."""
    return [
        rec("process", 5.0, started=0.0, step=0, checkpoint_every=100),
        rec("span", 5.0, cause="startup", seconds=5.0, step=0),
        rec("steps", 25.0, first=0, last=100, seconds=20.0, compile_seconds=4.0),
        rec("span", 26.0, cause="checkpoint_save", seconds=1.0, step=100),
        rec("steps", 36.0, first=100, last=150, seconds=10.0, compile_seconds=0.0),
        # killed here: nothing more from process 1
        rec("process", 56.0, started=50.0, step=100, checkpoint_every=100),
        rec("span", 56.0, cause="checkpoint_restore", seconds=2.0, step=100),
        rec("span", 56.0, cause="startup", seconds=4.0, step=100),
        rec("steps", 80.0, first=100, last=200, seconds=24.0, compile_seconds=3.0),
        rec("span", 81.0, cause="checkpoint_save", seconds=1.0, step=200),
        rec("end", 81.0, how="done", step=200),
    ]


def test_steps_past_the_checkpoint_a_new_process_resumed_from_are_redone_and_every_second_is_accounted():
    account = goodput.account(crashed_and_resumed_job())
    assert account.elapsed_seconds == 81.0 and account.processes == 2 and account.restarts == 1
    assert account.steps_kept == 200 and account.steps_redone == 50
    assert account.productive_seconds == pytest.approx(16.0 + 21.0)  # compile time taken out
    badput = account.badput_seconds
    assert badput["redone"] == pytest.approx(10.0)
    assert badput["startup"] == pytest.approx(5.0 + 4.0 + 4.0 + 3.0)  # both starts, each with its first compile
    assert badput["disruption"] == pytest.approx(50.0 - 36.0)  # from process 1's last line to process 2's start
    assert badput["checkpoint_save"] == 2.0 and badput["checkpoint_restore"] == 2.0
    assert account.productive_seconds + sum(badput.values()) == pytest.approx(account.elapsed_seconds)
    assert account.goodput == pytest.approx(37.0 / 81.0) and account.ended == "done"


def test_a_reinit_action_costs_its_save_its_rebuild_and_the_compile_after_it_against_a_crash_at_its_oom():
    records = [
        rec("process", 2.0, started=0.0, step=0, checkpoint_every=500),
        rec("span", 2.0, cause="startup", seconds=2.0, step=0),
        rec("steps", 12.0, first=0, last=500, seconds=10.0, compile_seconds=1.0),  # 9 s for 500 steps
        rec("span", 13.0, cause="checkpoint_save", seconds=1.0, step=500),
        rec("steps", 17.5, first=500, last=700, seconds=4.5, compile_seconds=0.9),
        rec("action", 17.5, kind="checkpoint_reinit", step=700, projected_oom_step=900),
        rec("span", 18.0, cause="checkpoint_save", seconds=0.5, step=700),
        rec("span", 19.0, cause="reinit", seconds=1.0, step=700),
        rec("steps", 25.0, first=700, last=1000, seconds=6.0, compile_seconds=0.5),
        rec("end", 25.0, how="done", step=1000),
    ]
    account = goodput.account(records)
    (action,) = account.actions
    assert account.reinits == 1 and account.badput_seconds["reinit"] == pytest.approx(1.5)
    assert account.badput_seconds["recompilation"] == pytest.approx(0.9)
    assert action.cost_seconds == pytest.approx(0.5 + 1.0 + 0.5)
    # a crash at 900 resumes from the periodic checkpoint at 500: 400 steps lost, plus a restart
    # (none measured in this job: its own start-up, 2 s)
    per_step = account.productive_seconds / account.steps_kept
    assert action.crash_lost_steps == 400
    assert action.crash_cost_seconds == pytest.approx(400 * per_step + 2.0)
    assert account.watchdog_saved_seconds == pytest.approx(action.crash_cost_seconds - 2.0)
    assert "saved about" in account.block()


def test_a_restart_action_costs_its_save_and_the_restart_it_asked_for_and_a_drill_saves_nothing():
    records = [
        rec("job", 0.0),
        rec("process", 3.0, started=1.0, step=0, checkpoint_every=0),
        rec("span", 3.0, cause="startup", seconds=2.0, step=0),
        rec("steps", 13.0, first=0, last=100, seconds=10.0, compile_seconds=0.0),
        rec("action", 13.0, kind="checkpoint_restart", step=100, projected_oom_step=None),
        rec("span", 14.0, cause="checkpoint_save", seconds=1.0, step=100),
        rec("end", 14.0, how="restart", step=100),
        rec("process", 20.0, started=16.0, step=100, checkpoint_every=0),
        rec("span", 20.0, cause="checkpoint_restore", seconds=1.0, step=100),
        rec("span", 20.0, cause="startup", seconds=3.0, step=100),
        rec("steps", 30.0, first=100, last=200, seconds=10.0, compile_seconds=0.0),
        rec("end", 30.0, how="done", step=200),
    ]
    account = goodput.account(records)
    (action,) = account.actions
    assert account.elapsed_seconds == 30.0  # from the job line, before the first process
    assert action.cost_seconds == pytest.approx(1.0 + 2.0 + 3.0 + 1.0)  # save, gap, start-up, restore
    assert action.crash_cost_seconds is None and action.saved_seconds is None
    assert "nothing to save" in account.block()
    assert account.badput_seconds["other"] == pytest.approx(1.0)  # the supervisor's start, before the child


def test_only_the_newest_job_in_a_file_is_accounted():
    first = crashed_and_resumed_job()
    later = [rec("job", 100.0), rec("process", 101.0, started=100.5, step=0),
             rec("steps", 111.0, first=0, last=10, seconds=10.0), rec("end", 111.0, how="done", step=10)]
    account = goodput.account(first + later)
    assert account.processes == 1 and account.steps_kept == 10 and account.elapsed_seconds == 11.0


RECORD = st.one_of(
    st.builds(lambda s, st_, r: ("process", {"started": s, "step": st_, "restore": r}),
              st.floats(0, 5), st.integers(0, 300), st.floats(0, 2)),
    st.builds(lambda c, s: ("span", {"cause": c, "seconds": s}),
              st.sampled_from(sorted(goodput.SPAN_CAUSES - {"startup", "checkpoint_restore"})), st.floats(0, 3)),
    st.builds(lambda n, s, c: ("steps", {"n": n, "seconds": s, "compile": c}),
              st.integers(1, 100), st.floats(0, 20), st.floats(0, 25)),
    st.builds(lambda k, ahead: ("action", {"kind": k, "ahead": ahead}),
              st.sampled_from(["checkpoint_reinit", "checkpoint_restart"]), st.one_of(st.none(), st.integers(0, 400))),
)


def job_from(plan) -> list[dict]:
    """Well-formed records on a clock that only moves forward, as the writer produces them."""
    t, step, records = 0.0, 0, []
    for kind, fields in plan:
        if kind == "process":
            t += fields["started"]
            step = min(step, fields["step"])  # a process resumes from a checkpoint at or before the newest step
            records.append(rec("process", t, started=t, step=step, checkpoint_every=50))
            records.append(rec("span", t + fields["restore"], cause="checkpoint_restore", seconds=fields["restore"]))
            t += fields["restore"]
        elif not records:
            continue
        elif kind == "span":
            t += fields["seconds"]
            records.append(rec("span", t, cause=fields["cause"], seconds=fields["seconds"], step=step))
        elif kind == "steps":
            t += fields["seconds"]
            records.append(rec("steps", t, first=step, last=step + fields["n"], seconds=fields["seconds"],
                               compile_seconds=fields["compile"]))
            step += fields["n"]
        else:
            oom = None if fields["ahead"] is None else step + fields["ahead"]
            records.append(rec("action", t, kind=fields["kind"], step=step, projected_oom_step=oom))
    return records


@settings(max_examples=200, deadline=None)
@given(st.lists(RECORD, max_size=30))
def test_goodput_and_the_causes_always_add_up_to_the_elapsed_time(plan):
    records = job_from(plan)
    account = goodput.account(records)
    total = account.productive_seconds + sum(account.badput_seconds.values())
    assert total == pytest.approx(account.elapsed_seconds, abs=1e-6)
    assert account.productive_seconds >= -1e-9 and all(
        s >= -1e-9 for cause, s in account.badput_seconds.items() if cause != "other")
    assert account.badput_seconds["other"] == pytest.approx(0.0, abs=1e-6)  # a writer's records explain every second
    last = max((r["last"] for r in records if r["event"] == "steps"), default=0)
    newest_start = max((r["step"] for r in records if r["event"] == "process"), default=0)
    assert account.steps_kept <= max(last, newest_start)
    assert all(a.cost_seconds >= 0 for a in account.actions)
    json.dumps(account.fields())  # serialisable as `goodput --json` prints it


# ---- the file ---------------------------------------------------------------------------------

def test_a_torn_last_line_is_skipped_and_any_other_bad_line_is_a_one_line_error():
    good = json.dumps(rec("end", 1.0, how="done", step=0)) + "\n"
    assert len(list(goodput.parse_lines([good, '{"v": 1, "ev']))) == 1
    with pytest.raises(InputError, match=r"job:2: not a JSON line"):
        list(goodput.parse_lines([good, "step,timestamp\n", good], "job"))
    with pytest.raises(InputError, match="not a job record of version 1"):
        list(goodput.parse_lines(['{"v": 9, "event": "end"}\n'], "job"))
    with pytest.raises(InputError, match="longer than"):
        list(goodput.parse_lines(["{" + " " * goodput.MAX_LINE_CHARS + "}\n"], "job"))


def test_the_ledger_partitions_a_process_into_steps_and_spans_and_the_next_process_continues_the_file(tmp_path):
    path = tmp_path / "run.csv.job.jsonl"
    start_job(path)
    telemetry = Telemetry()
    compiled = [1.0]  # XLA's total compile time in this process, read by the ledger
    ledger = JobLedger(path, checkpoint_every=2, flush_seconds=3600, compile_seconds=lambda: compiled[0],
                       telemetry=telemetry)
    ledger.begin(0)
    compiled[0] = 1.25  # the first step compiles
    for step in range(1, 3):
        ledger.step_done(step)
    with ledger.span("checkpoint_save", 2):
        pass
    ledger.action("checkpoint_restart", 2, projected_oom_step=40)
    ledger.end("restart", 2)
    with path.open("a") as handle:
        handle.write('{"v": 1, "event": "steps", "fi')  # a process killed mid-line
    second = JobLedger(path, flush_seconds=3600)  # the torn line is cut before the next process appends
    second.begin(2, restore_seconds=0.1)
    second.step_done(3)
    second.end("done", 3)
    records = goodput.read(path)
    assert [r["event"] for r in records] == ["job", "process", "span", "steps", "span", "action", "end",
                                             "process", "span", "span", "steps", "end"]
    first_steps = records[3]
    assert (first_steps["first"], first_steps["last"], first_steps["compile_seconds"]) == (0, 2, 0.25)
    account = goodput.account(records)
    assert account.processes == 2 and account.steps_kept == 3 and account.ended == "done"
    live = telemetry.part(GoodputFigures).account
    assert live is not None and live.steps_kept == 2  # the live account, first process
    for record in records:  # the writer writes what its readers check (`goodput.FIELDS`), nothing else
        assert set(record) - {"v", "event"} <= {"t", *goodput.FIELDS.get(record["event"], {})}, record


def test_a_job_file_that_cannot_be_written_never_reaches_training(tmp_path, events):
    blocked = tmp_path / "file"
    blocked.write_text("")
    ledger = JobLedger(blocked / "job.jsonl")  # its folder is a file: every write fails
    ledger.begin(0)
    ledger.step_done(1)
    ledger.end("done", 1)
    assert len(events.named("job_file_write_failed")) == 1
    assert ledger.account().steps_kept == 1  # kept in memory, for /metrics


def test_the_job_series_are_served_by_cause_and_absent_without_a_job_file():
    telemetry = Telemetry(device="xla:0")

    def served():
        registry = CollectorRegistry()
        registry.register(TelemetryCollector(telemetry))
        text = generate_latest(registry).decode()
        return {(s.name, s.labels.get("cause")): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    assert not any(name.startswith("hbmwatch_goodput") for name, _ in served())
    telemetry.part(GoodputFigures).account = goodput.account(crashed_and_resumed_job())
    samples = served()
    assert samples[("hbmwatch_goodput_seconds_total", None)] == pytest.approx(37.0)
    assert samples[("hbmwatch_elapsed_seconds_total", None)] == 81.0
    assert samples[("hbmwatch_badput_seconds_total", "redone")] == pytest.approx(10.0)
    assert {cause for name, cause in samples if name == "hbmwatch_badput_seconds_total"} == set(goodput.CAUSES)


# ---- the command ------------------------------------------------------------------------------

def test_goodput_reads_the_job_file_beside_a_trace_and_says_where_the_time_went(tmp_path, capsys):
    trace = tmp_path / "run.csv"
    trace.write_text("step,timestamp,bytes_used,bytes_limit,peak_bytes_used,phase\n")
    with open(goodput.path_beside(trace), "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in crashed_and_resumed_job())
    assert main(["goodput", str(trace), "--json"]) == 0
    fields = json.loads(capsys.readouterr().out)
    assert fields["goodput"] == round(37 / 81, 4) and fields["steps_redone"] == 50
    assert set(fields["badput_seconds"]) == set(goodput.CAUSES)
    assert main(["goodput", goodput.path_beside(trace)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("goodput: 45.7% of 81.0 s elapsed") and "steps redone after a restart" in text


@pytest.mark.parametrize("content, message", [
    (None, "no such file, and no job file beside it"),
    ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n", "no job file beside this trace"),
    ("", "no process recorded"),
])
def test_goodput_refuses_what_is_not_a_job_in_one_line(tmp_path, capsys, content, message):
    path = tmp_path / ("run.csv" if content and content.startswith("step") else "job.jsonl")
    if content is not None:
        path.write_text(content)
    assert main(["goodput", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_infinite_or_missing_numbers_in_a_record_are_read_as_nothing_not_as_time():
    records = crashed_and_resumed_job()
    records.insert(3, rec("span", 26.0, cause="eval", seconds=math.inf, step=100))
    records.insert(3, rec("span", 26.0, cause="eval", step=100))
    account = goodput.account(records)
    assert account.badput_seconds["eval"] == 0.0


def test_a_reinit_escalated_to_a_restart_before_its_oom_counts_that_crash_once_at_the_restart():
    records = [
        rec("process", 1.0, started=0.0, step=0, checkpoint_every=0),
        rec("steps", 11.0, first=0, last=1000, seconds=10.0),
        rec("action", 11.0, kind="checkpoint_reinit", step=1000, projected_oom_step=1300),
        rec("span", 11.5, cause="checkpoint_save", seconds=0.5, step=1000),
        rec("span", 12.0, cause="reinit", seconds=0.5, step=1000),
        rec("steps", 12.1, first=1000, last=1010, seconds=0.1),
        rec("action", 12.1, kind="checkpoint_restart", step=1010, projected_oom_step=1300),
        rec("span", 12.6, cause="checkpoint_save", seconds=0.5, step=1010),
        rec("end", 12.6, how="restart", step=1010),
    ]
    reinit, restart = goodput.account(records).actions
    assert reinit.escalated_at == 1010 and reinit.crash_cost_seconds is None and reinit.cost_seconds == 1.0
    assert restart.escalated_at is None and restart.crash_lost_steps == 1300  # no checkpoint before it: from 0
    assert "the action at step 1010 answered the same OOM" in goodput.account(records).block()


def test_supervise_refuses_a_job_file_that_is_not_a_regular_file_in_one_line(capsys):
    assert main(["supervise", "--job-file", "/dev/null", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "--job-file" in err and "not a regular file" in err and err.count("\n") == 1


def test_an_action_against_an_oom_past_the_jobs_last_step_saved_nothing():
    """Seen in `bench --endurance`: a restart 133 steps before the end of an 80,000-step job, against
    an OOM projected at step 82,777."""
    records = [
        rec("process", 1.0, started=0.0, step=0),
        rec("steps", 11.0, first=0, last=990, seconds=10.0),
        rec("action", 11.0, kind="checkpoint_reinit", step=990, projected_oom_step=1200),
        rec("span", 11.5, cause="checkpoint_save", seconds=0.5, step=990),
        rec("span", 12.0, cause="reinit", seconds=0.5, step=990),
        rec("steps", 12.1, first=990, last=1000, seconds=0.1),
        rec("end", 12.1, how="done", step=1000),
    ]
    (action,) = goodput.account(records).actions
    assert action.job_ended_first and action.crash_cost_seconds is None and action.cost_seconds == 1.0
    assert "the job ended before the OOM it projected at step 1200" in goodput.account(records).block()


@pytest.mark.slow
def test_a_process_starts_after_it_was_asked_for_and_before_its_first_line():
    """A restart's disruption is the gap from the old process's last line to the new one's start: a
    start read a second early (psutil adds the boot time in whole seconds) made that gap 0."""
    import subprocess
    import sys
    import time

    from conftest import REPO, hbm_watchdog_env

    asked = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; now = time.time(); "
                          "from watchdog.records.job_ledger import process_started; print(process_started(), now)"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=hbm_watchdog_env())
    started, first_line = map(float, out.stdout.split())
    assert asked - 0.02 <= started <= first_line, (asked, started, first_line)  # /proc's clocks tick in 10 ms


def test_a_version_written_as_true_is_no_version():
    """Issue 53: `{"v": true, ...}` was taken as version 1 (`True == 1` in Python)."""
    assert goodput.is_record({"v": 1, "event": "job"})
    assert not goodput.is_record({"v": True, "event": "job"}) and not goodput.is_record({"v": 1.0, "event": "job"})


def test_a_restart_that_resumed_from_an_old_checkpoint_and_died_redoes_nothing_of_the_timeline():
    """The probe (W03): P1 trains 0-100 and saves; P2 starts from step 0 (its load failed) and dies
    before a step; P3 resumes from P1's step 100 and trains to 200. Nothing was redone: P2 is off the
    timeline that ended the job. (It read 100 steps redone, 41.7% goodput.)"""
    records = [rec("job", 0.0), rec("process", 0.0, pid=11, started=0.0, step=0, checkpoint_every=100),
               rec("steps", 100.0, first=0, last=100, seconds=100.0, compile_seconds=0.0),
               rec("end", 100.0, how="error", step=100),
               rec("process", 110.0, pid=12, started=110.0, step=0, checkpoint_every=100),
               rec("end", 115.0, how="error", step=0),
               rec("process", 120.0, pid=13, started=120.0, step=100, checkpoint_every=100),
               rec("steps", 220.0, first=100, last=200, seconds=100.0, compile_seconds=0.0),
               rec("end", 220.0, how="done", step=200)]
    account = goodput.account(records)
    assert (account.steps_kept, account.steps_redone) == (200, 0)
    # ... while one that did train from step 0, off the timeline, redid what it trained
    records[5:5] = [rec("steps", 114.0, first=0, last=30, seconds=4.0, compile_seconds=0.0)]
    account = goodput.account(records)
    assert (account.steps_kept, account.steps_redone) == (200, 30)


def test_a_loop_of_ones_own_keeps_its_share_of_the_job_file_through_its_watchdog(tmp_path, monkeypatch):
    """Issue 63, item 5: `supervise --job-file` then `goodput` said "no process recorded in it" for
    any loop but the trainer. Now the `Watchdog` keeps the account for whatever drives it: the
    process from its first step (resumed at 10), its steps, an evaluation as a span and not as
    steps, the action with its save and rebuild (through `carry_out`), and how it ended."""
    import time

    from watchdog.core.config import WatchdogConfig
    from watchdog.core.verdict import Action
    from watchdog.runtime.sidecar import Watchdog

    path = tmp_path / "job.jsonl"
    monkeypatch.setenv("HBMWATCH_JOB_FILE", str(path))
    config = WatchdogConfig(sample_every=5, source="rss", memory_limit_bytes=1 << 40, host_memory=False,
                            forensics=False, forced_actions=((30, Action.CHECKPOINT_REINIT),))
    with Watchdog(config) as wd:
        counter = 10
        while counter <= 60:
            action = wd.step(counter)
            if action is not None:
                wd.carry_out(action, save=lambda: time.sleep(0.05) or "ckpt.pt", rebuild=lambda: time.sleep(0.05))
            if counter == 40:
                with wd.phase("eval", steps=5):
                    for _ in range(5):
                        time.sleep(0.02)
                        counter += 1
                        wd.step(counter)
            if counter == 55:  # the loop's own save, under the phase a save runs in
                with wd.phase("save"):
                    time.sleep(0.05)
            counter += 1
    records = goodput.read(path)
    assert [r["event"] for r in records if r["event"] != "steps"] == [
        "process", "span", "action", "span", "span", "span", "span", "end"], records
    # the writer writes only what the readers' one list of fields names (issue 59)
    assert all(set(r) - {"v", "event", "t"} <= set(goodput.FIELDS.get(r["event"], {})) for r in records), records
    process, startup, action, save, reinit, evaluation, own_save, end = (r for r in records if r["event"] != "steps")
    assert own_save["cause"] == "checkpoint_save" and own_save["seconds"] >= 0.05, "a save's phase is no evaluation"
    assert process["step"] == 10 and startup["cause"] == "startup"
    assert (action["kind"], action["step"], save["cause"], reinit["cause"]) == ("checkpoint_reinit", 31,
                                                                              "checkpoint_save", "reinit")
    assert save["seconds"] >= 0.05 and reinit["seconds"] >= 0.05
    assert evaluation["cause"] == "eval" and evaluation["seconds"] >= 0.1 and evaluation["step"] == 46
    assert (end["how"], end["step"]) == ("done", 61)
    account = goodput.account(records)
    assert account.processes == 1 and account.reinits == 1 and account.ended == "done"
    assert account.steps_kept == (41 - 10) + (61 - 46), "the evaluation's five batches are no training steps"
    assert account.badput_seconds["checkpoint_save"] >= 0.1
    assert [a.kind for a in account.actions] == ["checkpoint_reinit"]
    assert account.productive_seconds + sum(account.badput_seconds.values()) == pytest.approx(account.elapsed_seconds)


def test_a_process_whose_own_ledger_keeps_the_job_file_gets_no_second_account_from_its_watchdog(tmp_path,
                                                                                            monkeypatch):
    """The instrumented trainer writes its own ledger (training steps, restores, periodic saves) and
    drives a `Watchdog` too: one process, one `process` record."""
    from watchdog.core.config import WatchdogConfig
    from watchdog.runtime.sidecar import Watchdog

    path = tmp_path / "job.jsonl"
    monkeypatch.setenv("HBMWATCH_JOB_FILE", str(path))
    with Watchdog(WatchdogConfig(sample_every=5, source="rss", memory_limit_bytes=1 << 40, host_memory=False,
                                 forensics=False)) as wd:
        trainers = JobLedger(path)
        trainers.begin(0)  # after the watchdog started, before its first step: as the trainer does
        for step in range(20):
            wd.step(step)
        trainers.end("done", 20)
    assert [r["event"] for r in goodput.read(path)].count("process") == 1


def test_processes_watched_from_outside_are_counted_with_the_time_between_them_and_no_goodput_is_made_up():
    """Issue 63, item 5: a script that cannot change, under `supervise --job-file` and `watch`: the
    daemon records each process it watched (`by`: "watch"), which says when it ran and how it
    ended, never its steps. `goodput` then counts the processes, the restarts and the time between
    them, and says n/a for the share it cannot know, rather than 0%."""
    records = [rec("job", 0.0),
               rec("process", 10.0, started=0.5, step=0, pid=11, by="watch"), rec("end", 10.0, how="signalled", step=0),
               rec("process", 25.0, started=12.0, step=0, pid=12, by="watch"), rec("end", 25.0, how="exit", step=0)]
    account = goodput.account(records)
    assert (account.processes, account.restarts, account.outside_processes, account.goodput) == (2, 1, 2, None)
    assert account.badput_seconds["disruption"] == pytest.approx(2.0) and account.elapsed_seconds == 25.0
    assert account.ended == "exit" and account.fields()["goodput"] is None
    assert "goodput: n/a of 25.0 s elapsed (2 processes" in account.block()
    assert "2 watched from outside by `watch`, which sees no steps" in account.block()


def test_watch_never_brings_back_the_folder_of_a_job_file_that_went_with_its_job(tmp_path, events):
    """`watch` records the process it saw exit in the job file supervise named; when supervise has
    already removed its temporary folder (the job is over), the folder is not made again: 49 of them
    were left in /tmp by one day's runs, each holding only the daemon's late lines."""
    import os

    from watchdog.daemon.job_file import TargetAccount

    folder = tmp_path / "hbm-watchdog-job-x"
    folder.mkdir()
    start_job(folder / "job.job.jsonl")
    account = TargetAccount(folder / "job.job.jsonl", os.getpid(), 0.0)
    account.record(signalled=False, exited=False)
    assert [r["event"] for r in goodput.read(folder / "job.job.jsonl")] == ["job", "process"]
    (folder / "job.job.jsonl").unlink()
    folder.rmdir()
    account.record(signalled=True, exited=True)
    assert not folder.exists()
    assert events.named("job_file_gone") and not events.named("job_file_not_written")


def test_the_oom_an_action_was_decided_against_is_counted_in_the_job_files_steps():
    """One rule for every writer of the job file (the action path's account, the trainer's ledger):
    the steps the verdict projected past its own step, counted from the steps done at the hand-over."""
    verdict = Verdict(step=100, timestamp=0.0, status=Status.OOM_PROJECTED, projected_oom_step=350.4)
    assert projected_oom(101, verdict) == 351
    assert projected_oom(101, verdict._replace(projected_oom_step=90.0)) == 101, "never before the hand-over"
    assert projected_oom(101, verdict._replace(projected_oom_step=math.inf)) is None
    assert projected_oom(101, verdict._replace(projected_oom_step=None)) is None
    assert projected_oom(101, None) is None
