//! Slurm: one batch job, one task per process, placed on its host.
//!
//! Why this exists: HPC centres (most AMD GPU clusters) run Slurm. `slurm/expertmesh.sbatch`
//! asks for the fabric's hosts (`--nodelist`) and one task per process; `srun
//! --distribution=arbitrary` with `SLURM_HOSTFILE=slurm/hostfile` (one host per task, in
//! process order) puts task `i` on process `i`'s host, and each task runs `launch.sh`, which
//! picks process `$SLURM_PROCID`. Tasks are processes, not CPU slots (a worker runs its own
//! threads), hence `--overcommit`.
//!
//! Failures: `--kill-on-bad-exit=0`, so a task that dies never takes the job down (a fabric
//! with replicas for the lost worker keeps answering); `launch.sh` restarts it, 2 s apart, up
//! to `$EXPERTMESH_RESTARTS` times (`--restarts`, default 3), then leaves it down. The script
//! waits until every router's `/ready` answers 200 (every worker joined) and prints
//! `expertmesh: fabric NAME ready: frontends connect to ...` in the job's output. `scancel`
//! sends SIGTERM: routers drain (up to their `--drain-timeout-s`, keep it under Slurm's
//! `KillWait`), workers finish what is queued, every task exits 0.
//!
//! The bundle must be at the same path on every node (a shared filesystem, or copied there:
//! `--bundle-path`), and each host's weights files where `hosts/HOST.files` says.

use super::launch::quote;
use super::{Plan, Writer};
use crate::FabricError;
use std::path::Path;

/// Slurm's settings.
#[derive(Debug, Clone, Default)]
pub struct SlurmOptions {
    /// `--partition`.
    pub partition: Option<String>,
    /// `--account`.
    pub account: Option<String>,
    /// `--time` (Slurm's syntax, e.g. `7-00:00:00`).
    pub time: Option<String>,
    /// Restarts of a failed process by `launch.sh` (0: none).
    pub restarts: u32,
    /// Where the output folder is on the cluster's nodes (default: its absolute path here).
    pub bundle_path: Option<String>,
    /// More `#SBATCH` directives, each one word (`--gres=gpu:8`, `--qos=serve`, ...).
    pub sbatch_args: Vec<String>,
}

/// The bundle's path on the nodes, once `o` is checked: called before anything is written
/// (a refused option leaves no files behind).
pub(super) fn bundle_on_nodes(plan: &Plan, o: &SlurmOptions) -> Result<String, FabricError> {
    // One word each on its `#SBATCH` line (whitespace ends it, a line break would start
    // another line of the script).
    let one_word =
        |v: &str| !v.is_empty() && !v.chars().any(|c| c.is_whitespace() || c.is_control());
    for (flag, v) in [
        ("--partition", &o.partition),
        ("--account", &o.account),
        ("--time", &o.time),
    ] {
        if let Some(v) = v
            && !one_word(v)
        {
            return Err(FabricError::Engine(format!(
                "{flag} {v:?}: give one word (no spaces or line breaks)"
            )));
        }
    }
    if let Some(a) = o
        .sbatch_args
        .iter()
        .find(|a| !one_word(a) || !a.starts_with('-'))
    {
        return Err(FabricError::Engine(format!(
            "--sbatch-arg {a:?}: give one sbatch option as one word (e.g. --gres=gpu:8), one \
             --sbatch-arg per option"
        )));
    }
    let bundle = match &o.bundle_path {
        Some(p) => p.clone(),
        None => std::path::absolute(&plan.opts.out)
            .map_err(|e| FabricError::Engine(format!("the output folder's path: {e}")))?
            .display()
            .to_string(),
    };
    // `#SBATCH` lines are split on whitespace and `%` starts a Slurm filename pattern: the
    // job's output path (inside the bundle) can hold neither, as `systemd`'s install folder.
    if !bundle.starts_with('/')
        || bundle
            .chars()
            .any(|c| c.is_whitespace() || c == '%' || c == '\\')
    {
        let what = if o.bundle_path.is_some() {
            "--bundle-path"
        } else {
            "the output folder (--out)"
        };
        return Err(FabricError::Engine(format!(
            "{what} {bundle:?}: the bundle's path on the nodes must be absolute (the job's \
             output, hostfile and binary are found from it whatever the working directory) and \
             the Slurm script's #SBATCH --output cannot hold spaces, '%' or '\\'; choose such a \
             path (or give --bundle-path)"
        )));
    }
    Ok(bundle)
}

/// Write `slurm/expertmesh.sbatch` and `slurm/hostfile`; the next steps.
pub(super) fn write(
    plan: &Plan,
    o: &SlurmOptions,
    w: &mut Writer,
) -> Result<Vec<String>, FabricError> {
    let bundle = bundle_on_nodes(plan, o)?;
    let hostfile: String = plan
        .processes
        .iter()
        .map(|p| format!("{}\n", p.host))
        .collect();
    w.file(Path::new("slurm/hostfile"), hostfile.as_bytes(), false)?;
    let script = sbatch(plan, o, &bundle);
    w.file(
        Path::new("slurm/expertmesh.sbatch"),
        script.as_bytes(),
        false,
    )?;
    let sbatch = format!("{bundle}/slurm/expertmesh.sbatch");
    let mut steps = vec![format!(
        "put {bundle} at that path on every node (a shared filesystem, or copy it), and each host's weights files as hosts/HOST.files lists"
    )];
    if !plan.frontend_credentials.is_empty() {
        steps.push(
            "first move frontends/ out of the bundle and hand each file to its frontend: no node needs them, and a node that could read an admin's may move experts".into(),
        );
    }
    steps.push(
        "note:   every task of a Slurm job runs as the job's user, so every node can read every process's credential in the bundle: one node taken over can act as any process of the fabric (Kubernetes and systemd give each host only its own)".into(),
    );
    let asks_gpus = o
        .sbatch_args
        .iter()
        .any(|a| a.starts_with("--gres") || a.starts_with("--gpus") || a.starts_with("-G"));
    if !asks_gpus {
        let gpus = gpus_per_host(plan);
        if gpus.values().any(|&n| n > 0) {
            let counts: Vec<String> = gpus.iter().map(|(h, n)| format!("{h} {n}")).collect();
            steps.push(format!(
                "note:   GPU devices per host: {}; where Slurm schedules GPUs as generic resources (GRES), a job sees only those it asks for: deploy again with --sbatch-arg=--gres=gpu:N (N on every node; hosts with different counts need a partition or a heterogeneous job of their own)",
                counts.join(", ")
            ));
        }
    }
    steps.extend([
        format!("start:  sbatch {}", quote(&sbatch)),
        format!(
            "ready:  the job's output {bundle}/slurm/expertmesh-JOBID.out says \"fabric {} ready\"",
            plan.dep.topology.name()
        ),
        "stop:   scancel JOBID (SIGTERM: routers drain, workers finish, every task exits 0)"
            .into(),
        "update: re-run deploy with the new placement or weights, then scancel and sbatch again (Slurm has no rolling update)"
            .into(),
    ]);
    Ok(steps)
}

/// GPU devices of the fabric's workers on each host.
fn gpus_per_host(plan: &Plan) -> std::collections::BTreeMap<String, usize> {
    let mut gpus = std::collections::BTreeMap::new();
    for p in &plan.processes {
        let n = gpus.entry(p.host.clone()).or_insert(0);
        if let super::Role::Worker(d, _) = &p.role
            && plan.dep.topology.devices()[d.0 as usize].kind()
                == expertmesh_topology::DeviceKind::Gpu
        {
            *n += 1;
        }
    }
    gpus
}

/// The batch script.
fn sbatch(plan: &Plan, o: &SlurmOptions, bundle: &str) -> String {
    let hosts = plan.hosts();
    let name = plan.dep.topology.name();
    let mut s = format!(
        "#!/bin/bash\n\
         # ExpertMesh fabric {q}, generation {g}: written by `expertmesh deploy slurm`; do not edit.\n\
         # Start: sbatch {sb}   Stop: scancel JOBID\n\
         #SBATCH --job-name=expertmesh-{label}\n\
         #SBATCH --nodes={n}\n\
         #SBATCH --ntasks={p}\n\
         #SBATCH --nodelist={nodes}\n\
         #SBATCH --overcommit\n\
         #SBATCH --exclusive\n\
         #SBATCH --mem=0\n\
         #SBATCH --output={bundle}/slurm/expertmesh-%j.out\n",
        q = quote(name),
        g = plan.generation,
        sb = quote(&format!("{bundle}/slurm/expertmesh.sbatch")),
        label = plan.cluster_label(),
        n = hosts.len(),
        p = plan.processes.len(),
        nodes = hosts.join(","),
    );
    for (opt, v) in [
        ("partition", &o.partition),
        ("account", &o.account),
        ("time", &o.time),
    ] {
        if let Some(v) = v {
            s += &format!("#SBATCH --{opt}={v}\n");
        }
    }
    for a in &o.sbatch_args {
        s += &format!("#SBATCH {a}\n");
    }
    s += &format!(
        r#"set -uo pipefail
bundle={bundle_q}
export SLURM_HOSTFILE="$bundle/slurm/hostfile"
export EXPERTMESH_RESTARTS=${{EXPERTMESH_RESTARTS:-{restarts}}}
srun --distribution=arbitrary --ntasks={p} --overcommit --kill-on-bad-exit=0 --label "$bundle/fabric/launch.sh" &
step=$!
stop() {{
  echo "expertmesh: stopping: routers drain, workers finish what is queued"
  kill -TERM "$step" 2>/dev/null
}}
trap stop TERM INT
# Whether HOST PORT answers GET /ready with 200 within 5 s (a host that drops packets would
# hold a bare connect for the kernel's SYN retries, and this script's SIGTERM trap with it).
ready() {{
  timeout 5 bash -c '
    exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "GET /ready HTTP/1.0\r\n\r\n" >&3
    line=""
    IFS= read -r line <&3 || true
    [[ $line == *" 200 "* ]]
  ' ready "$1" "$2" 2>/dev/null
}}
for r in {routers}; do
  addr=${{r% *}}
  port=${{r#* }}
  until ready "$addr" "$port"; do
    if ! kill -0 "$step" 2>/dev/null; then
      echo "expertmesh: the fabric's job step ended before the router at $addr (health port $port) was ready" >&2
      wait "$step"
      exit 1
    fi
    sleep 1
  done
done
echo "expertmesh: fabric {name_q} ready: frontends connect to {frontends}"
rc=0
wait "$step" || rc=$?
while kill -0 "$step" 2>/dev/null; do rc=0; wait "$step" || rc=$?; done
echo "expertmesh: the fabric's job step ended with status $rc"
exit "$rc"
"#,
        bundle_q = quote(bundle),
        restarts = o.restarts,
        p = plan.processes.len(),
        routers = plan
            .processes
            .iter()
            .filter(|p| p.role.component() == "router")
            .map(|p| quote(&format!("{} {}", p.address, p.metrics_port)))
            .collect::<Vec<_>>()
            .join(" "),
        name_q = name.replace(['"', '\\', '$', '`'], "_"),
        frontends = (0..plan.dep.router_count())
            .map(|i| plan.frontend_endpoint(i))
            .collect::<Vec<_>>()
            .join(", "),
    );
    s
}
