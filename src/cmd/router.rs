//! `expertmesh router`: the router service of a deployment, until Ctrl-C.
//!
//! Why this exists: a multi-host deployment runs one of these per `[[router]]` of its topology
//! (the local launcher starts the same service in its own process); this module turns
//! arguments into the router core, the mesh and frontend listeners, and the observers.

use crate::args::{
    AutoRebalanceArgs, DeployArgs, LinkTimeoutArgs, ObserveArgs, RouterArgs, SecurityArgs,
    link_parser, parse_endpoint, rdma_provider_parser,
};
use anyhow::anyhow;
use clap::Args;
use expertmesh_fabric::local::frontend_config;
use expertmesh_fabric::observe;
use expertmesh_router::service::{RouterService, ServiceConfig};
use expertmesh_transport::mesh::LinkKind;
use expertmesh_worker::shared::router_core;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

/// `expertmesh router`.
#[derive(Args, Debug)]
pub(crate) struct RouterCli {
    #[command(flatten)]
    deploy: DeployArgs,
    #[command(flatten)]
    router: RouterArgs,
    /// Which router of the topology this is (0-based, in the order of its `[[router]]`
    /// tables; several routers share the same workers).
    #[arg(long, default_value_t = 0)]
    instance: u32,
    /// Frontend listen address (default: this router's section of the topology).
    #[arg(long, value_parser = parse_endpoint)]
    listen: Option<SocketAddr>,
    /// Mesh listen address for workers (default: this router's mesh_port, or its node's
    /// control port).
    #[arg(long, value_parser = parse_endpoint)]
    mesh_listen: Option<SocketAddr>,
    /// Link kind workers use (must match the workers' --link).
    #[arg(long, default_value = "tcp", value_parser = link_parser(&LinkKind::ALL))]
    link: LinkKind,
    /// The NIC under RDMA links (must match the workers' --rdma-provider): verbs, libfabric or
    /// `libfabric:<provider>`.
    #[arg(long, default_value = "verbs", value_parser = rdma_provider_parser)]
    rdma_provider: expertmesh_transport::rdma::RdmaProvider,
    #[command(flatten)]
    link_timeout: LinkTimeoutArgs,
    /// Threads for shared experts run on the router.
    #[arg(long, default_value_t = 1, value_parser = crate::args::threads_parser())]
    threads: usize,
    /// On SIGTERM or SIGINT, how long to keep answering the requests already admitted (new
    /// ones are refused, saying the router is draining) before exiting.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS", value_parser = crate::args::parse_seconds)]
    drain_timeout_s: f64,
    #[command(flatten)]
    observe: ObserveArgs,
    #[command(flatten)]
    auto: AutoRebalanceArgs,
    #[command(flatten)]
    security: SecurityArgs,
}

/// Run `expertmesh router` until interrupted.
pub(crate) fn run(cli: RouterCli) -> anyhow::Result<ExitCode> {
    let mut dep = cli.deploy.load()?;
    cli.link_timeout.apply(&mut dep);
    let instance = cli.instance;
    let frontend_of = |dep: &expertmesh_worker::deploy::Deployment| {
        let mut f = frontend_config(dep);
        f.server_rank = instance;
        cli.router.frontend_limits().apply(&mut f);
        f
    };
    // Before the core, which sizes buffers from these limits.
    expertmesh_router::service::check_limits(
        &cli.router.config(),
        dep.spec.hidden as usize,
        frontend_of(&dep).codec.max_frame_bytes,
    )
    .map_err(|e| anyhow!("{e}"))?;
    let core = router_core(&dep, cli.router.config(), cli.threads, instance)?;
    let mesh_listen = match cli.mesh_listen {
        Some(a) => a,
        None => dep.router_mesh_endpoint(instance)?,
    };
    let listen = match cli.listen {
        Some(a) => a,
        None => dep.router_frontend_endpoint(instance)?,
    };
    cli.security
        .security()
        .apply_rank(&mut dep, instance, &[mesh_listen, listen])?;
    let mut mesh = dep.mesh_config(instance, &[], &[], mesh_listen, cli.link);
    mesh.rdma_provider = cli.rdma_provider.clone();
    let service = RouterService::start(
        core,
        mesh,
        ServiceConfig {
            frontend_listen: listen,
            frontend: frontend_of(&dep),
            max_outstanding_per_client: 32,
        },
    )
    .map_err(|e| anyhow!("{e}"))?;
    println!(
        "expertmesh router {instance} of {}: model {} on {} devices; frontends connect to {}, workers to {}",
        dep.router_count(),
        dep.spec.name,
        dep.topology.devices().len(),
        service.frontend_addr(),
        service
            .mesh_addr()
            .map_or_else(|| "?".into(), |a| a.to_string())
    );
    let observers = observe::start(&cli.observe.options(), &[&service], &dep.spec)?;
    let auto = cli.auto.start(instance, &service, &dep)?;
    let signal = expertmesh_fabric::process::wait_for_stop_signal()?;
    let drain = Duration::from_secs_f64(cli.drain_timeout_s);
    println!(
        "expertmesh router {instance}: {signal}: draining (up to {:.0} s)",
        drain.as_secs_f64()
    );
    let left = service.drain(drain);
    if left > 0 {
        eprintln!(
            "expertmesh router {instance}: {left} requests unanswered (or their answers untaken) after {:.0} s of draining; they fail as the router stops",
            drain.as_secs_f64()
        );
    }
    drop(auto);
    drop(observers);
    drop(service);
    println!("expertmesh router {instance}: stopped");
    Ok(ExitCode::SUCCESS)
}
