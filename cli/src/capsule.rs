//! `mur capsule push DIR` and `mur capsule ls`: capsule bundles in the cluster's object
//! store, addressed by name and digest (issue #7). A new push changes no task already
//! submitted: a task runs the digest that was latest when it was submitted.

use crate::nats::Connection;
use anyhow::{Context, Result};
use comfy_table::{Table, presets::NOTHING};
use mur_proto::cluster::{CAPSULE_INDEX_BUCKET, CAPSULES_STORE};
use mur_worker::bundle;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `mur capsule …`
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Upload a capsule folder (manifest, prompts, hooks, scripts) as one bundle.
    Push {
        /// The capsule folder (holding murmur.yaml); several may be given.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        #[command(flatten)]
        conn: Connection,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the capsules pushed to the cluster (latest digest of each).
    Ls {
        #[command(flatten)]
        conn: Connection,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// The object store and index of a running cluster.
///
/// # Errors
/// When the cluster's resources do not exist yet (no coordinator ever ran there).
pub async fn stores(
    client: &async_nats::Client,
) -> Result<(async_nats::jetstream::object_store::ObjectStore, async_nats::jetstream::kv::Store)> {
    let js = async_nats::jetstream::new(client.clone());
    let hint = "no murmur cluster on this server: start `mur dev` or `mur coordinator` first";
    let store = js.get_object_store(CAPSULES_STORE).await.context(hint)?;
    let index = js.get_key_value(CAPSULE_INDEX_BUCKET).await.context(hint)?;
    Ok((store, index))
}

/// Packs and pushes `dir`.
///
/// # Errors
/// A malformed capsule (the field and rule are named), or the cluster is unreachable.
pub async fn push_dir(client: &async_nats::Client, dir: &Path) -> Result<bundle::PushReceipt> {
    let packed = bundle::pack(dir).with_context(|| format!("packing {}", dir.display()))?;
    let (store, index) = stores(client).await?;
    Ok(bundle::push(&store, &index, &packed).await?)
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        match cmd {
            Command::Push { dirs, conn, json } => {
                // Every folder is packed (and so checked) before anything is sent: a broken
                // capsule is refused with its own error, even with no server to reach, and
                // none of the folders is pushed.
                let packed = dirs
                    .iter()
                    .map(|dir| bundle::pack(dir).with_context(|| format!("packing {}", dir.display())))
                    .collect::<Result<Vec<_>>>()?;
                let client = conn.connect("mur capsule push").await?;
                let (store, index) = stores(&client).await?;
                for bundle in &packed {
                    let r = bundle::push(&store, &index, bundle).await?;
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({"name": r.name, "version": r.version, "digest": r.digest, "bytes": r.bytes})
                        );
                    } else {
                        println!("pushed {} {} {} ({} bytes)", r.name, r.version, &r.digest[..12], r.bytes);
                    }
                }
                Ok(ExitCode::SUCCESS)
            }
            Command::Ls { conn, json } => {
                let client = conn.connect("mur capsule ls").await?;
                let (_, index) = stores(&client).await?;
                let entries = bundle::list(&index).await?;
                if json {
                    println!("{}", serde_json::to_string(&entries)?);
                } else {
                    let mut t = Table::new();
                    t.load_preset(NOTHING).set_header(vec!["NAME", "VERSION", "DIGEST", "BYTES"]);
                    for e in entries {
                        t.add_row(vec![e.name, e.version, e.digest[..12].to_string(), e.bytes.to_string()]);
                    }
                    println!("{t}");
                }
                Ok(ExitCode::SUCCESS)
            }
        }
    })
}
