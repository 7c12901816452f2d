//! `expertmesh keys init|issue`: the cluster's credentials without a PKI.
//!
//! Why this exists: an operator needs one command to make every principal's own keys.
//! `keys init` writes a random 32-byte cluster master key (mode 0600, never overwritten);
//! `keys issue` derives one principal's credential file from it and the topology
//! ([`expertmesh_fabric::credentials::issue`]). The master key stays on the operator's
//! machine; each host gets only its processes' files.

use anyhow::{anyhow, bail};
use clap::{Args, Subcommand};
use expertmesh_fabric::credentials::{Principal, issue};
use expertmesh_transport::crypto::{self, Key};
use std::path::PathBuf;
use std::process::ExitCode;

/// Exit codes of `keys init` and `keys issue`, shown by their --help.
pub(crate) const KEYS_EXIT: &str = "Exit codes: 0 written; 2 the file exists (never overwritten), an unreadable or malformed key or topology, an unknown device or router, bad options (1 is not used).";

/// `expertmesh keys ...`.
#[derive(Subcommand, Debug)]
pub(crate) enum KeysCli {
    /// Write a new random cluster master key (mode 0600; an existing file is never
    /// overwritten). Keep it on the operator's machine: it derives every credential.
    #[command(after_help = KEYS_EXIT)]
    Init {
        /// Where to write the key.
        #[arg(long)]
        out: PathBuf,
    },
    /// Issue one principal's credential file from the master key and the topology: a device
    /// (worker), a router instance, or a named frontend.
    #[command(after_help = KEYS_EXIT)]
    Issue(IssueArgs),
}

/// `expertmesh keys issue`.
#[derive(Args, Debug)]
pub(crate) struct IssueArgs {
    /// The cluster master key (`expertmesh keys init`).
    #[arg(long)]
    key: PathBuf,
    /// Topology file (cluster name, routers and devices).
    #[arg(long)]
    topology: PathBuf,
    /// A device to issue for: its id ("node/device") or topology rank.
    #[arg(long, group = "principal")]
    device: Option<String>,
    /// A router instance to issue for.
    #[arg(long, group = "principal")]
    router: Option<u32>,
    /// A frontend (serving client) name to issue for.
    #[arg(long, group = "principal")]
    frontend: Option<String>,
    /// Where to write the credential file (mode 0600; never overwritten).
    #[arg(long)]
    out: PathBuf,
}

/// A secret file could not be written: "refusing to overwrite" only where it exists (secret
/// files are created, never replaced), otherwise the cause (a missing folder, permissions).
fn writing(what: &str, e: crypto::KeyError) -> anyhow::Error {
    let exists = matches!(&e, crypto::KeyError::Io { error, .. }
        if error.kind() == std::io::ErrorKind::AlreadyExists);
    if exists {
        anyhow!("writing {what} (refusing to overwrite): {e}")
    } else {
        anyhow!("writing {what}: {e}")
    }
}

/// Run `expertmesh keys`.
pub(crate) fn run(cli: KeysCli) -> anyhow::Result<ExitCode> {
    match cli {
        KeysCli::Init { out } => {
            let key = Key::random()?;
            crypto::write_secret_file(&out, &crypto::master_key_text(&key))
                .map_err(|e| writing("the cluster master key", e))?;
            println!(
                "wrote the cluster master key to {} (mode 0600); issue credentials with `expertmesh keys issue --key {} ...`",
                out.display(),
                out.display()
            );
        }
        KeysCli::Issue(a) => {
            let master = crypto::load_master_key(&a.key)?;
            let topo = expertmesh_topology::topology::Topology::load(&a.topology)
                .map_err(|e| anyhow!("{e}"))?;
            let who = principal(&a)?;
            let creds = issue(&master, &topo, &who)?;
            crypto::write_secret_file(&a.out, &creds.to_file_text())
                .map_err(|e| writing("the credential file", e))?;
            println!(
                "wrote {}'s credential to {} (mode 0600)",
                who.describe(),
                a.out.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The one principal `keys issue` was asked for.
fn principal(a: &IssueArgs) -> anyhow::Result<Principal> {
    match (&a.device, a.router, &a.frontend) {
        (Some(d), None, None) => Ok(Principal::Device(d.clone())),
        (None, Some(r), None) => Ok(Principal::Router(r)),
        (None, None, Some(f)) => Ok(Principal::Frontend(f.clone())),
        _ => bail!("give exactly one of --device NODE/DEV, --router I or --frontend NAME"),
    }
}
