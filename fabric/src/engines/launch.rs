//! `launch.sh`: the one entry point every engine runs.
//!
//! Why this exists: Slurm tasks, Kubernetes containers and systemd units must each start one
//! process of the fabric with that process's arguments and files, and find which one from
//! what the engine gives them. One POSIX shell script, generated from the plan, does that for
//! all three, so what runs is the same whatever starts it (and the tests run it as is):
//!
//! - the process: the first argument, else `$EXPERTMESH_PROCESS`, else Slurm's
//!   `$SLURM_PROCID` (task `i` runs process `i` of `processes.tsv`);
//! - the host check: when the engine names the host (`$EXPERTMESH_NODE`, which the Kubernetes
//!   manifests set from the node name and the systemd units from `%H`, else Slurm's
//!   `$SLURMD_NODENAME`), it must be the process's host, or the script refuses to start;
//! - files: relative to the script's folder; credentials from systemd's
//!   `$CREDENTIALS_DIRECTORY`, else `$EXPERTMESH_CREDENTIALS_DIR`, else `../credentials`;
//!   the binary from `$EXPERTMESH_BIN`, else the one `deploy` was told;
//! - a GPU worker in a container that sees only its device plugin's GPU gets
//!   `--gpu-index $EXPERTMESH_GPU_INDEX` (the Kubernetes manifests set it to 0);
//! - a worker's `--tile-cache` folder is created private (mode 0700) when missing, and made
//!   private when empty (a Kubernetes emptyDir starts world-writable);
//! - restarts: with `$EXPERTMESH_RESTARTS` = N > 0 (the Slurm job sets it) the script keeps
//!   the process as a child, restarts it after a failure up to N times,
//!   `$EXPERTMESH_RESTART_PAUSE_S` (default 2) seconds apart, and on SIGTERM/SIGINT passes
//!   the signal on and exits with the process's status (0 when it comes during a pause,
//!   which it ends); otherwise it `exec`s the process (Kubernetes and systemd restart it
//!   themselves).

use super::Plan;

/// One argument of a process's command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arg {
    /// Literal text.
    Lit(String),
    /// A file of the bundle's `fabric/` folder.
    File(String),
    /// The credential file of the named process.
    Credential(String),
}

impl Arg {
    /// A literal.
    pub fn lit(s: &str) -> Self {
        Arg::Lit(s.to_owned())
    }

    /// The argument in shell syntax (`$here` the script's folder, `$creds` the credentials').
    fn shell(&self) -> String {
        match self {
            Arg::Lit(s) => quote(s),
            Arg::File(f) => format!("\"$here\"/{}", quote(f)),
            Arg::Credential(p) => format!("\"$creds\"/{}", quote(&format!("{p}.cred"))),
        }
    }
}

/// `s` as one POSIX shell word (single-quoted unless it is plainly safe).
pub fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The script's text for `plan`.
// long-fn: one shell template (the script's text), filled in per process
pub fn script(plan: &Plan) -> String {
    let names: Vec<&str> = plan.processes.iter().map(|p| p.name.as_str()).collect();
    let mut s = format!(
        r#"#!/bin/sh
# ExpertMesh fabric "{cluster}", generation {generation}: written by `expertmesh deploy`; do not edit
# (re-run deploy). Runs one process of the fabric:
#   launch.sh PROCESS   or   EXPERTMESH_PROCESS=PROCESS launch.sh   or as Slurm task $SLURM_PROCID
# Processes: {list}
set -eu
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
bin=${{EXPERTMESH_BIN:-{bin}}}
creds=${{CREDENTIALS_DIRECTORY:-${{EXPERTMESH_CREDENTIALS_DIR:-$here/../credentials}}}}
proc=${{1:-${{EXPERTMESH_PROCESS:-}}}}
tiles=
if [ -z "$proc" ] && [ -n "${{SLURM_PROCID:-}}" ]; then
  case "$SLURM_PROCID" in
"#,
        cluster = plan.dep.topology.name().replace(['"', '\n'], "_"),
        generation = plan.generation,
        list = names.join(" "),
        bin = quote(&plan.opts.bin),
    );
    for (i, p) in plan.processes.iter().enumerate() {
        s += &format!("    {i}) proc={} ;;\n", p.name);
    }
    s += r#"    *) echo "launch.sh: Slurm task $SLURM_PROCID has no process (the job must have one task per process)" >&2; exit 2 ;;
  esac
fi
case "$proc" in
"#;
    for p in &plan.processes {
        let args: Vec<String> = p.args.iter().map(Arg::shell).collect();
        let tiles = match super::flag_values(&p.args, "--tile-cache").pop() {
            Some(dir) => format!(" tiles={};", quote(&dir)),
            None => String::new(),
        };
        s += &format!(
            "  {name}) host={host};{tiles} set -- {args} ;;\n",
            name = p.name,
            host = quote(&p.host),
            args = args.join(" ")
        );
    }
    s += &format!(
        r#"  '') echo "launch.sh: which process? Give it as the argument or in EXPERTMESH_PROCESS (one of: {list})" >&2; exit 2 ;;
  *) echo "launch.sh: no process '$proc' in fabric \"{cluster}\" (one of: {list})" >&2; exit 2 ;;
esac
# A container that sees only the GPU its device plugin gave it: that GPU is index 0 there.
if [ "$1" = worker ] && [ -n "${{EXPERTMESH_GPU_INDEX:-}}" ]; then
  set -- "$@" --gpu-index "$EXPERTMESH_GPU_INDEX"
fi
node=${{EXPERTMESH_NODE:-${{SLURMD_NODENAME:-}}}}
if [ -n "$node" ] && [ "$node" != "$host" ]; then
  echo "launch.sh: $proc belongs on host $host, but this is $node: check the engine's placement (deploy --host NODE=HOST)" >&2
  exit 2
fi
# A worker's tile cache folder must be private: made so when missing, or when empty (a
# Kubernetes emptyDir starts world-writable); a folder already in use is left as it is.
if [ -n "$tiles" ]; then
  if [ ! -e "$tiles" ]; then
    (umask 077 && mkdir -p -- "$tiles") \
      || echo "launch.sh: cannot create the tile cache folder $tiles; the worker will repack" >&2
  elif [ -d "$tiles" ] && [ -z "$(ls -A -- "$tiles" 2>/dev/null)" ]; then
    chmod 700 -- "$tiles" \
      || echo "launch.sh: cannot make the tile cache folder $tiles private; the worker will repack" >&2
  fi
fi
restarts=${{EXPERTMESH_RESTARTS:-0}}
if [ "$restarts" -le 0 ]; then
  exec "$bin" "$@"
fi
# Supervised: restart after a failure (never after a clean stop), at most $restarts times.
child=
stopping=0
trap 'stopping=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null || true' TERM INT
n=0
while :; do
  "$bin" "$@" &
  child=$!
  # A stop that came before the trap could see this child: pass it on.
  if [ "$stopping" = 1 ]; then kill -TERM "$child" 2>/dev/null || true; fi
  rc=0
  wait "$child" || rc=$?
  while kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done
  child=
  if [ "$stopping" = 1 ] || [ "$rc" = 0 ]; then
    exit "$rc"
  fi
  n=$((n + 1))
  if [ "$n" -gt "$restarts" ]; then
    echo "launch.sh: $proc exited with status $rc; no restarts left (EXPERTMESH_RESTARTS=$restarts)" >&2
    exit "$rc"
  fi
  pause=${{EXPERTMESH_RESTART_PAUSE_S:-2}}
  echo "launch.sh: $proc exited with status $rc; restart $n of $restarts in $pause s" >&2
  # A second at a time, each in the background so that a stop ends it at once (the shell
  # runs a trap only once a foreground command ends, but interrupts `wait`); a stop that
  # comes between two seconds is seen within one.
  i=0
  while [ "$stopping" != 1 ] && [ "$i" -lt "$pause" ]; do
    sleep 1 &
    paused=$!
    wait "$paused" || true
    kill "$paused" 2>/dev/null || true
    i=$((i + 1))
  done
  # Told to stop during the pause: no new start.
  if [ "$stopping" = 1 ]; then exit 0; fi
done
"#,
        list = names.join(" "),
        cluster = plan.dep.topology.name().replace(['"', '\n'], "_"),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::quote;

    #[test]
    fn quoting_survives_the_shell() {
        for s in [
            "plain",
            "a b",
            "it's",
            "",
            "$HOME",
            "`x`",
            "a\"b",
            "x;y",
            "--metrics",
        ] {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", quote(s)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), s);
        }
    }
}
