"""Kubernetes manifests: they parse, the generated rule objects match rules.yml, ports are safe,
exit status 42 restarts the slice without spending the JobSet's restart budget while a crash ends
the JobSet, and every JobSet is valid against the upstream CRD (tests/data)."""

from __future__ import annotations

import copy
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from watchdog.core.errors import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_RESTART_REQUESTED, EXIT_UNSAVED
from watchdog.core.policy import PolicyConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "k8s"
TPU_RESERVED_PORTS = {8431, 8471, *range(8476, 8480)}  # libtpu metrics, TPU runtime
IANA_SVC_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def documents() -> dict[str, dict]:
    found = {}
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path
            found[doc["kind"]] = doc
    return found


DOCS = documents()
JOBSET = DOCS["JobSet"]
(REPLICATED,) = JOBSET["spec"]["replicatedJobs"]
JOB = REPLICATED["template"]["spec"]
POD = JOB["template"]
(TRAINER,) = POD["spec"]["containers"]
ARGS = dict((a.removeprefix("--").split("=", 1) + [""])[:2] for a in TRAINER["args"])  # a bare flag: ""


def test_every_kind_is_shipped():
    assert {"JobSet", "PodMonitoring", "PodMonitor", "PrometheusRule", "Rules"} <= set(DOCS)


@pytest.mark.slow
def test_generated_rule_objects_are_up_to_date_and_match_rules_yml():
    out = subprocess.run([sys.executable, str(K8S / "render_rules.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    source = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    assert DOCS["PrometheusRule"]["spec"]["groups"] == source
    gmp = DOCS["Rules"]["spec"]["groups"]
    assert [{k: v for k, v in g.items() if k != "interval"} for g in gmp] == source
    assert all(g["interval"] for g in gmp)


def test_metrics_ports_are_named_one_per_process_and_clear_of_the_tpu_runtime():
    ports = TRAINER["ports"]
    names = [p["name"] for p in ports]
    numbers = [p["containerPort"] for p in ports]
    assert len(set(names)) == len(names) and len(set(numbers)) == len(numbers)
    assert all(len(n) <= 15 and IANA_SVC_NAME.match(n) for n in names), names
    assert not set(numbers) & TPU_RESERVED_PORTS
    base = int(ARGS["metrics-port"])
    processes_per_host = 1 if "spmd" in ARGS else int(ARGS.get("num-devices", 1))
    assert numbers == [base + rank for rank in range(processes_per_host)]  # serve_metrics binds base + local rank
    assert names[0] == "metrics"
    assert ARGS["metrics-address"] == "0.0.0.0"  # Prometheus scrapes the pod IP; the default is loopback


def test_tpu_slice_scheduling():
    selector = POD["spec"]["nodeSelector"]
    assert selector["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
    rows, cols = map(int, selector["cloud.google.com/gke-tpu-topology"].split("x"))
    chips_per_host = int(TRAINER["resources"]["limits"]["google.com/tpu"])
    assert TRAINER["resources"]["requests"]["google.com/tpu"] == chips_per_host
    assert JOB["parallelism"] == JOB["completions"] == rows * cols // chips_per_host  # one pod per host


def test_spmd_one_process_per_host_joined_from_the_jobsets_environment():
    """--spmd drives every chip of a host from one process; the hosts find each other through the
    JobSet: rank = completion index, world size = parallelism, address = the coordinator pod."""
    assert "spmd" in ARGS and "num-devices" not in ARGS
    env = {e["name"]: e for e in TRAINER["env"]}
    assert int(env["WORLD_SIZE"]["value"]) == JOB["parallelism"]
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/job-completion-index']")
    assert env["MASTER_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['jobset.sigs.k8s.io/coordinator']")
    coordinator = JOBSET["spec"]["coordinator"]
    assert coordinator["replicatedJob"] == REPLICATED["name"] and coordinator["podIndex"] == 0
    assert int(env["MASTER_PORT"]["value"]) not in TPU_RESERVED_PORTS | {int(ARGS["metrics-port"])}
    assert "$(HOST_INDEX)" in ARGS["trace-file"]  # one trace per host: every host watches its own chips


def test_trainer_resumes_from_checkpoints_on_the_persistent_volume():
    assert TRAINER["command"][0] == "hbm-watchdog" and "train" in TRAINER["command"]
    assert ARGS["resume"] == "auto"
    mounts = {m["mountPath"]: m["name"] for m in TRAINER["volumeMounts"]}
    (mount,) = [path for path in mounts if ARGS["checkpoint-dir"].startswith(path + "/")]
    volumes = {v["name"]: v for v in POD["spec"]["volumes"]}
    assert volumes[mounts[mount]]["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    env = {e["name"]: e for e in TRAINER["env"]}
    assert "restart-attempt" in env["HBMWATCH_RESTART_COUNT"]["valueFrom"]["fieldRef"]["fieldPath"]


# -- the restart path: the Job controller's podFailurePolicy, then the JobSet's failurePolicy ----------

POD_NAME = "default/hbm-watchdog-train-slice-0-2-x7k2p"  # namespace/name, as the Job controller writes it
OUTCOMES = {"FailJobSet": "jobset failed", "RestartJobSet": "slice restarted, budget spent",
            "RestartJobSetAndIgnoreMaxRestarts": "slice restarted, budget kept",
            "RestartJob": "job restarted, budget spent", "RestartJobAndIgnoreMaxRestarts": "job restarted, budget kept"}


def pod_failure(exit_code: int | None, disrupted: bool = False) -> tuple[str, str | None]:
    """One failed trainer pod against the Job's podFailurePolicy, as Kubernetes' Job controller
    matches it (pkg/controller/job/pod_failure_policy.go): the first rule that matches gives the
    action, and a FailJob rule the Job's failure message. exit_code None: the container left no
    exit code (its node was lost); 0 is never matched."""
    for index, rule in enumerate(JOB["podFailurePolicy"]["rules"]):
        codes, conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
        if codes is not None:
            if not exit_code or codes.get("containerName", TRAINER["name"]) != TRAINER["name"]:
                continue
            if (exit_code in codes["values"]) != (codes["operator"] == "In"):
                continue
            message = (f"Container {TRAINER['name']} for pod {POD_NAME} failed with exit code {exit_code} "
                       f"matching {rule['action']} rule at index {index}")
        elif disrupted and any(c["type"] == "DisruptionTarget" and c["status"] == "True" for c in conditions):
            message = f"Pod {POD_NAME} has condition DisruptionTarget matching {rule['action']} rule at index {index}"
        else:
            continue
        return rule["action"], message if rule["action"] == "FailJob" else None
    return "Count", None


def job_failure(pods: list[tuple[int | None, bool]]) -> tuple[str, str] | None:
    """The Job's Failed condition (reason, message) once these pods have failed, seen in one pass:
    any pod matching FailJob fails the Job first (reason PodFailurePolicy, that pod's message);
    else pods counted past backoffLimit fail it (BackoffLimitExceeded). None: the Job goes on."""
    failures = [pod_failure(code, disrupted) for code, disrupted in pods]
    for action, message in failures:
        if action == "FailJob":
            return "PodFailurePolicy", message
    if sum(action != "Ignore" for action, _ in failures) > JOB["backoffLimit"]:
        return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    return None


def jobset_outcome(exit_code: int | None, disrupted: bool = False,
                   peers: tuple[tuple[int | None, bool], ...] = ()) -> str:
    """What Kubernetes does when a trainer pod fails (and `peers`, other hosts, in the same pass),
    following the manifest's own rules: the Job's podFailurePolicy, then the JobSet's failurePolicy
    rules in order (reasons, RE2 message patterns searched unanchored, target replicated jobs),
    else the JobSet's default, RestartJobSet."""
    failure = job_failure([(exit_code, disrupted), *peers])
    if failure is None:
        return "pod replaced"
    reason, message = failure
    for rule in JOBSET["spec"]["failurePolicy"].get("rules", []):
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        patterns = rule.get("onJobFailureMessagePatterns")
        if patterns and not any(re.search(pattern, message) for pattern in patterns):
            continue
        if rule.get("targetReplicatedJobs") and REPLICATED["name"] not in rule["targetReplicatedJobs"]:
            continue
        return OUTCOMES[rule["action"]]
    return OUTCOMES["RestartJobSet"]


def test_the_watchdogs_restart_keeps_the_jobsets_budget_and_other_failures_end_the_jobset():
    assert POD["spec"]["restartPolicy"] == "Never"  # required by podFailurePolicy
    assert JOB["backoffLimit"] == 0  # one counted pod fails the Job: the JobSet restarts the slice whole
    # 42: every host saved and asks for a restart; the watchdog's own budget bounds these
    assert jobset_outcome(EXIT_RESTART_REQUESTED) == "slice restarted, budget kept"
    every_host = tuple((EXIT_RESTART_REQUESTED, False) for _ in range(JOB["parallelism"] - 1))
    assert jobset_outcome(EXIT_RESTART_REQUESTED, peers=every_host) == "slice restarted, budget kept"
    assert PolicyConfig().max_restarts > 0 and PolicyConfig().restart_window_steps > 0
    # 43: no budget of the watchdog's bounds it, so it spends the JobSet's
    assert jobset_outcome(EXIT_PEER_LOST) == "slice restarted, budget spent"
    # 44: a restart whose checkpoint the disk refused saved nothing: a full store would loop, so it spends it
    assert jobset_outcome(EXIT_UNSAVED) == "slice restarted, budget spent"
    # preempted or drained, with or without an exit code: spent
    assert jobset_outcome(None, disrupted=True) == "slice restarted, budget spent"
    assert jobset_outcome(EXIT_RESTART_REQUESTED, disrupted=True) == "slice restarted, budget spent"
    assert jobset_outcome(143, disrupted=True) == "slice restarted, budget spent"
    # ...unless the other hosts' 42 (the trainer saves on SIGTERM) is seen in the same pass: FailJob
    # wins over the backoff limit, and that restart keeps the budget (the manifest's header says so)
    assert jobset_outcome(EXIT_RESTART_REQUESTED, disrupted=True, peers=every_host) == "slice restarted, budget kept"
    for code in (1, EXIT_BAD_INPUT, 137, 255):
        assert jobset_outcome(code) == "jobset failed", code
        # a crashed host and the others' 43 in the same pass: the crash decides, never a restart
        hosts_lost = tuple((EXIT_PEER_LOST, False) for _ in range(JOB["parallelism"] - 1))
        assert jobset_outcome(EXIT_PEER_LOST, peers=((code, False), *hosts_lost[1:])) == "jobset failed", code
    assert JOBSET["spec"]["failurePolicy"]["maxRestarts"] > 0  # disruptions and 43 have room


def test_the_restart_rule_matches_only_the_job_controllers_message_for_exit_42():
    """The message pattern is searched in exactly what the Job controller writes; another exit code,
    container or a pod condition does not match it."""
    (rule,) = [r for r in JOBSET["spec"]["failurePolicy"]["rules"] if r["action"] == "RestartJobSetAndIgnoreMaxRestarts"]
    (pattern,) = rule["onJobFailureMessagePatterns"]
    index = next(i for i, r in enumerate(JOB["podFailurePolicy"]["rules"])
                 if r["action"] == "FailJob" and r.get("onExitCodes", {}).get("operator") == "In")
    said = "Container trainer for pod ml/hbm-watchdog-train-slice-0-3-4f2xz failed with exit code {} matching FailJob rule at index {}"
    assert re.search(pattern, said.format(42, index))
    for code in (4, 2, 43, 44, 142, 242):
        assert not re.search(pattern, said.format(code, index)), code
    assert not re.search(pattern, said.replace("trainer", "gke-gcsfuse-sidecar").format(42, index))
    assert not re.search(pattern, "Pod ml/p-42 has condition DisruptionTarget matching FailJob rule at index 0")
    assert pod_failure(EXIT_RESTART_REQUESTED)[1] == said.replace("ml/hbm-watchdog-train-slice-0-3-4f2xz", POD_NAME).format(42, index)
    rules = JOBSET["spec"]["failurePolicy"]["rules"]
    assert rules.index(rule) < next(i for i, r in enumerate(rules) if r["action"] == "FailJobSet")


# -- the JobSet against the upstream CRD (tests/data/jobset-crd-v0.12.0.yaml) -------------------------

CRD_FIXTURE = Path(__file__).resolve().parent / "data" / "jobset-crd-v0.12.0.yaml"
# the JobSet webhook's own checks of failurePolicy (pkg/webhooks/jobset_webhook.go, v0.12.0): not in the CRD
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}


def jobset_documents() -> list[tuple[str, dict]]:
    return [(f"{path.relative_to(K8S)}#{n}", doc) for path in sorted(K8S.rglob("*.yaml"))
            for n, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc["kind"] == "JobSet"]


def strict(schema):
    """The schema with unknown fields refused, as `kubectl apply` (strict field validation) does;
    jsonschema ignores Kubernetes' x-kubernetes-* extensions, and a field a schema leaves open
    (x-kubernetes-preserve-unknown-fields, additionalProperties) stays open."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "enum" or k == "default" else strict(v)) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: strict(s) for name, s in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator():
    jsonschema = pytest.importorskip("jsonschema")
    fixture = yaml.safe_load(CRD_FIXTURE.read_text())
    return jsonschema.Draft7Validator(strict(fixture["openAPIV3Schema"]))


def crd_errors(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator().iter_errors(doc)]


def webhook_errors(doc: dict) -> list[str]:
    errors = []
    names = {job["name"] for job in doc["spec"]["replicatedJobs"]}
    rules = doc["spec"].get("failurePolicy", {}).get("rules", [])
    seen = [rule["name"] for rule in rules]
    errors += [f"rule names are not unique: {n}" for n in sorted(set(seen)) if seen.count(n) > 1]
    for rule in rules:
        if not (1 <= len(rule["name"]) <= 128 and RULE_NAME.match(rule["name"])):
            errors.append(f"invalid failure policy rule name {rule['name']!r}")
        errors += [f"unknown replicatedJob {j!r}" for j in rule.get("targetReplicatedJobs", []) if j not in names]
        errors += [f"unknown job failure reason {r!r}" for r in rule.get("onJobFailureReasons", [])
                   if r not in JOB_FAILURE_REASONS]
        for pattern in rule.get("onJobFailureMessagePatterns", []):
            try:
                re.compile(pattern)  # Python's re stands in for RE2 on this simple syntax
            except re.error as exc:
                errors.append(f"pattern {pattern!r}: {exc}")
    return errors


def test_every_jobset_is_valid_against_the_upstream_crd():
    first_line = CRD_FIXTURE.read_text().splitlines()[0]
    assert "kubernetes-sigs/jobset v0.12.0" in first_line and "jobset.x-k8s.io_jobsets.yaml" in first_line
    shipped = jobset_documents()
    assert shipped
    for where, doc in shipped:
        assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2", where
        assert crd_errors(doc) == [], where
        assert webhook_errors(doc) == [], where


def test_the_crd_check_rejects_an_invalid_jobset():
    (_, doc), *_ = jobset_documents()
    bad_action = copy.deepcopy(doc)
    bad_action["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartSlice"
    assert any("failurePolicy.rules.0.action" in e and "is not one of" in e for e in crd_errors(bad_action))
    misspelt = copy.deepcopy(doc)
    rule = misspelt["spec"]["failurePolicy"]["rules"][0]
    rule["onJobFailureMessagePattern"] = rule.pop("onJobFailureMessagePatterns")
    assert any("onJobFailureMessagePattern" in e for e in crd_errors(misspelt))
    bad_count = copy.deepcopy(doc)
    bad_count["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] = ["42"]
    assert any("is not of type 'integer'" in e for e in crd_errors(bad_count))
    unnamed = copy.deepcopy(doc)
    del unnamed["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["name"]
    assert any("'name' is a required property" in e for e in crd_errors(unnamed))
    hyphenated = copy.deepcopy(doc)  # the name this manifest had before: the webhook refuses it
    hyphenated["spec"]["failurePolicy"]["rules"][1]["name"] = "fail-on-real-errors"
    assert crd_errors(hyphenated) == [] and webhook_errors(hyphenated)
    elsewhere = copy.deepcopy(doc)
    elsewhere["spec"]["failurePolicy"]["rules"][0]["targetReplicatedJobs"] = ["workers"]
    assert webhook_errors(elsewhere)


def test_scrape_configs_select_the_trainer_pods_and_their_named_ports():
    pod_labels = POD["metadata"]["labels"]
    port_names = {p["name"] for p in TRAINER["ports"]}
    gmp, operator = DOCS["PodMonitoring"], DOCS["PodMonitor"]
    for monitor, endpoints in ((gmp, gmp["spec"]["endpoints"]), (operator, operator["spec"]["podMetricsEndpoints"])):
        assert monitor["metadata"]["name"] == "hbm-watchdog"  # the job label the alert rules expect
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert {e["port"] for e in endpoints} == port_names


# -- hbm-watchdog watch beside a trainer that cannot change (watch-sidecar.yaml) --------------------

WATCHED_POD = DOCS["Job"]["spec"]["template"]
(WATCH_SIDECAR,) = WATCHED_POD["spec"]["initContainers"]
(WATCHED_TRAINER,) = WATCHED_POD["spec"]["containers"]
K8S_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def bytes_of(quantity: str) -> int:
    number, suffix = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * K8S_QUANTITY.get(suffix, 1)


def watch_args():
    """The sidecar's command line as our own CLI parses it, with the downward-API values filled in."""
    from watchdog.commands import watch
    from watchdog.commands.cli import build_parser

    env = {}
    for var in WATCH_SIDECAR["env"]:
        field = var["valueFrom"]["resourceFieldRef"]
        (source,) = [c for c in WATCHED_POD["spec"]["containers"] if c["name"] == field["containerName"]]
        env[var["name"]] = str(bytes_of(source["resources"]["limits"][field["resource"].split(".")[1]]))
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in WATCH_SIDECAR["args"]]
    command = WATCH_SIDECAR["command"]
    assert command[0] == "hbm-watchdog"
    parsed = build_parser().parse_args([*command[1:], *args])
    assert parsed.command == "watch"
    return parsed, watch.build(parsed)


def test_the_watch_sidecar_shares_the_trainers_processes_and_lives_as_long_as_it():
    spec = WATCHED_POD["spec"]
    assert spec["shareProcessNamespace"] is True
    assert WATCH_SIDECAR["restartPolicy"] == "Always"  # a native sidecar: stopped once the trainer is done
    assert spec["restartPolicy"] == "OnFailure"  # the trainer's preemption exit restarts it in place


def test_the_watch_sidecars_flags_are_valid_and_aim_at_the_trainer():
    parsed, (config, finder, _) = watch_args()
    trainer_command = " ".join([*WATCHED_TRAINER["command"], *WATCHED_TRAINER.get("args", [])])
    assert finder.regex.search(trainer_command), "the pattern must match the trainer's command line"
    assert config.memory_limit_bytes == bytes_of(WATCHED_TRAINER["resources"]["limits"]["memory"])
    assert config.act and config.signal.name == "SIGTERM"
    assert config.axis.checkpoint_seconds < WATCHED_POD["spec"]["terminationGracePeriodSeconds"]
    assert config.wait_seconds > 300, "longer than the kubelet's longest restart back-off"
    assert config.axis.warmup_seconds >= config.axis.interval_seconds


def test_the_watch_sidecar_serves_metrics_where_the_monitors_scrape():
    parsed, _ = watch_args()
    ports = {p["name"]: p["containerPort"] for p in WATCH_SIDECAR["ports"]}
    assert ports == {"metrics": parsed.metrics_port} and parsed.metrics_port not in TPU_RESERVED_PORTS
    assert parsed.metrics_address == "0.0.0.0"  # Prometheus scrapes the pod IP; the default is loopback
    labels = WATCHED_POD["metadata"]["labels"]
    for monitor in (DOCS["PodMonitoring"], DOCS["PodMonitor"]):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_watch_sidecar_may_signal_the_trainer():
    """Same user in both containers (or CAP_KILL): the kernel's rule for sending a signal."""
    def user(container):
        return container.get("securityContext", {}).get("runAsUser", WATCHED_POD["spec"]["securityContext"]["runAsUser"])

    caps = WATCH_SIDECAR.get("securityContext", {}).get("capabilities", {}).get("add", [])
    assert user(WATCH_SIDECAR) == user(WATCHED_TRAINER) or "KILL" in caps
