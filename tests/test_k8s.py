"""Kubernetes manifests: they parse, the generated rule objects match rules.yml, ports are safe,
and exit status 42 restarts the slice while any other failure ends the JobSet."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from watchdog.core.errors import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_RESTART_REQUESTED
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


def jobset_outcome(exit_code: int | None, disrupted: bool = False) -> str:
    """What Kubernetes does with a failed trainer pod, following the manifests' own rules:
    the Job's podFailurePolicy (first matching rule), then the JobSet's failurePolicy."""
    action = "Count"  # no rule matched: counted against backoffLimit
    for rule in JOB["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and codes.get("containerName", TRAINER["name"]) == TRAINER["name"]:
            inside = exit_code in codes["values"]
            if inside == (codes["operator"] == "In"):
                action = rule["action"]
                break
        if disrupted and any(c["type"] == "DisruptionTarget" and c["status"] == "True"
                             for c in rule.get("onPodConditions", [])):
            action = rule["action"]
            break
    if action == "Ignore":
        return "pod replaced"
    if action == "Count" and JOB["backoffLimit"] > 0:
        return "pod retried"
    reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
    for rule in JOBSET["spec"]["failurePolicy"].get("rules", []):
        if reason in rule.get("onJobFailureReasons", [reason]):
            return {"FailJobSet": "jobset failed", "RestartJobSet": "slice restarted",
                    "RestartJobSetAndIgnoreMaxRestarts": "slice restarted"}[rule["action"]]
    return "slice restarted"  # the JobSet default: RestartJobSet


def test_exit_42_restarts_the_whole_slice_and_other_failures_end_the_jobset():
    assert POD["spec"]["restartPolicy"] == "Never"  # required by podFailurePolicy
    assert jobset_outcome(EXIT_RESTART_REQUESTED) == "slice restarted"
    assert jobset_outcome(EXIT_PEER_LOST) == "slice restarted", "a host lost during an agreement: restart whole"
    assert jobset_outcome(None, disrupted=True) == "slice restarted"
    for code in (1, EXIT_BAD_INPUT, 137, 255):
        assert jobset_outcome(code) == "jobset failed", code
    # the JobSet's restart budget covers the watchdog's own restart budget
    assert JOBSET["spec"]["failurePolicy"]["maxRestarts"] >= PolicyConfig().max_restarts


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
