//! `expertmesh deploy slurm|kubernetes|systemd`: the files that run a fabric on a cluster
//! engine.
//!
//! Why this exists: a cluster builder describes the cluster once (topology, model and
//! placement, or converted weights) and should not start routers and workers by hand on every
//! host. This command turns its arguments into [`expertmesh_fabric::engines`]' options, writes
//! the bundle and the engine's files, and prints the commands that start, update and stop it.

use crate::args::DeployArgs;
use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use expertmesh_fabric::engines::{
    DeployOptions, Engine, Plan, Source, kubernetes::KubernetesOptions, slurm::SlurmOptions,
    systemd::SystemdOptions,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

/// Exit codes of `deploy`, shown by its --help.
pub(crate) const DEPLOY_EXIT: &str = "Exit codes: 0 written; 2 an unreadable or invalid topology, model, placement, weights or key, bad options, or a failed write (1 is not used).";

/// `expertmesh deploy ...`.
#[derive(Subcommand, Debug)]
pub(crate) enum DeployCli {
    /// One Slurm batch job: one task per process on its host (`srun --distribution=arbitrary`),
    /// failed processes restarted by the entry script, `scancel` drains and stops.
    #[command(after_help = DEPLOY_EXIT)]
    Slurm {
        #[command(flatten)]
        common: CommonArgs,
        /// Slurm partition.
        #[arg(long)]
        partition: Option<String>,
        /// Slurm account.
        #[arg(long)]
        account: Option<String>,
        /// Time limit, in Slurm's syntax (e.g. 7-00:00:00).
        #[arg(long)]
        time: Option<String>,
        /// Restarts of a failed process before it is left down (0: none).
        #[arg(long, default_value_t = 3)]
        restarts: u32,
        /// Where --out is on the cluster's nodes (default: its absolute path here, e.g. on a
        /// shared filesystem).
        #[arg(long)]
        bundle_path: Option<String>,
        /// One more `#SBATCH` directive for the job, one word (e.g. --sbatch-arg=--gres=gpu:8
        /// where the cluster schedules GPUs as generic resources: a job sees none it did not
        /// ask for; --sbatch-arg=--qos=serve); repeat per directive.
        #[arg(long = "sbatch-arg", value_name = "ARG", allow_hyphen_values = true)]
        sbatch_args: Vec<String>,
    },
    /// Kubernetes manifests: a ConfigMap, one Secret and one Deployment per process (pinned to
    /// its node, host network, probes), a Service per router, PodDisruptionBudgets.
    #[command(after_help = DEPLOY_EXIT)]
    Kubernetes {
        #[command(flatten)]
        common: CommonArgs,
        /// Container image holding the expertmesh binary (and /bin/sh).
        #[arg(long)]
        image: String,
        /// Namespace of every object (default: kubectl's).
        #[arg(long)]
        namespace: Option<String>,
        /// Extended resource a GPU device's pod asks for.
        #[arg(long, default_value = "amd.com/gpu")]
        gpu_resource: String,
        /// Extended resource every pod asks for when its links are RDMA (the RDMA device
        /// plugin's, e.g. rdma/hca_shared_devices_a); also adds IPC_LOCK.
        #[arg(long)]
        rdma_resource: Option<String>,
        /// Run every pod as this user (and group; default: the user's number), not as the
        /// image's; a worker's --tile-cache folder is then given to that user by an init
        /// container running as root (the kubelet makes it root's).
        #[arg(long, value_name = "UID[:GID]", value_parser = parse_run_as)]
        run_as_user: Option<(u32, u32)>,
    },
    /// One systemd unit per process, per host, and the list of which goes where.
    #[command(after_help = DEPLOY_EXIT)]
    Systemd {
        #[command(flatten)]
        common: CommonArgs,
        /// Where each host keeps the bundle (default /etc/expertmesh/CLUSTER).
        #[arg(long)]
        install_dir: Option<String>,
    },
}

/// What every engine takes.
#[derive(Args, Debug)]
pub(crate) struct CommonArgs {
    #[command(flatten)]
    deploy: DeployArgs,
    /// Output folder (created; files of an earlier run are replaced).
    #[arg(long)]
    out: PathBuf,
    /// The cluster master key (`expertmesh keys init`): each process gets its own credential
    /// derived from it; the key itself is written nowhere.
    #[arg(long)]
    key: Option<PathBuf>,
    /// Run without credentials on non-loopback addresses (unauthenticated, unencrypted).
    #[arg(long, conflicts_with = "key")]
    insecure: bool,
    /// A serving client to issue a credential for (frontends/NAME.cred); repeat for more.
    #[arg(long = "frontend", value_name = "NAME")]
    frontends: Vec<String>,
    /// The engine's name of a topology node's host (Slurm node, Kubernetes node, ssh host;
    /// a name, not an address), NODE=HOST; repeat per node. Default: the node's name.
    #[arg(long = "host", value_name = "NODE=HOST")]
    hosts: Vec<String>,
    /// The expertmesh binary on the hosts.
    #[arg(long, default_value = "expertmesh")]
    bin: String,
    /// The weights folder's path on every host, absolute (default: --weights, made
    /// absolute).
    #[arg(long)]
    weights_on_hosts: Option<String>,
    /// First metrics and health port: process I (routers, then devices in topology order)
    /// serves /metrics, /live and /ready on its node's address at this port + I.
    #[arg(long, default_value_t = 9400)]
    metrics_port: u16,
    /// An extra argument for every router (e.g. --router-arg=--mode --router-arg=exact);
    /// repeat per argument.
    #[arg(long = "router-arg", value_name = "ARG", allow_hyphen_values = true)]
    router_args: Vec<String>,
    /// An extra argument for every worker (e.g. --worker-arg=--link --worker-arg=rdma);
    /// --link and --rdma-provider, given to either side, go to routers and workers alike
    /// (they must agree).
    #[arg(long = "worker-arg", value_name = "ARG", allow_hyphen_values = true)]
    worker_args: Vec<String>,
}

impl CommonArgs {
    fn options(&self) -> anyhow::Result<DeployOptions> {
        if self.deploy.weights.is_none()
            && let Some(p) = &self.weights_on_hosts
        {
            anyhow::bail!(
                "--weights-on-hosts {p:?} without --weights: it says where the converted weights \
                 are on the hosts; give --weights too (synthetic weights need no folder)"
            );
        }
        let source = match &self.deploy.weights {
            Some(w) => Source::Weights {
                on_hosts: match &self.weights_on_hosts {
                    Some(p) if !p.starts_with('/') => anyhow::bail!(
                        "--weights-on-hosts {p:?}: give the folder's absolute path on the hosts \
                         (a relative one would be read from each process's working directory)"
                    ),
                    Some(p) => p.clone(),
                    None => std::path::absolute(w)
                        .with_context(|| format!("the weights folder {}", w.display()))?
                        .display()
                        .to_string(),
                },
            },
            None => Source::Synthetic {
                model: self.deploy.model.clone().unwrap_or_default(),
                placement: self.deploy.placement.clone().unwrap_or_default(),
                seed: self.deploy.seed,
            },
        };
        let mut hosts = BTreeMap::new();
        for h in &self.hosts {
            let Some((node, host)) = h
                .split_once('=')
                .filter(|(n, h)| !n.is_empty() && !h.is_empty())
            else {
                bail!(
                    "--host {h:?}: write NODE=HOST (a topology node's name = the engine's host name)"
                );
            };
            if host.parse::<std::net::IpAddr>().is_ok() {
                bail!(
                    "--host {h:?}: {host:?} is an address; give the host's name as the engine \
                     names it (its hostname for systemd, the Slurm node name, the Kubernetes node \
                     name): each process checks that it runs there by that name"
                );
            }
            if !expertmesh_topology::topology::is_valid_host(host) {
                bail!(
                    "--host {h:?}: {host:?} is not a host name (letters, digits, '-' and '.', as \
                     the engine names its hosts)"
                );
            }
            if hosts.insert(node.to_owned(), host.to_owned()).is_some() {
                bail!("--host: node {node:?} given twice");
            }
        }
        extra_args_parse("router", "--router-arg", &self.router_args)?;
        extra_args_parse("worker", "--worker-arg", &self.worker_args)?;
        let master_key = match &self.key {
            Some(k) => Some(expertmesh_transport::crypto::load_master_key(k)?),
            None => None,
        };
        Ok(DeployOptions {
            topology: self.deploy.topology.clone(),
            source,
            out: self.out.clone(),
            master_key,
            insecure: self.insecure,
            frontends: self.frontends.clone(),
            hosts,
            bin: self.bin.clone(),
            metrics_port: self.metrics_port,
            router_args: self.router_args.clone(),
            worker_args: self.worker_args.clone(),
        })
    }
}

/// `--router-arg`/`--worker-arg`: parsed as this binary's `expertmesh COMPONENT` parses
/// them, so a mistyped flag or a bad value is refused here, not by every process on every
/// node when the fabric starts. What deploy itself adds (topology, addresses, credentials) is
/// left out, so the only errors accepted are the one saying such a required flag is missing
/// and a host name that does not resolve here (it may inside the cluster); a flag deploy sets
/// itself is refused by the engines' plan.
fn extra_args_parse(component: &str, flag: &str, extra: &[String]) -> anyhow::Result<()> {
    use clap::Parser;
    use clap::error::ErrorKind;
    use expertmesh_fabric::endpoint::EndpointError;
    if extra.is_empty() {
        return Ok(());
    }
    let argv = ["expertmesh", component]
        .into_iter()
        .map(str::to_owned)
        .chain(extra.iter().cloned());
    match crate::cli::Cli::try_parse_from(argv) {
        Ok(_) => Ok(()),
        // Missing only what deploy adds itself (not a flag an extra argument requires).
        Err(e)
            if e.kind() == ErrorKind::MissingRequiredArgument
                && missing_args(&e)
                    .iter()
                    .all(|m| expertmesh_fabric::engines::SET_BY_DEPLOY.contains(&m.as_str())) =>
        {
            Ok(())
        }
        // A host name only the cluster resolves (its nodes' names), not this machine.
        Err(e)
            if e.kind() == ErrorKind::ValueValidation
                && std::error::Error::source(&e)
                    .and_then(|s| s.downcast_ref::<EndpointError>())
                    .is_some_and(|s| matches!(s, EndpointError::Unresolved { .. })) =>
        {
            Ok(())
        }
        Err(e) => {
            let rendered = e.render().to_string();
            // clap's message and its tip, without the usage lines after them.
            let said = rendered
                .split("\n\nUsage:")
                .next()
                .unwrap_or(&rendered)
                .trim()
                .trim_start_matches("error: ");
            bail!(
                "{flag} {}: `expertmesh {component}` would not start with it: {said}",
                extra.join(" ")
            )
        }
    }
}

/// The flags a clap "required arguments were not provided" error names (`--tile-cache`
/// of `--tile-cache <DIR>`).
fn missing_args(e: &clap::Error) -> Vec<String> {
    use clap::error::{ContextKind, ContextValue};
    match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::Strings(v)) => v
            .iter()
            .map(|a| a.split_whitespace().next().unwrap_or(a).to_owned())
            .collect(),
        Some(ContextValue::String(a)) => {
            vec![a.split_whitespace().next().unwrap_or(a).to_owned()]
        }
        _ => Vec::new(),
    }
}

/// Run `expertmesh deploy`.
pub(crate) fn run(cli: DeployCli) -> anyhow::Result<ExitCode> {
    let (common, engine) = match cli {
        DeployCli::Slurm {
            common,
            partition,
            account,
            time,
            restarts,
            bundle_path,
            sbatch_args,
        } => (
            common,
            Engine::Slurm(SlurmOptions {
                partition,
                account,
                time,
                restarts,
                bundle_path,
                sbatch_args,
            }),
        ),
        DeployCli::Kubernetes {
            common,
            image,
            namespace,
            gpu_resource,
            rdma_resource,
            run_as_user,
        } => (
            common,
            Engine::Kubernetes(KubernetesOptions {
                image,
                namespace,
                gpu_resource,
                rdma_resource,
                run_as: run_as_user,
            }),
        ),
        DeployCli::Systemd {
            common,
            install_dir,
        } => (common, Engine::Systemd(SystemdOptions { install_dir })),
    };
    let dep = common.deploy.load()?;
    let plan = Plan::new(dep, common.options()?)?;
    let written = plan.write(&engine)?;
    println!(
        "expertmesh deploy {}: fabric {:?} (generation {}), {} processes on {} hosts, {} files in {}",
        engine.name(),
        plan.dep.topology.name(),
        plan.generation,
        plan.processes.len(),
        plan.hosts().len(),
        written.files.len(),
        common.out.display()
    );
    for p in &plan.processes {
        println!(
            "  {:<10} on {:<16} health http://{}:{}/ready",
            p.name, p.host, p.address, p.metrics_port
        );
    }
    if !written.removed.is_empty() {
        let shown: Vec<String> = written
            .removed
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        println!(
            "  removed {} files of an earlier deploy that this one does not have: {}",
            shown.len(),
            shown.join(", ")
        );
    }
    if plan.credentials.is_empty() {
        println!(
            "  no credentials (--insecure or loopback): traffic is unauthenticated and unencrypted"
        );
    }
    for step in &written.next_steps {
        println!("{step}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `--run-as-user UID[:GID]`: numeric ids (the group defaults to the user's number).
fn parse_run_as(s: &str) -> Result<(u32, u32), String> {
    let id = |t: &str| {
        t.trim()
            .parse::<u32>()
            .map_err(|_| format!("{s:?}: give numeric ids, UID or UID:GID (e.g. 1000:1000)"))
    };
    match s.split_once(':') {
        Some((u, g)) => Ok((id(u)?, id(g)?)),
        None => id(s).map(|u| (u, u)),
    }
}
