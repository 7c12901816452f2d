//! Kubernetes: plain manifests, one Deployment per process, pinned to its node.
//!
//! Why this exists: cloud serving runs on Kubernetes. The manifests (`kubernetes/*.yaml`,
//! applied with `kubectl apply -f`) are:
//! - `fabric.yaml`: a ConfigMap with the bundle's `fabric/` files (`launch.sh`, topology,
//!   model, placement), mounted at `/etc/expertmesh`;
//! - `credentials.yaml`: one Secret per process holding only that process's credential,
//!   mounted at `/var/run/expertmesh/credentials` (never the master key);
//! - `processes.yaml`: one Deployment per process (one replica, `Recreate`: two copies of a
//!   rank never run at once), pinned to its node by `kubernetes.io/hostname`, on the host's
//!   network (`hostNetwork`: the topology's addresses are the nodes', and RoCE needs it),
//!   running `sh /etc/expertmesh/launch.sh PROCESS` with the node name from the downward API
//!   (`EXPERTMESH_NODE`, checked by the script); probes: startup and liveness on `/live`,
//!   readiness on `/ready` (a router: every worker joined); GPU devices ask for one
//!   `--gpu-resource`, RDMA links for one `--rdma-resource` (with `IPC_LOCK`); the weights
//!   folder is a read-only `hostPath`; a worker's `--tile-cache` folder is an `emptyDir`
//!   (kept across the container's restarts; `launch.sh` makes it private) with `IPC_LOCK`
//!   to lock the tiles in memory; with `--run-as-user UID[:GID]` every pod runs as that user
//!   (`runAsNonRoot`), and a worker's tile cache folder, which the kubelet makes root's, is
//!   given to that user by an init container running as root (a non-root process cannot
//!   make root's folder private, and the worker refuses a folder others may write; the
//!   "restricted" Pod Security level refuses such an init container, and a non-root process
//!   gets no `IPC_LOCK`, so its tiles are copied unless its memlock limit allows locking);
//!   the credential Secret's files, which the kubelet makes root's, are copied by another init
//!   container into an in-memory emptyDir as that user's own (mode 0600) and mounted in its
//!   place; probes ask the process's topology address (`httpGet.host`);
//!   SIGTERM on termination drains (grace period 60 s);
//!   a change of placement, weights or arguments changes the pod template's
//!   `expertmesh.io/generation` annotation, so `kubectl apply` rolls exactly those pods;
//! - `services.yaml`: a Service per router (its frontend port) for frontends, and a
//!   PodDisruptionBudget per component (one pod of each at a time).

use super::{Plan, Role, Writer};
use crate::FabricError;
use serde_json::{Value, json};
use std::path::Path;

/// Where the ConfigMap is mounted in every container.
pub const CONFIG_DIR: &str = "/etc/expertmesh";
/// Where a process's credential Secret is mounted.
pub const CREDENTIALS_DIR: &str = "/var/run/expertmesh/credentials";

/// Kubernetes' settings.
#[derive(Debug, Clone)]
pub struct KubernetesOptions {
    /// Container image with the `expertmesh` binary (and `/bin/sh`).
    pub image: String,
    /// Namespace of every object (default: kubectl's).
    pub namespace: Option<String>,
    /// Extended resource a GPU device's pod asks for.
    pub gpu_resource: String,
    /// Extended resource a pod asks for when its links are RDMA (the RDMA device plugin's).
    pub rdma_resource: Option<String>,
    /// The user and group every pod runs as (`--run-as-user UID[:GID]`); `None`: the image's.
    pub run_as: Option<(u32, u32)>,
}

/// Write the manifests; the next steps.
pub(super) fn write(
    plan: &Plan,
    o: &KubernetesOptions,
    w: &mut Writer,
) -> Result<Vec<String>, FabricError> {
    if o.image.is_empty() {
        return Err(FabricError::Engine(
            "--image: give the container image that holds the expertmesh binary".into(),
        ));
    }
    for p in &plan.processes {
        for file in super::flag_values(&p.args, "--load-stats") {
            if load_stats_folder(p).is_none() {
                return Err(FabricError::Engine(format!(
                    "--load-stats {file}: give an absolute path in a folder of its own under \
                     Kubernetes (the folder becomes the pod's volume for it)"
                )));
            }
        }
    }
    let c = plan.cluster_label();
    let docs = [
        ("fabric.yaml", vec![config_map(plan, o)]),
        (
            "credentials.yaml",
            plan.processes
                .iter()
                .filter_map(|p| {
                    let text = plan.credentials.get(&p.name)?;
                    Some(secret(plan, o, &p.name, text))
                })
                .collect(),
        ),
        (
            "processes.yaml",
            plan.processes
                .iter()
                .map(|p| deployment(plan, o, p))
                .collect(),
        ),
        ("services.yaml", services(plan, o)),
    ];
    for (file, objects) in docs {
        if objects.is_empty() {
            continue;
        }
        let text = format!(
            "# ExpertMesh fabric {:?}, generation {}: written by `expertmesh deploy kubernetes`; do not edit.\n{}",
            plan.dep.topology.name(),
            plan.generation,
            super::yaml::documents(&objects)
        );
        // The Secrets' file holds credentials: readable by its owner only.
        let secret = file == "credentials.yaml";
        w.file(&Path::new("kubernetes").join(file), text.as_bytes(), secret)?;
    }
    let out = plan.opts.out.display();
    let ns = o
        .namespace
        .as_ref()
        .map_or_else(String::new, |n| format!(" -n {n}"));
    Ok(vec![
        "put each host's weights files where hosts/HOST.files lists (a read-only hostPath)".into(),
        format!("start:  kubectl apply -f {out}/kubernetes/"),
        format!(
            "ready:  kubectl{ns} wait --for=condition=Available deployment -l app.kubernetes.io/instance={c} --timeout=15m"
        ),
        format!(
            "use:    frontends connect to Service {c}-router-I (port of router I in the topology)"
        ),
        format!(
            "update: re-run deploy, then kubectl apply -f {out}/kubernetes/ (pods whose generation changed restart)"
        ),
        format!(
            "stop:   kubectl delete -f {out}/kubernetes/ (SIGTERM: routers drain, workers finish)"
        ),
    ])
}

/// Labels of every object of the fabric, plus those given.
fn labels(plan: &Plan, extra: &[(&str, &str)]) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("app.kubernetes.io/name".into(), json!("expertmesh"));
    m.insert(
        "app.kubernetes.io/instance".into(),
        json!(plan.cluster_label()),
    );
    for (k, v) in extra {
        m.insert((*k).into(), json!(v));
    }
    Value::Object(m)
}

fn metadata(plan: &Plan, o: &KubernetesOptions, name: &str, extra: &[(&str, &str)]) -> Value {
    let mut m = json!({ "name": name, "labels": labels(plan, extra) });
    if let Some(ns) = &o.namespace {
        m["namespace"] = json!(ns);
    }
    m
}

fn config_map(plan: &Plan, o: &KubernetesOptions) -> Value {
    let mut data = serde_json::Map::new();
    for (name, bytes) in &plan.fabric_files {
        data.insert(
            name.clone(),
            json!(String::from_utf8_lossy(bytes).into_owned()),
        );
    }
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(plan, o, &format!("{}-fabric", plan.cluster_label()), &[]),
        "data": data,
    })
}

fn secret(plan: &Plan, o: &KubernetesOptions, process: &str, text: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(
            plan,
            o,
            &format!("{}-{process}-credential", plan.cluster_label()),
            &[("expertmesh.io/process", process)],
        ),
        "type": "Opaque",
        "stringData": { format!("{process}.cred"): text },
    })
}

/// A process's environment, volume mounts and volumes: the ConfigMap at [`CONFIG_DIR`], its
/// credential Secret at [`CREDENTIALS_DIR`], the weights folder (read-only hostPath), and the
/// host's `/dev/shm` for shared-memory rings.
fn pod_files(
    plan: &Plan,
    o: &KubernetesOptions,
    p: &super::Process,
) -> (Vec<Value>, Vec<Value>, Vec<Value>) {
    let c = plan.cluster_label();
    let mut env = vec![
        json!({ "name": "EXPERTMESH_NODE", "valueFrom": { "fieldRef": { "fieldPath": "spec.nodeName" } } }),
        json!({ "name": "EXPERTMESH_BIN", "value": plan.opts.bin }),
    ];
    let mut mounts = vec![json!({ "name": "fabric", "mountPath": CONFIG_DIR, "readOnly": true })];
    let mut volumes =
        vec![json!({ "name": "fabric", "configMap": { "name": format!("{c}-fabric") } })];
    if plan.credentials.contains_key(&p.name) {
        env.push(json!({ "name": "EXPERTMESH_CREDENTIALS_DIR", "value": CREDENTIALS_DIR }));
        mounts
            .push(json!({ "name": "credential", "mountPath": CREDENTIALS_DIR, "readOnly": true }));
        let secret = json!({
            "secretName": format!("{c}-{}-credential", p.name),
            "defaultMode": 0o400,
        });
        if non_root(o).is_some() {
            // The kubelet makes a Secret's files root's: a copy the init container gives to
            // the pod's user (mode 0600, which the credential loader requires) is mounted.
            volumes.push(json!({ "name": "credential-secret", "secret": secret }));
            volumes.push(json!({ "name": "credential", "emptyDir": { "medium": "Memory" } }));
        } else {
            volumes.push(json!({ "name": "credential", "secret": secret }));
        }
    }
    if let super::Source::Weights { on_hosts, .. } = &plan.opts.source {
        mounts.push(json!({ "name": "weights", "mountPath": on_hosts, "readOnly": true }));
        volumes.push(
            json!({ "name": "weights", "hostPath": { "path": on_hosts, "type": "Directory" } }),
        );
    }
    // Shared-memory rings join processes of one host, each in a pod of its own (a node's
    // devices fan dispatches out over them, a router reaches its node's workers over them):
    // every pod mounts the host's /dev/shm, where one creates a ring file (0600, unlinked once
    // both ends have mapped it) and its peer opens it. A pod's own in-memory /dev/shm is
    // seen by no other pod: every such link fell back to TCP.
    mounts.push(json!({ "name": "dshm", "mountPath": "/dev/shm" }));
    volumes
        .push(json!({ "name": "dshm", "hostPath": { "path": "/dev/shm", "type": "Directory" } }));
    // A worker's tile cache outlives its container's restarts (not the pod's) in an emptyDir.
    if let Some(dir) = tile_cache(p) {
        mounts.push(json!({ "name": "tile-cache", "mountPath": dir }));
        volumes.push(json!({ "name": "tile-cache", "emptyDir": {} }));
    }
    // A router's load file likewise (the image's folders may not exist or be writable, and a
    // restarted container resumes the file): an emptyDir at its folder.
    if let Some(dir) = load_stats_folder(p) {
        mounts.push(json!({ "name": "load-stats", "mountPath": dir }));
        volumes.push(json!({ "name": "load-stats", "emptyDir": {} }));
    }
    (env, mounts, volumes)
}

/// With `--run-as-user`: the pod's security context (that user and group, not root unless
/// uid 0) and the init containers that give that user what the kubelet makes root's: a
/// worker's tile cache folder (an emptyDir, world-writable), made private, and the process's
/// credential (a Secret), copied into an in-memory emptyDir as the user's own, mode 0600.
/// Without: neither.
fn run_as(
    o: &KubernetesOptions,
    p: &super::Process,
    has_credential: bool,
) -> (Option<Value>, Vec<Value>) {
    let Some((uid, gid)) = o.run_as else {
        return (None, Vec::new());
    };
    let security = json!({ "runAsUser": uid, "runAsGroup": gid, "runAsNonRoot": uid != 0 });
    let as_root = json!({ "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": false });
    let mut init = Vec::new();
    if let Some(dir) = tile_cache(p).filter(|_| uid != 0) {
        init.push(json!({
            "name": "tile-cache-owner",
            "image": o.image,
            "command": ["/bin/sh", "-c", format!("chown {uid}:{gid} \"$0\" && chmod 700 \"$0\""), dir],
            "securityContext": as_root,
            "volumeMounts": [{ "name": "tile-cache", "mountPath": dir }],
        }));
    }
    if uid != 0 && has_credential {
        // The Secret's files (links into its data folder, root's) copied as that user's own.
        let from = format!("{CREDENTIALS_DIR}-secret");
        init.push(json!({
            "name": "credential-owner",
            "image": o.image,
            "command": [
                "/bin/sh", "-c",
                format!("cp -L \"$0\"/* \"$1\"/ && chown -R {uid}:{gid} \"$1\" && chmod 700 \"$1\" && chmod 600 \"$1\"/*"),
                from, CREDENTIALS_DIR,
            ],
            "securityContext": as_root,
            "volumeMounts": [
                { "name": "credential-secret", "mountPath": from, "readOnly": true },
                { "name": "credential", "mountPath": CREDENTIALS_DIR },
            ],
        }));
    }
    (Some(security), init)
}

/// The pod's user when it is not root (`--run-as-user` other than 0).
fn non_root(o: &KubernetesOptions) -> Option<(u32, u32)> {
    o.run_as.filter(|&(uid, _)| uid != 0)
}

/// The `--tile-cache` folder of worker `p`, if it has one.
/// The folder of a router's `--load-stats` file, when it keeps one at an absolute path.
fn load_stats_folder(p: &super::Process) -> Option<String> {
    let file = matches!(p.role, Role::Router(..))
        .then(|| super::flag_values(&p.args, "--load-stats").pop())
        .flatten()?;
    let folder = std::path::Path::new(&file).parent()?;
    (folder.is_absolute() && folder != std::path::Path::new("/"))
        .then(|| folder.display().to_string())
}

fn tile_cache(p: &super::Process) -> Option<String> {
    matches!(p.role, Role::Worker(..))
        .then(|| super::flag_values(&p.args, "--tile-cache").pop())
        .flatten()
}

/// Process `p`'s container resources: what the scheduler reserves (requests) and the devices
/// it takes (limits: a GPU device's GPU, announced to the process as index 0 in `env`; the
/// RDMA resource).
fn resources(
    plan: &Plan,
    o: &KubernetesOptions,
    p: &super::Process,
    env: &mut Vec<Value>,
) -> Value {
    let mut limits = serde_json::Map::new();
    // What the scheduler reserves (the pod is pinned to its node: a node that cannot hold
    // it leaves it Pending, saying why, rather than a BestEffort pod evicted first under
    // memory pressure): a CPU device's threads and the memory its experts are pinned in; a
    // core for a GPU device's worker or a router.
    let mut requests = serde_json::Map::new();
    requests.insert("cpu".into(), json!("1"));
    if let Role::Worker(d, _) = &p.role {
        let device = plan.dep.topology.device(*d);
        if let Some(dev) =
            device.filter(|dev| dev.kind() == expertmesh_topology::topology::DeviceKind::Cpu)
        {
            requests.insert(
                "cpu".into(),
                json!(dev.threads().unwrap_or(1).max(1).to_string()),
            );
            requests.insert(
                "memory".into(),
                json!(dev.expert_memory_bytes().to_string()),
            );
        }
        let gpu =
            device.is_some_and(|dev| dev.kind() == expertmesh_topology::topology::DeviceKind::Gpu);
        if gpu {
            limits.insert(o.gpu_resource.clone(), json!(1));
            // The device plugin shows the pod only the GPU it gave it, as index 0.
            env.push(json!({ "name": "EXPERTMESH_GPU_INDEX", "value": "0" }));
        }
    }
    if let Some(r) = &o.rdma_resource {
        limits.insert(r.clone(), json!(1));
    }
    let mut resources = json!({ "requests": requests });
    if !limits.is_empty() {
        resources["limits"] = json!(limits);
    }
    resources
}

fn deployment(plan: &Plan, o: &KubernetesOptions, p: &super::Process) -> Value {
    let c = plan.cluster_label();
    let component = p.role.component();
    let pod_labels = [
        ("app.kubernetes.io/component", component),
        ("expertmesh.io/process", p.name.as_str()),
    ];
    let selector = json!({
        "app.kubernetes.io/instance": c,
        "expertmesh.io/process": p.name,
    });
    let (mut env, mounts, volumes) = pod_files(plan, o, p);
    let mut ports = vec![json!({ "name": "metrics", "containerPort": p.metrics_port })];
    if let Role::Router(i) = p.role
        && let Some(r) = plan.dep.topology.routers().get(i as usize)
    {
        ports.push(json!({ "name": "frontend", "containerPort": r.port() }));
    }
    let resources = resources(plan, o, p, &mut env);
    let (pod_security, init) = run_as(o, p, plan.credentials.contains_key(&p.name));
    let mut container = json!({
        "name": "expertmesh",
        "image": o.image,
        "command": ["/bin/sh", format!("{CONFIG_DIR}/launch.sh"), p.name],
        "env": env,
        "ports": ports,
        // The process serves its metrics on its topology address, which on a node with
        // several networks is not the pod's (the node's InternalIP): probed there.
        "startupProbe": { "httpGet": { "host": p.address, "path": "/live", "port": "metrics" }, "periodSeconds": 10, "failureThreshold": 90, "timeoutSeconds": 5 },
        "livenessProbe": { "httpGet": { "host": p.address, "path": "/live", "port": "metrics" }, "periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": 5 },
        "readinessProbe": { "httpGet": { "host": p.address, "path": "/ready", "port": "metrics" }, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 5 },
        "volumeMounts": mounts,
    });
    // RDMA registers (locks) its buffers; a tile cache locks its tiles in memory.
    if o.rdma_resource.is_some() || tile_cache(p).is_some() {
        container["securityContext"] = json!({ "capabilities": { "add": ["IPC_LOCK"] } });
    }
    container["resources"] = resources;
    let mut d = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(plan, o, &format!("{c}-{}", p.name), &pod_labels),
        "spec": {
            "replicas": 1,
            "strategy": { "type": "Recreate" },
            "selector": { "matchLabels": selector },
            "template": {
                "metadata": {
                    "labels": labels(plan, &pod_labels),
                    "annotations": {
                        "expertmesh.io/generation": p.generation,
                        "expertmesh.io/node": p.node_name,
                    },
                },
                "spec": {
                    "nodeSelector": { "kubernetes.io/hostname": p.host },
                    "hostNetwork": true,
                    "dnsPolicy": "ClusterFirstWithHostNet",
                    "enableServiceLinks": false,
                    "terminationGracePeriodSeconds": super::stop_grace_s(p),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    });
    let spec = &mut d["spec"]["template"]["spec"];
    if let Some(security) = pod_security {
        spec["securityContext"] = security;
    }
    if !init.is_empty() {
        spec["initContainers"] = json!(init);
    }
    d
}

fn services(plan: &Plan, o: &KubernetesOptions) -> Vec<Value> {
    let c = plan.cluster_label();
    let mut out = Vec::new();
    for p in &plan.processes {
        let Role::Router(i) = p.role else { continue };
        let Some(r) = plan.dep.topology.routers().get(i as usize) else {
            continue;
        };
        out.push(json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata(plan, o, &format!("{c}-{}", p.name), &[("app.kubernetes.io/component", "router")]),
            "spec": {
                "selector": { "app.kubernetes.io/instance": c, "expertmesh.io/process": p.name },
                "ports": [{ "name": "frontend", "port": r.port(), "targetPort": r.port(), "protocol": "TCP" }],
            },
        }));
    }
    for component in ["router", "worker"] {
        out.push(json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": metadata(plan, o, &format!("{c}-{component}s"), &[("app.kubernetes.io/component", component)]),
            "spec": {
                "maxUnavailable": 1,
                "selector": { "matchLabels": { "app.kubernetes.io/instance": c, "app.kubernetes.io/component": component } },
            },
        }));
    }
    out
}
