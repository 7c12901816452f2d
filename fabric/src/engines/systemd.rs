//! systemd: one unit per process, per host, for bare metal.
//!
//! Why this exists: bare-metal clusters run their services under systemd. Each host gets the
//! bundle's `fabric/` at `--install-dir` and one unit per process it runs,
//! `systemd/HOST/expertmesh-CLUSTER-PROCESS.service`: `launch.sh PROCESS` with the host's name
//! (`%H`) checked against the process's; its credential handed over by systemd
//! (`LoadCredential=`, so only the unit reads it); `Restart=on-failure`; SIGTERM to stop
//! (routers drain, `TimeoutStopSec` their drain and 30 s, at least 60); hardening that leaves `/dev/shm` and the GPU and RDMA
//! devices usable (`ProtectSystem=strict` keeps `/dev` writable; no `PrivateDevices`,
//! `LimitMEMLOCK=infinity` for RDMA memory registration and a tile cache's lock;
//! `ReadWritePaths=` for the folder of a router's `--load-stats` file and a worker's
//! `--tile-cache` folder, which `hosts.txt` creates first). `systemd/hosts.txt` says which unit
//! goes on which host and the commands to install, start, check, update and stop them.

use super::launch::quote;
use super::{Plan, Writer};
use crate::FabricError;
use std::path::Path;

/// systemd's settings.
#[derive(Debug, Clone)]
pub struct SystemdOptions {
    /// Where each host keeps the bundle's `fabric/` and `credentials/` (default
    /// `/etc/expertmesh/CLUSTER`).
    pub install_dir: Option<String>,
}

/// Write the units and `systemd/hosts.txt`; the next steps.
pub(super) fn write(
    plan: &Plan,
    o: &SystemdOptions,
    w: &mut Writer,
) -> Result<Vec<String>, FabricError> {
    let c = plan.cluster_label();
    let dir = o
        .install_dir
        .clone()
        .unwrap_or_else(|| format!("/etc/expertmesh/{c}"));
    if !dir.starts_with('/') || dir.chars().any(|ch| ch.is_whitespace() || ch == '%') {
        return Err(FabricError::Engine(format!(
            "--install-dir {dir:?}: give an absolute path without spaces or '%'"
        )));
    }
    // The bundle's folder on this machine, one shell word in the copy commands.
    let out = quote(&plan.opts.out.display().to_string());
    let mut hosts = format!(
        "# ExpertMesh fabric {:?}, generation {}: which unit goes on which host.\n\
         # On each host: copy the files, then enable and start its units.\n",
        plan.dep.topology.name(),
        plan.generation
    );
    for host in plan.hosts() {
        let units: Vec<String> = plan
            .on_host(&host)
            .map(|p| format!("expertmesh-{c}-{}.service", p.name))
            .collect();
        for p in plan.on_host(&host) {
            let unit = unit(plan, p, &dir)?;
            let path = Path::new("systemd")
                .join(&host)
                .join(format!("expertmesh-{c}-{}.service", p.name));
            w.file(&path, unit.as_bytes(), false)?;
        }
        let creds: Vec<String> = plan
            .on_host(&host)
            .filter(|p| plan.credentials.contains_key(&p.name))
            .map(|p| format!("{out}/credentials/{}.cred", p.name))
            .collect();
        hosts += &format!("\n[{host}] {}\n", units.join(" "));
        hosts += &format!(
            // Root's files on the host, not the copying user's: `rsync -a` of a folder keeps the
            // local owner and mode of the folder itself and of every file in it.
            "  ssh {h} mkdir -p -m 755 {dir}/fabric && ssh {h} mkdir -p -m 700 {dir}/credentials && rsync -rlpt --chown=root:root --chmod=D755,Fgo-w {out}/fabric/ {h}:{dir}/fabric/\n",
            h = quote(&host)
        );
        // A unit's writable folders must exist before it starts (ReadWritePaths=).
        let mut folders: Vec<String> = Vec::new();
        for p in plan.on_host(&host) {
            let cache = super::flag_values(&p.args, "--tile-cache");
            for f in written_paths(&p.args)?.into_iter().chain(cache) {
                if !folders.contains(&f) {
                    folders.push(f);
                }
            }
        }
        if !folders.is_empty() {
            let quoted: Vec<String> = folders.iter().map(|f| quote(f)).collect();
            hosts += &format!(
                "  ssh {h} mkdir -p -m 700 {}\n",
                quoted.join(" "),
                h = quote(&host)
            );
        }
        if !creds.is_empty() {
            hosts += &format!(
                "  rsync -lpt --chown=root:root --chmod=F600 {} {h}:{dir}/credentials/\n",
                creds.join(" "),
                h = quote(&host)
            );
        }
        // The unit files only (not their folder, whose owner and mode `rsync` would give
        // /etc/systemd/system), owned by root.
        let unit_files: Vec<String> = units
            .iter()
            .map(|u| format!("{out}/systemd/{}/{u}", quote(&host)))
            .collect();
        hosts += &format!(
            "  rsync -lpt --chown=root:root --chmod=F644 {} {h}:/etc/systemd/system/ && ssh {h} 'systemctl daemon-reload && systemctl enable --now {}'\n",
            unit_files.join(" "),
            units.join(" "),
            h = quote(&host)
        );
    }
    hosts += &format!(
        "\ncheck:  systemctl status 'expertmesh-{c}-*'; curl http://ADDRESS:PORT/ready (processes.tsv lists each health address)\n\
         update: re-run deploy, copy again, then on each host in turn: systemctl restart 'expertmesh-{c}-*'\n\
         stop:   systemctl disable --now 'expertmesh-{c}-*' (SIGTERM: routers drain, workers finish)\n"
    );
    w.file(Path::new("systemd/hosts.txt"), hosts.as_bytes(), false)?;
    Ok(vec![
        format!(
            "install: follow {out}/systemd/hosts.txt on each host (copy, then systemctl enable --now)"
        ),
        format!("check:   systemctl status 'expertmesh-{c}-*' on each host"),
        format!("stop:    systemctl disable --now 'expertmesh-{c}-*'"),
    ])
}

/// The folders of the files a process's arguments tell it to write (`--load-stats FILE`),
/// for `ReadWritePaths=`.
fn written_paths(args: &[super::launch::Arg]) -> Result<Vec<String>, FabricError> {
    let mut out = Vec::new();
    for file in super::flag_values(args, "--load-stats") {
        // One word in ReadWritePaths= and in hosts.txt's mkdir (systemd splits on spaces and
        // expands '%'), as a tile cache's folder.
        let plain = !file
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '%' | '"' | '\'' | '\\'));
        let folder = std::path::Path::new(&file)
            .parent()
            .filter(|p| p.is_absolute() && plain)
            .ok_or_else(|| {
                FabricError::Engine(format!(
                    "--load-stats {file}: give an absolute path without spaces, '%' or quotes under systemd (the unit's file system is read-only but for that file's folder)"
                ))
            })?
            .display()
            .to_string();
        if !out.contains(&folder) {
            out.push(folder);
        }
    }
    Ok(out)
}

/// The unit of process `p` (the bundle installed at `dir` on its host).
/// `value` inside a double-quoted unit-file assignment (`Environment="NAME=value"`):
/// backslashes and quotes escaped, `%` doubled (a unit-file specifier otherwise); a newline
/// cannot be written and is refused.
fn unit_quoted(value: &str) -> Result<String, FabricError> {
    if value.contains('\n') {
        return Err(FabricError::Engine(format!(
            "--bin {value:?}: a path with a line break cannot go into a systemd unit"
        )));
    }
    Ok(value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('%', "%%"))
}

fn unit(plan: &Plan, p: &super::Process, dir: &str) -> Result<String, FabricError> {
    let role = match &p.role {
        super::Role::Router(i) => format!("router {i}"),
        super::Role::Worker(_, id) => format!("worker of device {id}"),
    };
    let mut s = format!(
        "# ExpertMesh fabric {:?}, generation {}: written by `expertmesh deploy systemd`; do not edit.\n\
         [Unit]\n\
         Description=ExpertMesh {}: {role}\n\
         After=network-online.target\n\
         Wants=network-online.target\n\
         StartLimitIntervalSec=300\n\
         StartLimitBurst=10\n\
         \n\
         [Service]\n\
         Type=simple\n\
         ExecStart=/bin/sh {dir}/fabric/launch.sh {}\n\
         Environment=EXPERTMESH_NODE=%H\n\
         Environment=\"EXPERTMESH_BIN={}\"\n",
        plan.dep.topology.name(),
        p.generation,
        plan.dep.topology.name().replace(['\n', '%'], "_"),
        p.name,
        unit_quoted(&plan.opts.bin)?,
    );
    if plan.credentials.contains_key(&p.name) {
        s += &format!(
            "LoadCredential={n}.cred:{dir}/credentials/{n}.cred\n",
            n = p.name
        );
    }
    // ProtectSystem=strict makes the file system read-only: a file the process writes (the
    // router's --load-stats) needs its folder writable, and so does a worker's tile cache
    // (`-`: a missing cache folder must not keep the worker from starting; it repacks).
    for path in written_paths(&p.args)? {
        s += &format!("ReadWritePaths={path}\n");
    }
    for path in super::flag_values(&p.args, "--tile-cache") {
        s += &format!("ReadWritePaths=-{path}\n");
    }
    s += &format!(
        "Restart=on-failure\nRestartSec=2\nKillSignal=SIGTERM\nTimeoutStopSec={}\n",
        super::stop_grace_s(p)
    );
    s += "LimitMEMLOCK=infinity\n\
          LimitNOFILE=65536\n\
          NoNewPrivileges=yes\n\
          ProtectSystem=strict\n\
          ProtectHome=read-only\n\
          PrivateTmp=yes\n\
          ProtectKernelTunables=yes\n\
          ProtectKernelModules=yes\n\
          ProtectControlGroups=yes\n\
          RestrictSUIDSGID=yes\n\
          LockPersonality=yes\n\
          \n\
          [Install]\n\
          WantedBy=multi-user.target\n";
    Ok(s)
}
