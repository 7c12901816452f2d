//! `expertmesh infer`: one MoE-layer call from .npy files through a running router.
//!
//! Why this exists: the smallest frontend there is, for trying a fabric from a shell and for
//! scripts: the input's header is checked, then the router is asked whether it accepts that
//! shape, and only then is the data read and sent; the answer is written as .npy.

use crate::args::SecurityArgs;
use crate::npy::{self, NpyDtype};
use anyhow::{anyhow, bail};
use clap::Args;
use expertmesh_fabric::endpoint;
use expertmesh_router::client::{ClientError, ClientOptions, RouterClient};
use expertmesh_transport::dtype::ActivationDtype;
use expertmesh_transport::frontend::{FrontendConfig, FrontendError};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The input format and a NumPy recipe, shown by `expertmesh infer --help` (and the README).
pub(crate) const INFER_HELP: &str = "\
Input: a 2-D .npy of hidden states [tokens, hidden]: float32, float16, or bf16 bits stored as
uint16 (float64 is accepted and converted to float32). hidden is the model's hidden size
(`expertmesh models` lists it; 1024 for demo-small, and `expertmesh up` prints it). A request
carries at most the router's --max-tokens tokens (256 by default): split larger inputs.

Make one with NumPy:
  import numpy as np
  x = np.random.randn(4, 1024).astype(np.float32)   # [tokens, hidden]
  np.save(\"x.npy\", x)

Then: expertmesh infer --router 127.0.0.1:47400 --cluster single-host --layer 1 \\
        --input x.npy --output y.npy";

/// `expertmesh infer`.
#[derive(Args, Debug)]
#[command(after_help = INFER_HELP)]
pub(crate) struct InferCli {
    /// Router frontend address, HOST:PORT (a host name or an IP address). Give the routers of
    /// one fabric (repeat --router, or separate with commas) to fail over between them: when
    /// the router in use is lost or stops answering, the request goes to the next.
    #[arg(long, required = true, value_delimiter = ',')]
    router: Vec<String>,
    /// Cluster name (the topology's `name`), checked in the handshake.
    #[arg(long, default_value = "single-host")]
    cluster: String,
    /// Decoder layer index (`model.layers.{L}`) of a MoE layer; a dense layer is refused.
    #[arg(long)]
    layer: u32,
    /// Hidden states, 2-D [tokens, hidden]: f32, f16 or bf16 bits as uint16 (f64 is converted
    /// to f32). See below for how to make one.
    #[arg(long)]
    input: PathBuf,
    /// Where to write the output [tokens, hidden] (f32).
    #[arg(long)]
    output: PathBuf,
    /// Optional router logits [tokens, experts] (f32).
    #[arg(long)]
    logits: Option<PathBuf>,
    /// Deadline in milliseconds: the router gives up then, and so does this client whatever
    /// the router does (exit 1, DeadlineExceeded). Default: the router's own, and 30 s here.
    #[arg(long)]
    deadline_ms: Option<u64>,
    #[command(flatten)]
    security: SecurityArgs,
}

/// Run `expertmesh infer`: exit 0 with the output written, 1 when the router refused the
/// request (its reason printed), 2 on usage and I/O errors.
///
/// Order: the input's header (dtype, shape), then the router is asked whether it accepts that
/// shape (layer, hidden size, its per-request token limit), and only then is the data read, so
/// an input that can never be sent is refused at once, however large.
pub(crate) fn run(cli: InferCli) -> anyhow::Result<ExitCode> {
    let head = npy::read_header(&cli.input).map_err(|e| anyhow!("{e}"))?;
    if let Some(p) = &cli.logits {
        let l = npy::read_header(p).map_err(|e| anyhow!("{e}"))?;
        if l.rows != head.rows {
            bail!(
                "{}: {} rows of logits for {} tokens",
                p.display(),
                l.rows,
                head.rows
            );
        }
    }
    let dtype = match head.dtype {
        NpyDtype::F32 | NpyDtype::F64 => ActivationDtype::F32,
        NpyDtype::F16 => ActivationDtype::F16,
        NpyDtype::Bf16Bits => ActivationDtype::Bf16,
    };
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for r in &cli.router {
        for a in endpoint::resolve_all(r.trim()).map_err(|e| anyhow!("--router: {e}"))? {
            if !addrs.contains(&a) {
                addrs.push(a);
            }
        }
    }
    let mut cfg = FrontendConfig::new(cli.cluster.clone());
    cfg.credentials = cli.security.security().frontend(&cli.cluster, &addrs)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let checked = rt.block_on(async {
        let opts = ClientOptions::default();
        let mut client = RouterClient::connect_any(&addrs, &cfg, opts).await?;
        client.check_shape(cli.layer, head.rows, head.cols).await?;
        Ok(client)
    });
    let mut client = match checked {
        Ok(c) => c,
        Err(e) => return client_failure(e),
    };
    let frame_limit = cfg.codec.max_frame_bytes as u64;
    let bytes = dtype
        .payload_bytes(head.rows, head.cols)
        .unwrap_or(u64::MAX);
    if bytes > frame_limit {
        let per_token = (bytes / head.rows.max(1) as u64).max(1);
        eprintln!(
            "error: {}: {} tokens are {bytes} bytes as {}, more than one request frame carries ({frame_limit} bytes); split the input into requests of at most {} tokens",
            cli.input.display(),
            head.rows,
            dtype.name(),
            frame_limit / per_token
        );
        return Ok(ExitCode::from(crate::exit::EXIT_INVALID));
    }
    let x = npy::read(&cli.input).map_err(|e| anyhow!("{e}"))?;
    if x.dtype == NpyDtype::F64 {
        eprintln!(
            "note: {} is float64; converted to float32 (save float32, float16 or bf16 bits as uint16 to skip the conversion)",
            cli.input.display()
        );
    }
    let logits = match &cli.logits {
        Some(p) => Some(npy::read(p).map_err(|e| anyhow!("{e}"))?.data),
        None => None,
    };
    let result = rt.block_on(client.call_as(
        cli.layer,
        &x.data,
        x.cols,
        dtype,
        logits.as_deref(),
        cli.deadline_ms.map(Duration::from_millis),
    ));
    match result {
        Ok(out) => {
            npy::write(&cli.output, x.rows, x.cols, &out, NpyDtype::F32)
                .map_err(|e| anyhow!("{e}"))?;
            println!(
                "wrote {} ({} x {} f32)",
                cli.output.display(),
                x.rows,
                x.cols
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => client_failure(e),
    }
}

/// A failed call: exit 1 with the router's reason when it refused the request, else an error
/// (exit 2) said once, with a hint when nothing listens there.
fn client_failure(e: ClientError) -> anyhow::Result<ExitCode> {
    match e {
        ClientError::Server { .. } | ClientError::Deadline { .. } => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(crate::exit::EXIT_INVALID))
        }
        ClientError::Transport(FrontendError::Io { ref source, .. })
            if matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotConnected
            ) =>
        {
            Err(anyhow!(
                "{e}; is the router running (`expertmesh up` or `expertmesh router`), and is this its frontend port?"
            ))
        }
        e => Err(anyhow!("{e}")),
    }
}
