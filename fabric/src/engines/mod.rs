//! A multi-host fabric on the engines clusters already run: Slurm, Kubernetes and systemd.
//!
//! Why this exists: `expertmesh up` starts a whole fabric, but only on one host. A cluster
//! builder describes the cluster once (topology, model, placement or converted weights) and
//! `expertmesh deploy ENGINE` turns that into everything the engine needs: one process per
//! router instance and per device, each with exactly its own files (its credential, never the
//! master key; the topology, model and placement; its shard within the weights folder on its
//! host), and the engine's own files to start, restart and stop them. ExpertMesh does not grow
//! its own multi-host launcher.
//!
//! Every engine runs the same entry point, `launch.sh` in the bundle (see [`launch`]): it
//! picks its process from its argument, `$EXPERTMESH_PROCESS`, or Slurm's `$SLURM_PROCID`;
//! refuses to start on another host than the one the topology gives the process; and runs
//! `expertmesh router` or `expertmesh worker` with that process's arguments. The processes
//! stop on SIGTERM: a router drains (answers what it admitted, refuses the rest saying so), a
//! worker answers what is queued. Each serves `/metrics`, `/live` and `/ready` (a router is
//! ready when every worker joined it) on its node's address at `--metrics-port` plus its
//! index, which Kubernetes probes and the Slurm script waits on.
//!
//! Layout of `--out DIR`:
//! - `fabric/`: what every host gets (the Kubernetes ConfigMap): `launch.sh`,
//!   `topology.toml`, the model and placement files of a synthetic deployment, and
//!   `processes.tsv` (process, role, topology node, host, metrics port).
//! - `credentials/PROCESS.cred`: one per process (mode 0600); `frontends/NAME.cred` for the
//!   serving clients named with `--frontend`.
//! - `hosts/HOST.files`: which files each host needs (its processes' credentials, and of the
//!   weights folder only the manifest, model, placement and its own shards or router file).
//! - the engine's files: `slurm/`, `kubernetes/` or `systemd/` (see their modules).
//! - `.expertmesh-deploy-files`: what this deploy wrote. A later deploy into the same folder
//!   removes the files of that list it does not write again (a process, host or frontend
//!   gone), and nothing else.
//!
//! The generation (a hash of every rank's fingerprint, which covers the model, the weights'
//! identity and the placement, and of the processes' arguments) is written into every file
//! an engine compares, so re-running `deploy` after a new placement or new weights changes
//! exactly what must restart (Kubernetes rolls the pods whose template changed).

pub mod kubernetes;
pub mod launch;
pub mod slurm;
pub mod systemd;
pub mod yaml;

use crate::FabricError;
use crate::credentials::{Principal, issue};
use expertmesh_topology::topology::DeviceRank;
use expertmesh_transport::crypto::Key;
use expertmesh_worker::deploy::Deployment;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Which engine to write files for, with its own settings.
#[derive(Debug, Clone)]
pub enum Engine {
    /// One Slurm batch job: one task per process.
    Slurm(slurm::SlurmOptions),
    /// Kubernetes manifests: one Deployment per process, pinned to its node.
    Kubernetes(kubernetes::KubernetesOptions),
    /// One systemd unit per process, per host.
    Systemd(systemd::SystemdOptions),
}

impl Engine {
    /// "slurm", "kubernetes" or "systemd".
    pub fn name(&self) -> &'static str {
        match self {
            Engine::Slurm(_) => "slurm",
            Engine::Kubernetes(_) => "kubernetes",
            Engine::Systemd(_) => "systemd",
        }
    }
}

/// Where the deployment's model and weights come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A converted weights folder (loaded into the deployment; its manifest names the files
    /// each host needs): the processes read it at this path on their hosts.
    Weights {
        /// The folder's path on every host.
        on_hosts: String,
    },
    /// Synthetic weights: a model preset or file, a placement file and the seed.
    Synthetic {
        /// Model preset name or model file.
        model: String,
        /// Placement file.
        placement: PathBuf,
        /// Seed of the synthetic weights.
        seed: u64,
    },
}

/// What `expertmesh deploy` was asked for (all engines).
#[derive(Debug, Clone)]
pub struct DeployOptions {
    /// The topology file (copied into the bundle).
    pub topology: PathBuf,
    /// Model and weights.
    pub source: Source,
    /// Output folder.
    pub out: PathBuf,
    /// The cluster master key: each process gets its own credential derived from it. `None`:
    /// no credentials (only with `insecure` or a loopback-only topology).
    pub master_key: Option<Key>,
    /// Run without credentials off loopback.
    pub insecure: bool,
    /// Serving clients to issue credential files for (`frontends/NAME.cred`).
    pub frontends: Vec<String>,
    /// Engine host name of a topology node (Slurm node, Kubernetes node, ssh host); default:
    /// the node's name.
    pub hosts: BTreeMap<String, String>,
    /// The `expertmesh` binary on the hosts (the entry point's default; `$EXPERTMESH_BIN`
    /// overrides it at run time).
    pub bin: String,
    /// First metrics and health port: process `i` (routers first, then devices in topology
    /// order) listens on its node's address at this port plus `i`.
    pub metrics_port: u16,
    /// Extra arguments of every `expertmesh router` (e.g. `--mode exact`).
    pub router_args: Vec<String>,
    /// Extra arguments of every `expertmesh worker` (e.g. `--link shm`).
    pub worker_args: Vec<String>,
}

/// One process of the fabric.
#[derive(Debug, Clone)]
pub struct Process {
    /// `router-I` or `worker-R` (R: the device's topology rank); also its credential's name.
    pub name: String,
    /// What it runs.
    pub role: Role,
    /// Index of its node in the topology.
    pub node: usize,
    /// The topology node's name.
    pub node_name: String,
    /// The engine's name of its host.
    pub host: String,
    /// Its node's address (where it listens).
    pub address: String,
    /// Its metrics and health port.
    pub metrics_port: u16,
    /// `expertmesh` arguments.
    pub args: Vec<launch::Arg>,
    /// Hash of this process's rank fingerprint (model, weights' identity, its placement),
    /// host and arguments (12 hex digits): changes exactly when this process must restart.
    pub generation: String,
}

/// A process's role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Router instance.
    Router(u32),
    /// The worker of a device: its topology rank and id (`node/device`).
    Worker(DeviceRank, String),
}

impl Role {
    /// "router" or "worker".
    pub fn component(&self) -> &'static str {
        match self {
            Role::Router(_) => "router",
            Role::Worker(..) => "worker",
        }
    }
}

/// Everything the engines' writers share: the deployment, the processes, the bundle's files.
#[derive(Debug)]
pub struct Plan {
    /// The loaded deployment.
    pub dep: Deployment,
    /// The options.
    pub opts: DeployOptions,
    /// Routers first, then one worker per device in topology order.
    pub processes: Vec<Process>,
    /// Hash of every process's generation (12 hex digits).
    pub generation: String,
    /// Files of the bundle's `fabric/` folder: (name, contents).
    pub fabric_files: Vec<(String, Vec<u8>)>,
    /// Credential file text per process name (and per `frontends/NAME`).
    pub credentials: BTreeMap<String, String>,
    /// Frontend credential texts by frontend name.
    pub frontend_credentials: BTreeMap<String, String>,
}

/// What `deploy` wrote, and the commands that start the fabric.
#[derive(Debug)]
pub struct Written {
    /// Files written, relative to the output folder.
    pub files: Vec<PathBuf>,
    /// Files an earlier deploy into the same folder wrote that this one did not (a process,
    /// host or frontend no longer there), removed so the folder holds exactly this deployment.
    pub removed: Vec<PathBuf>,
    /// The one or two commands to start it (and how to update and stop it), for the user.
    pub next_steps: Vec<String>,
}

impl Plan {
    /// Plan `dep` for the engines: processes, arguments, credentials, bundle files.
    pub fn new(dep: Deployment, mut opts: DeployOptions) -> Result<Self, FabricError> {
        check_options(&dep, &opts)?;
        agree_link_flags(&mut opts)?;
        let topo = &dep.topology;
        let mut fabric_files = vec![(
            "topology.toml".to_owned(),
            read(&opts.topology, "the topology")?,
        )];
        let model_arg = model_args(&opts.source, &mut fabric_files)?;
        let mut processes = list_processes(&dep, &opts)?;
        let mut credentials = BTreeMap::new();
        for p in &mut processes {
            p.args = process_args(p, &model_arg, &opts)?;
            check_tile_cache_args(&p.args)?;
            if let Some(key) = &opts.master_key {
                let who = match &p.role {
                    Role::Router(i) => Principal::Router(*i),
                    Role::Worker(_, id) => Principal::Device(id.clone()),
                };
                credentials.insert(p.name.clone(), issue(key, topo, &who)?.to_file_text());
            }
        }
        let mut frontend_credentials = BTreeMap::new();
        frontend_files_apart(&opts.frontends)?;
        for f in &opts.frontends {
            let Some(key) = &opts.master_key else {
                return Err(FabricError::Engine(
                    "--frontend needs --key: a frontend credential is derived from the master key"
                        .into(),
                ));
            };
            let text = issue(key, topo, &Principal::Frontend(f.clone()))?.to_file_text();
            frontend_credentials.insert(f.clone(), text);
        }
        let fingerprints = dep.fingerprints();
        for p in &mut processes {
            let rank = match &p.role {
                Role::Router(i) => *i as usize,
                Role::Worker(d, _) => dep.mesh_rank(*d) as usize,
            };
            p.generation = process_generation(fingerprints.get(rank), p);
        }
        let generation = hex12(&{
            use sha2::{Digest, Sha256};
            let mut h = Sha256::new();
            for p in &processes {
                h.update(p.generation.as_bytes());
            }
            h.finalize()
        });
        let mut plan = Self {
            dep,
            opts,
            processes,
            generation,
            fabric_files,
            credentials,
            frontend_credentials,
        };
        let script = launch::script(&plan);
        plan.fabric_files
            .push(("launch.sh".into(), script.into_bytes()));
        plan.fabric_files
            .push(("processes.tsv".into(), processes_table(&plan).into_bytes()));
        Ok(plan)
    }

    /// The processes on host `host`.
    pub fn on_host<'a>(&'a self, host: &'a str) -> impl Iterator<Item = &'a Process> + 'a {
        self.processes.iter().filter(move |p| p.host == host)
    }

    /// The hosts, in topology order, each once.
    pub fn hosts(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for p in &self.processes {
            if !out.contains(&p.host) {
                out.push(p.host.clone());
            }
        }
        out
    }

    /// The cluster's name, made into a DNS label (lowercase letters, digits and '-').
    pub fn cluster_label(&self) -> String {
        dns_label(self.dep.topology.name())
    }

    /// The frontend endpoint (`address:port`) of router `i`.
    pub fn frontend_endpoint(&self, i: u32) -> String {
        self.dep.topology.routers().get(i as usize).map_or_else(
            || {
                self.dep
                    .router_frontend_endpoint(i)
                    .map_or_else(|e| e.to_string(), |a| a.to_string())
            },
            |r| r.listen_endpoint(),
        )
    }

    /// Write the bundle and the engine's files under the output folder.
    pub fn write(&self, engine: &Engine) -> Result<Written, FabricError> {
        if let Engine::Slurm(o) = engine {
            slurm::bundle_on_nodes(self, o)?;
        }
        let mut w = Writer::new(&self.opts.out)?;
        for (name, bytes) in &self.fabric_files {
            w.file(&Path::new("fabric").join(name), bytes, false)?;
        }
        for (name, text) in &self.credentials {
            w.file(
                &Path::new("credentials").join(format!("{name}.cred")),
                text.as_bytes(),
                true,
            )?;
        }
        for (name, text) in &self.frontend_credentials {
            w.file(
                &Path::new("frontends").join(format!("{}.cred", file_safe(name))),
                text.as_bytes(),
                true,
            )?;
        }
        for host in self.hosts() {
            w.file(
                &Path::new("hosts").join(format!("{}.files", file_safe(&host))),
                self.host_files(&host).as_bytes(),
                false,
            )?;
        }
        let next_steps = match engine {
            Engine::Slurm(o) => slurm::write(self, o, &mut w)?,
            Engine::Kubernetes(o) => kubernetes::write(self, o, &mut w)?,
            Engine::Systemd(o) => systemd::write(self, o, &mut w)?,
        };
        let removed = w.finish()?;
        Ok(Written {
            files: w.written,
            removed,
            next_steps,
        })
    }

    /// `hosts/HOST.files`: what host `host` needs, one path per line with a comment saying why.
    fn host_files(&self, host: &str) -> String {
        let mut s = format!(
            "# Files host {host} needs for cluster {} (generation {}), written by `expertmesh deploy`.\n\
             # Paths under the bundle (this folder's parent), then the weights folder's files.\n",
            self.dep.topology.name(),
            self.generation
        );
        s += "fabric/\n";
        for p in self.on_host(host) {
            if self.credentials.contains_key(&p.name) {
                s += &format!("credentials/{}.cred\n", p.name);
            }
        }
        if let (Source::Weights { on_hosts, .. }, Some(w)) = (&self.opts.source, &self.dep.weights)
        {
            let m = &w.manifest;
            s += &format!("# from the weights folder, at {on_hosts} on the host:\n");
            s += &format!(
                "{on_hosts}/{}\n{on_hosts}/{}\n{on_hosts}/{}\n",
                expertmesh_worker::deploy::MANIFEST_FILE,
                m.model_file,
                m.placement_file
            );
            let mut router_file = false;
            for p in self.on_host(host) {
                match &p.role {
                    Role::Router(_) => router_file = true,
                    Role::Worker(d, _) => {
                        if let Some(r) = m.shards.get(d.0 as usize) {
                            s += &format!("{on_hosts}/{}\n", r.file);
                        }
                    }
                }
            }
            if router_file {
                s += &format!("{on_hosts}/{}\n", m.router.file);
            }
        }
        s
    }
}

/// Refuses options that cannot make a working fabric: a `--host` for no node, no
/// credentials off loopback without `--insecure`.
fn check_options(dep: &Deployment, opts: &DeployOptions) -> Result<(), FabricError> {
    let topo = &dep.topology;
    for node in opts.hosts.keys() {
        if !topo.nodes().iter().any(|n| n.name() == node) {
            return Err(FabricError::Engine(format!(
                "--host {node}=...: the topology has no node {node:?} (its nodes: {})",
                topo.nodes()
                    .iter()
                    .map(|n| n.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    if topo.routers().is_empty() {
        return Err(FabricError::Engine(format!(
            "topology {} has no [router] section: a deployed router listens where its [router] \
             table says (node, port); add one (or one [[router]] per router)",
            topo.name()
        )));
    }
    // Every address a process listens on: a router's listen address (0.0.0.0 is not
    // loopback) and each node's control and data addresses.
    let loopback = |a: &str| a.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback());
    let loopback_only = topo
        .nodes()
        .iter()
        .all(|n| loopback(n.address()) && loopback(n.data_address()))
        && topo.routers().iter().all(|r| loopback(r.listen_address()));
    if opts.master_key.is_none() && !opts.insecure && !loopback_only {
        return Err(FabricError::Engine(
            "the topology's nodes are not on loopback: give --key MASTER (from `expertmesh keys init`) so each process gets its own credential, or --insecure to run unauthenticated and unencrypted".into(),
        ));
    }
    Ok(())
}

/// The processes: routers, then one worker per device in topology order (arguments and
/// generations are filled in later).
fn list_processes(dep: &Deployment, opts: &DeployOptions) -> Result<Vec<Process>, FabricError> {
    let topo = &dep.topology;
    let routers = dep.router_count();
    let total = routers as usize + topo.devices().len();
    if opts.metrics_port == 0 {
        return Err(FabricError::Engine(
            "--metrics-port 0: each process serves its metrics on a port of its own, from this one up; give a port of 1 or more".into(),
        ));
    }
    if usize::from(opts.metrics_port) + total > usize::from(u16::MAX) {
        return Err(FabricError::Engine(format!(
            "--metrics-port {}: {total} processes need ports up to {}, past 65535",
            opts.metrics_port,
            usize::from(opts.metrics_port) + total - 1
        )));
    }
    let roles = (0..routers)
        .map(|i| (format!("router-{i}"), Role::Router(i), dep.router_node(i)))
        .chain(topo.devices().iter().map(|dev| {
            (
                format!("worker-{}", dev.rank().0),
                Role::Worker(dev.rank(), dev.id().to_owned()),
                dev.node_index(),
            )
        }));
    // The sockets the topology gives its listeners (address, port): a metrics port on one
    // of them, at the same address, would make that process fail to bind. A process serves
    // its metrics on its node's address.
    let nodes = topo.nodes();
    let mut taken: Vec<(&str, u16, String)> = Vec::new();
    for n in nodes {
        let what = format!("node {}'s control_port", n.name());
        taken.push((n.address(), n.control_port(), what));
    }
    for (i, r) in topo.routers().iter().enumerate() {
        let at = nodes[r.node_index()].address();
        taken.push((
            r.listen_address(),
            r.port(),
            format!("router {i}'s frontend port"),
        ));
        taken.push((at, r.mesh_port(), format!("router {i}'s mesh port")));
    }
    for d in topo.devices() {
        let at = nodes[d.node_index()].data_address();
        taken.push((at, d.data_port(), format!("device {}'s data port", d.id())));
    }
    let roles: Vec<_> = roles.collect();
    for (index, (name, _, node)) in roles.iter().enumerate() {
        let port = opts.metrics_port + index as u16;
        let at = nodes[*node].address();
        let clash = |(a, p, _): &&(&str, u16, String)| {
            *p == port && (*a == at || ["0.0.0.0", "::"].contains(a))
        };
        if let Some((_, _, what)) = taken.iter().find(clash) {
            return Err(FabricError::Engine(format!(
                "--metrics-port {}: {name} would serve its metrics on {at} port {port}, which \
                 is {what}; choose a first metrics port whose {total} ports miss the \
                 topology's",
                opts.metrics_port
            )));
        }
    }
    Ok(roles
        .into_iter()
        .enumerate()
        .map(|(index, (name, role, node))| {
            let n = &topo.nodes()[node];
            Process {
                name,
                role,
                node,
                node_name: n.name().to_owned(),
                host: opts
                    .hosts
                    .get(n.name())
                    .cloned()
                    .unwrap_or_else(|| n.name().to_owned()),
                address: n.address().to_owned(),
                metrics_port: opts.metrics_port + index as u16,
                args: Vec::new(),
                generation: String::new(),
            }
        })
        .collect())
}

/// The model and weights arguments every process shares; copies a model file and the
/// placement into the bundle's files.
fn model_args(
    source: &Source,
    fabric_files: &mut Vec<(String, Vec<u8>)>,
) -> Result<Vec<launch::Arg>, FabricError> {
    Ok(match source {
        Source::Weights { on_hosts, .. } => {
            vec![launch::Arg::lit("--weights"), launch::Arg::lit(on_hosts)]
        }
        Source::Synthetic {
            model,
            placement,
            seed,
        } => {
            let model = if Path::new(model).is_file() {
                fabric_files.push(("model.toml".into(), read(Path::new(model), "the model")?));
                launch::Arg::File("model.toml".into())
            } else {
                launch::Arg::lit(model)
            };
            fabric_files.push(("placement.toml".into(), read(placement, "the placement")?));
            vec![
                launch::Arg::lit("--model"),
                model,
                launch::Arg::lit("--placement"),
                launch::Arg::File("placement.toml".into()),
                launch::Arg::lit("--seed"),
                launch::Arg::lit(&seed.to_string()),
            ]
        }
    })
}

/// Every flag [`process_args`] (with [`model_args`]) gives a router or a worker itself: an
/// extra argument may not give one again, and `expertmesh deploy`'s check of the extra
/// arguments accepts their absence. (Checked against what `process_args` writes, in debug
/// builds: every deploy test keeps the list whole.)
pub const SET_BY_DEPLOY: &[&str] = &[
    "--topology",
    "--model",
    "--weights",
    "--placement",
    "--seed",
    "--instance",
    "--device",
    "--metrics",
    "--credentials",
    "--insecure",
];

/// The `expertmesh` arguments of process `p` (files relative to the bundle's `fabric/`).
fn process_args(
    p: &Process,
    model: &[launch::Arg],
    opts: &DeployOptions,
) -> Result<Vec<launch::Arg>, FabricError> {
    use launch::Arg;
    let mut a = vec![
        Arg::lit(p.role.component()),
        Arg::lit("--topology"),
        Arg::File("topology.toml".into()),
    ];
    a.extend(model.iter().cloned());
    let extra = match &p.role {
        Role::Router(i) => {
            a.extend([Arg::lit("--instance"), Arg::lit(&i.to_string())]);
            &opts.router_args
        }
        Role::Worker(_, id) => {
            a.extend([Arg::lit("--device"), Arg::lit(id)]);
            &opts.worker_args
        }
    };
    a.extend([
        Arg::lit("--metrics"),
        Arg::lit(&expertmesh_topology::topology::endpoint(
            &p.address,
            p.metrics_port,
        )),
    ]);
    if opts.master_key.is_some() {
        a.extend([Arg::lit("--credentials"), Arg::Credential(p.name.clone())]);
    } else if opts.insecure {
        a.push(Arg::lit("--insecure"));
    }
    // A flag set here may not come again from --router-arg/--worker-arg: the process would
    // refuse the second ("cannot be used multiple times") on every node.
    let flag_name = |t: &str| t.split('=').next().unwrap_or(t).to_owned();
    let set: Vec<String> = a
        .iter()
        .filter_map(|x| match x {
            Arg::Lit(t) if t.starts_with("--") => Some(flag_name(t)),
            _ => None,
        })
        .collect();
    debug_assert!(
        set.iter().all(|f| SET_BY_DEPLOY.contains(&f.as_str())),
        "SET_BY_DEPLOY lacks a flag process_args sets: {set:?}"
    );
    if let Some(dup) = extra
        .iter()
        .filter(|t| t.starts_with("--"))
        .map(|t| flag_name(t))
        .find(|f| set.contains(f))
    {
        let c = p.role.component();
        return Err(FabricError::Engine(format!(
            "--{c}-arg {dup}: deploy sets {dup} for every {c} itself; leave it out"
        )));
    }
    a.extend(extra.iter().map(|s| Arg::lit(s)));
    Ok(a)
}

/// A worker's `--tile-cache` folder, wherever an engine starts it, must be absolute (the
/// engines start processes in folders of their own) and one word for systemd and the shell
/// (no spaces, `%` or quotes).
fn check_tile_cache_args(args: &[launch::Arg]) -> Result<(), FabricError> {
    for dir in flag_values(args, "--tile-cache") {
        let plain = !dir
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '%' | '"' | '\'' | '\\'));
        if !dir.starts_with('/') || !plain {
            return Err(FabricError::Engine(format!(
                "--tile-cache {dir}: give an absolute path without spaces, '%' or quotes"
            )));
        }
    }
    Ok(())
}

/// Seconds an engine gives process `p` to stop after SIGTERM before it kills it: a router's
/// `--drain-timeout-s` (30 s unless given) and 30 s more to finish and exit, at least 60 (a
/// router told to drain for longer was killed in the middle of its drain).
pub(crate) fn stop_grace_s(p: &Process) -> u64 {
    let drain = flag_values(&p.args, "--drain-timeout-s")
        .pop()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .unwrap_or(30.0);
    (drain.ceil() as u64).saturating_add(30).max(60)
}

/// The folders `args` name after `flag`, as `FLAG VALUE` or `FLAG=VALUE` (a worker's
/// `--tile-cache`, a router's `--load-stats`), in order.
pub(crate) fn flag_values(args: &[launch::Arg], flag: &str) -> Vec<String> {
    let texts: Vec<Option<&str>> = args
        .iter()
        .map(|a| match a {
            launch::Arg::Lit(text) => Some(text.as_str()),
            _ => None,
        })
        .collect();
    texts_flag_values(&texts, flag)
}

/// [`flag_values`] of plain arguments (`--router-arg`s, `--worker-arg`s).
fn string_flag_values(args: &[String], flag: &str) -> Vec<String> {
    let texts: Vec<Option<&str>> = args.iter().map(|a| Some(a.as_str())).collect();
    texts_flag_values(&texts, flag)
}

/// The values after `flag` in `texts` (`None`: an argument that is not text).
fn texts_flag_values(texts: &[Option<&str>], flag: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let Some(text) = text else { continue };
        if *text == flag {
            if let Some(Some(v)) = texts.get(i + 1) {
                out.push((*v).to_owned());
            }
        } else if let Some(v) = text
            .strip_prefix(flag)
            .and_then(|rest| rest.strip_prefix('='))
        {
            out.push(v.to_owned());
        }
    }
    out
}

/// The flags routers and workers must agree on: the link workers ask for, and the NIC
/// implementation under RDMA links (each router sets its side of a link up with its own).
const AGREED_FLAGS: [&str; 2] = ["--link", "--rdma-provider"];

/// Copies every [`AGREED_FLAGS`] one side's extra arguments give to the other
/// (`--worker-arg=--link --worker-arg=rdma` alone left routers on their default provider,
/// and links fell back to TCP), or refuses a flag both give differently.
fn agree_link_flags(opts: &mut DeployOptions) -> Result<(), FabricError> {
    for flag in AGREED_FLAGS {
        let router = string_flag_values(&opts.router_args, flag).pop();
        let worker = string_flag_values(&opts.worker_args, flag).pop();
        match (router, worker) {
            (Some(r), Some(w)) if r != w => {
                return Err(FabricError::Engine(format!(
                    "--router-arg={flag} {r} but --worker-arg={flag} {w}: routers and workers \
                     must agree on it; give it once (as either, it goes to both)"
                )));
            }
            (Some(r), None) => opts.worker_args.extend([flag.to_owned(), r]),
            (None, Some(w)) => opts.router_args.extend([flag.to_owned(), w]),
            _ => {}
        }
    }
    Ok(())
}

/// [`Process::generation`] of `p`, whose rank's fingerprint is `fingerprint`.
fn process_generation(fingerprint: Option<&[u8; 32]>, p: &Process) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    if let Some(f) = fingerprint {
        h.update(f);
    }
    h.update(p.name.as_bytes());
    h.update([0]);
    h.update(p.host.as_bytes());
    for a in &p.args {
        h.update([0]);
        h.update(format!("{a:?}").as_bytes());
    }
    hex12(&h.finalize())
}

/// The first 6 bytes of `digest` in hex.
fn hex12(digest: &[u8]) -> String {
    digest[..6].iter().map(|b| format!("{b:02x}")).collect()
}

/// `processes.tsv`: process, role, node, host, metrics port.
fn processes_table(plan: &Plan) -> String {
    let mut s = String::from("# process\trole\tnode\thost\tmetrics\n");
    for p in &plan.processes {
        let role = match &p.role {
            Role::Router(i) => format!("router {i}"),
            Role::Worker(_, id) => format!("worker {id}"),
        };
        s += &format!(
            "{}\t{role}\t{}\t{}\t{}\n",
            p.name,
            p.node_name,
            p.host,
            expertmesh_topology::topology::endpoint(&p.address, p.metrics_port)
        );
    }
    s
}

/// `s` as a DNS label: lowercase ASCII letters, digits and '-', starting and ending with an
/// alphanumeric, at most 40 characters (room for the suffixes added to it).
pub fn dns_label(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    out.truncate(40);
    let out = out.trim_matches('-').to_owned();
    if out.is_empty() {
        "expertmesh".into()
    } else {
        out
    }
}

/// Each `--frontend` name gets a file of its own: two names that differ only in characters a
/// file name cannot hold (`"a b"` and `"a_b"`) would write one `frontends/NAME.cred`, the second
/// credential over the first, and a name of dots alone would give a hidden `.cred`.
fn frontend_files_apart(names: &[String]) -> Result<(), FabricError> {
    let mut files: BTreeMap<String, &str> = BTreeMap::new();
    for name in names {
        let file = file_safe(name);
        if !file.chars().any(|c| c.is_ascii_alphanumeric()) {
            return Err(FabricError::Engine(format!(
                "--frontend {name:?}: the name needs a letter or digit (its credential is \
                 written to frontends/NAME.cred)"
            )));
        }
        // Compared without case: on a case-insensitive filesystem (a Mac's) `Team` and
        // `team` would share one file too.
        match files.insert(file.to_ascii_lowercase(), name) {
            Some(other) if other != name => {
                return Err(FabricError::Engine(format!(
                    "--frontend {other:?} and --frontend {name:?} would share the file \
                     frontends/{file}.cred (characters other than letters, digits, '-', '_' \
                     and '.' become '_', and some filesystems do not tell case apart): choose \
                     names that differ in letters or digits"
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// `s` usable as one file name (no '/', no leading '.').
fn file_safe(s: &str) -> String {
    let out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    out.trim_start_matches('.').to_owned()
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, FabricError> {
    std::fs::read(path)
        .map_err(|e| FabricError::Engine(format!("cannot read {what} {}: {e}", path.display())))
}

/// The list of the files the last deploy wrote into its output folder.
pub const LIST_FILE: &str = ".expertmesh-deploy-files";

/// Writes files under the output folder, each atomically (temporary file, then rename), and
/// remembers what it wrote.
pub struct Writer {
    root: PathBuf,
    written: Vec<PathBuf>,
}

impl Writer {
    fn new(root: &Path) -> Result<Self, FabricError> {
        std::fs::create_dir_all(root).map_err(|e| {
            FabricError::Engine(format!(
                "cannot create the output folder {}: {e}",
                root.display()
            ))
        })?;
        Ok(Self {
            root: root.to_path_buf(),
            written: Vec::new(),
        })
    }

    /// Remove what the previous deploy into this folder wrote and this one did not (only files
    /// its list names, never anything else), then record this deploy's list
    /// ([`LIST_FILE`]). Returns the files removed.
    fn finish(&mut self) -> Result<Vec<PathBuf>, FabricError> {
        let list = self.root.join(LIST_FILE);
        let before = std::fs::read_to_string(&list).unwrap_or_default();
        let mut removed = Vec::new();
        for line in before
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let rel = PathBuf::from(line);
            // Only plain relative paths inside the folder (a hand-edited list cannot reach out).
            let inside = rel
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside || self.written.contains(&rel) {
                continue;
            }
            match std::fs::remove_file(self.root.join(&rel)) {
                Ok(()) => removed.push(rel),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(FabricError::Engine(format!(
                        "cannot remove {} (written by an earlier deploy, not by this one): {e}",
                        self.root.join(&rel).display()
                    )));
                }
            }
        }
        let mut text = String::from(
            "# The files `expertmesh deploy` wrote here; the next deploy removes those it does not write.\n",
        );
        for f in &self.written {
            text += &format!("{}\n", f.display());
        }
        let written = std::mem::take(&mut self.written);
        self.file(Path::new(LIST_FILE), text.as_bytes(), false)?;
        self.written = written;
        Ok(removed)
    }

    /// Write `rel` (relative to the output folder) whole or not at all
    /// ([`expertmesh_files::write_whole`]); `secret`: mode 0600, else 0644 (0755 for a `.sh` or
    /// `.sbatch` file), whatever the umask.
    pub fn file(&mut self, rel: &Path, bytes: &[u8], secret: bool) -> Result<(), FabricError> {
        let path = self.root.join(rel);
        let fail = |e: std::io::Error| {
            FabricError::Engine(format!(
                "cannot write {}: {e} (is the disk full or the folder read-only?)",
                path.display()
            ))
        };
        let dir = path.parent().unwrap_or(&self.root);
        std::fs::create_dir_all(dir).map_err(fail)?;
        let exec = matches!(
            rel.extension().and_then(|e| e.to_str()),
            Some("sh" | "sbatch")
        );
        let mode = if secret {
            0o600
        } else if exec {
            0o755
        } else {
            0o644
        };
        expertmesh_files::write_whole(&path, bytes, Some(mode)).map_err(fail)?;
        self.written.push(rel.to_path_buf());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(router_args: &[&str], worker_args: &[&str]) -> DeployOptions {
        let strings = |a: &[&str]| a.iter().map(|s| s.to_string()).collect();
        DeployOptions {
            topology: PathBuf::new(),
            source: Source::Synthetic {
                model: String::new(),
                placement: PathBuf::new(),
                seed: 0,
            },
            out: PathBuf::new(),
            master_key: None,
            insecure: false,
            frontends: Vec::new(),
            hosts: BTreeMap::new(),
            bin: String::new(),
            metrics_port: 9400,
            router_args: strings(router_args),
            worker_args: strings(worker_args),
        }
    }

    /// Two frontends never share a credential file; a repeated name is one frontend.
    #[test]
    fn frontend_names_get_files_of_their_own() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(frontend_files_apart(&names(&["serve-a", "serve_b", "serve-a", "x.y"])).is_ok());
        let e = frontend_files_apart(&names(&["team a", "team_a"])).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("\"team a\"") && e.contains("frontends/team_a.cred"),
            "{e}"
        );
        let e = frontend_files_apart(&names(&["x", ".x"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("frontends/x.cred"), "{e}");
        for nameless in ["...", "-", "__"] {
            let e = frontend_files_apart(&names(&[nameless]))
                .unwrap_err()
                .to_string();
            assert!(e.contains("a letter or digit"), "{nameless}: {e}");
        }
        let e = frontend_files_apart(&names(&["Team", "team"])).unwrap_err();
        assert!(e.to_string().contains("would share the file"), "{e}");
    }

    /// A link flag given to one side reaches the other; given to both, it must agree.
    #[test]
    fn link_flags_reach_routers_and_workers_alike() {
        let mut o = options(
            &["--mode", "exact"],
            &["--link", "rdma", "--rdma-provider=libfabric"],
        );
        agree_link_flags(&mut o).unwrap();
        let value = |args: &[String], flag| string_flag_values(args, flag).pop();
        assert_eq!(value(&o.router_args, "--link").as_deref(), Some("rdma"));
        let provider = value(&o.router_args, "--rdma-provider");
        assert_eq!(provider.as_deref(), Some("libfabric"));
        assert_eq!(value(&o.router_args, "--mode").as_deref(), Some("exact"));
        assert_eq!(o.worker_args.len(), 3, "{:?}", o.worker_args);
        let mut o = options(&["--link=shm"], &[]);
        agree_link_flags(&mut o).unwrap();
        assert_eq!(o.router_args.len(), 1);
        assert_eq!(value(&o.worker_args, "--link").as_deref(), Some("shm"));
        assert!(agree_link_flags(&mut options(&["--link", "shm"], &["--link=shm"])).is_ok());
        let e = agree_link_flags(&mut options(&["--link", "tcp"], &["--link", "rdma"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("must agree"), "{e}");
    }
}
